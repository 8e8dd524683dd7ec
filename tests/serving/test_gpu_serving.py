"""TreeVerify on a GPU, as a server runs it: two layers (their own q, cache and out; one block table, prefix
lengths, tree mask and workspace) captured in one torch.cuda.graph at SGLang's dummy lengths, then replayed on
new lengths and trees written into the same tensors, each layer judged against the float64 reference with kdtr's
tolerances; neither torch nor cupy allocates during a replay, nor during a direct run once warm."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kdtr.check.compare import compare
from kdtr.golden.reference import reference
from kdtr.golden.tolerances import default
from kdtr.inputs.cases import CaseSpec, build_problem

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

T_BUDGET, H, MAX_BATCH = 16, 4, 4
GROUPS = {  # (page size, capacity): three requests at two sets of lengths, the buffers of one shape
    1: ((0, 65, 300), (130, 1, 257)),
    64: ((64, 0, 250), (3, 192, 129)),
}
CAPACITY = 320


def problem(prefix_lens, page_size, seed, out_dtype="bf16"):
    spec = CaseSpec(model="deepseek-v3", heads=H, prefix_lens=prefix_lens, budget=T_BUDGET, page_size=page_size,
                    capacity=CAPACITY, out_dtype=out_dtype, seed=seed)
    return build_problem(spec)[0]


def second_layer(pr, seed):
    """The same layout (block table, lengths, tree) with another layer's q and cache values (NaN kept)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(pr.q.shape).astype(pr.q.dtype)
    kv = np.where(np.isnan(pr.kv_cache.astype(np.float32)), np.nan,
                  rng.standard_normal(pr.kv_cache.shape)).astype(pr.kv_cache.dtype)
    return replace(pr, q=q, kv_cache=kv)


def to_torch(a: np.ndarray, device="cuda"):
    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
    if a.dtype == np.uint32:
        return torch.from_numpy(a.view(np.int32)).to(device)
    return torch.from_numpy(a).to(device)


class Layer:
    """One layer's tensors (q, cache, out, lse), written in place for each step."""

    def __init__(self, pr, out_dtype):
        B, T = pr.B, pr.T
        self.q, self.kv = to_torch(pr.q).reshape(B * T, H, 576), to_torch(pr.kv_cache)
        self.out = torch.empty(B * T, H, 512, dtype=torch.bfloat16 if out_dtype == "bf16" else torch.float32,
                               device="cuda")
        self.lse = torch.empty(B * T, H, dtype=torch.float32, device="cuda")

    def load(self, pr):
        self.q.copy_(to_torch(pr.q).reshape(self.q.shape))
        self.kv.copy_(to_torch(pr.kv_cache))

    def poison(self):
        self.out.fill_(float("nan"))
        self.lse.fill_(float("nan"))

    def judge(self, pr, out_dtype):
        want_out, want_lse = reference(pr)
        got_out = self.out.float().cpu().numpy().reshape(want_out.shape)
        got_lse = self.lse.cpu().numpy().reshape(want_lse.shape)
        kv = pr.kv_dtype
        for name, got, want in (("out", got_out, want_out), ("lse", got_lse, want_lse)):
            chk = compare(got, want, default(kv, out_dtype, name), name, depth=pr.tree_depth,
                          out_dtype=out_dtype if name == "out" else None)
            assert not chk.status.failed, f"{name}: {chk.status.value} {chk.message}"


