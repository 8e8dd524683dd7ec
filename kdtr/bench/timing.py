"""Timing for `kdtr bench`: CUDA-event medians with a flushed L2, and the GPU's ceilings (the roofline's copy
and GEMM peaks, and the mma.sync ceiling of the portable kernel's instruction).

cupy comes through kdtr.launch (the one module that imports it), so this stays importable
without a GPU.
"""

from __future__ import annotations

import numpy as np

from kdtr.kernels.launch import cupy_module, device_info, load_function, read_global_ints
from kdtr.kernels.nvrtc import CUDA_DIR


FLUSH_MODE = "read"
"""How time_launcher empties the L2 between repetitions by default."""
METHOD = {"l2_flush": FLUSH_MODE, "gpu_held_during_enqueue": True}
"""How time_launcher times, as recorded in bench JSON."""
PEAK_KEYS = ("copy_gbs", "gemm_tflops", "mma_tflops")
"""The ceilings measure_peaks returns; a cached entry missing one (written before it was measured) is stale."""
MMA_PEAK_SOURCE = CUDA_DIR / "mma_peak.cu"
"""The mma.sync issue loop (kdtr_mma_peak)."""
MMA_PEAK_KERNEL = "kdtr_mma_peak"
"""Its extern "C" kernel (out, iters); kdtr_mma_peak_shape beside it holds {threads a CTA, chains a warp}."""
MMA_INSTRUCTION = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
"""What cuda/flash.cu's products issue (kdtr::mma_bf16), and what the loop times."""
MMA_FLOPS = 2 * 16 * 8 * 16
"""FLOPs of one m16n8k16 (a warp's instruction)."""

_HOLD = r"""
extern "C" __global__ void kdtr_hold(unsigned long long ns) {  // one thread spins ns on the GPU clock
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
"""


def l2_flush_bytes(l2_bytes: int | None) -> int:
    """The buffer time_launcher reads between repetitions: twice the L2 and 16 MB more, so nothing
    of the last repetition survives in it."""
    return 2 * (l2_bytes or 64 << 20) + (16 << 20)


def hold_ns(enqueue_s: float) -> int:
    """How long the GPU waits before each timed repetition: longer than the host takes to enqueue
    it (1.5x + 20 us, at most 50 ms), so the events time device work, never Python's launch loop."""
    return int(min(50e-3, 1.5 * max(enqueue_s, 0.0) + 20e-6) * 1e9)


def cold_run(fn, flush, hold, wait_ns: int, flush_mode: str = FLUSH_MODE, tag: int = 0) -> float:
    """One repetition as time_launcher times it, fn's device time in ms: the ``flush`` buffer read (or, "write",
    filled with ``tag``), the GPU held ``wait_ns`` by ``hold`` (kdtr_hold) while the host enqueues, then fn between
    two events. The profiling scripts time single launches with it too."""
    cp = cupy_module()
    if flush is not None:
        if flush_mode == "read":
            flush.sum()  # a reduction: every byte read, one number written
        else:
            flush.fill(tag)
    hold((1,), (1,), (np.uint64(wait_ns),))  # the GPU idles while the host enqueues what the events time
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return float(cp.cuda.get_elapsed_time(start, stop))


