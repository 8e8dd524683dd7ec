"""`kdtr compile`: ptxas's resource report for each CUDA kernel build, per arch; no GPU needed."""

from __future__ import annotations

import sys
import time

import click

from kdtr.cli.options import EXIT_FAIL, EXIT_OK, check_output, emit, json_option
from kdtr.errors import InputError


def compile_data(specs: list[str], arch: str | None, all_variants: bool) -> dict:
    """ptxas's resource report for each kernel spec's builds (kdtr.kernels.build_report); no GPU."""
    from kdtr.kernels import build_report, nvrtc

    archs = build_report.parse_archs(arch)
    targets = [t for spec in specs for t in build_report.targets_for(spec, archs, all_variants)]
    if not nvrtc.available():
        raise InputError("NVRTC is not installed here: pip install 'kdtr[nvrtc]'")
    t0 = time.perf_counter()
    rows = build_report.build_report(targets)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status.value] = counts.get(r.status.value, 0) + 1
    return {"nvrtc": ".".join(map(str, nvrtc.version())), "rows": [r.to_json() for r in rows], "counts": counts,
            "failed": sum(r.status.failed for r in rows), "seconds": time.perf_counter() - t0}


def render_compile(d: dict) -> None:
    from kdtr.cli import report

    rows = [(report.escape(r["kernel"]), r["arch"], str(r["registers"]),
             f"{r['shared_bytes'] + r['dynamic_smem']}/{r['smem_limit'] or '-'}", str(r["stack_frame"]),
             f"{r['spill_stores']}/{r['spill_loads']}", report.status_text(r["status"])) for r in d["rows"]]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(d["counts"].items()))
    report.table(f"kdtr compile (NVRTC {d['nvrtc']}; ptxas -v per build)",
                 ["kernel", "arch", "regs", "smem/limit B", "stack B", "spill B", "status"], rows,
                 right=("regs", "smem/limit B", "stack B", "spill B"), no_wrap=("arch", "smem/limit B", "status"),
                 caption=f"{counts} in {d['seconds']:.1f} s; smem: static + dynamic shared memory per block against "
                         "the arch's limit; spill: stores/loads (--json: every figure)")
    report.details("messages", [(f"{r['label']} {r['arch']}", r["message"]) for r in d["rows"] if r["message"]])


@click.command("compile")
@click.option("-k", "--kernel", "kernels", multiple=True, default=("naive", "flash", "flash-sm90"), show_default=True,
              help="CUDA kernel(s): built-in name (or NAME-bug=BUG) or file.cu:symbol (repeatable).")
@click.option("--arch", default=None,
              help="NVRTC targets, e.g. sm_80,sm_90,sm_120 [each kernel's own: sm_80/90/120; flash-sm90 sm_90a].")
@click.option("--all-variants", is_flag=True, help="Built-ins: every planted-bug build too (what CI compiles).")
@json_option("The rows")
def compile_cmd(kernels, arch, all_variants, json_to):
    """Registers, shared memory, stack and spills per arch from ptxas, no GPU needed (exit 1 on a spill,
    shared memory over the arch's limit, a serialized wgmma or a compile error)."""
    check_output(json_to, "--json", ".json")
    d = compile_data(list(kernels), arch, all_variants)
    emit(d, json_to, render_compile)
    sys.exit(EXIT_FAIL if d["failed"] else EXIT_OK)
