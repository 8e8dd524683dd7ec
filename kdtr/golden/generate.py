"""Golden generation: case -> inputs -> float64 reference -> bundle, recorded in MANIFEST.json.

``kdtr gen`` may be killed at any instant (Ctrl-C, OOM killer, a lost machine), so a goldens
directory keeps one invariant at every moment: each bundle MANIFEST.json lists exists and has
the listed sha256, and each ``*.kdtr`` file is complete. Per case, in this order:

1. a worker writes the bundle under a temporary name (``.NAME.kdtr.PID.HEX.tmp``) and fsyncs it;
2. if the manifest lists NAME.kdtr with a different sha256, that entry is removed first (atomic
   manifest rewrite): the old file stays valid, merely unlisted, until it is replaced;
3. the temporary file is renamed onto NAME.kdtr (atomic) and the directory fsynced;
4. the entry with the new sha256 is added (atomic manifest rewrite).

So a kill leaves at worst a temporary file, which the next ``generate`` in that directory
removes once its writer is gone, or a complete bundle not listed (yet), which ``check`` reports
and the next ``generate`` of that case lists. Ctrl-C ends the pool's workers at once (they are
writers like any other: their temporary files go, finished bundles stay listed). Cases that
would not fit in host memory are refused before anything is written (kdtr.resources).

``check`` regenerates bundles and proves they are reproducible: inputs byte-identical, outputs
within 1e-12 relative. The float64 reference's last bits are not reproducible byte for byte: they
depend on the machine (BLAS kernels, SIMD paths) and even on what the process allocated before.
So ``generate`` keeps an existing bundle that the fresh build reproduces in check's sense (and
that is listed with its checksum, with the same metadata): regenerating committed goldens, on any
machine, leaves them byte for byte as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from kdtr.version import __version__
from kdtr.golden import tolerances
from kdtr.golden.atomic import atomic_write_bytes, publish, remove_stale_temps, temp_path
from kdtr.golden.bundle import Bundle, BundleError, file_sha256, load_bundle, read_meta, save_bundle
from kdtr.inputs.cases import CaseSpec, build_problem, draft_logp
from kdtr.golden.reference import reference_with_score
from kdtr.golden.resources import check_fits

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "kdtr-manifest"
GENERATOR = f"kdtr {__version__}"
REPRO_RTOL = 1e-12
"""Regenerated float64 outputs must agree with the stored ones to this relative error (beyond fp32 rounding of out)."""


@dataclass
class GenResult:
    """One generated bundle."""

    name: str
    """Case name (file stem)."""
    path: str
    """Where it was written."""
    sha256: str
    """Checksum of the whole file (recorded in the manifest)."""
    nbytes: int
    """File size."""
    seconds: float
    """Wall time to build and write it."""
    spec: CaseSpec
    """The case."""
    staged: str | None = None
    """The complete temporary file, until generate renames it onto path (then None)."""
    kept: bool = False
    """The bundle already at path reproduced the fresh build, so it was left as it is."""


def build_bundle(spec: CaseSpec, keep_exact: bool = False) -> Bundle:
    """Inputs and reference outputs of a case, in memory.

    out is stored rounded to the nearest fp32 (it dominates the bundle's size; the rounding is
    far below every tolerance); lse stays float64. keep_exact leaves out in float64.
    """
    prob, tlist = build_problem(spec)
    out, lse, smax = reference_with_score(prob)  # [B, T, H, 512], [B, T, H] float64, max |s| over visible pairs
    if not keep_exact:
        out = out.astype(np.float32)
    meta = {
        "case": spec.name,
        "out_dtype": spec.out_dtype,
        "tree": {"family": spec.family, **tlist[0].params} if tlist else {"family": spec.family},
        "seed": spec.seed,
        "model": spec.model,
        "tolerances": tolerances.for_bundle_meta(spec.kv_dtype, spec.out_dtype),
        "conditioning": {"max_abs_score": tolerances.record_score(smax)},
        "generator": GENERATOR,
        "spec": spec.to_json(),
    }
    return Bundle(path=None, problem=prob, out=out, lse=lse, draft_logp=draft_logp(tlist), meta=meta)


def stage_case(spec: CaseSpec, out_dir: str | os.PathLike, entry: dict | None = None) -> GenResult:
    """Build a case and write it, complete and fsynced, under a temporary name next to its target;
    or keep the bundle already there (manifest entry ``entry``) when it reproduces the build."""
    t0 = time.perf_counter()
    bnd = build_bundle(spec, keep_exact=True)
    path = Path(out_dir) / f"{spec.name}.kdtr"
    if reproduces(path, entry, bnd):
        return GenResult(spec.name, str(path), entry["sha256"], entry["bytes"], time.perf_counter() - t0, spec, kept=True)
    staged = temp_path(path)
    sha = save_bundle(staged, bnd.problem, bnd.out, bnd.lse, bnd.meta, draft_logp=bnd.draft_logp, atomic=False)
    return GenResult(spec.name, str(path), sha, os.stat(staged).st_size, time.perf_counter() - t0, spec, staged)


def _entry(sha256: str, nbytes: int, spec: CaseSpec) -> dict:
    """A bundle's manifest entry."""
    return {"sha256": sha256, "bytes": nbytes, "case": spec.to_json()}


