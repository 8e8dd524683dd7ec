"""A/B timer: two or more kernel specs timed on the same shapes in one process, interleaved.

    python3 tools/ab.py -k flash-sm90 -k 'flash-sm90[xr=1]' --set memory [--rounds 3] [--json ab.json]
    python3 tools/ab.py -k flash-sm90 -k path/my_kernel.cu:my_verify --model kimi-k2 --budget 0,8 --prefix 32k
    python3 tools/ab.py -k flash --tree main=../kdtr-main --tree new=. --set compute --rounds 2

Per shape every spec launches on the same device inputs (kdtr.bench.run.device_problem, kernel.prepare), timed by
kdtr's own timing (kdtr.bench.timing.time_launcher: CUDA-event medians, the L2 flushed before every repetition) in
--rounds rounds, the spec order reversed every other round so that no spec is always first. A spec's time is the
median of its round medians and its spread half the range of them. The table gives each spec's time in us and, for
every spec after the first (A), A's time over its own (above 1: faster than A), and how many output elements
differ from A's bit for bit (0: the same results). Check a spec first with `kdtr verify -k SPEC ci`: this only times.

With --tree (two source trees or more: checkouts or `git worktree`s of kdtr, each with kdtr/ and cuda/), every spec is
timed as each tree builds and plans it, labelled SPEC@NAME: one process a tree and round, that tree first on the path
(asserted), the tree order reversed every other round; the first tree's process also measures the peaks, and its first
spec's outputs are the bits the other trees' cells are compared with (the same inputs where the trees draw them alike).

Stopped by Ctrl-C or SIGTERM (`timeout`), it prints the table of the rounds done by then and exits 130; --json is
rewritten after every shape (tree mode: every tree's round, with the shapes a stopped round had done), marked
"partial" until the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import string
import subprocess
import sys
import tempfile
from pathlib import Path


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any GPU work."""
    print(f"ab.py: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", "--kernel", action="append", default=[], metavar="SPEC",
                    help="kernel spec (built-in, NAME[KEY=VALUE,...], file.cu:symbol); two or more, the first is A")
    ap.add_argument("--set", action="append", default=[], metavar="NAME", help="named shape set: compute, memory")
    ap.add_argument("--model", help="grid: models, e.g. deepseek-v3,kimi-k2 (default deepseek-v3)")
    ap.add_argument("--tp", help="grid: tensor-parallel degrees (default 8)")
    ap.add_argument("--budget", help="grid: tree budgets, 0 = decode (default 64)")
    ap.add_argument("--prefix", help="grid: prefix lengths, e.g. 8k,32k (default 8k)")
    ap.add_argument("--batch", help="grid: batch sizes (default 1)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--out-dtype", default=None, help="default: the kv dtype")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape (default 3)")
    ap.add_argument("--budget-ms", type=float, default=500.0, help="timing budget of one spec in one round (default 500)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--json", metavar="PATH", help="also write every round's times here")
    ap.add_argument("--tree", action="append", default=[], metavar="[NAME=]DIR",
                    help="time the specs as this kdtr source tree builds them (two or more; NAME: its label)")
    ap.add_argument("--worker", metavar="JOB.json", help=argparse.SUPPRESS)  # one tree's round (tree mode)
    return ap.parse_args()


def shapes(args) -> list:
    """The CaseSpecs that --set and the grid options name (ValueError / InputError naming a bad value)."""
    from kdtr.bench.run import grid
    from kdtr.inputs.presets import BENCH_GRIDS, parse_list

    out_dtype = args.out_dtype or args.kv_dtype
    specs = []
    for name in args.set:
        if name not in BENCH_GRIDS:
            raise ValueError(f"--set {name}: unknown shape set; known: {', '.join(BENCH_GRIDS)}")
        g = BENCH_GRIDS[name]
        specs += grid(g["models"], g["tps"], g["budgets"], g["prefixes"], g["batches"], args.page_size, args.kv_dtype,
                      out_dtype)
    if args.prefix or args.budget:
        specs += grid(parse_list(args.model or "deepseek-v3", str), parse_list(args.tp or "8", int),
                      parse_list(args.budget or "64", int), parse_list(args.prefix or "8k"),
                      parse_list(args.batch or "1", int), args.page_size, args.kv_dtype, out_dtype)
    return specs


