"""Does flash-sm90's speed depend on which load of its module runs? The shipped build's modules loaded afresh K times
in one process (each time from a new copy of the same cubin file, so the bytes are the same and only the load
differs), timed on the same device inputs each round: Kimi decode shapes, where builds of the same code timed
1-2 us apart (docs/PERF.md, session 20). Every round after the first loads a padding module of another code size
first, and every module stays loaded, so each round's code lands somewhere new.

    python3 scripts/reload_spread.py [K] [--data]

--data: the other half of the question. One load of the modules, and each round new device inputs instead, behind a
padding allocation of another size (all kept), so the inputs and the workspace move while the code stays; the
round's line adds where the small inputs and the workspace sit (the 2 MB page, and the KB offset in it).

Why the copies: cupy memoizes RawModule by its path, so loading the same cached cubin path again returns the module
already loaded. Session 20's run 8 (this script before) therefore timed one module K times, not K loads.
"""
import shutil
import sys
import tempfile
from pathlib import Path

from kdtr.bench import run as bench
from kdtr.kernels import registry as kernels, launch
from kdtr.bench.timing import l2_flush_bytes, measure_peaks, time_launcher

args = [a for a in sys.argv[1:] if not a.startswith("--")]
K = int(args[0]) if args else 8
DATA = "--data" in sys.argv
SPECS = (bench.grid(["kimi-k2"], [8], [8], [32768], [1]) + bench.grid(["kimi-k2"], [8], [4], [32768], [1])
         + bench.grid(["kimi-k2"], [8], [0], [131072, 32768], [1]))
PAD = """extern "C" __global__ void kdtr_pad(float* x) {
  float a = x[threadIdx.x];
#pragma unroll
  for (int i = 0; i < N; ++i) a = a * 1.0001f + (float)i;
  x[threadIdx.x] = a;
}"""

cp = launch.cupy_module()
copies = Path(tempfile.mkdtemp(prefix="kdtr-reload-"))
RawModule = cp.RawModule


def fresh_module(*, path=None, **kw):
    """cupy.RawModule from a new copy of ``path``: a module load of its own (cupy memoizes by path)."""
    if path is not None:
        n = len(list(copies.iterdir()))
        path = str(shutil.copy(path, copies / f"{n}-{Path(path).name}"))
    return RawModule(path=path, **kw)


if not DATA:
    cp.RawModule = fresh_module  # kdtr.launch.load_function creates its modules through cp.RawModule
peaks = measure_peaks()
flush = l2_flush_bytes(peaks.get("l2_bytes"))


def make_problems():
    return [(spec, bench.device_problem(spec)) for spec in SPECS]


def where(a) -> str:
    """A device buffer's place: page (2 MB) : KB offset in it."""
    p = a.data.ptr
    return f"{p >> 21:x}:{(p & ((1 << 21) - 1)) >> 10}"


problems = make_problems()
labels = ["-".join(s.name.split("-")[2:4]) for s in SPECS]  # kimi-h8-p32k-ddtree8m-... -> p32k-ddtree8m
print("round  pad  " + "  ".join(f"{x:>15s}" for x in labels) + "   (us)")
keep, rows = [], []
impl = kernels.flash90_build("load0")
for k in range(K):
    pad_n, places = 0, ""
    if k and DATA:  # the inputs move: a padding allocation of another size, then new inputs (all kept)
        pad_n = 1 + (k * 2654435761) % 4093  # KB
        keep += [cp.empty(pad_n << 10, cp.uint8), problems]
        problems = make_problems()
    elif k:  # the code moves: a padding module of another code size, then new loads of every module
        launch._MODULES.clear()  # (earlier modules stay loaded in `keep`)
        pad_n = 64 + (k * 2654435761) % 3000  # ~1-48 KB of code, another size every round
        pad = RawModule(code=PAD, options=(f"-DN={pad_n}",))
        pad.get_function("kdtr_pad")  # compiled and loaded now (cupy defers both to the first use)
        keep += [pad, impl]
        impl = kernels.flash90_build(f"load{k}")
    ts = []
    for _, dp in problems:
        fn = impl.prepare(dp)
        ts.append(time_launcher(fn, flush_bytes=flush)["median_ms"] * 1e3)
        if DATA and dp is problems[0][1]:  # T9 P32k B1's small inputs and workspace
            places = "  q " + where(dp.q) + " bt " + where(dp.block_table) + " pl " + where(dp.prefix_lens) \
                     + " mask " + where(dp.tree_mask) + " ws " + (where(fn.workspace) if getattr(fn, "workspace", None) is not None else "-")
    rows.append(ts)
    print(f"{k:5d} {pad_n:4d}  " + "  ".join(f"{t:15.1f}" for t in ts) + places, flush=True)
print("spread " + "  ".join(f"{label}: {min(c):.1f}-{max(c):.1f}" for label, c in zip(labels, zip(*rows))))
print(f"module files loaded: {len(list(copies.iterdir()))}")
