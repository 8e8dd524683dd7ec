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