def differing(a, b) -> int:
    """Output elements (out, and lse where both write it) whose float32 bits differ between two runs."""
    import numpy as np

    n = int(np.sum(a.out.view(np.uint32) != b.out.view(np.uint32)))
    if a.lse is not None and b.lse is not None:
        n += int(np.sum(a.lse.view(np.uint32) != b.lse.view(np.uint32)))
    return n


def time_shape(spec, kernels: list, peaks: dict, args, ref=None) -> tuple[dict, object]:
    """Every kernel on one shape: its round medians (ms), or why it was not timed; bits differing from ``ref``'s
    outputs (another process's, tree mode), else from the first kernel's. Also the first kernel's outputs."""
    from kdtr.bench.run import device_problem, min_bytes, roofline_ms
    from kdtr.bench.timing import l2_flush_bytes, time_launcher
    from kdtr.inputs.problem import visible_flops

    dp = device_problem(spec, args.seed)
    layout = dp.problem
    flops, nbytes = visible_flops(layout.prefix_lens, layout.tree_depth, layout.H), min_bytes(layout, spec.out_dtype)
    row = {"shape": spec.name, "dims": {"model": spec.model, "T": spec.T, "P": max(spec.prefix_lens), "B": spec.B},
           "roofline_ms": roofline_ms(flops, nbytes, peaks), "cells": []}
    launchers, first = {}, None
    for i, k in enumerate(kernels):
        cell = {"spec": k.name, "status": "ok", "rounds_ms": [], "differing": None}
        row["cells"].append(cell)
        why = k.caps.why_not(layout, spec.out_dtype)
        if why:
            cell["status"] = f"skipped: {why}"
            continue
        try:
            got = k.run_on(dp)
            first = got if i == 0 else first
            base = ref if ref is not None else first
            cell["differing"] = differing(base, got) if base is not None else None
            launchers[i] = k.prepare(dp)
        except Exception as e:  # a compile or launch failure of one spec: its cell says so, the others go on
            cell["status"] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
    flush = l2_flush_bytes(peaks.get("l2_bytes"))
    order = list(launchers)
    for r in range(args.rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            t = time_launcher(launchers[i], flush_bytes=flush, budget_ms=args.budget_ms)
            row["cells"][i]["rounds_ms"].append(t["median_ms"])
    for c in (row["cells"][i] for i in order):
        summarize(c)
    return row, first


def summarize(cell: dict) -> None:
    """A timed cell's time (the median of its round medians) and spread (half their range), in place."""
    import numpy as np

    cell["median_ms"] = float(np.median(cell["rounds_ms"]))
    cell["spread_ms"] = (max(cell["rounds_ms"]) - min(cell["rounds_ms"])) / 2


JOB_ARGS = ("kernel", "set", "model", "tp", "budget", "prefix", "batch", "page_size", "kv_dtype", "out_dtype", "budget_ms",
            "seed")
"""The options a tree's worker process takes over from the command line (tree mode)."""


def parse_trees(items: list[str]) -> list[tuple[str, Path]]:
    """--tree [NAME=]DIR values as (label, resolved folder); ValueError naming the first bad one."""
    trees = []
    for item in items:
        name, sep, folder = item.partition("=")
        name, folder = (name, folder) if sep else ("", item)
        path = Path(folder).expanduser().resolve()
        if not (path / "kdtr" / "__init__.py").is_file() or not (path / "cuda").is_dir():
            raise ValueError(f"--tree {item}: {path} is not a kdtr source tree (it needs kdtr/__init__.py and cuda/)")
        trees.append((name or path.name, path))
    names = [n for n, _ in trees]
    if len(set(names)) < len(names):
        raise ValueError(f"--tree: two trees are labelled {max(names, key=names.count)!r}; name them NAME=DIR")
    return trees


def worker(job_file: str) -> None:
    """One tree's round (tree mode): this tree's kdtr times the specs once on every shape; rows to the job's out file.
    Round 0 of the first tree measures the peaks and leaves its first spec's outputs for the others' bit counts."""
    import numpy as np

    import kdtr
    from kdtr.bench.timing import measure_peaks
    from kdtr.golden.atomic import atomic_write_bytes
    from kdtr.kernels.nvrtc import CUDA_DIR
    from kdtr.kernels.registry import resolve_kernel

    job = json.loads(Path(job_file).read_text())
    tree, tmp, first_tree, r = Path(job["tree"]), Path(job["tmp"]), job["first_tree"], job["round"]
    for what, where in (("kdtr", Path(kdtr.__file__)), ("the CUDA sources", CUDA_DIR)):
        if not where.resolve().is_relative_to(tree):
            raise SystemExit(f"ab.py: --tree {tree}: {what} came from {where}, not from the tree")
    args = argparse.Namespace(**job["args"], rounds=1)
    specs, kernels = shapes(args), [resolve_kernel(k) for k in args.kernel]
    if first_tree and r == 0:
        (tmp / "peaks.json").write_text(json.dumps(measure_peaks(), default=str))
    peaks = json.loads((tmp / "peaks.json").read_text())
    rows = []
    for spec in specs:
        saved = tmp / f"ref-{spec.name}.npz"
        ref = None
        if r == 0 and not first_tree and saved.exists():
            with np.load(saved) as z:
                ref = argparse.Namespace(out=z["out"], lse=z["lse"] if "lse" in z else None)
        row, first = time_shape(spec, kernels, peaks, args, ref)
        if r == 0 and first_tree and first is not None:
            np.savez(saved, out=first.out, **({"lse": first.lse} if first.lse is not None else {}))
        if r > 0:  # bits are counted in round 0
            for c in row["cells"]:
                c["differing"] = None
        rows.append(row)
        # after every shape, so that a stopped round keeps the shapes it did
        atomic_write_bytes(job["out"], json.dumps({"peaks": peaks, "rows": rows}, default=str).encode())
        print(f"  {spec.name}", file=sys.stderr, flush=True)


def run_trees(args, trees: list[tuple[str, Path]], progress: Progress | None = None) -> tuple[dict, list[dict], list[str]]:
    """Tree mode: a worker process a tree and round (the order reversed every other round), its rows merged by shape
    and handed to ``progress`` after every worker, also one that was stopped (its shapes done so far).
    Returns (the first tree's peaks, rows as time_shape makes them, the cell labels SPEC@NAME)."""
    labels = tree_labels(args.kernel, trees)
    merged: dict[str, dict] = {}
    peaks: dict = {}
    with tempfile.TemporaryDirectory(prefix="kdtr-ab-") as tmp:
        for r in range(args.rounds):
            order = list(enumerate(trees))
            for t, (name, path) in order if r % 2 == 0 else order[::-1]:
                out = Path(tmp) / f"rows-{t}-{r}.json"
                job = {"args": {a: getattr(args, a) for a in JOB_ARGS}, "tree": str(path), "tmp": tmp, "round": r,
                       "first_tree": t == 0, "out": str(out)}
                (Path(tmp) / "job.json").write_text(json.dumps(job))
                env = {k: v for k, v in os.environ.items() if k != "KDTR_CUDA_DIR"}  # the tree's own cuda/
                env["PYTHONPATH"] = os.pathsep.join([str(path)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
                print(f"round {r + 1} of {args.rounds}: {name} ({path})", flush=True)
                try:  # stopped (Ctrl-C, SIGTERM), subprocess.run kills the worker; the shapes it wrote still count
                    done = subprocess.run([sys.executable, __file__, "--worker", str(Path(tmp) / "job.json")], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                finally:
                    if out.exists():
                        got = json.loads(out.read_text())
                        peaks = got["peaks"] if t == 0 else peaks
                        merge_rows(merged, got["rows"], args.kernel, name)
                    if progress is not None:
                        progress.update(peaks, finish_rows(merged, labels))
                if done.returncode != 0:
                    tail = "\n".join(done.stdout.strip().splitlines()[-12:])
                    print(f"ab.py: {name}, round {r + 1}: its process exited {done.returncode}:\n{tail}", file=sys.stderr)
                    sys.exit(1)
    return peaks, finish_rows(merged, labels), labels


def tree_labels(kernels: list[str], trees: list[tuple[str, Path]]) -> list[str]:
    """The cell labels of tree mode, SPEC@NAME, tree by tree."""
    return [f"{k}@{name}" for name, _ in trees for k in kernels]


def merge_rows(merged: dict[str, dict], rows: list[dict], kernels: list[str], name: str) -> None:
    """One worker's rows into the run's, by shape (in place): its round times appended to each SPEC@NAME cell."""
    for row in rows:
        m = merged.setdefault(row["shape"], {**row, "cells": {}})
        for i, c in enumerate(row["cells"]):
            cell = m["cells"].setdefault(f"{kernels[i]}@{name}", {**c, "rounds_ms": []})
            cell["rounds_ms"] += c["rounds_ms"]
            cell["status"] = c["status"] if c["status"] != "ok" else cell["status"]
            cell["differing"] = c["differing"] if c["differing"] is not None else cell["differing"]


def finish_rows(merged: dict[str, dict], labels: list[str]) -> list[dict]:
    """The merged rows as time_shape makes them: cells in label order, each timed one summarized; a cell a tree has
    not timed (no such shape, or the run stopped first) says so in its status."""
    rows = []
    for m in merged.values():
        cells = []
        for label in labels:
            c = {**(m["cells"].get(label) or {"status": "missing: not timed (no such shape, or stopped first)",
                                              "rounds_ms": [], "differing": None}), "spec": label}
            if c["status"] == "ok" and c["rounds_ms"]:
                summarize(c)
            elif c["status"] == "ok":
                c["status"] = "missing: not timed (stopped first)"
            cells.append(c)
        rows.append({**m, "cells": cells})
    return rows


class Progress:
    """What a run has timed so far, rewritten to --json after every shape (tree mode: every worker) and marked
    partial until the run ends, so a run that is stopped or killed keeps its rounds (kdtr.cli.options.checkpoint_to,
    as `kdtr bench` does). ``labels`` head the table's columns, ``specs`` name them in the JSON."""

    def __init__(self, args, labels: list[str], specs: list[str], trees: list[tuple[str, Path]]):
        from kdtr.cli.options import checkpoint_to

        self.path, self.checkpoint = args.json, checkpoint_to(args.json)
        self.labels, self.specs, self.trees = labels, specs, trees
        self.peaks: dict = {}
        self.rows: list[dict] = []

    def report(self, partial: bool) -> dict:
        return {"peaks": self.peaks, "specs": self.specs, "partial": partial,
                "trees": {n: str(p) for n, p in self.trees}, "rows": self.rows}

    def update(self, peaks: dict, rows: list[dict]) -> None:
        """The rows so far, checkpointed (a failed write lets the run go on; the last one says so)."""
        self.peaks, self.rows = peaks, rows
        if self.checkpoint is not None:
            self.checkpoint(self.report(partial=True))

    def save(self, partial: bool) -> None:
        """The last write, which fails loudly."""
        if self.path:
            from kdtr.cli.options import dumps
            from kdtr.golden.atomic import atomic_write_bytes

            atomic_write_bytes(self.path, (dumps(self.report(partial)) + "\n").encode())


def print_table(rows: list[dict], specs: list[str]) -> None:
    """One line per shape: the floor, each spec's time ± spread, A's time over each later spec's, bits differing."""
    import numpy as np

    letters = string.ascii_uppercase
    for i, s in enumerate(specs):
        print(f"{letters[i]} = {s}")
    head = f"{'shape':28s} {'floor us':>8s} " + " ".join(f"{letters[i] + ' us':>14s}" for i in range(len(specs)))
    head += "".join(f" {'A/' + letters[i]:>6s} {'bits':>5s}" for i in range(1, len(specs)))
    print(head)
    ratios: dict[int, list[float]] = {}
    for row in rows:
        d = row["dims"]
        tag = f"{d['model']} T{d['T']} P{d['P'] // 1024}k B{d['B']}" if d["P"] % 1024 == 0 else row["shape"][:28]
        line = f"{tag:28s} {row['roofline_ms'] * 1e3:8.1f} "
        cells = row["cells"]
        line += " ".join(f"{c['median_ms'] * 1e3:8.1f}±{c['spread_ms'] * 1e3:<5.1f}" if "median_ms" in c
                         else f"{c['status'][:14]:>14s}" for c in cells)
        a = cells[0].get("median_ms")
        for i, c in enumerate(cells[1:], 1):
            if a and "median_ms" in c and c["differing"] is not None:
                ratios.setdefault(i, []).append(a / c["median_ms"])
                line += f" {a / c['median_ms']:5.3f}x {c['differing']:5d}"
            else:
                line += f" {'-':>6s} {'-':>5s}"
        print(line)
        for c in cells:
            if c["status"] != "ok":
                print(f"  {c['spec']}: {c['status']}")
    for i, rs in sorted(ratios.items()):
        print(f"A/{letters[i]}: geometric mean {float(np.exp(np.mean(np.log(rs)))):.3f}x over {len(rs)} shapes "
              f"(above 1: {letters[i]} faster)")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker)
        return
    try:
        trees = parse_trees(args.tree)
    except ValueError as e:
        fail(str(e))
    if len(trees) == 1:
        fail("--tree: give two trees or more (without --tree, the specs run as this checkout builds them)")
    cells = len(args.kernel) * max(1, len(trees))
    if cells < 2:
        fail("give two or more kernel specs, e.g. -k flash-sm90 -k 'flash-sm90[xr=1]' (or one spec and two --tree)")
    if cells > 26:
        fail("at most 26 cells (A to Z): kernel specs times trees")
    if args.rounds < 1:
        fail(f"--rounds {args.rounds}: give 1 or more")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        fail(f"--json {args.json}: its folder does not exist")
    if not (args.set or args.prefix or args.budget):
        fail("no shapes: give --set compute / memory, or a grid (--prefix and / or --budget, with --model --tp --batch)")
    from kdtr.bench.timing import measure_peaks
    from kdtr.errors import InputError, KernelSpecError
    from kdtr.kernels.launch import gpu_available, gpu_unavailable_reason
    from kdtr.kernels.registry import resolve_kernel

    try:
        specs = shapes(args)
        kernels = [resolve_kernel(s) for s in args.kernel]
    except (KernelSpecError, InputError, ValueError) as e:
        fail(str(e))
    untimed = [k.name for k in kernels if not hasattr(k, "prepare")]
    if untimed:
        fail(f"{', '.join(untimed)}: no launcher to time (ab.py times kernels that have prepare(): CUDA kernels)")
    if len({k.name for k in kernels}) < len(kernels):
        fail("a kernel spec is given twice: each spec once (the rounds repeat it)")
    if not gpu_available():
        fail(f"needs a CUDA GPU and cupy: {gpu_unavailable_reason()}")
    from kdtr.cli.bench import mma_text

    def peaks_line(pk: dict, where: str) -> str:
        return (f"peaks on {pk['device']}{where}: copy {pk['copy_gbs']:.0f} GB/s, bf16 GEMM {pk['gemm_tflops']:.0f} TFLOP/s, "
                f"{mma_text(pk)}; {len(specs)} shapes, {args.rounds} rounds")

    from kdtr.cli.options import EXIT_INTERRUPTED, stop_on_sigterm

    labels = tree_labels(args.kernel, trees) if trees else [k.name for k in kernels]
    progress = Progress(args, labels, labels if trees else args.kernel, trees)
    stopped = False
    with stop_on_sigterm():  # SIGTERM (timeout, a scheduler) stops the run as Ctrl-C does: what is done is kept
        try:
            if trees:
                run_trees(args, trees, progress)
            else:
                peaks = measure_peaks()  # the roofline's two ceilings and the mma.sync one, in this process like the times
                print(peaks_line(peaks, ""), flush=True)
                rows = []
                for s in specs:
                    rows.append(time_shape(s, kernels, peaks, args)[0])
                    progress.update(peaks, rows)
        except KeyboardInterrupt:
            stopped = True
    if trees and progress.peaks:
        print(peaks_line(progress.peaks, f" (the first tree's process), {len(trees)} trees"))
    print_table(progress.rows, progress.labels)
    progress.save(partial=stopped)
    if stopped:
        print(f"ab.py: stopped; the table holds the rounds done by then{' (also in --json, marked partial)' if args.json else ''}",
              file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
