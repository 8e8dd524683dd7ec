"""The `kdtr` command line: parse, call the library, render.

Heavy modules (numpy work, rich, cupy) are imported inside the commands so `kdtr --help`
stays instant. User errors end as one line on stderr and exit code 2; a failed check exits 1.
"""

from __future__ import annotations

import json
import os
import sys

import click

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UserError(Exception):
    """A mistake in what the user asked for; printed as one line, exit code 2."""


def _user_error_types() -> tuple[type, ...]:
    from kdtr.golden.bundle import BundleError
    from kdtr.inputs.trees import TreeError
    from kdtr.errors import InputError

    types = [BundleError, TreeError, InputError, UserError, ValueError, OSError]
    try:
        from kdtr.kernels.registry import KernelSpecError

        types.append(KernelSpecError)
    except ImportError:
        pass
    try:
        from kdtr.kernels.launch import GpuUnavailable

        types.append(GpuUnavailable)
    except ImportError:
        pass
    return tuple(types)


class KdtrGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as e:
            if isinstance(e, _user_error_types()) and not os.environ.get("KDTR_DEBUG"):
                from kdtr.cli import report

                report.error(" ".join(str(e).split()) or type(e).__name__)
                sys.exit(EXIT_USAGE)
            raise


@click.group(cls=KdtrGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kdtr")
def main():
    """kdtr: golden references, verification and benchmarks for tree-verify MLA attention kernels."""


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_cmd(as_json):
    """Suites, models and the preset table."""
    from kdtr.cli import commands

    data = commands.list_data()
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    commands.render_list(data)


@main.command()
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
@click.option("--trees", "json_path", default=None, help="Captured trees JSON (family json).")
@click.option("--page-size", type=int, default=64, show_default=True)
@click.option("--kv-dtype", default="bf16", show_default=True, help="fp32 or bf16 storage.")
@click.option("--out-dtype", default=None, help="fp32 or bf16 output [= kv dtype].")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--force", is_flag=True, help="Generate even cases estimated not to fit in host memory.")
def gen(suite, out_dir, seed, jobs, check, as_json, force, **shape):
    """Generate golden .kdtr bundles (a suite or one explicit shape)."""
    from kdtr.cli import commands

    if check:
        data = commands.gen_check(out_dir or f"goldens/{suite or 'ci'}")
        _emit(data, as_json, commands.render_check)
        sys.exit(EXIT_OK if data["ok"] else EXIT_FAIL)
    specs, default_out = commands.gen_specs(suite, seed, shape)
    data = commands.gen_run(specs, out_dir or default_out, jobs, quiet=as_json, force=force)
    _emit(data, as_json, commands.render_gen)


@main.command()
@click.argument("bundle", type=str)
@click.option("--json", "as_json", is_flag=True, help="Metadata and tensor table as JSON.")
@click.option("--request", "b", type=int, default=0, show_default=True, help="Which request's tree to draw.")
def show(bundle, as_json, b):
    """Metadata, tensors, the tree, its mask and depth histogram of a bundle."""
    from kdtr.cli import commands

    data = commands.show_data(bundle, b)
    _emit(data, as_json, commands.render_show)


@main.command()
@click.argument("bundles", nargs=-1)
@click.option("-k", "--kernel", "kernel_spec", required=True,
              help="Built-in name, path/file.cu:symbol, or package.module:callable.")
@click.option("--repeat", type=int, default=1, show_default=True, help="Runs per case; all must be bit-identical.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the full report here.")
@click.option("--atol", type=float, default=None, help="Override atol of out.")
@click.option("--rtol", type=float, default=None, help="Override rtol of out.")
@click.option("--rel-norm", type=float, default=None, help="Override the relative-norm bound of out.")
@click.option("-j", "--jobs", type=int, default=1, help="Workers when a suite must be generated first.")
@click.option("--isolate/--no-isolate", default=True, show_default=True,
              help="Run each case in a child process, so a kernel that crashes or hangs fails only its case "
                   "(RUNTIME_ERROR / TIMEOUT). --no-isolate: in this process (faster; a crash ends the run).")
@click.option("--timeout", type=float, default=None,
              help="Seconds per case before its child is killed (TIMEOUT). Default: 60 + the case's visible "
                   "FLOPs at 10 GFLOP/s (1 GFLOP/s for CPU kernels) per run + 1 s per 100 MB of bundle; "
                   "under --sanitize 300 + 100x that.")
@click.option("--sanitize", type=click.Choice(["memcheck", "racecheck", "initcheck", "synccheck"]), default=None,
              help="Run each case's child (one run) under compute-sanitizer with this tool; findings are SANITIZER.")
@click.option("--force", is_flag=True, help="Generate a missing suite even where generation's checks would refuse.")
def verify(bundles, kernel_spec, repeat, json_file, atol, rtol, rel_norm, jobs, isolate, timeout, sanitize, force):
    """Verify a kernel against golden bundles (files, directories, globs or suite names)."""
    from kdtr.cli import commands

    if repeat < 1:
        raise UserError("--repeat must be >= 1")
    if timeout is not None and not timeout > 0:
        raise UserError("--timeout must be a positive number of seconds")
    if not isolate and (timeout is not None or sanitize):
        raise UserError("--timeout and --sanitize run each case in a child process: drop --no-isolate")
    overrides = {"out": {"atol": atol, "rtol": rtol, "rel_norm": rel_norm}}
    rep = commands.verify_run(kernel_spec, list(bundles) or ["smoke"], repeat, overrides, json_file, jobs,
                              isolate=isolate, timeout=timeout, sanitize=sanitize, force=force)
    sys.exit(EXIT_FAIL if rep.failed else EXIT_OK)


@main.command("compile")
@click.option("-k", "--kernel", "kernels", multiple=True, default=("naive", "flash", "flash-sm90"), show_default=True,
              help="CUDA kernel(s): built-in name (or NAME-bug=BUG) or file.cu:symbol (repeatable).")
@click.option("--arch", default=None,
              help="NVRTC targets, e.g. sm_80,sm_90,sm_120 [each kernel's own: sm_80/90/120; flash-sm90 sm_90a].")
@click.option("--all-variants", is_flag=True, help="Built-ins: every planted-bug build too (what CI compiles).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def compile_cmd(kernels, arch, all_variants, as_json):
    """Registers, shared memory, stack and spills per arch from ptxas, no GPU needed (exit 1 on a spill,
    shared memory over the arch's limit, a serialized wgmma or a compile error)."""
    from kdtr.cli import commands

    d = commands.compile_data(list(kernels), arch, all_variants)
    _emit(d, as_json, commands.render_compile)
    sys.exit(EXIT_FAIL if d["failed"] else EXIT_OK)


@main.group(invoke_without_command=True)
@click.option("-k", "--kernel", "kernels", multiple=True, default=("flash", "flash-sm90"), show_default=True,
              help="Kernel(s) to time: built-in name, file.cu:symbol or module:callable (repeatable); "
                   "flash-sm90 is skipped off sm_90.")
@click.option("--baselines", default="eager,sdpa,flex", show_default=True,
              help="Torch baselines side by side (comma list of eager, sdpa, flex; 'none' for none).")
@click.option("--set", "sets", multiple=True, help="Named shape set(s): compute, memory.")
@click.option("--suite", default=None, help="Time the cases of a suite (smoke, ci, long).")
@click.option("--model", default=None, help="Grid: models, e.g. deepseek-v3,kimi-k2.")
@click.option("--tp", default=None, help="Grid: tensor-parallel degrees, e.g. 8.")
@click.option("--budget", default=None, help="Grid: budgets, e.g. 64,256 (0 = decode).")
@click.option("--prefix", default=None, help="Grid: prefix lengths, e.g. 8k,32k,128k.")
@click.option("--batch", default=None, help="Grid: batch sizes, e.g. 1,8.")
@click.option("--page-size", type=int, default=64, show_default=True)
@click.option("--kv-dtype", default="bf16", show_default=True)
@click.option("--out-dtype", default=None)
@click.option("--peaks", "peaks_only", is_flag=True, help="Measure (or show the cached) GPU peaks and stop.")
@click.option("--remeasure", is_flag=True, help="Re-measure the peaks instead of using the cache.")
@click.option("--no-check", is_flag=True, help="Skip the correctness gate before timing.")
@click.option("--devices", type=int, default=1, show_default=True, help="Spread shapes over this many local GPUs.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the full results here.")
@click.option("--csv", "csv_file", type=click.Path(dir_okay=False), help="Write one line per (shape, impl).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="PNG: % of roofline vs prefix per budget.")
@click.pass_context
def bench(ctx, kernels, baselines, sets, suite, peaks_only, remeasure, no_check, devices, json_file, csv_file,
          plot_file, **shape):
    """Time kernels against the GPU's roofline and torch baselines (`kdtr bench compare A B` to diff runs)."""
    if ctx.invoked_subcommand:
        return
    from kdtr.cli import bench_commands, commands

    commands.check_knobs()
    peaks = bench_commands.bench_peaks(remeasure)
    if peaks_only:
        _emit({k: v for k, v in peaks.items()}, False, lambda d: click.echo(json.dumps(d, indent=1)))
        return
    specs = bench_commands.bench_specs(suite, sets, shape)
    names = [] if baselines.strip() in ("", "none") else [b.strip() for b in baselines.split(",") if b.strip()]
    data = bench_commands.bench_run(specs, list(kernels), names, peaks, not no_check, devices)
    if json_file:
        from kdtr.golden.atomic import atomic_write_bytes

        atomic_write_bytes(json_file, (json.dumps(data, indent=1, default=str) + "\n").encode())
    if csv_file:
        bench_commands.write_csv(csv_file, data)
    if plot_file:
        bench_commands.write_plot(plot_file, data)
    bench_commands.render_bench(data)


@bench.command("compare")
@click.argument("old", type=str)
@click.argument("new", type=str)
@click.option("--json", "as_json", is_flag=True)
def bench_compare(old, new, as_json):
    """Per-shape change between two `kdtr bench --json` runs, flagged beyond the measured noise."""
    from kdtr.cli import bench_commands

    _emit(bench_commands.bench_compare(old, new), as_json, bench_commands.render_bench_compare)


def _emit(data, as_json, render):
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
    else:
        render(data)


if __name__ == "__main__":
    main()
