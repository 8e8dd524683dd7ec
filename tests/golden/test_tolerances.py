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