class Metadata:
    """What a server fills outside the graph: block table (or req_to_token + req_pool_indices), lengths, mask."""

    def __init__(self, pr, gather: bool):
        self.gather = gather
        self.prefix_lens = to_torch(pr.prefix_lens.astype(np.int32))
        self.tree_mask = to_torch(pr.tree_mask)
        if gather:  # SGLang: token slots of each request in a pool row, rows picked by req_pool_indices
            self.rows = torch.tensor([5, 0, 2], dtype=torch.int64, device="cuda")
            self.req_to_token = torch.zeros(8, CAPACITY + 64, dtype=torch.int32, device="cuda")
        else:
            self.block_table = to_torch(pr.block_table.astype(np.int32))
        self.load(pr)

    def load(self, pr):
        self.prefix_lens.copy_(to_torch(pr.prefix_lens.astype(np.int32)))
        self.tree_mask.copy_(to_torch(pr.tree_mask))
        if self.gather:
            pg = pr.page_size
            j = np.arange(self.req_to_token.shape[1])
            table = pr.block_table[:, np.minimum(j // pg, pr.block_table.shape[1] - 1)]
            slots = (table.astype(np.int64) * pg + j % pg).astype(np.int32)
            self.req_to_token[self.rows] = to_torch(slots)
        else:
            self.block_table.copy_(to_torch(pr.block_table.astype(np.int32)))

    def dummy(self):
        """SGLang's capture-time state: every prefix at 1, a chain tree."""
        self.prefix_lens.fill_(1)
        T = self.tree_mask.shape[1]
        chain = np.zeros((T, self.tree_mask.shape[2]), np.uint32)
        for t in range(T):
            for c in range(t + 1):
                chain[t, c // 32] |= np.uint32(1 << (c % 32))
        self.tree_mask.copy_(to_torch(np.broadcast_to(chain, self.tree_mask.shape).copy()))

    def args(self):
        if self.gather:
            return dict(block_table=self.req_to_token, req_pool_indices=self.rows)
        return dict(block_table=self.block_table)


def run_layers(tv, layers, meta, ws):
    for layer in layers:
        tv.run(layer.q, layer.kv, prefix_lens=meta.prefix_lens, tree_mask=meta.tree_mask, out=layer.out,
               lse=layer.lse, workspace=ws, **meta.args())


def cupy_pool_bytes():
    from kdtr.kernels.launch import cupy_module

    pool = cupy_module().get_default_memory_pool()
    return pool.used_bytes(), pool.total_bytes()


@pytest.mark.parametrize("kernel", [None, "flash", "naive"])
@pytest.mark.parametrize("page_size", sorted(GROUPS))
@pytest.mark.parametrize("gather", [False, True], ids=["block-table", "req-to-token"])
def test_two_layers_in_one_graph_replay_new_lengths_and_trees_right_without_allocating(kernel, page_size, gather):
    from kdtr.serving import TreeVerify

    first, then = GROUPS[page_size]
    out_dtype = "bf16"
    a = problem(first, page_size, seed=1)
    b = problem(then, page_size, seed=2)
    steps = [(a, second_layer(a, 11)), (b, second_layer(b, 12))]
    tv = TreeVerify(T=a.T, H=H, max_batch=MAX_BATCH, max_context=CAPACITY, page_size=page_size, scale=a.scale,
                    out_dtype=out_dtype, kernel=kernel)
    layers = [Layer(pr, out_dtype) for pr in steps[0]]
    meta = Metadata(a, gather)
    ws = tv.new_workspace()

    # a direct (eager) step, judged, and warm: a second direct step allocates nothing
    run_layers(tv, layers, meta, ws)
    torch.cuda.synchronize()
    for layer, pr in zip(layers, steps[0]):
        layer.judge(pr, out_dtype)
    before, pool = torch.cuda.memory_stats()["allocation.all.allocated"], cupy_pool_bytes()
    run_layers(tv, layers, meta, ws)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before and cupy_pool_bytes() == pool

    # captured at SGLang's dummy lengths, both layers in one graph sharing the workspace
    meta.dummy()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_layers(tv, layers, meta, ws)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layers(tv, layers, meta, ws)

    for step in (steps[1], steps[0], steps[1]):  # new lengths and trees, back, and again
        meta.load(step[0])
        for layer, pr in zip(layers, step):
            layer.load(pr)
            layer.poison()
        torch.cuda.synchronize()
        before, pool = torch.cuda.memory_stats()["allocation.all.allocated"], cupy_pool_bytes()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "the replay allocated"
        assert cupy_pool_bytes() == pool, "cupy's pool changed during the replay"
        for layer, pr in zip(layers, step):
            layer.judge(pr, out_dtype)
    tv.close()


def test_workspace_bytes_never_shrink_with_the_batch_and_a_smaller_batch_runs():
    from kdtr.serving import TreeVerify

    tv = TreeVerify(T=9, H=16, max_batch=16, max_context=4096, page_size=64, scale=0.1447)
    sizes = [tv.workspace_bytes(b) for b in range(1, 17)]
    assert sizes == sorted(sizes) and tv.workspace_bytes() == sizes[-1]
    assert all(tv.workspace_bytes(b) >= tv._launch.plan(b).workspace_bytes for b in range(1, 17))
    tv.close()


def test_a_batch_outside_batch_sizes_and_a_short_workspace_are_input_errors():
    from kdtr.errors import InputError
    from kdtr.serving import TreeVerify

    a = problem((40, 200), 64, seed=3)
    tv = TreeVerify(T=a.T, H=H, max_batch=4, max_context=CAPACITY, page_size=64, scale=a.scale, batch_sizes=(1, 4))
    layer, meta = Layer(a, "bf16"), Metadata(a, False)
    with pytest.raises(InputError, match="batch 2 was not planned"):
        run_layers(tv, [layer], meta, tv.new_workspace())
    tv.close()
    tv = TreeVerify(T=a.T, H=H, max_batch=4, max_context=CAPACITY, page_size=64, scale=a.scale, kernel="flash")
    if tv.workspace_bytes(2):  # where the plan splits the keys
        with pytest.raises(InputError, match="needs a workspace of"):
            run_layers(tv, [layer], meta, torch.zeros(1, dtype=torch.uint8, device="cuda"))
    tv.close()


def test_a_compiled_layer_calls_the_op_and_matches_the_reference():
    from kdtr.serving import TreeVerify

    a = problem(GROUPS[64][0], 64, seed=4)
    tv = TreeVerify(T=a.T, H=H, max_batch=MAX_BATCH, max_context=CAPACITY, page_size=64, scale=a.scale)
    layer, meta, ws = Layer(a, "bf16"), Metadata(a, False), tv.new_workspace()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def attend(q, kv, block_table, prefix_lens, tree_mask, out, lse, workspace):
        torch.ops.kdtr.tree_verify(tv.handle, q, kv, block_table, prefix_lens, tree_mask, out, lse, workspace)
        return out

    attend(layer.q, layer.kv, meta.block_table, meta.prefix_lens, meta.tree_mask, layer.out, layer.lse, ws)
    torch.cuda.synchronize()
    layer.judge(a, "bf16")
    tv.close()


def test_the_serving_example_runs_and_matches_its_reference():
    import subprocess
    import sys

    from conftest import ROOT

    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "serving_example.py")], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK") and r.stdout.count("step ") == 3, r.stdout
