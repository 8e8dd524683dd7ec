"""kdtr.serving without a GPU: a TreeVerify's arguments are checked before any device work (one InputError line
each), the workspace table never shrinks with the batch, and the custom op's fake implementation checks the
tensors' shapes and dtypes as the real one does (torch.compile and graph capture trace it)."""

from __future__ import annotations

import pytest

from kdtr.errors import InputError
from kdtr.serving.config import VerifyConfig, workspace_table

GOOD = dict(T=9, H=16, max_batch=4, max_context=1000, page_size=1, scale=0.1352)


@pytest.mark.parametrize("change, words", [
    (dict(T=0), "T must be a positive int"),
    (dict(T=2000), "at most 1280"),
    (dict(H=2.5), "H must be a positive int"),
    (dict(max_batch=True), "max_batch must be a positive int"),
    (dict(max_context=8), "shorter than the tree"),
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(scale=float("nan")), "scale must be a positive finite float"),
    (dict(scale=-1.0), "scale must be a positive finite float"),
    (dict(out_dtype="fp16"), "out_dtype must be one of bf16, fp32"),
    (dict(kv_dtype="fp8"), "kv_dtype must be one of bf16, fp32"),
    (dict(arch="hopper"), "arch must be like 'sm_90'"),
    (dict(kernel="triton"), "kernel must be one of flash-sm90, flash, naive"),
    (dict(kernel="flash", kv_dtype="fp32"), "fp32 storage takes kernel='naive'"),
    (dict(batch_sizes=(1, 8)), "batch_sizes must be ints in 1..max_batch=4"),
    (dict(batch_sizes=()), "batch_sizes must be ints"),
])
def test_bad_arguments_are_one_input_error_line(change, words):
    with pytest.raises(InputError, match=words) as e:
        VerifyConfig(**{**GOOD, **change})
    assert "\n" not in str(e.value) and str(e.value).startswith("TreeVerify: ")


def test_tree_verify_checks_its_arguments_before_it_needs_torch_or_a_gpu():
    from kdtr.serving import TreeVerify

    with pytest.raises(InputError, match="max_context=8 is shorter"):
        TreeVerify(**{**GOOD, "max_context": 8})
    with pytest.raises(InputError, match="batch_sizes must be a list of ints"):
        TreeVerify(**GOOD, batch_sizes=3)


def test_config_derives_pages_words_sizes_and_the_kernel():
    cfg = VerifyConfig(**{**GOOD, "T": 33, "page_size": 64, "max_context": 130, "batch_sizes": (4, 1, 2, 2)})
    assert (cfg.max_pages, cfg.mask_words, cfg.sizes) == (3, 2, (1, 2, 4))
    assert VerifyConfig(**GOOD).sizes == (1, 2, 3, 4)
    assert cfg.kernel_for("sm_90") == "flash-sm90" and cfg.kernel_for("sm_80") == "flash"
    assert VerifyConfig(**{**GOOD, "kv_dtype": "fp32"}).kernel_for("sm_90") == "naive"
    assert VerifyConfig(**{**GOOD, "kernel": "flash"}).kernel_for("sm_90") == "flash"


def test_workspace_table_is_nondecreasing_even_where_a_plan_needs_less_at_a_larger_batch():
    needs = {1: 100, 2: 400, 3: 0, 4: 300, 6: 900}  # a plan may split less at a larger batch
    table = workspace_table(needs, needs.get)
    assert table == {1: 100, 2: 400, 3: 400, 4: 400, 6: 900}
    values = [table[b] for b in sorted(table)]
    assert values == sorted(values) and all(table[b] >= needs[b] for b in needs)


def _tensors(torch, B=3, T=9, H=16, out_dtype=None, **change):
    bf16 = torch.bfloat16
    t = dict(q=torch.empty(B * T, H, 576, dtype=bf16), kv_cache=torch.empty(5000, 1, 576, dtype=bf16),
             block_table=torch.empty(4, 1000, dtype=torch.int32), prefix_lens=torch.empty(4, dtype=torch.int32),
             tree_mask=torch.empty(B, T, 1, dtype=torch.int32), out=torch.empty(B * T, H, 512, dtype=out_dtype or bf16),
             lse=torch.empty(B * T, H), workspace=torch.empty(64, dtype=torch.uint8))
    t.update(change)
    return t


@pytest.fixture
def handle():
    """A TreeVerify registered with the custom op for checks only, released after the test."""
    pytest.importorskip("torch")
    from kdtr.serving import op

    h = op.register(VerifyConfig(**GOOD))
    yield h
    op.release(h)


@pytest.mark.parametrize("bad, words", [
    (lambda torch: dict(out=torch.empty(26, 16, 512, dtype=torch.bfloat16)), "out must be"),
    (lambda torch: dict(q=torch.empty(27, 16, 576)), "q must be"),
    (lambda torch: dict(q=torch.empty(5 * 9, 16, 576, dtype=torch.bfloat16)), "q holds 5 requests"),
    (lambda torch: dict(prefix_lens=torch.empty(4, dtype=torch.int64)), "prefix_lens must be 1-D int32"),
    (lambda torch: dict(tree_mask=torch.empty(3, 9, 2, dtype=torch.int32)), "tree_mask must be"),
    (lambda torch: dict(kv_cache=torch.empty(10, 1, 512, dtype=torch.bfloat16)), "kv_cache must be"),
    (lambda torch: dict(lse=torch.empty(27, 16, dtype=torch.float64)), "lse must be"),
    (lambda torch: dict(block_table=torch.empty(2, 1000, dtype=torch.int32)), "block_table has 2 rows"),
])
def test_the_ops_fake_implementation_checks_shapes_and_dtypes(handle, bad, words):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kdtr.serving import op

    tree_verify = op.tree_verify_op()
    with FakeTensorMode():
        good = _tensors(torch)
        assert tree_verify(handle, **good) is None  # writes nothing, returns nothing
        with pytest.raises(InputError, match=words):
            tree_verify(handle, **{**good, **bad(torch)})
    with pytest.raises(InputError, match="no TreeVerify with handle"):
        with FakeTensorMode():
            tree_verify(handle + 1000, **_tensors(torch))


def test_the_op_traces_as_one_call_that_writes_out_lse_and_workspace(handle):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from kdtr.serving import op

    schema = op.tree_verify_op().default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"out", "lse", "workspace"}
    assert [a.name for a in schema.arguments][:2] == ["handle", "q"] and not schema.returns

    def layer(t):
        torch.ops.kdtr.tree_verify(handle, **t)
        return t["out"].float().sum()

    with FakeTensorMode():
        gm = make_fx(layer)(_tensors(torch))
    assert "kdtr.tree_verify" in gm.code


def test_a_checks_only_handle_refuses_to_launch(handle):
    import torch

    from kdtr.serving import op

    with pytest.raises(InputError, match="registered for checks only"):
        op.tree_verify_op()(handle, **_tensors(torch))