def reproduces(path: Path, entry: dict | None, fresh: Bundle) -> bool:
    """Whether the file at ``path`` is the bundle ``fresh`` (an exact build) would be: listed in the
    manifest with its checksum and size, the same metadata, and check's criteria (differences)."""
    if entry is None or not path.is_file():
        return False
    spec = CaseSpec.from_json(fresh.meta["spec"])
    try:
        meta = read_meta(path)
        if any(meta.get(k) != v for k, v in json.loads(json.dumps(fresh.meta)).items()):
            return False
        if entry != _entry(file_sha256(path), path.stat().st_size, spec):
            return False
        return not differences(load_bundle(path), fresh)
    except (BundleError, OSError):
        return False


def read_manifest(out_dir: str | os.PathLike) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return {"format": MANIFEST_FORMAT, "version": 1, "bundles": {}}
    try:
        m = json.loads(path.read_text())
        if m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("bundles"), dict):
            raise ValueError("not a kdtr manifest")
        return m
    except (ValueError, OSError) as e:
        raise BundleError(f"{path}: unreadable manifest ({e}); delete it and run kdtr gen again") from None


def _write_manifest(out_dir: Path, man: dict) -> None:
    man["generator"] = GENERATOR
    man["bundles"] = dict(sorted(man["bundles"].items()))
    atomic_write_bytes(out_dir / MANIFEST, (json.dumps(man, indent=1, sort_keys=True) + "\n").encode())


def _record(out_dir: Path, results: Iterable[GenResult]) -> None:
    man = read_manifest(out_dir)
    for r in results:
        man["bundles"][Path(r.path).name] = _entry(r.sha256, r.nbytes, r.spec)
    _write_manifest(out_dir, man)


def _install(out_dir: Path, r: GenResult) -> None:
    """Steps 2-4 of the module docstring: unlist a differing entry, rename the staged file in, list it.
    A kept bundle is only (re)listed, where another generator changed its entry meanwhile."""
    with _locked(out_dir):
        man = read_manifest(out_dir)
        if r.kept:
            if man["bundles"].get(Path(r.path).name) != _entry(r.sha256, r.nbytes, r.spec):
                _record(out_dir, [r])
            return
        entry = man["bundles"].get(Path(r.path).name)
        if entry is not None and entry.get("sha256") != r.sha256:
            del man["bundles"][Path(r.path).name]
            _write_manifest(out_dir, man)
        publish(r.staged, r.path)
        r.staged = None
        _record(out_dir, [r])


@contextlib.contextmanager
def _locked(folder: Path):
    """Serialise manifest updates of generators sharing a directory (flock on the folder itself).

    Two `kdtr verify` runs may fill the same suite cache at once; without the lock one could
    rewrite the manifest from a stale read. Where flock is unavailable this does nothing.
    """
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _discard(results: Iterable[GenResult]) -> None:
    for r in results:
        if r.staged:
            with contextlib.suppress(OSError):
                os.unlink(r.staged)


def generate(
    specs: list[CaseSpec],
    out_dir: str | os.PathLike,
    jobs: int = 1,
    on_done: Callable[[GenResult], None] | None = None,
    force: bool = False,
) -> list[GenResult]:
    """Write every case's bundle into out_dir (in `jobs` processes) and record it in the manifest.

    Raises kdtr.resources.ResourceError, before writing anything, when a case (or `jobs` cases at
    once) would not fit in host memory; force=True skips that check.
    """
    out = Path(out_dir)
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate case names: {', '.join(sorted(dup))}")
    check_fits(specs, force=force, jobs=jobs)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    listed = read_manifest(out)["bundles"]
    entries = [listed.get(f"{s.name}.kdtr") for s in specs]
    results: list[GenResult] = []

    def done(r: GenResult) -> None:
        try:
            _install(out, r)
        finally:
            _discard([r])
        results.append(r)
        if on_done:
            on_done(r)

    if jobs <= 1 or len(specs) <= 1:
        for s, e in zip(specs, entries):
            done(stage_case(s, out, e))
    else:
        pool = ProcessPoolExecutor(max_workers=jobs)
        futs = [pool.submit(stage_case, s, out, e) for s, e in zip(specs, entries)]
        try:
            for f in as_completed(futs):
                done(f.result())
        except BaseException:  # Ctrl-C, or a case that failed: stop now, drop what is unpublished
            _stop(pool)
            _discard(f.result() for f in futs if f.done() and not f.cancelled() and f.exception() is None)
            remove_stale_temps(out)  # the stopped workers' half-written files
            raise
        pool.shutdown()
    order = {n: i for i, n in enumerate(names)}
    return sorted(results, key=lambda r: order[r.name])


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel the cases not started and end the workers at once, rather than waiting for the
    running ones (each may take seconds): a killed worker leaves only a temporary file."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # Python >= 3.14: pool.kill_workers()
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(timeout=10)


