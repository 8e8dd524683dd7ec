"""``python -m kdtr``: the same command line as ``kdtr``."""

from kdtr.cli import main

main(prog_name="kdtr")
