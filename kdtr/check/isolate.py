"""Crash and hang isolation: each (kernel, bundle) case verified in a child process.

A kernel that segfaults, aborts, traps or poisons its CUDA context takes down only the child
running its case: the case becomes RUNTIME_ERROR (with the CUDA error text the child reported,
or "child process died with signal N" / "exited with code N"), and one that hangs is killed
after a timeout (TIMEOUT). The parent never runs these kernels, so its own CUDA context (if it
has one) stays clean and the run goes on with the next case.

Protocol: the parent writes a job JSON (kernel spec, bundle path, repeat count, tolerance
overrides, result path; under verify --graph the flag and the sibling bundle's path) and runs
``python -m kdtr.check.isolate JOB`` in a new session, so that a kill reaches the whole process
group (compute-sanitizer's target included). The child verifies the case in-process
(kdtr.check.case.verify_bundle, or kdtr.check.graph.verify_graph), writes ``{"result": CaseResult
JSON}`` (or ``{"error": text}``) to the result path and leaves with os._exit(0), skipping CUDA
teardown of a possibly poisoned context. The child sees the parent's sys.path (PYTHONPATH),
so ``module:callable`` kernels import there as they do here.

Default timeout per case (seconds), generous on purpose (a false TIMEOUT costs more than a late
one; the first case of a run also pays cupy's import and the NVRTC compile):
    60 + runs * visible FLOPs / rate + bundle bytes / 1e8
with rate = 1e10 FLOP/s for GPU kernels and 1e9 for CPU kernels (numpy) and runs the repeat count
(plus every replay under verify --graph: ``runs``); under a sanitizer (one run, or a run and the
replays): 300 + 100 * (runs * FLOPs / rate + bytes / 1e8).

``--sanitize TOOL`` runs the child as ``compute-sanitizer --tool TOOL --error-exitcode 99
--print-limit 20 [--report-api-errors no] python -m kdtr.check.isolate JOB``; exit code 99 makes the
case SANITIZER with the first lines of the findings as its message. CUDA API errors are not
findings (cupy probes for an optional ``kdtr_launch`` symbol; kernel faults already surface as
RUNTIME_ERROR). compute-sanitizer is looked up in $KDTR_SANITIZER, on PATH, in pip's
nvidia-cuda-sanitizer-api (``kdtr[sanitizer]``), in $CUDA_HOME / $CUDA_PATH, then under
/usr/local/cuda*/bin and /opt/nvidia.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kdtr.golden.bundle import load_bundle
from kdtr.check.compare import Status
from kdtr.kernels.nvrtc import LINEINFO_ENV
from kdtr.check.case import CaseResult, new_result
from kdtr.errors import InputError

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
SANITIZER_EXIT = 99
"""compute-sanitizer's exit code when it found errors (--error-exitcode)."""
SEARCH_GLOBS = ("/usr/local/cuda*/bin/compute-sanitizer", "/usr/local/cuda*/compute-sanitizer/compute-sanitizer",
                "/opt/nvidia/*/compute-sanitizer", "/opt/nvidia/*/bin/compute-sanitizer",
                "/opt/nvidia/*/*/compute-sanitizer", "/opt/nvidia/*/*/bin/compute-sanitizer")
"""Where compute-sanitizer is looked for after $KDTR_SANITIZER, PATH, pip and $CUDA_HOME."""
BASE_S, SANITIZER_BASE_S, SANITIZER_SLOWDOWN = 60.0, 300.0, 100.0
GPU_RATE, CPU_RATE, IO_RATE = 1e10, 1e9, 1e8
"""FLOP/s assumed of GPU / CPU kernels, bytes/s of bundle loading and comparing (all low on purpose)."""


# ---- parent side --------------------------------------------------------------------------------

def default_timeout(flops: int, nbytes: int, repeat: int = 1, gpu: bool = True, sanitize: bool = False) -> float:
    """Seconds one case may take before its child is killed (formula in the module docstring)."""
    run = flops / (GPU_RATE if gpu else CPU_RATE)
    if sanitize:
        return SANITIZER_BASE_S + SANITIZER_SLOWDOWN * (max(1, repeat) * run + nbytes / IO_RATE)
    return BASE_S + max(1, repeat) * run + nbytes / IO_RATE


