"""Generation, the manifest, reproducibility checks and the committed goldens."""

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kdtr.golden import generate as gen
from kdtr.inputs import suites
from kdtr.golden.bundle import load_bundle, read_meta
from kdtr.inputs import trees
from kdtr.inputs.cases import CaseSpec

SMALL = [
    CaseSpec(heads=2, prefix_lens=(0, 9), budget=8, page_size=4),
    CaseSpec(model="kimi-k2", heads=1, prefix_lens=(3,), family="chain", budget=3, page_size=1, kv_dtype="fp32", out_dtype="fp32"),
]
ROOT = Path(__file__).resolve().parents[2]
GOLDENS = ROOT / "goldens" / "ci"
CAPTURED = "kdtr:data/captured_trees.json"


def strings(obj):
    """Every string in a JSON-like value, keys included."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def test_generate_writes_bundles_and_manifest(tmp_path):
    res = gen.generate(SMALL, tmp_path, jobs=2)
    assert [r.name for r in res] == [s.name for s in SMALL]
    man = json.loads((tmp_path / gen.MANIFEST).read_text())
    assert set(man["bundles"]) == {f"{s.name}.kdtr" for s in SMALL}
    for r in res:
        assert man["bundles"][Path(r.path).name]["sha256"] == r.sha256
        b = load_bundle(r.path)
        assert b.name == r.name and b.out.dtype == np.float32 and b.lse.dtype == np.float64
    assert not list(tmp_path.glob("*.tmp*")), "temporary files left behind"


def test_check_passes_then_catches_tampering(tmp_path):
    gen.generate(SMALL, tmp_path)
    assert all(r.ok for r in gen.check(tmp_path))
    # a regenerated bundle written with another seed under the old name: inputs differ
    man = json.loads((tmp_path / gen.MANIFEST).read_text())
    first = next(iter(man["bundles"]))
    spec = CaseSpec.from_json(man["bundles"][first]["case"])
    other = gen.build_bundle(CaseSpec.from_json({**spec.to_json(), "seed": 5}))
    from kdtr.golden.bundle import save_bundle

    save_bundle(tmp_path / first, other.problem, other.out, other.lse, {**other.meta, "case": spec.name})
    bad = {r.file: r for r in gen.check(tmp_path)}[first]
    assert not bad.ok
    assert any("checksum differs" in p for p in bad.problems)
    assert any("input q is not byte-identical" in p for p in bad.problems)


def test_check_flags_missing_and_unlisted(tmp_path):
    gen.generate(SMALL, tmp_path)
    names = sorted(p.name for p in tmp_path.glob("*.kdtr"))
    (tmp_path / names[0]).rename(tmp_path / "stray.kdtr")
    res = {r.file: r for r in gen.check(tmp_path)}
    assert not res[names[0]].ok and "missing" in res[names[0]].problems[0]
    assert not res["stray.kdtr"].ok and "not listed" in res["stray.kdtr"].problems[0]


def test_reproducible_to_1e12():
    b1 = gen.build_bundle(SMALL[0])
    b2 = gen.build_bundle(SMALL[0])
    assert b1.problem.kv_cache.tobytes() == b2.problem.kv_cache.tobytes()
    np.testing.assert_allclose(b1.lse, b2.lse, rtol=gen.REPRO_RTOL, atol=0)


@pytest.mark.skipif(not (GOLDENS / gen.MANIFEST).exists(), reason="goldens/ci not generated")
def test_committed_goldens_match_the_ci_suite_and_are_small():
    man = json.loads((GOLDENS / gen.MANIFEST).read_text())
    assert set(man["bundles"]) == {f"{s.name}.kdtr" for s in suites.ci()}
    total = sum(p.stat().st_size for p in GOLDENS.glob("*.kdtr"))
    assert total < 29.5e6, f"ci goldens are {total / 1e6:.1f} MB"


@pytest.mark.slow
@pytest.mark.skipif(not (GOLDENS / gen.MANIFEST).exists(), reason="goldens/ci not generated")
def test_committed_goldens_regenerate_exactly():
    bad = [(r.file, r.problems) for r in gen.check(GOLDENS) if not r.ok]
    assert not bad, bad


@pytest.mark.skipif(not (GOLDENS / gen.MANIFEST).exists(), reason="goldens/ci not generated")
def test_committed_goldens_record_no_machine_path():
    """A golden that names a path of the machine that made it fails everywhere else (issue 37, defect 1)."""
    recorded = list(strings(json.loads((GOLDENS / gen.MANIFEST).read_text())))
    for path in sorted(GOLDENS.glob("*.kdtr")):
        recorded += strings(read_meta(path))
    paths = [t for t in recorded if os.path.isabs(t) or str(ROOT) in t or "/kdtr/data/" in t]
    assert not paths, paths
    assert CAPTURED in recorded


def test_the_captured_trees_case_records_a_package_reference():
    spec = next(s for s in suites.ci() if s.family == "json")
    assert spec.json_path == CAPTURED
    meta = gen.build_bundle(spec).meta
    assert meta["tree"]["json_path"] == CAPTURED and meta["spec"]["json_path"] == CAPTURED
    absolute = replace(spec, json_path=str(trees.PACKAGE_DIR / "data" / "captured_trees.json"))
    assert absolute.json_path == CAPTURED and absolute.name == spec.name
    assert not [t for t in strings(gen.build_bundle(absolute).meta) if os.path.isabs(t)]


@pytest.mark.slow
@pytest.mark.skipif(not (GOLDENS / gen.MANIFEST).exists(), reason="goldens/ci not generated")
def test_gen_suite_ci_over_a_copy_of_the_goldens_changes_no_byte(tmp_path):
    """`kdtr gen --suite ci` in a checkout leaves git status clean, on any machine: bundles whose
    float64 outputs a machine's BLAS rounds differently in the last bits are kept, not rewritten."""
    from click.testing import CliRunner

    from kdtr.cli import main

    copy = tmp_path / "ci"
    shutil.copytree(GOLDENS, copy)
    r = CliRunner().invoke(main, ["gen", "--suite", "ci", "--out", str(copy), "-j", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert all(b["kept"] for b in json.loads(r.stdout)["bundles"])
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in GOLDENS.iterdir())
    changed = [p.name for p in GOLDENS.iterdir() if (copy / p.name).read_bytes() != p.read_bytes()]
    assert not changed, changed


GRAPH = ROOT / "goldens" / "graph"


@pytest.mark.skipif(not (GRAPH / gen.MANIFEST).exists(), reason="goldens/graph not generated")
def test_committed_graph_goldens_match_the_graph_suite_are_small_and_keep_its_order():
    from kdtr.golden.store import find_bundles

    man = json.loads((GRAPH / gen.MANIFEST).read_text())
    assert set(man["bundles"]) == {f"{s.name}.kdtr" for s in suites.graph()}
    total = sum(p.stat().st_size for p in GRAPH.glob("*.kdtr"))
    assert total < 7e6, f"graph goldens are {total / 1e6:.1f} MB"
    assert [p.name for p in find_bundles(["graph"])] == [f"{s.name}.kdtr" for s in suites.graph()]  # suite order
    assert all(read_meta(p)["spec"]["capacity"] for p in GRAPH.glob("*.kdtr"))


@pytest.mark.slow
@pytest.mark.skipif(not (GRAPH / gen.MANIFEST).exists(), reason="goldens/graph not generated")
def test_committed_graph_goldens_regenerate_exactly():
    bad = [(r.file, r.problems) for r in gen.check(GRAPH) if not r.ok]
    assert not bad, bad


def test_bundles_record_their_max_score_and_check_recomputes_it():
    """The conditioning the bounds scale with is recorded at generation, rounded up (so that another
    machine's float64 noise keeps the bytes), and a bundle whose record differs is flagged by check."""
    from kdtr.golden.reference import reference_with_score
    from kdtr.golden.tolerances import record_score

    for values in ("normal", "hard"):
        spec = CaseSpec(model="kimi-k2", heads=2, prefix_lens=(3, 40), budget=8, values=values)
        b = gen.build_bundle(spec, keep_exact=True)
        _, _, smax = reference_with_score(b.problem)
        assert b.meta["conditioning"] == {"max_abs_score": record_score(smax)} and smax <= record_score(smax)
        assert (smax > 100) == (values == "hard") and b.meta["spec"].get("values", "normal") == values
        assert not gen.differences(b, b)
        edited = replace(b, meta={**b.meta, "conditioning": {"max_abs_score": 1e3}})
        assert any("'conditioning'" in p for p in gen.differences(edited, b))