@dataclass
class CheckResult:
    """Reproducibility of one committed bundle."""

    file: str
    """Bundle file name."""
    ok: bool
    """True when every check below held."""
    problems: list[str]
    """What differs, one line each."""


def check_bundle(path: Path, entry: dict) -> CheckResult:
    problems: list[str] = []
    if not path.exists():
        return CheckResult(path.name, False, ["listed in the manifest but missing"])
    if file_sha256(path) != entry.get("sha256"):
        problems.append("file checksum differs from the manifest")
    try:
        old = load_bundle(path)
    except BundleError as e:
        return CheckResult(path.name, False, problems + [str(e)])
    try:
        spec = CaseSpec.from_json(entry["case"])
        new = build_bundle(spec, keep_exact=True)
    except (KeyError, TypeError, ValueError) as e:  # TreeError, a renamed or missing captured-trees file...
        return CheckResult(path.name, False, problems + [f"cannot rebuild the listed case: {' '.join(str(e).split())}"])
    problems += differences(old, new)
    return CheckResult(path.name, not problems, problems)


def differences(old: Bundle, new: Bundle) -> list[str]:
    """What makes a stored bundle differ from a fresh exact build (new), one line each: inputs not
    byte-identical, outputs beyond REPRO_RTOL, metadata that this generator would write otherwise."""
    problems = []
    p_old, p_new = old.problem, new.problem
    for name in ("q", "kv_cache", "block_table", "prefix_lens", "tree_parent", "tree_depth", "tree_mask"):
        a, b = getattr(p_old, name), getattr(p_new, name)
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            problems.append(f"input {name} is not byte-identical when regenerated")
    if p_old.scale != p_new.scale:
        problems.append(f"scale {p_old.scale} differs from {p_new.scale}")
    a, b = old.draft_logp, new.draft_logp
    if (a is None) != (b is None) or (a is not None and (a.shape != b.shape or a.tobytes() != b.tobytes())):
        problems.append("draft_logp is not byte-identical when regenerated")
    for name, a, b in (("out", old.out, new.out), ("lse", old.lse, new.lse)):
        rel = repro_error(a, b) if a.shape == b.shape else np.inf
        if rel > REPRO_RTOL:
            problems.append(f"output {name} differs by {rel:.3g} relative (> {REPRO_RTOL:g})")
    for key in ("case", "tolerances", "conditioning", "tree", "out_dtype", "spec"):
        if old.meta.get(key) != json.loads(json.dumps(new.meta.get(key))):
            problems.append(f"metadata '{key}' differs from what this generator writes")
    return problems


def repro_error(stored: np.ndarray, fresh: np.ndarray) -> float:
    """Relative disagreement of a stored output with a fresh float64 one, beyond storage rounding.

    fp32-stored values may differ from the fresh float64 value by half an fp32 ulp (their
    rounding); anything beyond that, relative to |fresh|, is real irreproducibility.
    """
    s = stored.astype(np.float64)
    slack = 0.5 * np.spacing(np.abs(stored)).astype(np.float64) if stored.dtype == np.float32 else 0.0
    excess = np.maximum(np.abs(s - fresh) - slack, 0.0)
    return float(np.max(excess / np.maximum(np.abs(fresh), 1e-300), initial=0.0))


def check(out_dir: str | os.PathLike, on_done: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Regenerate every bundle listed in out_dir's manifest and compare."""
    out = Path(out_dir)
    man = read_manifest(out)
    if not man["bundles"]:
        raise BundleError(f"{out / MANIFEST}: no bundles listed; run kdtr gen first")
    results = []
    for file, entry in man["bundles"].items():
        r = check_bundle(out / file, entry)
        results.append(r)
        if on_done:
            on_done(r)
    listed = set(man["bundles"])
    for extra in sorted(p.name for p in out.glob("*.kdtr") if p.name not in listed):
        results.append(CheckResult(extra, False, ["bundle not listed in the manifest"]))
    return results
