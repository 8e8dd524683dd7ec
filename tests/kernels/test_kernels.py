"""The kernel registry on a CPU: names, specs, capability reasons, the launcher's import guard."""

from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest

from kdtr.kernels.flash import combine
from kdtr.kernels.flash.force import RowLayout
from kdtr.kernels import registry as kernels, launch
from kdtr.kernels.bugs import LAUNCH_BUGS, PLANTED, Bug
from kdtr.kernels.python import PyCallableKernel
from kdtr.kernels.registry import Caps, KernelSpecError, resolve_kernel
from kdtr.inputs.presets import DK
from kdtr.inputs.problem import Problem, mask_words


def tiny_problem(T=3, H=2, page_size=64, dtype=np.float32, P=5) -> Problem:
    """Shapes only (zeros); enough for capability checks."""
    n_pages = -(-(P + T) // page_size)
    return Problem(
        q=np.zeros((1, T, H, DK), dtype), kv_cache=np.zeros((n_pages, page_size, DK), dtype),
        block_table=np.arange(n_pages, dtype=np.int32)[None], prefix_lens=np.array([P], np.int32),
        tree_parent=np.arange(-1, T - 1, dtype=np.int32)[None], tree_depth=np.arange(T, dtype=np.int32)[None],
        tree_mask=np.zeros((1, T, mask_words(T)), np.uint32), scale=0.1352,
    )


def test_builtin_names_cover_every_bug():
    names = kernels.builtin_names()
    for base in ("naive", "emulate-flash"):
        assert base in names
        for bug in PLANTED:
            assert f"{base}-bug={bug.slug}" in names
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", ["naive", "naive-bug=no-rope", "emulate-flash", "emulate-flash-bug=merge-wrong-max"])
def test_builtins_resolve(name):
    k = resolve_kernel(name)
    assert isinstance(k, kernels.Kernel) and k.name == name and k.writes_lse
    if "bug=" in name:
        assert int(k.bug) == int(Bug.parse(name.split("bug=")[1]))


def test_bug_aliases_resolve_to_the_canonical_name():
    assert resolve_kernel("naive-bug=6").name == "naive-bug=merge-wrong-max"
    assert resolve_kernel("naive-bug=NO_ROPE").name == "naive-bug=no-rope"


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_unknown_name_lists_known_ones():
    with pytest.raises(KernelSpecError) as e:
        resolve_kernel("flashy")
    text = one_line(e)
    assert "unknown kernel 'flashy'" in text and "naive," in text and "emulate-flash" in text
    assert all(b.slug in text for b in PLANTED) and "NAME-bug=BUG" in text
    with pytest.raises(KernelSpecError) as e:
        resolve_kernel("naiv")
    assert "did you mean 'naive'" in one_line(e)


def test_unknown_bug_lists_bugs():
    with pytest.raises(KernelSpecError) as e:
        resolve_kernel("naive-bug=typo")
    assert "page-off-by-one" in one_line(e)


def test_cuda_file_specs(tmp_path):
    with pytest.raises(KernelSpecError) as e:
        resolve_kernel(str(tmp_path / "missing.cu") + ":my_kernel")
    assert "no such CUDA file" in one_line(e)
    src = tmp_path / "mine.cu"
    src.write_text("// empty\n")
    with pytest.raises(KernelSpecError) as e:
        resolve_kernel(str(src))
    assert "name the kernel" in one_line(e)
    k = resolve_kernel(f"{src}:my_verify<{{kv}}, {{out}}, 8>")
    assert k.name_expression("bf16", "fp32") == "my_verify<__nv_bfloat16, float, 8>"
    assert k.geometry is None  # the file's kdtr_launch (or the default) decides


def test_python_specs(monkeypatch):
    with pytest.raises(KernelSpecError) as e:
        resolve_kernel("kdtr_no_such_module_xyz:verify")
    assert "cannot import module" in one_line(e)
    with pytest.raises(KernelSpecError) as e:
        resolve_kernel("json:no_such_function")
    assert "has no attribute" in one_line(e)
    with pytest.raises(KernelSpecError) as e:
        resolve_kernel("json:__doc__")
    assert "not a callable" in one_line(e)

    def verify(*args, **kw):  # never called here
        raise AssertionError

    verify.kdtr_framework = "torch"
    verify.kdtr_caps = Caps(kv_dtypes=("bf16",))
    monkeypatch.setitem(sys.modules, "kdtr_fake_user_mod", types.SimpleNamespace(verify=verify))
    k = resolve_kernel("kdtr_fake_user_mod:verify")
    assert isinstance(k, PyCallableKernel) and k.framework == "torch" and k.caps.kv_dtypes == ("bf16",)


def test_caps_why_not(monkeypatch):
    monkeypatch.setattr(launch, "gpu_available", lambda: True)
    pr = tiny_problem(T=5, H=4, page_size=1)
    assert Caps().why_not(pr, "fp32") is None
    assert "storage dtype fp32" in Caps(kv_dtypes=("bf16",)).why_not(pr, "fp32")
    assert "output dtype fp32" in Caps(out_dtypes=("bf16",)).why_not(pr, "fp32")
    assert "page size 1" in Caps(page_sizes=(64,)).why_not(pr, "fp32")
    assert "T=5" in Caps(max_T=4).why_not(pr, "fp32")
    assert "H=4" in Caps(max_H=2).why_not(pr, "fp32")
    monkeypatch.setattr(launch, "gpu_available", lambda: False)
    assert "GPU" in Caps().why_not(pr, "fp32")
    assert Caps(needs_gpu=False).why_not(pr, "fp32") is None


def test_naive_takes_everything_but_needs_a_gpu(monkeypatch):
    naive = resolve_kernel("naive")
    pr = tiny_problem(page_size=1, dtype=np.float32)
    monkeypatch.setattr(launch, "gpu_available", lambda: True)
    assert naive.caps.why_not(pr, "bf16") is None
    monkeypatch.setattr(launch, "gpu_available", lambda: False)
    assert "GPU" in naive.caps.why_not(pr, "fp32")
    emu = resolve_kernel("emulate-flash").caps
    assert "storage dtype fp32" in emu.why_not(pr, "fp32")  # it emulates a bf16 kernel
    assert emu.why_not(tiny_problem(dtype=ml_dtypes.bfloat16), "fp32") is None


def test_compile_targets_cover_every_variant():
    (src, names, archs), *rest = kernels.compile_targets()
    assert src.name == "naive.cu" and src.is_file() and archs == ("sm_80", "sm_90", "sm_120")
    built = [b for b in Bug if b not in LAUNCH_BUGS]  # a bug planted in the launch runs the correct build
    assert len(names) == 2 * 2 * len(built) and len(set(names)) == len(names)
    for bug in built:
        assert f"kdtr_naive_verify<__nv_bfloat16, float, {int(bug)}>" in names
    by_file = {s.name: (n, a) for s, n, a in rest}
    assert by_file["flash.cu"][1] == ("sm_80", "sm_90", "sm_120") and by_file["flash_sm90.cu"][1] == ("sm_90a",)
    # bug x out dtype x (the three merges with 64-row tiles, rows past 64 or all rows transposed with the combine
    # launch), + 2 x 8 combines (per chunk, a warp per row or half row, narrow chunks of 32 and 64 columns x 4 and
    # 8 warps, the work table's cut jobs) + the work table's device scheduler
    assert len(by_file["flash_sm90.cu"][0]) == 2 * 5 * len(built) + 16 + 1
    assert "kdtr_flash_schedule" in by_file["flash_sm90.cu"][0]
    assert "kdtr_flash_combine_rows<float, 2>" in by_file["flash_sm90.cu"][0]
    for cols in combine.NARROW_COLS:
        for warps in combine.NARROW_WARPS:
            assert f"kdtr_flash_combine_narrow<float, {cols}, {warps}>" in by_file["flash_sm90.cu"][0]
    assert "kdtr_flash_sm90_verify<__nv_bfloat16, 0, 0, 8>" in by_file["flash_sm90.cu"][0]
    assert f"kdtr_flash_sm90_verify<__nv_bfloat16, 5, 0, {int(RowLayout.TRANSPOSED)}>" in by_file["flash_sm90.cu"][0]
    assert "kdtr_flash_sm90_verify<float, 6, 2, 0>" in by_file["flash_sm90.cu"][0]  # the work table
    assert "kdtr_flash_combine_jobs<__nv_bfloat16, 64>" in by_file["flash_sm90.cu"][0]
    assert len(by_file["flash.cu"][0]) == 3 * 2 * len(built) + 14


def test_flash_sm90_skips_other_archs(monkeypatch):
    monkeypatch.setattr(launch, "gpu_available", lambda: True)
    pr = tiny_problem(dtype=ml_dtypes.bfloat16)
    caps = resolve_kernel("flash-sm90").caps
    monkeypatch.setattr(launch, "device_arch", lambda: "sm_120")
    assert "sm_90" in caps.why_not(pr, "bf16") and "sm_120" in caps.why_not(pr, "bf16")
    monkeypatch.setattr(launch, "device_arch", lambda: "sm_90")
    assert caps.why_not(pr, "bf16") is None
    assert resolve_kernel("flash").caps.why_not(pr, "bf16") is None


def test_emulate_kernel_calls_emulate_flash(monkeypatch):
    seen = {}

    def emulate_flash(problem, out_dtype, bug=Bug.NONE):
        seen.update(out_dtype=out_dtype, bug=bug)
        return np.zeros(problem.out_shape(), np.float64), np.ones((problem.B, problem.T, problem.H))

    monkeypatch.setitem(sys.modules, "kdtr.kernels.emulate", types.SimpleNamespace(emulate_flash=emulate_flash))
    res = resolve_kernel("emulate-flash-bug=scale-off").run(tiny_problem(), "bf16")
    assert seen == {"out_dtype": "bf16", "bug": Bug.SCALE_OFF}
    assert res.out.dtype == np.float32 and res.lse.dtype == np.float32 and res.ms >= 0


def test_launch_imports_without_cupy_and_fails_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    launch.gpu_available.cache_clear()
    try:
        assert launch.gpu_available() is False
        with pytest.raises(launch.GpuUnavailable) as e:
            launch.DeviceProblem(tiny_problem(), "fp32")
        assert "\n" not in str(e.value) and "cupy" in str(e.value)
    finally:
        launch.gpu_available.cache_clear()


def test_a_launcher_keeps_its_device_problem_alive(monkeypatch):
    """KdtrParams carries only the inputs' and outputs' addresses: a launcher built on a DeviceProblem
    nobody else holds (``kernel.prepare(device_problem(spec))``) must keep it, or the pool hands its memory
    to the next allocation and the timed launch reads freed memory (a bandwidth probe faulted so)."""
    import gc
    import weakref

    from kdtr.kernels import contract as abi

    class FakeProblem:
        def params(self, workspace_ptr, num_splits, prefix_lens_ptr=None):
            return np.zeros(1, abi.PARAMS_DTYPE)[0]

    monkeypatch.setattr(launch, "cupy_module", lambda: types.SimpleNamespace())
    dp = FakeProblem()
    alive = weakref.ref(dp)
    go = launch.make_launcher(dp, [])
    del dp
    gc.collect()
    assert alive() is not None
    del go
    gc.collect()
    assert alive() is None


def test_launch_from_constants_follows_the_abi_contract():
    pr = tiny_problem(T=5, H=3)
    g = launch.launch_from_constants(pr, launch.DEFAULT_LAUNCH)
    assert g.grid == (15, 1, 1) and g.block == (128, 1, 1) and g.smem_bytes == 0 and g.workspace_bytes == 0
    g = launch.launch_from_constants(pr, (4, 256, 70000, 3))
    assert g.grid == (4, 1, 3) and g.num_splits == 3 and g.workspace_bytes == 3 * 15 * 514 * 4 + 15 * 4
    with pytest.raises(launch.KernelRuntimeError):
        launch.launch_from_constants(pr, (0, 128, 0, 1))


def test_storage_bits_and_back_are_exact():
    """bf16 goes up as its raw bits and comes back to fp32 exactly, NaN and -0 included."""
    from kdtr.kernels.launch_types import bf16_bits_to_f32, storage_bits, to_f32

    x = np.array([1.0, -0.0, 3.140625, np.nan, -np.inf, 1e-40], np.float32).astype(ml_dtypes.bfloat16)
    bits = storage_bits(x)
    assert bits.dtype == np.uint16 and np.array_equal(bits, x.view(np.uint16))
    back = bf16_bits_to_f32(bits)
    assert np.array_equal(back.view(np.uint32), x.astype(np.float32).view(np.uint32))
    assert np.array_equal(to_f32(x).view(np.uint32), back.view(np.uint32))
    f = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]  # not contiguous
    assert storage_bits(f).flags.c_contiguous and np.array_equal(storage_bits(f), f)
    assert to_f32(np.array([1, 2], np.int32)).dtype == np.float32


