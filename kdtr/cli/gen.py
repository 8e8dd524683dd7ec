"""`kdtr gen`: golden bundles for a suite or one explicit shape, and `gen --check` of a manifest."""

from __future__ import annotations

import sys
import time

import click

from kdtr.cli.options import EXIT_FAIL, EXIT_OK, STDOUT, at_least, check_output, emit, exclusive, json_option, option_list
from kdtr.errors import InputError

SHAPE_OPTIONS = ("model", "tp", "heads", "prefix", "budget")
"""Options that make an explicit case (instead of --suite)."""


def gen_specs(suite: str | None, seed: int | None, shape: dict):
    """Cases from a suite name or from explicit shape options; and the default output dir."""
    from dataclasses import replace

    from kdtr.inputs import presets, suites
    from kdtr.inputs.cases import CaseSpec

    explicit = any(shape.get(k) is not None for k in SHAPE_OPTIONS)
    if suite and explicit:
        raise InputError("give either --suite or explicit shape options (--model, --prefix, --budget...), not both")
    if suite:
        specs = suites.suite(suite)
        if seed is not None:
            specs = [replace(s, seed=seed) for s in specs]
        return specs, f"goldens/{suite}" if suite in suites.COMMITTED else f"bundles/{suite}"
    if not explicit:
        raise InputError("nothing to generate: give --suite NAME or a shape (--model --prefix --budget)")
    m = presets.model(shape.get("model") or "deepseek-v3")
    heads = shape["heads"] if shape["heads"] is not None else m.heads_per_gpu(shape["tp"])
    prefix = tuple(option_list("--prefix", shape.get("prefix") or "0"))
    budgets = option_list("--budget", shape.get("budget") or "16", int)
    if min(budgets) < 0:
        raise InputError(f"--budget must be >= 0 (0 is plain decode), got {shape['budget']}")
    return [
        CaseSpec(model=m.name, heads=heads, prefix_lens=prefix, family=shape["family"], budget=b,
                 profile=shape["profile"], page_size=shape["page_size"], kv_dtype=shape["kv_dtype"],
                 out_dtype=shape["out_dtype"] or shape["kv_dtype"], seed=seed or 0, json_path=shape["json_path"])
        for b in budgets
    ], "bundles"


def check_shape_options(shape: dict, seed: int | None) -> None:
    """What CaseSpec would find later, said under the options' own names."""
    at_least("--heads", shape["heads"], 1)
    at_least("--tp", shape["tp"], 1)
    exclusive(tp=shape["tp"], heads=shape["heads"])
    at_least("--page-size", shape["page_size"], 1)
    at_least("--seed", seed, 0)
    if shape["family"] == "json" and not shape["json_path"]:
        raise InputError("--family json needs --trees FILE, a JSON file of parent arrays "
                         "(e.g. --trees kdtr:data/captured_trees.json, the package's sample)")
    if shape["json_path"] and shape["family"] != "json":
        raise InputError(f"--trees is read by --family json only (this is --family {shape['family']})")
    if shape["json_path"]:
        from kdtr.inputs.trees import tree_file_path

        if not tree_file_path(shape["json_path"]).is_file():
            raise InputError(f"--trees {shape['json_path']}: no such file")


def gen_run(specs, out_dir: str, jobs: int, quiet: bool = False, force: bool = False) -> dict:
    from kdtr.cli import report
    from kdtr.golden.generate import generate

    t0 = time.perf_counter()
    with report.progress(len(specs), "generating", show=not quiet) as advance:
        results = generate(specs, out_dir, jobs=jobs, on_done=lambda r: advance(r.name), force=force)
    return {
        "out_dir": str(out_dir), "seconds": time.perf_counter() - t0, "jobs": jobs,
        "total_bytes": sum(r.nbytes for r in results),
        "bundles": [{"name": r.name, "path": r.path, "bytes": r.nbytes, "seconds": r.seconds, "sha256": r.sha256,
                     "kept": r.kept, "B": r.spec.B, "T": r.spec.T, "H": r.spec.H, "P": list(r.spec.prefix_lens),
                     "tree": r.spec.family, "page": r.spec.page_size, "kv": r.spec.kv_dtype, "out": r.spec.out_dtype}
                    for r in results],
    }