def runs(repeat: int, graph: bool, sanitized: bool) -> int:
    """Kernel runs a child makes: the repeats (one under a sanitizer), and under verify --graph every
    capture's replays (kdtr/check/graph.py: up to len(FILLS) + 1 captures of max(2, repeat) replays each)."""
    from kdtr.check.graph import FILLS

    direct = 1 if sanitized else max(1, repeat)
    return direct + ((len(FILLS) + 1) * max(2, direct) if graph else 0)


def _pip_sanitizers() -> list[str]:
    from kdtr.kernels.nvrtc import _nvidia_roots

    return [h for r in _nvidia_roots() for pat in ("*/bin/compute-sanitizer", "*/compute-sanitizer/compute-sanitizer")
            for h in sorted(glob.glob(str(r / pat)))]


def find_sanitizer() -> str | None:
    """Path of an executable compute-sanitizer, or None."""
    if os.environ.get("KDTR_SANITIZER"):
        return os.environ["KDTR_SANITIZER"] if os.access(os.environ["KDTR_SANITIZER"], os.X_OK) else None
    if hit := shutil.which("compute-sanitizer"):
        return hit
    homes = [os.path.join(os.environ[e], "bin", "compute-sanitizer") for e in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(e)]
    globbed = [h for pat in SEARCH_GLOBS for h in sorted(glob.glob(pat), reverse=True)]
    return next((h for h in _pip_sanitizers() + homes + globbed if os.path.isfile(h) and os.access(h, os.X_OK)), None)


def sanitizer_command(tool: str) -> list[str]:
    """The command prefix a sanitized child runs under; InputError (one line) when impossible."""
    if tool not in TOOLS:
        raise InputError(f"unknown sanitizer tool {tool!r}; one of {', '.join(TOOLS)}")
    exe = find_sanitizer()
    if not exe:
        raise InputError("--sanitize needs compute-sanitizer (CUDA toolkit, or pip install 'kdtr[sanitizer]'): not found "
                         "in $KDTR_SANITIZER, on PATH, in pip's nvidia packages, $CUDA_HOME, /usr/local/cuda*/bin or /opt/nvidia")
    cmd = [exe, "--tool", tool, "--error-exitcode", str(SANITIZER_EXIT), "--print-limit", "20"]
    return cmd + (["--report-api-errors", "no"] if tool == "memcheck" else [])


def run_case(kernel, spec: str, path, repeat: int = 1, overrides: dict | None = None, timeout: float | None = None,
             sanitizer: list[str] | None = None, *, graph: bool = False, sibling=None) -> CaseResult:
    """Verify one bundle in a child process; a crash or hang is this case's status. graph: verify --graph
    (kdtr/check/graph.py), with ``sibling`` the bundle file of the case's sibling capture (or None)."""
    bundle = load_bundle(path)  # a bad bundle is the user's error, raised here as in-process
    res = new_result(kernel, bundle)
    if res.status is Status.SKIPPED:
        return res
    if not timeout:
        from kdtr.inputs.problem import visible_flops

        flops = visible_flops(bundle.problem.prefix_lens, bundle.problem.tree_depth, bundle.problem.H)
        gpu = getattr(kernel.caps, "needs_gpu", True)
        n_runs = runs(repeat, graph, bool(sanitizer))
        timeout = default_timeout(flops, os.path.getsize(path), n_runs, gpu, bool(sanitizer))
    del bundle
    with tempfile.TemporaryDirectory(prefix="kdtr-case-") as tmp:
        job, result, log = (os.path.join(tmp, n) for n in ("job.json", "result.json", "child.log"))
        Path(job).write_text(json.dumps({"kernel": spec, "bundle": os.path.abspath(path), "result": result,
                                         "repeat": 1 if sanitizer else repeat, "overrides": overrides or {},
                                         "graph": graph, "sibling": os.path.abspath(sibling) if sibling else None}))
        env = {LINEINFO_ENV: "1"} if sanitizer else {}  # sanitizer reports then name .cu lines
        rc = _run([*(sanitizer or []), sys.executable, "-m", "kdtr.check.isolate", job], log, timeout, env)
        try:
            payload = json.loads(Path(result).read_text())
        except (OSError, ValueError):
            payload = {}
        text = Path(log).read_bytes()[-(1 << 20):].decode(errors="replace")
    return _judge(res, payload, rc, timeout, text, bool(sanitizer))


