"""Named suites of cases, built from the preset table.

smoke: seconds, for the demo. ci: committed under goldens/ci, covers every edge (budgets, value distributions,
prefix edges, mixed batches, page sizes, dtypes, tree families) within a small byte budget;
heads are cut where T is large so that float64 outputs stay small. long: real serving sizes
(prefixes up to 128k, all heads of a TP8 GPU), generated on demand and never committed.
graph: committed under goldens/graph, for `kdtr verify --graph`: groups of cases that share their
buffers (a capacity), each case after the one whose capture it replays.
"""

from __future__ import annotations

from kdtr.inputs.cases import CaseSpec
from kdtr.inputs.presets import BUDGETS, LONG_PREFIXES, model, prefix_edges

DSV3, KIMI = "deepseek-v3", "kimi-k2"
H_DSV3 = model(DSV3).heads_per_gpu()  # 16 at TP8
H_KIMI = model(KIMI).heads_per_gpu()  # 8 at TP8
CAPTURED_TREES = "kdtr:data/captured_trees.json"
"""A small file of parent arrays in the captured-tree JSON format (family "json"), named relative to
the package (kdtr.inputs.trees.PACKAGE_REF) so that bundles record no machine's path."""


def _c(tags: str, **kw) -> CaseSpec:
    return CaseSpec(tags=tuple(tags.split(",")), **kw)


def smoke() -> list[CaseSpec]:
    return [
        _c("ddtree,mixed-batch", model=DSV3, heads=H_DSV3, prefix_lens=(0, 70), budget=16),
        _c("chain,pg1,fp32", model=KIMI, heads=H_KIMI, prefix_lens=(5,), family="chain", budget=4,
           page_size=1, kv_dtype="fp32", out_dtype="fp32"),
        _c("decode", model=DSV3, heads=H_DSV3, prefix_lens=(33,), family="root", budget=0),
    ]


def ci() -> list[CaseSpec]:
    edges = prefix_edges(64)  # 0, 1, 63, 64, 65, 2500
    short_edges = tuple(p for p in edges if p < 1000)
    b = dict(zip(("decode", "b16", "b64", "b256", "b1024"), BUDGETS))
    return [
        # plain decode (T = 1) over every prefix edge in one batch, both page sizes and dtypes
        _c("decode,edges,mixed-batch,pg64", model=DSV3, heads=H_DSV3, prefix_lens=edges, family="root", budget=b["decode"]),
        _c("decode,edges,pg1,fp32", model=KIMI, heads=H_KIMI, prefix_lens=short_edges, family="root",
           page_size=1, kv_dtype="fp32", out_dtype="fp32"),
        # DDTree budgets 16 .. 1024 (T = 17 .. 1025), profiles, heads cut as T grows
        _c("ddtree,b16,mixed-batch", model=DSV3, heads=H_DSV3, prefix_lens=(1, 130), budget=b["b16"]),
        _c("ddtree,b16,edges,fp32", model=KIMI, heads=2, prefix_lens=(63, 64, 65), budget=b["b16"],
           profile="confident", kv_dtype="fp32", out_dtype="fp32"),
        _c("ddtree,b16,bf16-in-fp32-out", model=DSV3, heads=4, prefix_lens=(700,), budget=b["b16"], out_dtype="fp32"),
        _c("ddtree,b64,uncertain", model=KIMI, heads=2, prefix_lens=(200,), budget=b["b64"], profile="uncertain"),
        _c("ddtree,b64,edges", model=DSV3, heads=1, prefix_lens=short_edges, budget=b["b64"]),
        _c("ddtree,b64,fp32-in-bf16-out,pg1", model=DSV3, heads=2, prefix_lens=(1,), budget=b["b64"], page_size=1,
           kv_dtype="fp32", out_dtype="bf16"),
        _c("ddtree,b256,confident", model=DSV3, heads=1, prefix_lens=(64,), budget=b["b256"], profile="confident"),
        _c("ddtree,b256,fp32,pg1", model=KIMI, heads=1, prefix_lens=(65,), budget=b["b256"], page_size=1,
           kv_dtype="fp32", out_dtype="fp32"),
        _c("ddtree,b1024,T1025", model=DSV3, heads=1, prefix_lens=(129,), budget=b["b1024"]),
        # other tree families
        _c("chain,mixed-batch", model=KIMI, heads=4, prefix_lens=(0, 100), family="chain", budget=b["b16"]),
        _c("star,pg1", model=KIMI, heads=4, prefix_lens=(64,), family="star", budget=b["b16"], page_size=1),
        _c("json,captured", model=DSV3, heads=2, prefix_lens=(65, 3), family="json", budget=23,
           json_path=CAPTURED_TREES),
        _c("root,P0", model=DSV3, heads=H_DSV3, prefix_lens=(0,), family="root", kv_dtype="fp32", out_dtype="fp32"),
        # 8 rows or fewer in bf16: Kimi decode and a 4-node tree (flash-sm90's plan transposes every
        # row transposed; the kernel spec flash-sm90[xr=0] forces its 64-row build)
        _c("decode,edges,mixed-batch,pg64", model=KIMI, heads=H_KIMI, prefix_lens=(0, 1, 33, 64, 65, 300), family="root"),
        _c("ddtree,b3,mixed-batch", model=KIMI, heads=2, prefix_lens=(31, 130), budget=3, profile="uncertain"),
        # "hard" values (scores to +-145: outlier channels, sink keys, near-ties; every request and head
        # scaled and offset differently), T at the 32-bit mask-word edges (31, 32, 33, 64), bushy trees
        _c("hard,ddtree,b31,T32,bushy,mixed-batch", model=DSV3, heads=2, prefix_lens=(70, 5), budget=31,
           profile="bushy", values="hard"),
        _c("hard,ddtree,b32,T33,mixed-batch", model=KIMI, heads=2, prefix_lens=(0, 129), budget=32, values="hard"),
        _c("hard,ddtree,b63,T64,bushy,bf16-in-fp32-out", model=DSV3, heads=1, prefix_lens=(33, 60), budget=63,
           profile="bushy", values="hard", out_dtype="fp32"),
        _c("hard,ddtree,b30,T31", model=DSV3, heads=1, prefix_lens=(1, 65), budget=30, profile="confident",
           values="hard"),
        _c("hard,ddtree,b16,bushy,fp32,pg1", model=KIMI, heads=2, prefix_lens=(1, 90), budget=16, profile="bushy",
           page_size=1, kv_dtype="fp32", out_dtype="fp32", values="hard"),
        _c("hard,decode,heads,mixed-batch,pg1", model=DSV3, heads=H_DSV3, prefix_lens=(0, 1, 64, 300), family="root",
           page_size=1, values="hard"),
    ]


