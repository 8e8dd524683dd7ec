"""What each CLI command computes (plain data) and how it is shown (through kdtr.report).

The click layer only parses options; these functions call the library and shape its results
into JSON-able dicts, which either go out as --json or through the report tables.
"""

from __future__ import annotations

import json
import time

import numpy as np

from kdtr.inputs import presets, suites


# ----------------------------------------------------------------------------- list

def list_data() -> dict:
    return {
        "suites": {n: [{"name": s.name, "B": s.B, "T": s.T, "H": s.H, "tags": list(s.tags)} for s in f()]
                   for n, f in suites.SUITES.items()},
        "models": {m.name: {"heads": m.heads, "scale": m.scale, "tp": m.tp, "heads_per_gpu": m.heads_per_gpu()}
                   for m in presets.MODELS.values()},
        "budgets": list(presets.BUDGETS),
        "page_sizes": list(presets.PAGE_SIZES),
        "dtypes": list(presets.DTYPES),
        "tree_families": list(presets.TREE_FAMILIES),
        "prefix_edges": list(presets.prefix_edges()),
        "long_prefixes": list(presets.LONG_PREFIXES),
    }


def render_list(d: dict) -> None:
    from kdtr.cli import report

    report.table("models", ["model", "heads", "scale", "TP", "heads/GPU"],
                 [(k, str(v["heads"]), str(v["scale"]), str(v["tp"]), str(v["heads_per_gpu"])) for k, v in d["models"].items()])
    report.kv_table("presets", [("budgets (T = budget + 1)", ", ".join(map(str, d["budgets"]))),
                                ("prefix edges", ", ".join(map(str, d["prefix_edges"]))),
                                ("long prefixes", ", ".join(map(str, d["long_prefixes"]))),
                                ("page sizes", ", ".join(map(str, d["page_sizes"]))),
                                ("dtypes", ", ".join(d["dtypes"])), ("tree families", ", ".join(d["tree_families"]))])
    for name, cases in d["suites"].items():
        report.table(f"suite {name} ({len(cases)} cases)", ["case", "B", "T", "H", "covers"],
                     [(c["name"], str(c["B"]), str(c["T"]), str(c["H"]), ", ".join(c["tags"])) for c in cases],
                     right=("B", "T", "H"))


# ----------------------------------------------------------------------------- gen

def gen_specs(suite: str | None, seed: int | None, shape: dict):
    """Cases from a suite name or from explicit shape options; and the default output dir."""
    from dataclasses import replace

    from kdtr.inputs.cases import CaseSpec

    explicit = any(shape.get(k) is not None for k in ("model", "tp", "heads", "prefix", "budget"))
    if suite and explicit:
        raise ValueError("give either --suite or explicit shape options (--model, --prefix, --budget...), not both")
    if suite:
        specs = suites.suite(suite)
        if seed is not None:
            specs = [replace(s, seed=seed) for s in specs]
        return specs, f"goldens/{suite}" if suite in suites.COMMITTED else f"bundles/{suite}"
    if not explicit:
        raise ValueError("nothing to generate: give --suite NAME or a shape (--model --prefix --budget)")
    m = presets.model(shape.get("model") or "deepseek-v3")
    heads = shape["heads"] or m.heads_per_gpu(shape["tp"])
    prefix = tuple(presets.parse_list(shape.get("prefix") or "0"))
    budgets = presets.parse_list(shape.get("budget") or "16", int)
    specs = [
        CaseSpec(model=m.name, heads=heads, prefix_lens=prefix, family=shape["family"], budget=b,
                 profile=shape["profile"], page_size=shape["page_size"], kv_dtype=shape["kv_dtype"],
                 out_dtype=shape["out_dtype"] or shape["kv_dtype"], seed=seed or 0, json_path=shape["json_path"])
        for b in budgets
    ]
    return specs, "bundles"


def gen_run(specs, out_dir: str, jobs: int, quiet: bool = False, force: bool = False) -> dict:
    from kdtr.cli import report
    from kdtr.golden.generate import generate

    t0 = time.perf_counter()
    with (report.progress(len(specs), "generating") if not quiet else _null_progress()) as advance:
        results = generate(specs, out_dir, jobs=jobs, on_done=lambda r: advance(r.name), force=force)
    return {
        "out_dir": str(out_dir), "seconds": time.perf_counter() - t0, "jobs": jobs,
        "total_bytes": sum(r.nbytes for r in results),
        "bundles": [{"name": r.name, "path": r.path, "bytes": r.nbytes, "seconds": r.seconds, "sha256": r.sha256,
                     "B": r.spec.B, "T": r.spec.T, "H": r.spec.H, "P": list(r.spec.prefix_lens),
                     "tree": r.spec.family, "page": r.spec.page_size, "kv": r.spec.kv_dtype, "out": r.spec.out_dtype}
                    for r in results],
    }


