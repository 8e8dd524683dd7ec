"""Are some SMs slower streamers than others, every launch, and does XR_ONLY's decode tail follow them?

Session 16 found that the SMs whose Kimi T1 P128k B1 CTAs end late stay late from launch to launch
(rank correlation 0.73) while the CTAs placed on them change. If that is a property of the SM (its
place in the chip), a split whose piece lengths follow each SM's speed could end the launch together.
This script measures it; nothing here is checked (a timing aid for docs/PERF.md).

1. A bulk-copy probe: 2 CTAs an SM (every SM), each streams its own 17 x 36 KB (as XR_ONLY's CTA on
   T1 P128k B1: two 36 KB stages, one cp.async.bulk a stage, nothing computed), records its SM, the
   globaltimer at its start and end and when its first chunk landed. L2 flushed before each of REPEAT
   launches. Variants: contiguous regions or shuffled 72 KB pages; the kernel's own tensor map and box
   at three L2 promotions; 0-2 dependent cold loads before the first copy.
2. flash-sm90's profile build (-DKDTR_F90_PROFILE) on Kimi T1 P128k B1, XR_ONLY with the plan's splits
   and with 2 x SMs splits (no SM alone): each CTA's SM, first TMA boxes, first tile and loop end.
Printed: per-SM stability of the probe across launches, its spread, SMs sorted by id (the GPC
structure, if any), and the correlation of the probe's per-SM time with the kernel's per-SM loop end.

    python3 scripts/sm_speed.py      SM_SPEED_KERNEL_ONLY=1: skip the probes; SM_SPEED_OPTS: more -D options
"""
import os

import numpy as np

from kdtr.bench import run as bench
from kdtr.kernels import registry as kernels
from kdtr.kernels.launch import cupy_module, device_info, make_launcher
from kdtr.bench.timing import _HOLD, cold_run, l2_flush_bytes