def time_launcher(fn, *, flush_bytes: int = 0, flush_mode: str = FLUSH_MODE, warmup_ms: float = 25.0,
                  budget_ms: float = 1500.0, min_reps: int = 10, max_reps: int = 400, noise: float = 0.02) -> dict:
    """Median and IQR of fn's device time by CUDA events (do_bench style).

    Warm-up by time budget (module load and first-launch costs stay out); before every timed
    repetition a buffer of ``flush_bytes`` (> 2x L2) is read (``flush_mode`` "read") so each
    repetition starts with a cold and clean L2. "write" overwrites it instead, as
    triton.testing.do_bench does; that leaves the L2 full of dirty lines whose write-back the timed
    kernel then pays: a bare 38 MB read takes 16.1 us after it and 12.4 us after a read flush on
    the H200 (docs/PERF.md ledger, flush-read). Then a one-thread kernel holds the GPU for longer than
    the host needs to enqueue ``fn`` (hold_ns, from the warm-up), so a launch-bound ``fn`` (torch
    eager issues dozens of small kernels per call) is timed by its device work, not by Python.
    Repetitions go on until the IQR is under ``noise`` of the median (after min_reps) or the time
    budget is spent.
    """
    import time as _time

    if flush_mode not in ("read", "write"):
        raise ValueError(f"flush_mode must be 'read' or 'write', not {flush_mode!r}")
    cp = cupy_module()
    flush = cp.empty(max(flush_bytes, 0) // 4, cp.int32) if flush_bytes else None
    hold = cp.RawKernel(_HOLD, "kdtr_hold")
    t0 = _time.perf_counter()
    n, enqueue = 0, []
    while n < 2 or (_time.perf_counter() - t0) * 1e3 < warmup_ms:
        e0 = _time.perf_counter()
        fn()
        enqueue.append(_time.perf_counter() - e0)  # host time to enqueue (no sync inside fn)
        n += 1
        cp.cuda.runtime.deviceSynchronize()
    est_ms = (_time.perf_counter() - t0) * 1e3 / n
    wait = hold_ns(float(np.median(enqueue[1:] or enqueue)))
    min_reps = max(3, min(min_reps, int(budget_ms / max(est_ms, 1e-3))))  # slow baselines: fewer reps
    times: list[float] = []
    t0 = _time.perf_counter()
    while len(times) < max_reps:
        times.append(cold_run(fn, flush, hold, wait, flush_mode, len(times)))
        if len(times) >= min_reps:
            q1, med, q3 = np.percentile(times, [25, 50, 75])
            if (q3 - q1) <= noise * med or (_time.perf_counter() - t0) * 1e3 > budget_ms:
                break
    q1, med, q3 = np.percentile(times, [25, 50, 75])
    return {"median_ms": float(med), "iqr_ms": float(q3 - q1), "reps": len(times), "min_ms": float(min(times))}


def mma_loop_flops(ctas: int, threads: int, chains: int, iters: int) -> int:
    """FLOPs of one kdtr_mma_peak launch: every warp issues ``chains`` m16n8k16 an iteration."""
    return ctas * (threads // 32) * chains * iters * MMA_FLOPS


def measure_mma_peak(iters: int = 8192) -> dict:
    """The mma.sync ceiling of this GPU, measured now: cuda/mma_peak.cu's issue loop of MMA_INSTRUCTION
    (independent accumulator chains in registers, no memory traffic), one CTA an SM, timed as time_launcher
    times (no L2 flush: the loop reads no memory). "mma_tflops", "mma" (the timing) and "mma_method"."""
    cp = cupy_module()
    loaded = load_function(MMA_PEAK_SOURCE, MMA_PEAK_KERNEL)
    threads, chains = read_global_ints(loaded.module, "kdtr_mma_peak_shape", 2)
    ctas = device_info()["sm_count"]
    out = cp.zeros(ctas * threads, cp.float32)
    args = (out, np.int32(iters))
    t = time_launcher(lambda: loaded.function((ctas,), (threads,), args), budget_ms=500)
    flops = mma_loop_flops(ctas, threads, chains, iters)
    return {"mma_tflops": flops / (t["median_ms"] * 1e-3) / 1e12, "mma": t,
            "mma_method": f"{MMA_INSTRUCTION} issue loop, {ctas} CTAs x {threads // 32} warps x {chains} chains x "
                          f"{iters} iters ({MMA_PEAK_SOURCE.name})"}


def measure_peaks(copy_bytes: int = 2 << 30, gemm_n: int = 8192) -> dict:
    """The ceilings of this GPU, measured now: the roofline's two, a device-to-device copy (bytes read +
    written) and a large bf16 GEMM on random data (torch when present, else cupy fp16, same rate), and
    the mma.sync ceiling (measure_mma_peak). Where the mma loop cannot run (no NVRTC, a compile error),
    mma_tflops is None and mma_method says why."""
    cp = cupy_module()
    src = cp.random.random(copy_bytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    copy = time_launcher(lambda: cp.copyto(dst, src), budget_ms=1000)
    gemm_tflops, how = None, ""
    try:
        import torch

        a = torch.randn(gemm_n, gemm_n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(gemm_n, gemm_n, device="cuda", dtype=torch.bfloat16)
        g = time_launcher(lambda: torch.matmul(a, b), budget_ms=1500)
        how = f"torch.matmul bf16 {gemm_n}^3"
    except Exception:
        a = cp.random.standard_normal((gemm_n, gemm_n), dtype=cp.float32).astype(cp.float16)
        b = cp.random.standard_normal((gemm_n, gemm_n), dtype=cp.float32).astype(cp.float16)
        g = time_launcher(lambda: cp.matmul(a, b), budget_ms=1500)
        how = f"cupy.matmul fp16 {gemm_n}^3 (no torch)"
    gemm_tflops = 2 * gemm_n**3 / (g["median_ms"] * 1e-3) / 1e12
    try:
        mma = measure_mma_peak()
    except Exception as e:  # NVRTC missing or the loop not compiling here: the other ceilings still stand
        mma = {"mma_tflops": None, "mma_method": f"not measured ({type(e).__name__}: {' '.join(str(e).split())[:160]})"}
    info = device_info()
    return {
        "device": info["name"], "driver": info["driver_version"], "sm_count": info["sm_count"],
        "copy_gbs": 2 * copy_bytes / (copy["median_ms"] * 1e-3) / 1e9, "gemm_tflops": gemm_tflops,
        "mma_tflops": mma.pop("mma_tflops"), "copy": copy, "gemm": g, "gemm_method": how, **mma,
        "l2_bytes": info["l2_bytes"],
    }
