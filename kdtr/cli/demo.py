"""The end of `make demo`: a real verification of the built-in kernels on the smoke bundles.

With a GPU it verifies the CUDA kernels; without one it says so plainly and verifies the CPU
emulation of the bf16 flash kernel instead.

    python -m kdtr.cli.demo out/demo
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from kdtr.cli import report
    from kdtr.cli.verify import verify_run
    from kdtr.kernels.launch import device_arch, gpu_available, gpu_unavailable_reason
    from kdtr.kernels.registry import builtin_names

    target = argv[0] if argv else "smoke"
    if gpu_available():
        hopper = ("flash-sm90",) if device_arch() == "sm_90" else ()  # it SKIPs (so fails) elsewhere
        kernels = [k for k in ("naive", "flash", *hopper) if k in builtin_names()]
    else:
        report.notice("No GPU found", f"({gpu_unavailable_reason()}): running emulate-flash, the CPU emulation of "
                      "the bf16 flash kernel, instead of the CUDA kernels.")
        kernels = ["emulate-flash"]
    failed = False
    for k in kernels:
        failed |= verify_run(k, [target]).failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
