"""The `kdtr` command line: the group, its one-line error handling, and the commands, one module
each (kdtr/cli/<command>.py: parse, call the library, render through kdtr/cli/report.py).

Heavy modules (numpy work, rich, cupy) are imported inside the commands so that `kdtr --help`
stays instant. Bad usage or input ends as one line on stderr and exit code 2 (KDTR_DEBUG=1 shows
the traceback instead); a failed check exits 1; Ctrl-C exits 130 (bench and verify, also on SIGTERM, after
showing and writing what they did).
"""

from __future__ import annotations

import os
import sys

import click

from kdtr.cli import bench, gen, show, verify
from kdtr.cli import compile as compile_module, list as list_module  # modules, not the builtins
from kdtr.cli.options import EXIT_INTERRUPTED, EXIT_USAGE


def _user_error_types() -> tuple[type, ...]:
    """Exceptions that are the user's input, not kdtr's bug (imported only once one is raised)."""
    from kdtr.errors import InputError, KernelSpecError
    from kdtr.golden.bundle import BundleError
    from kdtr.inputs.trees import TreeError

    types = [BundleError, TreeError, InputError, KernelSpecError, ValueError, OSError]
    try:
        from kdtr.kernels.launch import GpuUnavailable

        types.append(GpuUnavailable)
    except ImportError:
        pass
    return tuple(types)


def _fail(message: str, code: int = EXIT_USAGE):
    from kdtr.cli import report

    report.error(" ".join(message.split()))
    sys.exit(code)


def _interrupted():
    click.echo("interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


class KdtrGroup(click.Group):
    """click's group, with every error a user can cause printed as one line."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:  # click's own parse errors: one line, with where help is
            where = e.ctx.command_path if e.ctx else "kdtr"
            _fail(f"{e.format_message()} (see {where} --help)")
        except click.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except click.exceptions.Abort:
            _interrupted()

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            _interrupted()
        except Exception as e:
            if isinstance(e, _user_error_types()) and not os.environ.get("KDTR_DEBUG"):
                _fail(str(e) or type(e).__name__)
            raise


@click.group(name="kdtr", cls=KdtrGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kdtr")
def main():
    """kdtr: golden references, verification and benchmarks for tree-verify MLA attention kernels.

    --json on every command: bare --json (or --json -) prints JSON to stdout, --json PATH.json writes it.
    """


for _command in (list_module.list_cmd, gen.gen, show.show, verify.verify, compile_module.compile_cmd, bench.bench):
    main.add_command(_command)


if __name__ == "__main__":
    main()