def render_gen(d: dict) -> None:
    from kdtr.cli import report

    report.table(
        f"generated {len(d['bundles'])} bundles in {d['out_dir']}",
        ["case", "B", "T", "H", "P", "tree", "page", "kv/out", "MB", "s"],
        [(b["name"], str(b["B"]), str(b["T"]), str(b["H"]), _plist(b["P"]), b["tree"], str(b["page"]),
          f"{b['kv']}/{b['out']}", f"{b['bytes'] / 1e6:.2f}", f"{b['seconds']:.2f}") for b in d["bundles"]],
        right=("B", "T", "H", "page", "MB", "s"),
        caption=f"{d['total_bytes'] / 1e6:.2f} MB in {d['seconds']:.1f} s with {d['jobs']} worker(s); manifest: {d['out_dir']}/MANIFEST.json",
    )


def gen_check(out_dir: str) -> dict:
    from kdtr.golden.generate import check

    results = check(out_dir)
    return {"out_dir": out_dir, "ok": all(r.ok for r in results),
            "bundles": [{"file": r.file, "ok": r.ok, "problems": r.problems} for r in results]}


def render_check(d: dict) -> None:
    from kdtr.cli import report

    report.table(f"gen --check {d['out_dir']}", ["bundle", "status", "problems"],
                 [(b["file"], report.status_text("SAME" if b["ok"] else "DIFFERS"),
                   report.escape("; ".join(b["problems"]))) for b in d["bundles"]])
    n_bad = sum(not b["ok"] for b in d["bundles"])
    report.note(f"{len(d['bundles']) - n_bad} reproduced exactly, {n_bad} differ")


def _plist(p: list) -> str:
    return ",".join(map(str, p)) if len(p) <= 4 else f"{min(p)}..{max(p)} ({len(p)})"


class _null_progress:
    def __enter__(self):
        return lambda text="": None

    def __exit__(self, *a):
        return False


# ----------------------------------------------------------------------------- show

def show_data(path: str, b: int = 0) -> dict:
    from kdtr.inputs import trees
    from kdtr.golden.bundle import load_bundle

    bnd = load_bundle(path)
    p = bnd.problem
    if not 0 <= b < p.B:
        raise ValueError(f"--request {b} out of range: the bundle has {p.B} requests")
    parent, depth = p.tree_parent[b], p.tree_depth[b]
    tensors = {n: {"dtype": str(a.dtype), "shape": list(a.shape), "bytes": int(a.nbytes)}
               for n, a in [("q", p.q), ("kv_cache", p.kv_cache), ("block_table", p.block_table),
                            ("prefix_lens", p.prefix_lens), ("tree_parent", p.tree_parent),
                            ("tree_depth", p.tree_depth), ("tree_mask", p.tree_mask), ("out", bnd.out),
                            ("lse", bnd.lse)] + ([("draft_logp", bnd.draft_logp)] if bnd.draft_logp is not None else [])}
    return {
        "path": str(path), "meta": {k: v for k, v in bnd.meta.items() if k != "checksums"},
        "tensors": tensors, "request": b, "prefix_len": int(p.prefix_lens[b]),
        "tree": {"T": p.T, "parent": parent.tolist(), "depth": depth.tolist(), "leaves": trees.leaf_count(parent),
                 "max_depth": int(depth.max()), "depth_histogram": {int(k): int(v) for k, v in trees.depth_histogram(depth).items()},
                 "density": float((depth.astype(np.int64) + 1).sum() / (p.T * p.T))},
        "visible": trees.unpack_mask(p.tree_mask[b], p.T).tolist() if p.T <= 64 else None,
    }


def render_show(d: dict) -> None:
    from kdtr.cli import report

    m = d["meta"]
    dims = m.get("dims", {})
    report.kv_table(f"{d['path']}", [
        ("case", m.get("case")), ("format", f"{m.get('format')} v{m.get('version')}"), ("generator", m.get("generator")),
        ("B x T x H", f"{dims.get('B')} x {dims.get('T')} x {dims.get('H')}"), ("scale", m.get("scale")),
        ("kv / out dtype", f"{m.get('kv_dtype')} / {m.get('out_dtype')}"), ("page size", dims.get("page_size")),
        ("tree", json.dumps(m.get("tree"))), ("seed", m.get("seed")),
        ("tolerances", json.dumps(m.get("tolerances"))),
    ])
    report.table("tensors", ["name", "dtype", "shape", "MB"],
                 [(n, t["dtype"], "x".join(map(str, t["shape"])), f"{t['bytes'] / 1e6:.3f}") for n, t in d["tensors"].items()],
                 right=("MB",))
    t = d["tree"]
    report.note(f"request {d['request']}: P = {d['prefix_len']}, T = {t['T']}, leaves = {t['leaves']}, "
                f"max depth = {t['max_depth']}, mask density = {t['density']:.3%}")
    if t["T"] <= 64:
        report.tree_picture(t["parent"], t["depth"])
        report.mask_picture(d["visible"])
    else:
        report.note(f"(tree and mask pictures drawn only for T <= 64; this tree has {t['T']} nodes)")
    report.histogram("depth histogram", t["depth_histogram"])


# ----------------------------------------------------------------------------- verify

def check_knobs() -> None:
    """A misspelt experiment knob (kdtr/kernels/knobs.py) stops verify and bench before they run anything:
    one line and exit 2 (ValueError), not an error in every case."""
    from kdtr.kernels.knobs import FlashKnobs

    FlashKnobs.from_env()