def render_gen(d: dict) -> None:
    from kdtr.cli import report

    kept = sum(b["kept"] for b in d["bundles"])
    report.table(
        f"generated {len(d['bundles'])} bundles in {d['out_dir']}",
        ["case", "BxTxH", "MB", "s"],
        [(report.escape(b["name"]), f"{b['B']}x{b['T']}x{b['H']}", f"{b['bytes'] / 1e6:.2f}",
          "kept" if b["kept"] else f"{b['seconds']:.2f}") for b in d["bundles"]],
        right=("MB", "s"), no_wrap=("BxTxH", "MB", "s"),
        caption=f"{d['total_bytes'] / 1e6:.2f} MB in {d['seconds']:.1f} s with {d['jobs']} worker(s)"
                + (f"; {kept} already there and reproduced, kept as they are" if kept else "")
                + f"; manifest: {d['out_dir']}/MANIFEST.json",
    )


def gen_check(out_dir: str) -> dict:
    from kdtr.golden.generate import check

    results = check(out_dir)
    return {"out_dir": out_dir, "ok": all(r.ok for r in results),
            "bundles": [{"file": r.file, "ok": r.ok, "problems": r.problems} for r in results]}


def render_check(d: dict) -> None:
    from kdtr.cli import report

    report.table(f"gen --check {d['out_dir']}", ["bundle", "status"],
                 [(report.escape(b["file"]), report.status_text("SAME" if b["ok"] else "DIFFERS")) for b in d["bundles"]],
                 no_wrap=("status",))
    report.details("what differs", [(b["file"], "; ".join(b["problems"])) for b in d["bundles"] if not b["ok"]])
    n_bad = sum(not b["ok"] for b in d["bundles"])
    report.note(f"{len(d['bundles']) - n_bad} reproduced (inputs byte for byte, outputs within 1e-12), {n_bad} differ")


@click.command()
@click.option("--suite", type=str, help="Named suite: smoke, ci, long.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Output directory [goldens/<suite> or ./bundles].")
@click.option("--seed", type=int, default=None, help="Seed (overrides the suite's).")
@click.option("-j", "--jobs", type=int, default=1, show_default=True, help="Worker processes.")
@click.option("--check", is_flag=True, help="Regenerate the bundles listed in the manifest and confirm them.")
@click.option("--model", default=None, help="Explicit case: model preset (deepseek-v3, kimi-k2).")
@click.option("--tp", type=int, default=None, help="Explicit case: tensor parallelism (heads = model heads / tp).")
@click.option("--heads", type=int, default=None, help="Explicit case: heads per GPU (instead of --tp).")
@click.option("--prefix", default=None, help="Explicit case: prefix lengths of one batch, e.g. 0,65,8k.")
@click.option("--budget", default=None, help="Explicit case: budget(s), e.g. 16,256 (one case each).")
@click.option("--family", default="ddtree", show_default=True, help="Tree family: ddtree, chain, star, root, json.")
@click.option("--profile", default="mixed", show_default=True, help="DDTree profile: confident, uncertain, mixed.")
@click.option("--trees", "json_path", default=None,
              help="Family json: a JSON file of parent arrays (kdtr:data/captured_trees.json is the package's sample).")
@click.option("--page-size", type=int, default=64, show_default=True)
@click.option("--kv-dtype", default="bf16", show_default=True, help="fp32 or bf16 storage.")
@click.option("--out-dtype", default=None, help="fp32 or bf16 output [= kv dtype].")
@json_option("The bundles written (or --check's findings)")
@click.option("--force", is_flag=True, help="Generate even cases estimated not to fit in host memory.")
def gen(suite, out_dir, seed, jobs, check, json_to, force, **shape):
    """Generate golden .kdtr bundles (a suite or one explicit shape).

    A bundle already in the folder that the fresh build reproduces (inputs byte-identical,
    outputs within 1e-12) is kept as it is, so regenerating goldens leaves them unchanged.
    """
    check_output(json_to, "--json", ".json")
    at_least("-j/--jobs", jobs, 1)
    if check:
        if any(shape.get(k) is not None for k in SHAPE_OPTIONS):
            raise InputError("--check regenerates what the manifest in --out lists: drop the shape options")
        data = gen_check(out_dir or f"goldens/{suite or 'ci'}")
        emit(data, json_to, render_check)
        sys.exit(EXIT_OK if data["ok"] else EXIT_FAIL)
    check_shape_options(shape, seed)
    specs, default_out = gen_specs(suite, seed, shape)
    emit(gen_run(specs, out_dir or default_out, jobs, quiet=json_to == STDOUT, force=force), json_to, render_gen)
