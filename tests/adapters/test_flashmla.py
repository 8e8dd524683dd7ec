"""FlashMLA's causal MTP decode as the ``flashmla-mtp`` bench peer (kdtr/adapters/flashmla.py): where flash_mla is
missing or does not load, the reason is one line and the peer SKIPs with it; its mask is a chain's, so the bench
gate checks it against the reference under a chain (DeviceProblem.with_tree), and the same output against the
problem's own tree FAILs. On an sm_90 GPU with flash_mla installed it is checked and timed."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from kdtr.adapters import flashmla
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.inputs.trees import make_tree, unpack_mask


@pytest.fixture
def fresh():
    flashmla._outcome.cache_clear()
    yield
    flashmla._outcome.cache_clear()


def test_without_flashmla_the_reason_is_one_line_and_the_peer_skips_with_it(monkeypatch, fresh):
    from kdtr.bench.baselines import baseline

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_mla" else real(name, *a))
    why = flashmla.unavailable_reason()
    assert why and "\n" not in why and ("not installed" in why or "needs torch" in why), why
    peer = baseline("flashmla-mtp")
    assert peer.name == "flashmla-mtp" and peer.untimed == f"flashmla-mtp: {why}"
    with pytest.raises(flashmla.FlashMlaUnavailable):
        flashmla.load()


def test_an_extension_that_does_not_load_is_one_line_naming_the_cause(monkeypatch, fresh):
    real_find, real_import = importlib.util.find_spec, importlib.import_module
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in ("flash_mla", "torch")
                        else real_find(name, *a))

    def refuse(name, *a):
        if name == "flash_mla":
            raise OSError("undefined symbol: torch_new_list_reserve_size\n(built for another torch)")
        return real_import(name, *a)

    monkeypatch.setattr(importlib, "import_module", refuse)
    why = flashmla.unavailable_reason()
    assert why.startswith("cannot load flash_mla: OSError: undefined symbol") and "\n" not in why, why


def test_an_unknown_baseline_names_flashmla_mtp_among_the_known():
    from kdtr.bench.baselines import baseline

    with pytest.raises(ValueError, match="flashmla-mtp"):
        baseline("flashmla")


@pytest.mark.parametrize("kw, why", [(dict(page_size=1), "page size 1"), (dict(kv_dtype="fp32"), "storage dtype fp32")])
def test_the_peer_takes_bf16_caches_of_64_token_pages_only(kw, why):
    from kdtr.bench.baselines import baseline

    spec = CaseSpec(model="deepseek-v3", heads=2, prefix_lens=(70,), budget=4, **{"page_size": 64, **kw})
    pr = build_problem(spec, values=False)[0]
    assert why in baseline("flashmla-mtp").caps.why_not(pr, "bf16")


@pytest.mark.parametrize("T", [1, 5, 65])
def test_the_peers_tree_is_the_causal_mask(T):
    """FlashMLA with s_q = T and causal=True lets query t see tokens 0..t of the tree: a chain's mask."""
    from kdtr.bench.baselines import FlashMlaMtpPeer

    tree = make_tree(FlashMlaMtpPeer.tree_family, budget=T - 1)
    assert tree.T == T and (unpack_mask(tree.mask_words(), T) == np.tril(np.ones((T, T), bool))).all()


def _device_problem(spec):
    from kdtr.bench.run import device_problem

    return device_problem(spec, seed=3)


@pytest.mark.gpu
def test_with_tree_keeps_the_inputs_and_changes_only_the_mask():
    from kdtr.check.compare import Status, compare
    from kdtr.golden.reference import reference
    from kdtr.golden.tolerances import default
    from kdtr.kernels.registry import resolve_kernel

    # the "uncertain" profile's DDTrees branch (a "mixed" one of 8 nodes can be a chain, the mask unchanged)
    spec = CaseSpec(model="deepseek-v3", heads=2, prefix_lens=(70, 130), budget=8, page_size=64, profile="uncertain")
    dp = _device_problem(spec)
    chain = dp.with_tree(make_tree("chain", budget=spec.T - 1))
    assert chain.q is dp.q and chain.kv_cache is dp.kv_cache and chain.out is not dp.out
    assert (chain.tree_mask.get() != dp.tree_mask.get()).any() and (dp.tree_mask.get() == dp.problem.tree_mask).all()
    naive = resolve_kernel("naive")
    got, mine = naive.run_on(chain).out, naive.run_on(dp).out
    want = reference(chain.download_inputs())[0]
    tol = default(spec.kv_dtype, spec.out_dtype, "out")  # bf16 out: the chain's rows pass, the tree's do not
    assert compare(got, want, tol, out_dtype=spec.out_dtype).status is Status.PASS
    assert compare(mine, want, tol, out_dtype=spec.out_dtype).status is Status.FAIL_NUMERIC
    with pytest.raises(ValueError, match="nodes"):
        dp.with_tree(make_tree("chain", budget=3))


def loadable():
    why = flashmla.unavailable_reason()
    if why:
        pytest.skip(f"FlashMLA does not load here: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("budget, batch", [(8, 2), (64, 1), (0, 3)])
def test_the_flashmla_peer_passes_under_a_chain_and_fails_under_the_tree(budget, batch):
    from kdtr.bench import run
    from kdtr.bench.baselines import FlashMlaMtpPeer
    from kdtr.kernels import launch

    loadable()
    if launch.device_arch() != "sm_90":
        pytest.skip("FlashMLA's dense decode runs on sm_90 only")

    class AgainstTheTree(FlashMlaMtpPeer):
        name, tree_family = "flashmla-mtp-vs-tree", None

    spec = CaseSpec(model="deepseek-v3", heads=16, prefix_lens=(1000, 3000, 200)[:batch], budget=budget,
                    family="root" if budget == 0 else "ddtree", profile="uncertain", page_size=64)  # trees that branch
    row = run.bench_shape(spec, [FlashMlaMtpPeer(), AgainstTheTree()], {"gemm_tflops": 700.0, "copy_gbs": 3000.0},
                          time_kw={"warmup_ms": 5.0, "budget_ms": 100.0})
    cells = {c.impl: c for c in row.cells}
    assert cells["flashmla-mtp"].status == "ok" and cells["flashmla-mtp"].median_ms > 0, cells["flashmla-mtp"]
    vs_tree = cells["flashmla-mtp-vs-tree"].status
    # a chain of T = 1 is the tree: the same output passes both; deeper trees differ from the chain
    assert vs_tree == "ok" if budget == 0 else vs_tree.startswith("FAIL"), vs_tree