def _run(cmd: list[str], log_path: str, timeout: float, extra_env: dict | None = None) -> int | None:
    """Run cmd in its own session with output to log_path; its exit status, None when killed for time."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path), **(extra_env or {}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:  # timed out or interrupted: the child's whole group goes
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _judge(res: CaseResult, payload: dict, rc: int | None, timeout: float, log: str, sanitized: bool) -> CaseResult:
    """The case's result from what the child left: its own verdict, or how it ended."""
    if rc is None:
        res.status = Status.TIMEOUT
        res.message = f"no result within {timeout:.0f} s: child killed (a hung kernel? --timeout SECONDS sets the limit)"
        return res
    got = CaseResult.from_json(payload["result"]) if "result" in payload else None
    if sanitized and rc == SANITIZER_EXIT:
        base = got or res
        own = f" (case itself: {base.status.value})" if got and got.status is not Status.PASS else ""
        base.status = Status.SANITIZER
        base.message = (findings(log) or f"compute-sanitizer reported errors (exit code {rc})") + own
        return base
    if got:
        return got
    res.status = Status.RUNTIME_ERROR
    if "error" in payload:
        res.message = f"child could not run the case: {payload['error']}"
        return res
    if rc < 0:
        try:
            name = f" ({signal.Signals(-rc).name})"
        except ValueError:
            name = ""
        res.message = f"child process died with signal {-rc}{name}"
    else:
        res.message = f"child process exited with code {rc} before reporting a result"
    tail = [ln.strip() for ln in log.splitlines() if ln.strip()][-2:]
    if tail:
        res.message += ": " + " | ".join(ln[:200] for ln in tail)
    return res


def findings(log: str, n: int = 6) -> str:
    """The first ``n`` lines of compute-sanitizer's report (no banner, host frames) plus its summary."""
    skip = ("COMPUTE-SANITIZER", "Saved host backtrace", "Host Frame", "ERROR SUMMARY: 0 errors")
    lines = [" ".join(ln[9:].split()) for ln in log.splitlines() if ln.startswith("=========")]
    lines = [ln for ln in lines if ln and not ln.startswith(skip)]
    summary = next((ln for ln in reversed(lines) if "SUMMARY" in ln), "")
    body = [ln for ln in lines if "SUMMARY" not in ln][:n]
    return " | ".join(body + ([summary] if summary else []))[:1000]


# ---- child side ---------------------------------------------------------------------------------

def child_main(job_path: str) -> None:
    """Verify the job's case here and write the result; never returns."""
    job = json.loads(Path(job_path).read_text())
    try:
        from kdtr.kernels.registry import resolve_kernel
        from kdtr.check.case import verify_bundle

        kernel = resolve_kernel(job["kernel"])
        bundle = load_bundle(job["bundle"])
        if job.get("graph"):
            from kdtr.check.graph import verify_graph

            sibling = load_bundle(job["sibling"]) if job.get("sibling") else None
            res = verify_graph(kernel, bundle, job["repeat"], job["overrides"], sibling)
        else:
            res = verify_bundle(kernel, bundle, repeat=job["repeat"], overrides=job["overrides"])
        payload = {"result": res.to_json()}
    except Exception as e:  # a kernel's own failure is already a status; this is the case not starting
        payload = {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]}
    tmp = job["result"] + ".tmp"
    Path(tmp).write_text(json.dumps(payload, default=str))
    os.replace(tmp, job["result"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no CUDA teardown: the context may be poisoned, and the verdict is written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m kdtr.check.isolate JOB.json (run by kdtr verify, not by hand)", file=sys.stderr)
        sys.exit(2)
    child_main(sys.argv[1])
