"""Tolerance resolution never lets input switch a check off (issue 37, defect 2): a NaN bound
compares false, an infinite one admits everything, a negative one fails everything."""

from __future__ import annotations

import math

import pytest

from kdtr.errors import InputError
from kdtr.golden import tolerances as tol

BAD = [math.nan, math.inf, -math.inf, -1.0, -1e-30]


@pytest.mark.parametrize("key", ["atol", "rtol", "rel_norm"])
@pytest.mark.parametrize("value", BAD)
def test_resolve_refuses_overrides_that_cannot_fail(key, value):
    with pytest.raises(InputError, match=key.replace("_", "-")):
        tol.resolve("bf16", "bf16", "out", overrides={key: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, 1.5, -2.0])
def test_min_cos_must_lie_within_its_range(value):
    with pytest.raises(InputError, match="min-cos"):
        tol.check_overrides({"out": {"min_cos": value}})


@pytest.mark.parametrize("overrides, fragment", [
    ({"outt": {"atol": 1.0}}, "unknown output"), ({"out": {"abs": 1.0}}, "not a tolerance"),
    ({"out": {"atol": "0.1"}}, "finite number"), ({"out": {"atol": True}}, "finite number"),
])
def test_overrides_name_real_bounds_with_numbers(overrides, fragment):
    with pytest.raises(InputError, match=fragment):
        tol.check_overrides(overrides)


def test_good_overrides_apply_and_none_means_not_given():
    t = tol.resolve("bf16", "bf16", "out", overrides={"atol": 0, "rtol": 1e-3, "rel_norm": None})
    assert (t.atol, t.rtol, t.rel_norm) == (0.0, 1e-3, tol.default("bf16", "bf16", "out").rel_norm)
    tol.check_overrides(None)
    tol.check_overrides({"out": {"atol": None, "rtol": None, "rel_norm": None}})


@pytest.mark.parametrize("field", ["atol", "rtol", "rel_norm", "min_cos"])
def test_a_tol_cannot_be_built_with_a_nan_or_infinite_bound(field):
    good = dict(atol=1e-3, rtol=1e-2, rel_norm=1e-3, min_cos=0.999)
    for value in (math.nan, math.inf):
        with pytest.raises(ValueError, match="switch its check off"):
            tol.Tol(**{**good, field: value})


def test_run_verify_checks_overrides_before_any_case(tmp_path):
    from kdtr.check.suite import run_verify
    from kdtr.kernels.registry import resolve_kernel

    with pytest.raises(InputError, match="finite"):
        run_verify(resolve_kernel("emulate-flash"), [tmp_path / "never-opened.kdtr"], overrides={"out": {"atol": math.nan}})


# ---------------------------------------------------------------- bounds that scale with the problem

SCORES = [0.0, 1.0, 17.0, tol.S_KNEE, 20.5, 50.0, 100.0, 148.0, 1e3, tol.S_MAX, 1e9]


@pytest.mark.parametrize("kv, out", [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "fp32"), ("bf16", "bf16")])
@pytest.mark.parametrize("output", tol.OUTPUTS)
def test_scaled_bounds_equal_the_table_below_the_knee_and_grow_monotonically(kv, out, output):
    table = tol.default(kv, out, output)
    prev = None
    for s in SCORES:
        t = tol.resolve(kv, out, output, cond=tol.Conditioning(max_abs_score=s, max_abs_value=4.0))
        assert all(math.isfinite(v) for v in (t.atol, t.rtol, t.rel_norm, t.min_cos)), (s, t)
        if s <= tol.S_KNEE:
            assert t == table, s
        else:
            assert t.atol > table.atol and t.rtol == table.rtol and t.min_cos == table.min_cos
        if prev is not None:
            assert t.atol >= prev.atol and t.rel_norm >= prev.rel_norm
        prev = t
    assert tol.resolve(kv, out, output, cond=tol.Conditioning(max_abs_score=1e9)) == \
        tol.resolve(kv, out, output, cond=tol.Conditioning(max_abs_score=tol.S_MAX))  # clipped, finite


