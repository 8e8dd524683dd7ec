"""TreeVerify's launch path on the CPU, with a stand-in kernel whose steps record their launches: each step gets one
KdtrParams packed from the tensors' addresses and the plan's split count, a repeated call repacks nothing, SGLang's
req_to_token + req_pool_indices go through the gather into TreeVerify's own block table first, the plan is made
from shapes (the stand-in cache address, never a length), and a short workspace is one InputError line."""

from __future__ import annotations

import contextlib

import pytest

from kdtr.errors import InputError
from kdtr.kernels.launch_types import Step
from kdtr.serving.config import VerifyConfig

torch = pytest.importorskip("torch")


class Recorded:
    """A loaded kernel whose launches are recorded."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.dependent = name, log, False
        self.function = self
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        self.log.append((self.name, grid, block, shared_mem, args))


class StandIn:
    """A kernel planned from shapes: a main step (60 KB of shared memory) and a merge, 2 splits, B KB of workspace."""

    def __init__(self, log):
        self.log, self.seen = log, []

    def steps(self, dp):
        from kdtr.kernels import serving

        self.seen.append((dp.problem.B, dp.problem.block_table.shape, dp.kv_cache.data.ptr))
        assert dp.kv_cache.data.ptr == serving.PLACEHOLDER_ADDRESS
        B = dp.problem.B
        return ([Step(Recorded("main", self.log), (3, 2, B), (128, 1, 1), 60_000),
                 Step(Recorded("merge", self.log), (1, B, 1), (256, 1, 1))], 1000 * B, 2)


@pytest.fixture
def verify(monkeypatch):
    from kdtr.kernels import launch, serving
    from kdtr.serving import op
    from kdtr.serving.verify import TreeVerify

    log = []
    monkeypatch.setattr(serving, "load_source", lambda src, expr, name: Recorded(expr, log))
    for module in (serving, launch):  # the gather's launch, and the steps' (launch.step_calls)
        monkeypatch.setattr(module, "external_stream", lambda ptr: contextlib.nullcontext())
    monkeypatch.setattr(launch, "pdl_enabled", lambda: False)
    cfg = VerifyConfig(T=9, H=2, max_batch=4, max_context=100, page_size=1, scale=0.125)
    kernel = StandIn(log)
    tv = TreeVerify.__new__(TreeVerify)
    tv._setup(cfg, serving.ServingLaunch(kernel, 9, 2, cfg.max_pages, 1, "bf16", "bf16", cfg.scale), torch.device("cpu"))
    tv.log, tv.kernel = log, kernel
    yield tv
    op.release(tv.handle)


def tensors(B=3):
    bf16 = torch.bfloat16
    return dict(q=torch.zeros(B * 9, 2, 576, dtype=bf16), kv_cache=torch.zeros(500, 1, 576, dtype=bf16),
                block_table=torch.zeros(4, 100, dtype=torch.int32), prefix_lens=torch.zeros(4, dtype=torch.int32),
                tree_mask=torch.zeros(B, 9, 1, dtype=torch.int32), out=torch.zeros(B * 9, 2, 512, dtype=bf16))


def params(args):
    from kdtr.kernels import contract as abi

    return args[0].view(abi.PARAMS_DTYPE)[0]


def test_every_batch_size_is_planned_from_shapes_and_the_workspace_table_is_their_running_max(verify):
    assert [b for b, _, _ in verify.kernel.seen] == [1, 2, 3, 4]
    assert {shape for _, shape, _ in verify.kernel.seen} == {(1, 100), (2, 100), (3, 100), (4, 100)}
    assert [verify.workspace_bytes(b) for b in (1, 2, 3, 4)] == [1000, 2000, 3000, 4000]
    assert verify._launch.plans[1].steps[0].loaded.max_dynamic_shared_size_bytes == 60_000


def test_each_step_gets_one_kdtr_params_of_the_tensors_and_a_repeat_repacks_nothing(verify):
    t = tensors()
    ws = verify.new_workspace()
    verify.run(**t, workspace=ws)
    verify.run(**t, workspace=ws)
    assert [c[0] for c in verify.log] == ["main", "merge", "main", "merge"]
    assert verify.log[0][1:4] == ((3, 2, 3), (128, 1, 1), 60_000)
    p = params(verify.log[0][4])
    assert (int(p["B"]), int(p["T"]), int(p["H"]), int(p["max_pages"]), int(p["num_pages"]), int(p["num_splits"])) == (
        3, 9, 2, 100, 500, 2)
    assert int(p["q"]) == t["q"].data_ptr() and int(p["out"]) == t["out"].data_ptr()
    assert int(p["workspace"]) == ws.data_ptr() and int(p["lse"]) == verify._lse.data_ptr()
    assert verify.log[0][4] is verify.log[2][4] and len(verify._launch._calls) == 1


def test_req_to_token_rows_are_gathered_into_its_own_block_table_first(verify):
    t = tensors()
    t["block_table"] = torch.zeros(8, 120, dtype=torch.int32)  # SGLang's req_to_token
    rows = torch.tensor([5, 0, 2])
    verify.run(**t, workspace=verify.new_workspace(), req_pool_indices=rows)
    assert [c[0] for c in verify.log] == ["kdtr_gather_pages<long long>", "main", "merge"]
    name, grid, block, _, args = verify.log[0]
    assert grid == (1, 3, 1) and int(args[0]) == t["block_table"].data_ptr() and int(args[3]) == rows.data_ptr()
    assert int(args[2]) == 120 and int(args[7]) == verify._block_table.data_ptr() and int(args[8]) == 100
    p = params(verify.log[1][4])
    assert int(p["block_table"]) == verify._block_table.data_ptr() and int(p["max_pages"]) == 100


def test_a_short_workspace_and_an_unplanned_batch_are_one_line_errors(verify):
    with pytest.raises(InputError, match="a batch of 3 needs a workspace of 3000 bytes, got 10"):
        verify.run(**tensors(), workspace=torch.zeros(10, dtype=torch.uint8))
    verify._launch.plans.pop(2)
    with pytest.raises(InputError, match="batch 2 was not planned"):
        verify.run(**tensors(B=2), workspace=verify.new_workspace())
    assert verify.log == []