cp = cupy_module()
info = device_info()
SMS = info["sm_count"]
flush = cp.empty(l2_flush_bytes(info["l2_bytes"]) // 4, cp.int32)
hold = cp.RawKernel(_HOLD, "kdtr_hold")
REPEAT = 6
CHUNK, CHUNKS = 36864, 17

PROBE = r"""
struct __align__(64) Map { unsigned long long opaque[16]; };

// Chunk c of this CTA into stage `dst`, completing on mbarrier `bar`: a bulk copy of CHUNK bytes at src + offs[c], or
// (TENSOR) one box of the cache's tensor map at key row slots[c].
template <bool TENSOR>
__device__ void copy(unsigned dst, unsigned bar, const char* src, const long long* offs, unsigned long long map,
                     const int* slots, int c) {
  asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(CHUNK) : "memory");
  if (TENSOR)
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(dst), "l"(map), "r"(0), "r"(slots[c]), "r"(0), "r"(bar) : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src + offs[c]), "r"(CHUNK), "r"(bar) : "memory");
}

// Thread 0 streams the CTA's `chunks` chunks through two stages and writes (SM, start, end, first chunk landed).
// `links` dependent loads of `chain` come first (the kernel's prefix length, then its block-table entry).
template <bool TENSOR>
__device__ void stream(const char* src, const long long* offs, unsigned long long map, const int* slots, int chunks,
                       unsigned long long* out, const int* chain, int links) {
  extern __shared__ __align__(1024) unsigned char smem[];  // two stages, then the two mbarriers; no static smem
  const unsigned s0 = (unsigned)__cvta_generic_to_shared(smem), b0 = s0 + 2 * CHUNK;
  if (s0 & 1023u) __trap();  // the 128-byte swizzle of a box needs 1 KB alignment
  offs += (long long)blockIdx.x * chunks;
  slots += (long long)blockIdx.x * chunks;
  unsigned long long t0, t1, tf = 0;
  if (threadIdx.x != 0) return;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  int at = blockIdx.x * 32;
  for (int k = 0; k < links; ++k) at = chain[at] + (k + 1) * gridDim.x * 32 + blockIdx.x * 32;  // a new line each
  if (at < 0) offs = nullptr;  // never: keeps the chain live
  for (int s = 0; s < 2; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(b0 + 8 * s));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  for (int c = 0; c < 2 && c < chunks; ++c) copy<TENSOR>(s0 + c * CHUNK, b0 + 8 * c, src, offs, map, slots, c);
  for (int c = 0; c < chunks; ++c) {
    const int s = c & 1;
    asm volatile("{\n.reg .pred p;\nW:\nmbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n@!p bra W;\n}\n"
                 ::"r"(b0 + 8 * s), "r"((c >> 1) & 1) : "memory");
    if (c == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(tf));
    if (c + 2 < chunks) copy<TENSOR>(s0 + s * CHUNK, b0 + 8 * s, src, offs, map, slots, c + 2);
  }
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  out[4 * blockIdx.x] = sm;
  out[4 * blockIdx.x + 1] = t0;
  out[4 * blockIdx.x + 2] = t1;
  out[4 * blockIdx.x + 3] = tf;
}

extern "C" __global__ void __launch_bounds__(128, 2) kdtr_sm_probe(const char* src, const long long* offs, int chunks,
                                                                  const int* chain, int links, unsigned long long* out) {
  stream<false>(src, offs, 0, nullptr, chunks, out, chain, links);
}
extern "C" __global__ void __launch_bounds__(128, 2) kdtr_sm_probe3d(const __grid_constant__ Map map, const int* slots,
                                                                    int chunks, unsigned long long* out) {
  stream<true>(nullptr, nullptr, reinterpret_cast<unsigned long long>(&map), slots, chunks, out, nullptr, 0);
}
""".replace("CHUNK", str(CHUNK))
SMEM = 2 * CHUNK + 16  # two stages and two mbarriers


def launches(kernel, args) -> list:
    """REPEAT launches of a probe kernel on 2 x SMs CTAs after a warm-up, each with a cold L2: per launch,
    (smid, start ns, end ns, first chunk landed ns) of each CTA."""
    ctas = 2 * SMS
    out = cp.zeros(4 * ctas, cp.uint64)
    runs = []
    for rep in range(REPEAT + 1):
        flush.sum()
        hold((1,), (1,), (np.uint64(200_000),))
        kernel((ctas,), (128,), (*args, out), shared_mem=SMEM)
        cp.cuda.runtime.deviceSynchronize()
        if rep:  # the first launch warms up
            runs.append(out.get().reshape(ctas, 4).astype(np.int64))
    return runs


def probe3d(promotion: str):
    """probe(pages=True) through the kernel's own tensor map and box (64 columns x 32 keys x 9 slabs, 128-byte
    swizzle) over a 64-token page cache, with L2 promotion ``promotion`` (kdtr/kernels/flash/tma.py's names)."""
    from kdtr.kernels.flash import tma

    k = cp.RawKernel(PROBE, "kdtr_sm_probe3d")
    k.max_dynamic_shared_size_bytes = SMEM
    ctas = 2 * SMS
    pages = (ctas * CHUNKS + 1) // 2
    cache = cp.random.randint(0, 255, pages * 2 * CHUNK, dtype=cp.uint8)
    t = np.arange(ctas * CHUNKS)
    perm = np.random.default_rng(0).permutation(pages)
    slots = cp.asarray((perm[t // 2] * 64 + (t % 2) * 32).astype(np.int32))
    spec = tma.kv_map_spec(pages, 64, 576, 64, 32, 9)
    return launches(k, (tma.encode(spec, cache.data.ptr, tma.l2_promotion(promotion)), slots, np.int32(CHUNKS)))


def probe(pages: bool, links: int = 0):
    """launches() of the bulk-copy probe. ``pages``: chunk c of CTA i is half of a 72 KB page placed at random
    (as a shuffled 64-token page cache), else the CTAs' regions are contiguous; ``links`` dependent loads first."""
    k = cp.RawKernel(PROBE, "kdtr_sm_probe")
    k.max_dynamic_shared_size_bytes = SMEM
    ctas = 2 * SMS
    src = cp.random.randint(0, 255, ctas * CHUNKS * CHUNK, dtype=cp.uint8)
    t = np.arange(ctas * CHUNKS)
    if pages:
        perm = np.random.default_rng(0).permutation((ctas * CHUNKS + 1) // 2)
        offs = perm[t // 2] * 2 * CHUNK + (t % 2) * CHUNK
        offs = np.where(offs + CHUNK <= src.size, offs, t * CHUNK)
    else:
        offs = t * CHUNK
    offs = cp.asarray(offs.astype(np.int64))
    chain = cp.zeros((links + 1) * ctas * 32, cp.int32)  # a 128-byte line per CTA and link: cold after the flush
    return launches(k, (src, offs, np.int32(CHUNKS), chain, np.int32(links)))


def per_sm(sm, t):
    """Mean of t over the CTAs of each SM (nan where none ran)."""
    s = np.bincount(sm, weights=t, minlength=SMS)
    n = np.bincount(sm, minlength=SMS)
    return np.where(n > 0, s / np.maximum(n, 1), np.nan), n


def rank_corr(a, b):
    ok = ~np.isnan(a) & ~np.isnan(b)
    r = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    return np.corrcoef(r(a[ok]), r(b[ok]))[0, 1]


pct = lambda x: " / ".join(f"{np.percentile(x[~np.isnan(x)], q):.2f}" for q in (0, 10, 50, 90, 100))  # noqa: E731

KERNEL_ONLY = os.environ.get("SM_SPEED_KERNEL_ONLY") == "1"  # skip the probes (their fast SMs: session 18's)
contiguous = []  # its launches also give the per-SM rates below
for label, pages in () if KERNEL_ONLY else (("random pages", True), ("contiguous", False)):
    tails = []
    runs = probe(pages)
    for r in runs:
        e = (r[:, 2] - r[:, 1].min()) / 1e3
        tails.append(f"{np.median(e):.1f}/{e.max():.1f}")
    print(f"probe, {label}: CTA end median/max per launch (us): " + ", ".join(tails))
    contiguous = runs
for promotion in () if KERNEL_ONLY else ("256", "none", "128"):  # the kernel's old 256 bytes, none, its 128
    firsts = []
    for r in probe3d(promotion):
        t0 = r[:, 1].min()
        e = (r[:, 2] - t0) / 1e3
        firsts.append(f"{np.median((r[:, 3] - t0) / 1e3):.2f}/{np.median(e):.1f}/{e.max():.1f}")
    print(f"probe through the kernel's tensor map, L2 promotion {promotion}: first chunk landed / CTA end median / max, "
          f"per launch (us): " + ", ".join(firsts))
for links in () if KERNEL_ONLY else (0, 1, 2):  # the first chunk's landing after 0-2 dependent cold loads (the kernel: prefix length, block table)
    firsts = []
    for r in probe(True, links):
        t0 = r[:, 1].min()
        firsts.append(f"{np.median((r[:, 3] - t0) / 1e3):.2f}/{np.median((r[:, 2] - t0) / 1e3):.1f}")
    print(f"probe, {links} dependent loads first: first chunk landed / CTA end, medians per launch (us): " + ", ".join(firsts))
sm_t = []
for r in contiguous:
    t0 = r[:, 1].min()
    end_us = (r[:, 2] - t0) / 1e3
    dur_us = (r[:, 2] - r[:, 1]) / 1e3
    m, n = per_sm(r[:, 0], dur_us)
    sm_t.append(m)
    print(f"probe launch: CTAs per SM {np.bincount(n, minlength=4)[:4].tolist()} (SMs with 0/1/2/3); end p0/10/50/90/100 "
          f"{pct(end_us)} us; CTA duration {pct(dur_us)} us")
sm_t = np.array(sm_t) if sm_t else np.full((REPEAT, SMS), np.nan)
if KERNEL_ONLY:  # session 18's probe: these 24 SMs streamed ~20 % faster than the other 108, every launch
    sm_t[:] = 36.0
    sm_t[:, [*range(32, 44), *range(78, 88), 126, 127]] = 29.0
mean = np.nanmean(sm_t, axis=0)
print(f"probe per-SM duration (mean of {REPEAT} launches) p0/10/50/90/100: {pct(mean)} us; "
      f"rank correlation between launches: " + ", ".join(f"{rank_corr(sm_t[0], sm_t[i]):.2f}" for i in range(1, REPEAT)))
print("probe per-SM mean duration by SM id (us):")
for i in range(0, SMS, 16):
    print(f"  {i:3d}: " + " ".join(f"{x:5.1f}" for x in mean[i:i + 16]))
fast_sms = np.argsort(mean)[:24]
print("fastest 24 SMs: " + ", ".join(f"{s} ({mean[s]:.1f})" for s in sorted(fast_sms)))
slow = np.argsort(-mean)[:20]
print("slowest 20 SMs: " + ", ".join(f"{s} ({mean[s]:.1f})" for s in slow))

# the kernel: XR_ONLY on Kimi T1 P128k B1, plan and 2 x SMs splits
kernel = kernels.flash90_build("prof", "-DKDTR_F90_PROFILE " + os.environ.get("SM_SPEED_OPTS", ""))
spec = bench.grid(["kimi-k2"], [8], [0], [131072], [1])[0]
for splits in ("", str(2 * SMS)):
    os.environ["KDTR_FLASH_SPLITS"] = splits
    dp = bench.device_problem(spec)
    steps, ws, nsplit = kernel.steps(dp)
    go = make_launcher(dp, steps, ws, nsplit)
    go()
    main = steps[0][0]
    prof = cp.ndarray((32,), cp.uint64, main.module.get_global("kdtr_f90_prof"))
    ends_d = cp.ndarray((4096,), cp.uint64, main.module.get_global("kdtr_f90_ends"))
    smid_d = cp.ndarray((4096,), cp.uint64, main.module.get_global("kdtr_f90_smid"))
    first_d = cp.ndarray((4096,), cp.uint64, main.module.get_global("kdtr_f90_first"))
    issue_d = cp.ndarray((4096,), cp.uint64, main.module.get_global("kdtr_f90_issue"))
    steps_d = cp.ndarray((3 * 4096,), cp.uint64, main.module.get_global("kdtr_f90_steps"))
    n = int(np.prod(steps[0][1]))
    k_t = []
    for rep in range(REPEAT):
        prof[:] = 0
        ends_d[:] = 0
        smid_d[:] = 0
        first_d[:] = 0
        issue_d[:] = 0
        steps_d[:] = 0
        prof[19:20] = cp.full((1,), np.iinfo(np.uint64).max, cp.uint64)
        prof[22:23] = cp.full((1,), np.iinfo(np.uint64).max, cp.uint64)
        ev = cold_run(go, flush, hold, 200_000) * 1e3
        t0 = int(prof.get()[19])
        ends, smid = ends_d.get()[:n].astype(np.int64), smid_d.get()[:n].astype(np.int64)
        first = first_d.get()[:n].astype(np.int64)
        ok = (ends > 0) & (smid > 0) & (first > 0)
        rel = (ends[ok] - t0) / 1e3
        sm = smid[ok] - 1
        f = (first[ok] - t0) / 1e3
        iss = issue_d.get()[:n].astype(np.int64)[ok]
        iss = (iss[iss > 0] - t0) / 1e3
        st = steps_d.get()[:3 * n].reshape(n, 3).astype(np.int64)[ok]
        med = lambda x: f"{np.median((x[x > 0] - t0) / 1e3):.2f}" if (x > 0).any() else "-"  # noqa: E731
        print(f"  TMA issuer, medians us: P known {med(st[:, 2])}, mbarriers ready {med(st[:, 0])}, box 0 issued {med(st[:, 1])}")
        dur = rel - f
        late = rel >= np.percentile(rel, 90)
        fast = np.isin(sm, fast_sms)
        cnt = np.bincount(sm, minlength=SMS)
        lone = cnt[sm] == 1
        print(f"  first TMA tiles issued p0/10/50/90/100 {pct(iss) if iss.size else '-'}; first tile landed p0/10/50/90/100 {pct(f)}; loop (first tile to end) {pct(dur)}; the latest 10 % of ends: "
              f"first tile {np.mean(f[late]):.2f} (all {np.mean(f):.2f}), loop {np.mean(dur[late]):.2f} (all {np.mean(dur):.2f}); "
              f"loop on the probe's fast SMs {np.mean(dur[fast & ~lone]):.2f} ({int(np.sum(fast))} CTAs), others sharing "
              f"{np.mean(dur[~fast & ~lone]):.2f}, alone {np.mean(dur[lone]) if lone.any() else float('nan'):.2f}")
        last = np.full(SMS, -np.inf)
        np.maximum.at(last, sm, rel)
        k_t.append(np.where(np.isfinite(last), last, np.nan))
        print(f"kernel {nsplit} splits, launch {rep}: events {ev:.1f} us; loop ends p0/10/50/90/100 {pct(rel)}; "
              f"SMs with 1 CTA {int(np.sum(cnt == 1))}")
    k_t = np.array(k_t)
    km = np.nanmean(k_t, axis=0)
    print(f"kernel {nsplit} splits: per-SM last loop end, rank correlation between launches: "
          + ", ".join(f"{rank_corr(k_t[0], k_t[i]):.2f}" for i in range(1, REPEAT))
          + f"; against the probe's per-SM duration: {rank_corr(km, mean):.2f} (per launch: "
          + ", ".join(f"{rank_corr(k_t[i], mean):.2f}" for i in range(REPEAT)) + ")")
    print(f"  per-SM mean last loop end p0/10/50/90/100: {pct(km)} us")
