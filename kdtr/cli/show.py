"""`kdtr show`: a bundle's metadata, tensors, one request's tree, its mask and depth histogram."""

from __future__ import annotations

import json

import click

from kdtr.cli.options import check_output, emit, json_option
from kdtr.errors import InputError

PICTURE_MAX_T = 64
"""Trees of at most this many nodes are drawn (tree and mask); larger ones are summarised."""


def show_data(path: str, b: int = 0) -> dict:
    import numpy as np

    from kdtr.golden.bundle import load_bundle
    from kdtr.inputs import trees

    bnd = load_bundle(path)
    p = bnd.problem
    if not 0 <= b < p.B:
        raise InputError(f"--request {b} out of range: the bundle has {p.B} requests (0..{p.B - 1})")
    parent, depth = p.tree_parent[b], p.tree_depth[b]
    named = [("q", p.q), ("kv_cache", p.kv_cache), ("block_table", p.block_table), ("prefix_lens", p.prefix_lens),
             ("tree_parent", p.tree_parent), ("tree_depth", p.tree_depth), ("tree_mask", p.tree_mask),
             ("out", bnd.out), ("lse", bnd.lse)] + ([("draft_logp", bnd.draft_logp)] if bnd.draft_logp is not None else [])
    return {
        "path": str(path), "meta": {k: v for k, v in bnd.meta.items() if k != "checksums"},
        "tensors": {n: {"dtype": str(a.dtype), "shape": list(a.shape), "bytes": int(a.nbytes)} for n, a in named},
        "request": b, "prefix_len": int(p.prefix_lens[b]),
        "tree": {"T": p.T, "parent": parent.tolist(), "depth": depth.tolist(), "leaves": trees.leaf_count(parent),
                 "max_depth": int(depth.max()),
                 "depth_histogram": {int(k): int(v) for k, v in trees.depth_histogram(depth).items()},
                 "density": float((depth.astype(np.int64) + 1).sum() / (p.T * p.T))},
        "visible": trees.unpack_mask(p.tree_mask[b], p.T).tolist() if p.T <= PICTURE_MAX_T else None,
    }


def render_show(d: dict) -> None:
    from kdtr.cli import report

    m = d["meta"]
    dims = m.get("dims", {})
    report.kv_table(f"{d['path']}", [
        ("case", m.get("case")), ("format", f"{m.get('format')} v{m.get('version')}"), ("generator", m.get("generator")),
        ("B x T x H", f"{dims.get('B')} x {dims.get('T')} x {dims.get('H')}"), ("scale", m.get("scale")),
        ("kv / out dtype", f"{m.get('kv_dtype')} / {m.get('out_dtype')}"), ("page size", dims.get("page_size")),
        ("tree", json.dumps(m.get("tree"))), ("seed", m.get("seed")),
        ("values", (m.get("spec") or {}).get("values", "normal")),
        ("max |scaled score|", (m.get("conditioning") or {}).get("max_abs_score", "not recorded")),
        ("tolerances", json.dumps(m.get("tolerances"))),
    ])
    report.table("tensors", ["name", "dtype", "shape", "MB"],
                 [(n, t["dtype"], "x".join(map(str, t["shape"])), f"{t['bytes'] / 1e6:.3f}") for n, t in d["tensors"].items()],
                 right=("MB",))
    t = d["tree"]
    report.note(f"request {d['request']}: P = {d['prefix_len']}, T = {t['T']}, leaves = {t['leaves']}, "
                f"max depth = {t['max_depth']}, mask density = {t['density']:.3%}")
    if t["T"] <= PICTURE_MAX_T:
        report.tree_picture(t["parent"], t["depth"])
        report.mask_picture(d["visible"])
    else:
        report.note(f"(tree and mask pictures drawn only for T <= {PICTURE_MAX_T}; this tree has {t['T']} nodes)")
    report.histogram("depth histogram", t["depth_histogram"])


@click.command()
@click.argument("bundle", type=str)
@json_option("Metadata, tensor table and the request's tree")
@click.option("--request", "b", type=int, default=0, show_default=True, help="Which request's tree to draw.")
def show(bundle, json_to, b):
    """Metadata, tensors, the tree, its mask and depth histogram of a bundle."""
    check_output(json_to, "--json", ".json")
    emit(show_data(bundle, b), json_to, render_show)
