"""`kdtr gen` killed at any point leaves the goldens directory and its manifest consistent (issue 6).

Consistent means: MANIFEST.json is valid JSON; every bundle it lists exists with the listed
sha256; every ``*.kdtr`` file loads (none is half-written); anything else is a kdtr temporary
file (hidden, ``.tmp``, never ``*.kdtr``), and the next ``gen`` in the directory removes those and
ends with every case listed. The runs below replace existing bundles with different bytes (a
different generator tag, same names), so the window between a bundle's rename and the manifest
rewrite is exercised.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdtr.golden import atomic
from kdtr.golden import generate as gen
from kdtr.golden.bundle import file_sha256, load_bundle, read_meta
from kdtr.inputs.cases import CaseSpec

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["--model", "deepseek-v3", "--heads", "2", "--prefix", "0,40", "--page-size", "16"]
TWO = SHAPE + ["--budget", "3,8"]
SIX = ["--model", "deepseek-v3", "--heads", "4", "--prefix", "0,3000", "--page-size", "16",
       "--budget", "3,8,16,32,64,128"]
DRIVER = r'''
"""kdtr's CLI, with a generator tag (same case names, different bytes) and an optional self-kill."""
import os, signal, sys

import kdtr.golden.bundle as bundle
import kdtr.golden.generate as generate

generate.GENERATOR = os.environ["GEN_TAG"]
mode, at, calls = os.environ.get("KILL_MODE"), int(os.environ.get("KILL_AT", "0")), [0]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if mode in ("before-rename", "after-rename"):
    real_replace = os.replace

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == at and mode == "before-rename":
            die()
        real_replace(src, dst)
        if calls[0] == at and mode == "after-rename":
            die()

    os.replace = replace
elif mode == "mid-write":  # bundle._raw: 1 call per tensor to checksum it, 1 more to write it
    real_raw = bundle._raw

    def raw(a):
        calls[0] += 1
        if calls[0] == at:
            die()
        return real_raw(a)

    bundle._raw = raw

from kdtr.cli import main