@pytest.mark.parametrize("base", sorted(kernels.FLASH_VARIANTS))
def test_flash_caps_max_t_matches_the_kernel_source(base):
    import re

    variant, caps = kernels.FLASH_VARIANTS[base]
    m = re.search(r"constexpr int MAX_T = (\d+);", variant.source.read_text())
    assert m and int(m.group(1)) == caps.max_T


@pytest.mark.parametrize("base", sorted(kernels.FLASH_VARIANTS))
def test_flash_config_array_matches_the_launcher(base):
    """The launcher reads the kernel's config array by field name: same length, and for the
    fixed-tile Hopper kernel the row tile it plans with (16 * mt) is the kernel's BM."""
    import re

    variant, _ = kernels.FLASH_VARIANTS[base]
    text = variant.source.read_text()
    m = re.search(rf'extern "C" __constant__ int {variant.config_symbol}\[(\d+)\]', text)
    assert m and int(m.group(1)) == len(variant.config_fields)
    if len(variant.mts) == 1:
        bm = re.search(r"constexpr int BM = (\d+);", text)
        assert bm and int(bm.group(1)) == 16 * variant.mts[0]
    xr = re.search(r"constexpr int XR_MAX = ROWS_EXTRA;", text)  # RowLayout's values: tests/kernels/test_force.py
    assert (int(RowLayout.EXTRA) if xr else 0) == variant.extra_rows