def long() -> list[CaseSpec]:
    out = []
    for p in LONG_PREFIXES:
        out.append(_c("long,ddtree,b256", model=DSV3, heads=H_DSV3, prefix_lens=(p,), budget=256))
    out += [
        _c("long,ddtree,b64,mixed-batch", model=DSV3, heads=H_DSV3, prefix_lens=(LONG_PREFIXES[1], 4097), budget=64),
        _c("long,ddtree,b1024", model=DSV3, heads=H_DSV3, prefix_lens=(LONG_PREFIXES[0],), budget=1024),
        _c("long,decode,pg1", model=KIMI, heads=H_KIMI, prefix_lens=(LONG_PREFIXES[-1], 1000), family="root",
           page_size=1),
        _c("long,ddtree,b8,fp32", model=KIMI, heads=H_KIMI, prefix_lens=(LONG_PREFIXES[-1],), budget=8,
           kv_dtype="fp32", out_dtype="fp32"),
        _c("long,chain,b4", model=KIMI, heads=H_KIMI, prefix_lens=(LONG_PREFIXES[1],), family="chain", budget=4,
           out_dtype="fp32"),
    ]
    return out


def graph() -> list[CaseSpec]:
    """Groups of cases with one buffer layout each (``capacity``: the same cache and block-table shapes at
    different prefix lengths and trees). verify --graph captures each case on the previous case of its
    group (kdtr/check/graph.py), so the order within a group is the transitions a server's replays make."""
    mixed = dict(model=KIMI, heads=2, family="root", page_size=64, capacity=64)  # B = 8 decode, one page each
    aligned = dict(model=DSV3, heads=1, budget=31, page_size=64, capacity=192, out_dtype="fp32")  # T = 32
    one = dict(model=DSV3, heads=2, budget=16, page_size=1, capacity=160)  # B = 1 on SGLang's token pool
    eight = dict(model=DSV3, heads=1, budget=16, page_size=1, capacity=48)  # B = 8 trees on the token pool
    return [
        _c("graph,decode,mixed->mixed,B8", prefix_lens=(0, 1, 5, 31, 32, 33, 62, 63), **mixed),
        _c("graph,decode,mixed->mixed,B8", prefix_lens=(63, 17, 0, 40, 2, 33, 50, 9), **mixed),
        _c("graph,ddtree,page-aligned", prefix_lens=(64, 128), **aligned),
        _c("graph,ddtree,page-aligned->ragged,T32", prefix_lens=(63, 129), **aligned),
        _c("graph,ddtree,pg1,B1", prefix_lens=(100,), **one),
        _c("graph,ddtree,pg1,B1,P0", prefix_lens=(0,), **one),
        _c("graph,ddtree,pg1,B1,new-tree", prefix_lens=(0,), profile="uncertain", **one),
        _c("graph,chain,pg1,B1,new-tree", prefix_lens=(143,), family="chain", **one),
        _c("graph,ddtree,pg1,mixed,B8", prefix_lens=(0, 1, 5, 31, 17, 2, 30, 9), **eight),
        _c("graph,ddtree,pg1,mixed->mixed,B8", prefix_lens=(31, 0, 9, 1, 30, 17, 5, 2), profile="confident", **eight),
    ]


SUITES = {"smoke": smoke, "ci": ci, "long": long, "graph": graph}
COMMITTED = ("ci", "graph")
"""Suites whose bundles live in the repository (goldens/<suite>/)."""


def suite(name: str) -> list[CaseSpec]:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return SUITES[name]()