def test_the_growth_is_the_documented_formula():
    c = tol.Conditioning(max_abs_score=148.0, max_abs_value=3.9)
    d = tol.K_SCORE * tol.U_ACC * (148.0 - tol.S_KNEE)
    out, lse = tol.resolve("fp32", "fp32", "out", cond=c), tol.resolve("fp32", "fp32", "lse", cond=c)
    base_out, base_lse = tol.default("fp32", "fp32", "out"), tol.default("fp32", "fp32", "lse")
    assert out.atol == pytest.approx(base_out.atol + 2 * d * 3.9)
    assert out.rel_norm == pytest.approx(base_out.rel_norm + 2 * d * 3.9 / tol.V_REF)
    assert lse.atol == pytest.approx(base_lse.atol + d) and lse.rel_norm == base_lse.rel_norm
    small_v = tol.resolve("fp32", "fp32", "out", cond=tol.Conditioning(max_abs_score=148.0, max_abs_value=0.1))
    assert small_v.atol == pytest.approx(base_out.atol + 2 * d * tol.V_REF)  # never below the unit-variance scale


@pytest.mark.parametrize("field", ["max_abs_score", "max_abs_value"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, "3", True])
def test_a_conditioning_that_would_switch_a_bound_off_cannot_be_built(field, value):
    with pytest.raises(ValueError, match="conditioning"):
        tol.Conditioning(**{field: value})


@pytest.mark.parametrize("recorded", [None, {"max_abs_score": math.nan}, {"max_abs_score": math.inf},
                                      {"max_abs_score": -5.0}, {"max_abs_score": "1e9"}, {"other": 1.0}, [1.0]])
def test_unusable_recorded_scores_leave_the_table(recorded):
    c = tol.conditioning(recorded, cap=1e6, max_abs_value=3.0)
    assert c.max_abs_score == 0.0 and tol.resolve("fp32", "fp32", "out", cond=c) == tol.default("fp32", "fp32", "out")


def test_a_recorded_score_is_capped_by_the_data_and_bad_data_counts_as_nothing():
    assert tol.conditioning({"max_abs_score": 500.0}, cap=120.0, max_abs_value=3.0).max_abs_score == 120.0
    assert tol.conditioning({"max_abs_score": 50.0}, cap=120.0, max_abs_value=3.0).max_abs_score == 50.0
    for cap in (math.nan, math.inf, -1.0):
        assert tol.conditioning({"max_abs_score": 500.0}, cap=cap, max_abs_value=3.0).max_abs_score == 0.0
    for v in (math.nan, math.inf, -1.0):
        assert tol.conditioning({"max_abs_score": 50.0}, cap=120.0, max_abs_value=v).max_abs_value == tol.V_REF
    assert tol.conditioning({"max_abs_score": 50.0}, cap=120.0, max_abs_value=1e30).max_abs_value == tol.V_MAX


@pytest.mark.parametrize("x", [1e-300, 0.1, 12.34567, 148.0, 145.6789, 3e5])
def test_recorded_scores_round_up_coarsely(x):
    r = tol.record_score(x)
    assert x <= r <= x * (1 + 2.0**-11) and tol.record_score(r) == r
    assert tol.record_score(math.nan) == tol.record_score(-1.0) == tol.record_score(0.0) == 0.0


def test_verify_widens_the_bounds_of_a_hard_golden_only(tmp_path):
    """judge applies the recorded max |s| (capped by the data): the table for unit-variance cases, wider
    bounds where scores pass the knee; the cap is a true bound on every visible score."""
    from kdtr.check.case import judge
    from kdtr.golden.bundle import load_bundle, save_bundle
    from kdtr.golden.generate import build_bundle
    from kdtr.golden.reference import reference_with_score, score_bounds
    from kdtr.inputs.cases import CaseSpec
    from kdtr.kernels.launch_types import RunOutput

    class Exact:
        writes_lse = True

    for values in ("normal", "hard"):
        spec = CaseSpec(model="kimi-k2", heads=2, prefix_lens=(3, 40), budget=8, kv_dtype="fp32", out_dtype="fp32",
                        values=values)
        built = build_bundle(spec)
        path = tmp_path / f"{spec.name}.kdtr"
        save_bundle(path, built.problem, built.out, built.lse, built.meta, draft_logp=built.draft_logp)
        b = load_bundle(path)
        _, _, smax = reference_with_score(b.problem)
        cap, vmax = score_bounds(b.problem)
        assert smax <= b.conditioning["max_abs_score"] <= cap and 0 < vmax < 10
        checks = judge(Exact(), b, RunOutput(out=b.out.copy(), lse=b.lse.astype("float32"), ms=0.0))
        table = tol.default("fp32", "fp32", "out")
        assert all(c.status.value == "PASS" for c in checks)
        out = next(c for c in checks if c.output == "out")
        assert (out.tol == table) == (values == "normal") and out.tol.atol >= table.atol
