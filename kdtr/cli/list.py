"""`kdtr list`: the built-in kernels and their planted bugs, suites, models and the preset table."""

from __future__ import annotations

import click

from kdtr.cli.options import check_output, emit, json_option

KERNEL_ABOUT = {
    "naive": "fp32 math, one thread per query row: obviously correct (CUDA)",
    "emulate-flash": "numpy emulation of the bf16 flash algorithm: no GPU needed",
    "flash": "bf16 tensor cores through mma.sync, split-KV (CUDA)",
    "flash-sm90": "Hopper: wgmma, TMA, warp-specialised (CUDA, sm_90 only)",
}
"""One line per built-in kernel (the kernel class's docstring stands in for one missing here)."""
SPEC_FORMS = [
    ("NAME", "a built-in kernel (below)"),
    ("NAME-bug=BUG", "that kernel with a planted bug (below): kdtr must fail it"),
    ("FLASH[KEY=VALUE,...]", "a flash kernel with its launch plan forced, e.g. flash-sm90[xr=1,splits=4]"),
    ("path/file.cu:SYMBOL", "a CUDA kernel taking const KdtrParams (cuda/kdtr_abi.h); {kv}/{out} pick dtypes"),
    ("package.module:fn", "an importable Python callable"),
    ("path/file.py:fn", "a Python callable in that file (its folder goes on sys.path)"),
]
"""The forms of a -k/--kernel spec."""


def list_data() -> dict:
    from kdtr.inputs import presets, suites
    from kdtr.kernels.bugs import PLANTED
    from kdtr.kernels.flash.force import KEYS

    return {
        "kernels": _kernels(),
        "bugs": [{"name": b.slug, "value": int(b), "about": _bug_docs().get(b.name, "")} for b in PLANTED],
        "kernel_specs": [{"form": f, "about": a} for f, a in SPEC_FORMS],
        "plan_keys": list(KEYS),
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


def _kernels() -> list[dict]:
    """Each built-in base kernel with what it takes (its Caps)."""
    from kdtr.kernels.registry import BASES, resolve_kernel

    rows = []
    for base in BASES:
        k = resolve_kernel(base)
        doc = (type(k).__doc__ or "").strip().splitlines()
        caps = k.caps
        rows.append({"name": base, "about": KERNEL_ABOUT.get(base) or (doc[0] if doc else ""),
                     "kv_dtypes": list(caps.kv_dtypes), "out_dtypes": list(caps.out_dtypes),
                     "needs_gpu": caps.needs_gpu, "archs": list(caps.archs) if caps.archs else None,
                     "max_T": caps.max_T, "writes_lse": bool(k.writes_lse)})
    return rows


def _bug_docs() -> dict[str, str]:
    """Bug member name -> the docstring under it in kdtr/kernels/bugs.py (one line)."""
    import ast
    import inspect

    from kdtr.kernels.bugs import Bug

    try:
        body = ast.parse(inspect.getsource(Bug)).body[0].body
    except (OSError, TypeError, IndexError):
        return {}
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.Assign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.targets[0].id] = " ".join(str(after.value.value).split())
    return docs


def render_list(d: dict) -> None:
    from kdtr.cli import report

    report.table("kernel specs", ["-k", "means"], [(report.escape(s["form"]), report.escape(s["about"]))
                                                   for s in d["kernel_specs"]], no_wrap=("-k",),
                 caption=f"plan keys: {', '.join(d['plan_keys'])}")
    report.table("kernels (-k NAME)", ["kernel", "storage", "runs on", "what it is"],
                 [(k["name"], "/".join(k["kv_dtypes"]),
                   ("GPU " + "/".join(k["archs"]) if k["archs"] else "GPU") if k["needs_gpu"] else "CPU",
                   report.escape(k["about"])) for k in d["kernels"]], no_wrap=("kernel",))
    report.table("planted bugs (-k NAME-bug=BUG: each must FAIL)", ["bug", "what the kernel does wrong"],
                 [(b["name"], report.escape(b["about"])) for b in d["bugs"]], no_wrap=("bug",))
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


@click.command("list")
@json_option("Everything listed")
def list_cmd(json_to):
    """Built-in kernels and planted bugs, kernel spec forms, suites, models and the preset table."""
    check_output(json_to, "--json", ".json")
    emit(list_data(), json_to, render_list)
