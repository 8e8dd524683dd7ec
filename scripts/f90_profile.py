"""Where flash-sm90's main loop spends its cycles: the kernel built with -DKDTR_F90_PROFILE sums,
per warpgroup role, the clock64 cycles of each loop section over every CTA (cuda/flash_sm90.cu,
struct Laps). Printed as cycles per KV tile, next to the tensor-pipe work of a tile measured by
scripts/wgmma_probe.py. A timing aid for docs/PERF.md: nothing here is checked.

    python3 scripts/f90_profile.py [default|small] [LABEL=OPTS ...]   (the plain build unless knobs are given)

"small": the compute shapes with few tiles per CTA, "decode": Kimi B1, "xr": Kimi T9 (transposed rows) and T1, "pertoken": Kimi T1 P32k /
P64k and T9 P32k B1 (is a CTA's tile rate the same whether its tiles come from DRAM or from L2?), "tail":
Kimi T9 B1 (with KDTR_FLASH_TAIL=1 both grids are reported, on one time axis: does the tail start beside the first?); the per-CTA lines (prologue
and its steps, epilogue, whole CTA in cycles and us) say how much lies outside the loop; the launch lines
(globaltimer, one launch timed as `kdtr bench` does) when the last CTA reached each step after it,
the split merge's included (session 9 found a 5 us merge there). Each shape is launched REPEAT times; the
first launch is reported in full, and the placement lines compare launches: whether CTA i runs on the same SM
each time, which CTAs are alone on their SM, and whether the same CTAs or the same SMs end late.
"""
import sys

import numpy as np

from kdtr.bench import run as bench
from kdtr.kernels import registry as kernels
from kdtr.kernels.launch import cupy_module, device_info, make_launcher
from kdtr.bench.timing import _HOLD, cold_run, l2_flush_bytes

cp = cupy_module()
flush = cp.empty(l2_flush_bytes(device_info()["l2_bytes"]) // 4, cp.int32)
hold = cp.RawKernel(_HOLD, "kdtr_hold")
PRODUCER = ("tile wait", "S issue", "S wait+softmax", "P store", "P-full wait")
CONSUMER = ("P-full wait", "alpha+P V issue", "P V wait", "both-consumer bar", "refill+commit")
SETS = {
    "default": (bench.grid(["deepseek-v3"], [8], [256], [32768], [1]) + bench.grid(["deepseek-v3"], [8], [64], [8192], [1])
                + bench.grid(["kimi-k2"], [8], [0], [32768], [32, 1]) + bench.grid(["kimi-k2"], [8], [8], [32768], [32])),
    "decode": bench.grid(["kimi-k2"], [8], [0, 4, 8], [32768, 131072], [1]),
    "xr": bench.grid(["kimi-k2"], [8], [8], [32768], [32, 1]) + bench.grid(["kimi-k2"], [8], [0], [32768], [32]),
    "t1": bench.grid(["kimi-k2"], [8], [0], [32768, 131072], [1]),  # with KDTR_FLASH_XR=1: XR_ONLY's loop and merge
    "tail": bench.grid(["kimi-k2"], [8], [8], [32768, 131072], [1]),  # with KDTR_FLASH_TAIL=1: both grids
    # the same tokens per CTA from DRAM (T1 P64k: 129 CTAs) or half of them from L2 (T9 P32k: two row tiles a split)
    "pertoken": bench.grid(["kimi-k2"], [8], [0], [32768, 65536], [1]) + bench.grid(["kimi-k2"], [8], [8], [32768], [1]),
    "small": (bench.grid(["deepseek-v3"], [8], [64], [8192], [1, 8]) + bench.grid(["deepseek-v3"], [8], [64], [32768], [1])
              + bench.grid(["deepseek-v3"], [8], [256], [8192], [1]) + bench.grid(["deepseek-v3"], [8], [256], [32768], [1])),
}
specs = SETS[next((a for a in sys.argv[1:] if "=" not in a), "default")]
variants = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a) or {"base": ""}


