"""The comparison must flag each kind of wrong output and name where it is."""

import numpy as np
import pytest

from kdtr.kernels.contract import POISON_BF16_BITS, POISON_F32_BITS
from kdtr.check.compare import Status, compare, worst_status
from kdtr.inputs.rng import Stream
from kdtr.golden.tolerances import Tol, resolve

TOL = Tol(atol=1e-3, rtol=1e-2, rel_norm=5e-3, min_cos=0.9999)


def _pair(shape=(2, 5, 3, 8)):
    want = Stream(0, "cmp").normalish(shape)
    return want.astype(np.float32), want


def test_identical_passes():
    got, want = _pair()
    c = compare(got, want, TOL)
    assert c.status is Status.PASS and c.ratio < 1e-2 and c.cos > 0.999999


def test_one_element_off_is_found_and_located():
    got, want = _pair()
    got[1, 3, 2, 5] += 0.5
    c = compare(got, want, TOL, depth=np.zeros((2, 5), dtype=np.int32) + np.arange(5))
    assert c.status is Status.FAIL_NUMERIC
    assert c.worst == (1, 3, 2, 5) and c.n_bad == 1 and c.bad_nodes == [3]
    assert c.depth_ratio[3] > 1 and c.depth_ratio[2] < 1
    assert c.worst_want == pytest.approx(want[1, 3, 2, 5])


def test_small_uniform_bias_fails_the_global_norm_bound_only():
    got, want = _pair()
    got = (want * (1 + 8e-3)).astype(np.float32)  # inside rtol element-wise, outside the norm bound
    c = compare(got, want, TOL)
    assert c.n_bad == 0 and c.status is Status.FAIL_NUMERIC and "relative norm" in c.message


@pytest.mark.parametrize("bits", [POISON_F32_BITS, POISON_BF16_BITS << 16])
def test_unwritten_elements_are_unwritten_not_nan(bits):
    got, want = _pair()
    got.reshape(-1).view(np.uint32)[7] = bits
    c = compare(got, want, TOL)
    assert c.status is Status.UNWRITTEN and c.n_bad == 1 and c.worst == np.unravel_index(7, got.shape)


def test_computed_nan_and_inf_are_nan_status():
    got, want = _pair()
    got[0, 0, 0, 1] = np.nan
    got[1, 1, 1, 1] = np.inf
    c = compare(got, want, TOL)
    assert c.status is Status.NAN and c.n_bad == 2 and c.worst == (0, 0, 0, 1)


def test_shape_mismatch():
    got, want = _pair()
    assert compare(got[:, :4], want, TOL).status is Status.SHAPE
    assert compare(None, want, TOL).status is Status.SHAPE


def test_sign_flip_of_a_whole_row_fails_cosine_or_elements():
    got, want = _pair()
    got[0, 2] *= -1
    c = compare(got, want, TOL)
    assert c.status is Status.FAIL_NUMERIC and c.bad_nodes == [2]


def test_worst_status_orders_by_severity():
    assert worst_status([Status.PASS, Status.SKIPPED]) is Status.SKIPPED
    assert worst_status([Status.PASS, Status.FAIL_NUMERIC, Status.NAN]) is Status.NAN
    assert worst_status([Status.RACE, Status.FAIL_NUMERIC]) is Status.RACE
    assert worst_status([Status.PASS]) is Status.PASS


def test_tolerance_layers():
    base = resolve("bf16", "bf16", "out")
    rec = resolve("bf16", "bf16", "out", recorded={"out": {"atol": 1.0}})
    cli = resolve("bf16", "bf16", "out", recorded={"out": {"atol": 1.0}}, overrides={"atol": 2.0, "rtol": None})
    assert rec.atol == 1.0 and rec.rtol == base.rtol and cli.atol == 2.0
    with pytest.raises(ValueError):
        resolve("fp8", "bf16", "out")


# ---------------------------------------------------------------- rounding bias of bf16 outputs

import math

import ml_dtypes

from kdtr.check.compare import Check, rounding_bias
from kdtr.golden.tolerances import BIAS_MAX, BIAS_MIN_COUNT

BF16_TOL = resolve("bf16", "bf16", "out")