main(sys.argv[1:], prog_name="kdtr")
'''


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("driver") / "gen_driver.py"
    path.write_text(DRIVER)
    return path


def run_gen(driver: Path, out: Path, shape: list[str], tag: str, kill: tuple[str, int] | None = None,
            jobs: int = 1, kill_after: float | None = None) -> int:
    """Run `kdtr gen` in a child process (own session); returns its exit status (-9 if killed)."""
    env = dict(os.environ, GEN_TAG=tag, PYTHONPATH=str(ROOT))
    if kill:
        env.update(KILL_MODE=kill[0], KILL_AT=str(kill[1]))
    cmd = [sys.executable, str(driver), "gen", *shape, "--out", str(out), "-j", str(jobs), "--json"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and its pool workers, mid-flight
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, -signal.SIGKILL), err.decode()
    return proc.returncode


def assert_consistent(out: Path) -> dict:
    """The directory invariant of kdtr.generate; returns the manifest's bundles."""
    listed = {}
    if (out / gen.MANIFEST).exists():
        man = json.loads((out / gen.MANIFEST).read_text())
        assert man["format"] == gen.MANIFEST_FORMAT
        listed = man["bundles"]
    for name, entry in listed.items():
        assert (out / name).is_file(), f"{name} is listed but missing"
        assert file_sha256(out / name) == entry["sha256"], f"{name} differs from its manifest entry"
    for path in out.glob("*.kdtr"):
        load_bundle(path)  # complete and valid, listed or not
    for path in out.iterdir():
        assert path.name == gen.MANIFEST or path.suffix == ".kdtr" or atomic.TEMP_NAME.match(path.name), path.name
        assert not (path.name.startswith(".") and path.suffix == ".kdtr"), path.name
    return listed


def assert_complete(out: Path, count: int, tag: str) -> None:
    """After a clean run: every case listed, written by that run, and no temporary file left."""
    listed = assert_consistent(out)
    assert len(listed) == count and sorted(p.name for p in out.glob("*.kdtr")) == sorted(listed)
    assert sorted(p.name for p in out.iterdir()) == sorted([gen.MANIFEST, *listed]), "temporary files left"
    assert {read_meta(out / name)["generator"] for name in listed} == {tag}


def two_specs() -> list[CaseSpec]:
    """The cases `kdtr gen TWO` makes."""
    return [CaseSpec(model="deepseek-v3", heads=2, prefix_lens=(0, 40), budget=b, page_size=16) for b in (3, 8)]


def test_killed_before_and_after_each_rename(driver, tmp_path, monkeypatch):
    """Two cases replaced with new bytes: 3 renames each (unlist, bundle, list); a kill around each.

    Before each kill the directory is reset (in-process) to complete bundles of another tag, so
    rename k is the same step in every run.
    """
    assert run_gen(driver, tmp_path, TWO, "tag-0") == 0
    assert_complete(tmp_path, 2, "tag-0")
    assert sorted(p.stem for p in tmp_path.glob("*.kdtr")) == sorted(s.name for s in two_specs())
    points = [("before-rename", k) for k in range(1, 7)] + [("after-rename", k) for k in (1, 2, 4, 5)]
    for i, point in enumerate(points, 1):
        monkeypatch.setattr(gen, "GENERATOR", "base")
        gen.generate(two_specs(), tmp_path)
        assert run_gen(driver, tmp_path, TWO, f"tag-{i}", kill=point) == -signal.SIGKILL, point
        assert_consistent(tmp_path)
    assert run_gen(driver, tmp_path, TWO, "final") == 0
    assert_complete(tmp_path, 2, "final")


def test_killed_mid_write(driver, tmp_path):
    """Killed while a bundle's bytes are being written: only a temporary file, removed next time."""
    assert run_gen(driver, tmp_path, TWO, "tag-0") == 0
    for i, at in enumerate((14, 17, 33), 1):  # the first bundle's 4th and 7th tensor, the second's 3rd
        assert run_gen(driver, tmp_path, TWO, f"tag-{i}", kill=("mid-write", at)) == -signal.SIGKILL
        assert_consistent(tmp_path)
        assert any(atomic.TEMP_NAME.match(p.name) for p in tmp_path.iterdir()), "the kill left no partial file"
    assert run_gen(driver, tmp_path, TWO, "final") == 0
    assert_complete(tmp_path, 2, "final")


def test_killed_at_random_times(driver, tmp_path):
    """SIGKILL to the whole process group (the run and its workers) at random instants, -j 1 and 2.

    The instants are drawn in [0.05 s, the duration of a clean run] (about 1 s here), so most
    kills land while bundles are being generated, written and listed.
    """
    t0 = time.perf_counter()
    assert run_gen(driver, tmp_path, SIX, "tag-0") == 0
    clean = time.perf_counter() - t0
    rnd = random.Random(6)
    statuses = []
    for i in range(1, 7):
        delay = rnd.uniform(0.05, max(0.1, clean))
        statuses.append(run_gen(driver, tmp_path, SIX, f"tag-{i}", jobs=1 + i % 2, kill_after=delay))
        assert_consistent(tmp_path)
    assert statuses.count(-signal.SIGKILL) >= 3, statuses
    assert run_gen(driver, tmp_path, SIX, "final", jobs=2) == 0
    assert_complete(tmp_path, 6, "final")


# ----------------------------------------------------------------------------- in-process checks


SPECS = [CaseSpec(heads=1, prefix_lens=(0, 9), budget=4, page_size=4),
         CaseSpec(model="kimi-k2", heads=1, prefix_lens=(3,), family="chain", budget=3, page_size=1)]


def test_invariant_holds_at_every_rename(tmp_path, monkeypatch):
    """Check the directory before and after every rename of a regeneration with new bytes.

    The old order (rename the bundle, then rewrite the manifest) fails here: between the two
    the manifest listed the old checksum of a replaced bundle.
    """
    gen.generate(SPECS, tmp_path)
    monkeypatch.setattr(gen, "GENERATOR", "kdtr test-other-bytes")
    real, renames, unlisted_seen = os.replace, [], []

    def checked_replace(src, dst):
        assert_consistent(tmp_path)
        real(src, dst)
        listed = assert_consistent(tmp_path)
        renames.append(Path(dst).name)
        unlisted_seen.extend(p.name for p in tmp_path.glob("*.kdtr") if p.name not in listed)

    monkeypatch.setattr(os, "replace", checked_replace)
    gen.generate(SPECS, tmp_path)
    names = [f"{s.name}.kdtr" for s in SPECS]
    assert renames == [gen.MANIFEST, names[0], gen.MANIFEST, gen.MANIFEST, names[1], gen.MANIFEST]
    assert set(unlisted_seen) == set(names)  # each was briefly unlisted while being replaced
    assert all(read_meta(tmp_path / n)["generator"] == "kdtr test-other-bytes" for n in names)


def test_identical_regeneration_keeps_the_files(tmp_path, monkeypatch):
    """Same case again: the bundles that reproduce stay as they are (no rename, no manifest write)."""
    gen.generate(SPECS, tmp_path)
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in tmp_path.iterdir()}
    real, renames = os.replace, []
    monkeypatch.setattr(os, "replace", lambda s, d: (renames.append(Path(d).name), real(s, d)))
    res = gen.generate(SPECS, tmp_path)
    assert renames == [] and all(r.kept for r in res)
    assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in tmp_path.iterdir()} == before


def test_regeneration_keeps_a_bundle_whose_last_bits_differ(tmp_path, monkeypatch):
    """The float64 reference's last bits vary between machines: a stored lse one ulp off (within
    REPRO_RTOL) is kept, one beyond it is replaced, and an unlisted file is replaced too."""
    import numpy as np

    from kdtr.golden.bundle import save_bundle

    gen.generate(SPECS[:1], tmp_path)
    path = tmp_path / f"{SPECS[0].name}.kdtr"
    b = load_bundle(path)

    def rewrite(lse):  # the same case with another lse, listed as it is now
        sha = save_bundle(path, b.problem, b.out, lse, b.meta, draft_logp=b.draft_logp)
        man = json.loads((tmp_path / gen.MANIFEST).read_text())
        man["bundles"][path.name].update(sha256=sha, bytes=path.stat().st_size)
        (tmp_path / gen.MANIFEST).write_text(json.dumps(man))
        return path.read_bytes()

    ulp_off = rewrite(np.nextafter(b.lse, np.inf))
    assert gen.generate(SPECS[:1], tmp_path)[0].kept and path.read_bytes() == ulp_off
    rewrite(b.lse * (1 + 1e-9))
    assert not gen.generate(SPECS[:1], tmp_path)[0].kept
    assert load_bundle(path).lse.tobytes() == b.lse.tobytes()
    (tmp_path / gen.MANIFEST).unlink()
    assert not gen.generate(SPECS[:1], tmp_path)[0].kept


def test_ctrl_c_with_workers_stops_promptly(tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C sends) with -j 2: the run ends
    within seconds, not after its workers' cases, and leaves the directory consistent."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    slow = ["--model", "deepseek-v3", "--heads", "16", "--prefix", "0,30000", "--budget", "64,128,256,512"]
    cmd = [sys.executable, "-m", "kdtr", "gen", *slow, "--out", str(tmp_path), "-j", "2"]
    # Ctrl-C's own disposition in the child: a shell that runs pytest in the background without job control
    # has it ignored, and the child would inherit that and never see the SIGINT below
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60

    def started() -> bool:  # a worker writing (a temporary file: there for a moment) or done (a bundle: it stays)
        return any(atomic.TEMP_NAME.match(p.name) or p.suffix == ".kdtr" for p in tmp_path.iterdir())

    while not started() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started() and proc.poll() is None, "gen wrote nothing within 60 s, or had finished: nothing to interrupt"
    time.sleep(0.3)  # the other worker is mid-case, two cases wait
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130 and "interrupted" in err.decode() and "Traceback" not in err.decode(), err.decode()
    assert took < 3.0, f"Ctrl-C took {took:.1f} s"
    assert_consistent(tmp_path)
    assert not [p.name for p in tmp_path.iterdir() if atomic.TEMP_NAME.match(p.name)], "workers' files left"


def test_next_run_removes_stale_temporary_files(tmp_path):
    """Temporary files of dead writers go; those of live processes and other files stay."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    names = {
        "dead_bundle": f".{SPECS[0].name}.kdtr.{dead}.0123abcd.tmp",
        "dead_manifest": f".{gen.MANIFEST}.{dead}.89abcdef.tmp",
        "live": f".other.kdtr.{os.getppid()}.0123abcd.tmp",
        "mine": f".mine.kdtr.{os.getpid()}.0123abcd.tmp",
        "user_file": ".keep.tmp",
        "user_bundle": "notes.txt",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"partial")
    gen.generate(SPECS[:1], tmp_path)
    left = {p.name for p in tmp_path.iterdir()}
    assert names["dead_bundle"] not in left and names["dead_manifest"] not in left
    assert {names[k] for k in ("live", "mine", "user_file", "user_bundle")} <= left
    assert atomic.remove_stale_temps(tmp_path / "missing") == []


def test_failing_worker_leaves_no_staged_files(tmp_path, monkeypatch):
    """A case that fails mid-run: the finished ones are listed, nothing temporary remains."""
    real = gen.build_bundle

    def flaky(spec, keep_exact=False):
        if spec.family == "chain":
            raise RuntimeError("boom")
        return real(spec, keep_exact)

    monkeypatch.setattr(gen, "build_bundle", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        gen.generate(SPECS, tmp_path)
    assert_consistent(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([gen.MANIFEST, f"{SPECS[0].name}.kdtr"])
    more = [CaseSpec(heads=1, prefix_lens=(p,), budget=4, page_size=4) for p in (1, 2, 3)]
    with pytest.raises(RuntimeError, match="boom"):  # workers (forked: they see the patch)
        gen.generate(more + SPECS[1:], tmp_path / "pool", jobs=2)
    listed = assert_consistent(tmp_path / "pool")
    assert sorted(p.name for p in (tmp_path / "pool").iterdir()) == sorted([gen.MANIFEST, *listed])


def test_check_reports_missing_and_mismatched_entries(tmp_path):
    gen.generate(SPECS, tmp_path)
    first, second = (f"{s.name}.kdtr" for s in SPECS)
    (tmp_path / first).unlink()
    raw = bytearray((tmp_path / second).read_bytes())
    raw[-1] ^= 1
    (tmp_path / second).write_bytes(bytes(raw))
    res = {r.file: r for r in gen.check(tmp_path)}
    assert not res[first].ok and res[first].problems == ["listed in the manifest but missing"]
    assert not res[second].ok and "file checksum differs from the manifest" in res[second].problems
    assert any("checksum mismatch in tensor" in p for p in res[second].problems)


def test_manifest_updates_wait_for_another_generator(tmp_path):
    """Installing waits while another process holds the directory's lock (concurrent generators)."""
    import fcntl
    import threading

    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    worker = threading.Thread(target=gen.generate, args=(SPECS[:1], tmp_path))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not any(atomic.TEMP_NAME.match(p.name) for p in tmp_path.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert not list(tmp_path.glob("*.kdtr")) and not (tmp_path / gen.MANIFEST).exists()  # staged, waiting
    finally:
        os.close(fd)  # releases the lock
    worker.join(timeout=30)
    assert_complete(tmp_path, 1, gen.GENERATOR)