def counters(loaded):
    """The profile build's counter arrays of one loaded kernel (each build is its own module): the
    sums, each CTA's loop end, each CTA's SM (+1)."""
    return tuple(cp.ndarray((n,), cp.uint64, loaded.module.get_global(name))
                 for n, name in ((32, "kdtr_f90_prof"), (4096, "kdtr_f90_ends"), (4096, "kdtr_f90_smid")))


def by_sm(rel, ends, smid):
    """Loop ends grouped by the SM each CTA ran on: CTAs alone on their SM against those sharing it,
    each SM's last end, and the SMs whose last CTA ends latest (is the spread placement or place?)."""
    ran = (ends > 0) & (smid > 0)
    sms = smid[ran].astype(np.int64) - 1
    t = rel[ran]
    count = np.bincount(sms, minlength=sms.max() + 1)
    pct = lambda x: " / ".join(f"{np.percentile(x, q):.1f}" for q in (10, 50, 90)) if x.size else "-"  # noqa: E731
    lone, shared = t[count[sms] == 1], t[count[sms] > 1]
    print(f"  loop ends p10/50/90 of CTAs alone on their SM ({lone.size}): {pct(lone)}; sharing it ({shared.size}): {pct(shared)}")
    last = np.full(count.size, -np.inf)
    np.maximum.at(last, sms, t)
    used = np.nonzero(count)[0]
    late = used[np.argsort(-last[used])][:12]
    print(f"  each SM's last loop end p10/50/90 over {used.size} SMs: {pct(last[used])}; latest SMs (id: us, CTAs): "
          + ", ".join(f"{s}: {last[s]:.1f} ({count[s]})" for s in late))


def report(title, raw, ends, smid, grid, t0, event_us):
    """One grid's lines; times in us after t0, the first CTA entry of the launch's first grid."""
    v = np.array(raw, dtype=float)
    tiles, ctas = v[10], v[11]
    print(f"{title}: {int(ctas)} CTAs, {tiles / ctas:.1f} tiles each; cycles per tile:")
    print("  producer  " + "  ".join(f"{n} {v[i] / tiles:6.0f}" for i, n in enumerate(PRODUCER))
          + f"  | sum {v[0:5].sum() / tiles:6.0f}")
    print("  consumer  " + "  ".join(f"{n} {v[5 + i] / tiles:6.0f}" for i, n in enumerate(CONSUMER))
          + f"  | sum {v[5:10].sum() / tiles:6.0f}")
    loop = v[5:10].sum() / ctas
    print(f"  per CTA: prologue {v[12] / ctas:7.0f}  loop {loop:8.0f}  epilogue {v[13] / ctas:7.0f}  "
          f"whole {v[14] / ctas:8.0f} cycles = {v[15] / ctas / 1e3:6.1f} us  (SM clock {v[14] / v[15]:.2f} GHz)")
    print(f"  producer from entry: split known {v[16] / ctas:6.0f}  tail scan done {v[17] / ctas:6.0f}  "
          f"Q registers loaded {v[18] / ctas:6.0f}  first tile may start {v[12] / ctas:6.0f} cycles")
    at = lambda k: f"{(raw[k] - t0) / 1e3:6.1f}" if raw[k] else "   -  "  # noqa: E731
    print(f"  CTA entries from {at(19)} to {at(20)} us, last exit {at(21)} us; CUDA events around the launch "
          f"{event_us:6.1f} us (cold L2)")
    e = (np.sort(ends[ends > 0]) - t0) / 1e3
    if e.size:
        print("  loop ends (us after the first entry), percentiles 0/10/50/90/100: "
              + " / ".join(f"{np.percentile(e, q):.1f}" for q in (0, 10, 50, 90, 100)))
        rel = (ends - t0) / 1e3
        by_sm(rel, ends, smid)
        late = np.nonzero((ends > 0) & (rel > np.percentile(e, 90) + 5.0))[0]
        if late.size:  # CTA x + gridDim.x * (y + gridDim.y * z), as the kernel numbers them
            print("  CTAs ending > 5 us after the 90th percentile: "
                  + ", ".join(f"{i} ({rel[i]:.1f})" for i in late[:12]) + f"  grid {grid}")
    print(f"  loops end from {at(22)} to {at(23)} us after the first entry; last CTA past: epilogue {at(24)}, "
          f"merge ticket {at(25)}, all splits in {at(26)}, max lse {at(28)}, partials summed {at(29)}, rows merged {at(27)}, exit {at(21)} us")