def verify_run(kernel_spec: str, sources: list[str], repeat: int, overrides: dict, json_file: str | None, jobs: int = 1,
               *, isolate: bool = True, timeout: float | None = None, sanitize: str | None = None, force: bool = False):
    from kdtr.cli import report
    from kdtr.kernels.registry import resolve_kernel
    from kdtr.golden.store import find_bundles
    from kdtr.check.suite import preflight, run_verify

    check_knobs()
    kernel = resolve_kernel(kernel_spec)
    preflight(kernel)
    if sanitize:  # fail on a missing compute-sanitizer before generating or loading anything
        from kdtr.check.isolate import sanitizer_command

        sanitizer_command(sanitize)
    paths = find_bundles(sources, jobs=jobs, force=force)
    with report.progress(len(paths), f"verify {kernel.name}") as advance:
        rep = run_verify(kernel, paths, repeat=repeat, overrides=overrides, on_case=lambda r: advance(r.case),
                         isolate=isolate, timeout=timeout, sanitize=sanitize, spec=kernel_spec)
    if json_file:
        from kdtr.golden.atomic import atomic_write_bytes

        atomic_write_bytes(json_file, (json.dumps(rep.to_json(), indent=1, default=str) + "\n").encode())
    render_verify(rep.to_json())
    return rep


def render_verify(d: dict) -> None:
    from kdtr.cli import report

    rows = []
    for r in d["results"]:
        s = r["shape"]
        out = next((c for c in r["checks"] if c["output"] == "out"), None)
        lse = next((c for c in r["checks"] if c["output"] == "lse"), None)
        err = f"{report.fmt(out['max_abs'])} / {report.fmt(out['tol']['atol'])}" if out else "-"
        rel = f"{report.fmt(out['rel_norm'])} / {report.fmt(out['tol']['rel_norm'])}" if out else "-"
        worst = "" if not out or out["status"] == "PASS" else f" worst {tuple(out['worst'] or ())}"
        nodes = f" nodes {out['bad_nodes'][:8]}" if out and out["bad_nodes"] and out["status"] != "PASS" else ""
        rows.append((r["case"], f"{s.get('B')}x{s.get('T')}x{s.get('H')}", s.get("tree", ""), f"{s.get('kv')}/{s.get('out')}",
                     err, rel, report.fmt(out["ratio"]) if out else "-", report.fmt(lse["max_abs"]) if lse else "-",
                     report.status_text(r["status"]), report.escape((r["message"] + worst + nodes)[:160])))
    counts = ", ".join(f"{k} {v}" for k, v in sorted(d["counts"].items()))
    how = f", under compute-sanitizer {d['sanitizer']}" if d.get("sanitizer") else ""
    report.table(f"kdtr verify --kernel {d['kernel']} ({d['device']}{how})",
                 ["case", "BxTxH", "tree", "kv/out", "max|err| / atol", "rel-norm / bound", "worst ratio", "lse err",
                  "status", "detail"], rows, right=("max|err| / atol", "rel-norm / bound", "worst ratio", "lse err"),
                 caption=f"{counts} in {d['seconds']:.1f} s")


# ----------------------------------------------------------------------------- compile

def compile_data(specs: list[str], arch: str | None, all_variants: bool) -> dict:
    """ptxas's resource report for each kernel spec's builds (kdtr.build_report); no GPU."""
    from kdtr.kernels import build_report, nvrtc

    archs = build_report.parse_archs(arch)
    targets = [t for spec in specs for t in build_report.targets_for(spec, archs, all_variants)]
    if not nvrtc.available():
        raise ValueError("NVRTC is not installed here: pip install 'kdtr[nvrtc]'")
    t0 = time.perf_counter()
    rows = build_report.build_report(targets)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status.value] = counts.get(r.status.value, 0) + 1
    return {"nvrtc": ".".join(map(str, nvrtc.version())), "rows": [r.to_json() for r in rows], "counts": counts,
            "failed": sum(r.status.failed for r in rows), "seconds": time.perf_counter() - t0}


def render_compile(d: dict) -> None:
    from kdtr.cli import report

    rows = [(r["label"], report.escape(r["kernel"]), r["arch"], str(r["registers"]),
             f"{r['shared_bytes']} + {r['dynamic_smem']} / {r['smem_limit'] or '-'}", str(r["stack_frame"]),
             f"{r['spill_stores']}/{r['spill_loads']}", str(r["barriers"]), report.status_text(r["status"]),
             report.escape(r["message"][:120])) for r in d["rows"]]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(d["counts"].items()))
    report.table(f"kdtr compile (NVRTC {d['nvrtc']}; ptxas -v per build)",
                 ["spec", "kernel", "arch", "registers", "smem B static + dynamic / limit", "stack B", "spill st/ld B",
                  "barriers", "status", "detail"], rows,
                 right=("registers", "smem B static + dynamic / limit", "stack B", "spill st/ld B", "barriers"),
                 caption=f"{counts} in {d['seconds']:.1f} s")