def _bf16_pair(shape=(2, 9, 2, 512)):
    """want: an attention-like output (float64, a spread of magnitudes and both signs); the bf16 values a
    kernel would store, rounded to nearest even and truncated toward zero."""
    want = Stream(3, "bias").normalish(shape) * 0.3
    rne = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    trunc = (want.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return want, rne, trunc


def test_round_to_nearest_passes_with_no_bias():
    want, rne, _ = _bf16_pair()
    c = compare(rne, want, BF16_TOL, out_dtype="bf16")
    assert c.status is Status.PASS and abs(c.ulp_bias) < 0.02 and abs(c.ulp_drift) < 0.02
    assert c.bias_count == want.size


def test_truncation_passes_every_element_bound_but_fails_the_bias():
    want, _, trunc = _bf16_pair()
    c = compare(trunc, want, BF16_TOL, out_dtype="bf16")
    assert c.n_bad == 0 and c.ratio < 1 and c.rel_norm < BF16_TOL.rel_norm  # invisible to every other bound
    assert c.status is Status.FAIL_NUMERIC and "rounding bias" in c.message and "toward zero" in c.message
    assert -0.55 < c.ulp_bias < -0.4 and abs(c.ulp_drift) < 0.05
    assert Check.from_json(c.to_json()).ulp_bias == c.ulp_bias


def test_rounding_toward_plus_infinity_fails_by_its_drift():
    want, rne, _ = _bf16_pair()
    w32 = want.astype(np.float32)
    up = np.where(rne < w32, np.nextafter(rne.astype(ml_dtypes.bfloat16), ml_dtypes.bfloat16(np.inf)).astype(np.float32), rne)
    c = compare(up, want, BF16_TOL, out_dtype="bf16")
    assert c.status is Status.FAIL_NUMERIC and "toward +inf" in c.message and c.ulp_drift > 0.4


def test_zero_mean_noise_of_many_ulps_passes():
    want, _, _ = _bf16_pair()
    loose = Tol(atol=0.05, rtol=0.1, rel_norm=0.05, min_cos=0.99)
    noise = (Stream(4, "noise").uniform(want.shape) - 0.5) * 12.0  # +-6 ulps, mean 0
    _, e = np.frexp(want)
    got = (want + noise * np.ldexp(1.0, e - 8)).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    c = compare(got, want, loose, out_dtype="bf16")
    assert c.status is Status.PASS and abs(c.ulp_bias) < 0.05 and abs(c.ulp_drift) < 0.05


def test_nan_inf_zero_and_subnormal_elements_cannot_switch_the_bias_off():
    want, _, trunc = _bf16_pair()
    want, trunc = want.copy(), trunc.copy()
    want[0, 0, 0, :4] = [np.nan, np.inf, 0.0, 1e-40]  # reference NaN / Inf where the kernel has them too
    trunc[0, 0, 0, :4] = [np.nan, np.inf, 0.0, 0.0]
    bias, drift, n = rounding_bias(trunc, want)
    assert n == want.size - 4 and math.isfinite(bias) and math.isfinite(drift) and bias < -BIAS_MAX
    trunc[1, 1, 1, 1] = np.inf
    assert rounding_bias(trunc, want)[2] == want.size - 5  # an Inf in got alone is skipped here, NAN in compare
    trunc[1, 1, 1, 1] = np.nan  # a NaN the reference does not have fails before the bias is looked at
    assert compare(trunc, want, BF16_TOL, out_dtype="bf16").status is Status.NAN


def test_bias_is_judged_on_bf16_outputs_with_enough_elements_only():
    want, _, trunc = _bf16_pair()
    assert compare(trunc, want, BF16_TOL, out_dtype="fp32").ulp_bias is None  # fp32 out: not judged
    assert compare(trunc, want, BF16_TOL).ulp_bias is None
    small = (slice(0, 1), slice(0, 1), slice(0, 2), slice(0, 512))
    c = compare(trunc[small], want[small], BF16_TOL, out_dtype="bf16")
    assert c.status is Status.PASS and c.ulp_bias is None and c.bias_count == 1024 < BIAS_MIN_COUNT
    assert rounding_bias(trunc, want)[0] < -BIAS_MAX