def placement(runs):
    """Across repeated launches of one grid: does CTA i land on the same SM, which CTAs are alone on
    theirs, and do the same SMs (and the same CTA numbers) end late each time?"""
    if len(runs) < 2:
        return
    (e0, s0), (e1, s1) = runs[0], runs[1]
    ran = (e0 > 0) & (e1 > 0) & (s0 > 0) & (s1 > 0)
    same = np.mean(s0[ran] == s1[ran]) * 100
    lone = []
    for _, s in runs:
        c = np.bincount(s[s > 0], minlength=s.max() + 1)
        lone.append(set(np.nonzero((s > 0) & (c[s] == 1))[0].tolist()))
    common = set.intersection(*lone)
    print(f"  over {len(runs)} launches: CTA i on the same SM in launches 0 and 1: {same:.0f} %; CTAs alone on "
          f"their SM: {[len(x) for x in lone]}, in every launch {len(common)}: {sorted(common)[:24]}")
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    cta = np.corrcoef(rank(e0[ran]), rank(e1[ran]))[0, 1]
    n = max(s0.max(), s1.max()) + 1
    last = []
    for e, s in runs[:2]:
        m = np.zeros(n)
        np.maximum.at(m, s[s > 0], e[s > 0].astype(float))
        last.append(m)
    used = (last[0] > 0) & (last[1] > 0)
    sm = np.corrcoef(rank(last[0][used]), rank(last[1][used]))[0, 1]
    print(f"  rank correlation of loop ends between launches 0 and 1: by CTA number {cta:.2f}, by SM (its last CTA) {sm:.2f}")


REPEAT = 3
for label, opts in variants.items():
    kernel = kernels.flash90_build(label, "-DKDTR_F90_PROFILE " + opts)
    for spec in specs:
        dp = bench.device_problem(spec)
        steps, ws, splits = kernel.steps(dp)
        go = make_launcher(dp, steps, ws, splits)
        go()  # warm-up: clocks, caches
        # the verify grids: the main kernel and, with KDTR_FLASH_TAIL=1, the tail launch (each its own counters)
        grids = [s for s in steps if "flash90_verify" in next(iter(s[0].compiled.lowered))]
        arrays = [counters(s[0]) for s in grids]
        runs = [[] for _ in grids]
        for rep in range(REPEAT):
            for prof, ends_dev, smid_dev in arrays:
                prof[:] = 0
                ends_dev[:] = 0
                smid_dev[:] = 0
                for slot in (19, 22):  # the first CTA entry and loop end are atomicMins
                    prof[slot:slot + 1] = cp.full((1,), np.iinfo(np.uint64).max, cp.uint64)
            event_us = cold_run(go, flush, hold, 200_000) * 1e3  # as kdtr bench times it
            raws = [[int(x) for x in prof.get()] for prof, _, _ in arrays]
            t0 = raws[0][19]
            for k, (step, raw, (_, ends_dev, smid_dev)) in enumerate(zip(grids, raws, arrays)):
                n = min(4096, int(np.prod(step[1])))
                ends, smid = ends_dev.get()[:n].astype(np.int64), smid_dev.get()[:n].astype(np.int64)
                runs[k].append((np.where(ends > 0, ends - t0, 0), smid))
                if rep == 0:
                    title = f"{label} {spec.name}" + (f" (grid {k}: {next(iter(step[0].compiled.lowered))})" if len(grids) > 1 else "")
                    report(title, raw, ends, smid, step[1], t0, event_us)
        for r in runs:
            placement(r)
