"""Generation, the manifest, reproducibility checks and the committed goldens."""

import json
from pathlib import Path

import numpy as np
import pytest

from kdtr.golden import generate as gen
from kdtr.inputs import suites
from kdtr.golden.bundle import load_bundle
from kdtr.inputs.cases import CaseSpec

SMALL = [
    CaseSpec(heads=2, prefix_lens=(0, 9), budget=8, page_size=4),
    CaseSpec(model="kimi-k2", heads=1, prefix_lens=(3,), family="chain", budget=3, page_size=1, kv_dtype="fp32", out_dtype="fp32"),
]
GOLDENS = Path(__file__).resolve().parents[2] / "goldens" / "ci"


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
    assert total < 25e6, f"ci goldens are {total / 1e6:.1f} MB"


@pytest.mark.slow
@pytest.mark.skipif(not (GOLDENS / gen.MANIFEST).exists(), reason="goldens/ci not generated")
def test_committed_goldens_regenerate_exactly():
    bad = [(r.file, r.problems) for r in gen.check(GOLDENS) if not r.ok]
    assert not bad, bad
