"""CPU Python-callable kernels (``kdtr_device = "cpu"``) for tests/test_isolate.py.

``correct`` wraps the CPU flash emulation; each other one behaves like it on small trees and
misbehaves (abort, exit, segfault, raise, hang) on trees of more than BIG_T nodes, so one run
over a small and a big bundle shows the fault isolated to its case. Spec'd as
``kernels_for_tests:NAME`` (tests/ is on sys.path under pytest, and the child inherits it).
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

from kdtr.kernels.emulate import emulate_flash
from kdtr.inputs.problem import Problem

BIG_T = 5


def cpu(fn):
    fn.kdtr_device = "cpu"
    return fn


def _problem(q, kv_cache, block_table, prefix_lens, tree_mask, scale) -> Problem:
    """The Problem these arrays are; parent and depth recovered from the ancestor mask."""
    B, T = q.shape[:2]
    bits = (tree_mask[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1
    vis = bits.reshape(B, T, -1)[..., :T].astype(bool)  # [B, T, T]: row t sees its ancestors and itself
    idx = np.arange(T)
    parent = np.where(vis & (idx[None, None, :] < idx[None, :, None]), idx, -1).max(-1).astype(np.int32)
    depth = (vis.sum(-1) - 1).astype(np.int32)
    return Problem(q=q, kv_cache=kv_cache, block_table=block_table, prefix_lens=prefix_lens, tree_parent=parent,
                   tree_depth=depth, tree_mask=tree_mask, scale=scale)


@cpu
def correct(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    return emulate_flash(_problem(q, kv_cache, block_table, prefix_lens, tree_mask, scale), out_dtype)


def _faulty(fault):
    @cpu
    def kernel(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
        if q.shape[1] > BIG_T:
            fault()
        return correct(q, kv_cache, block_table, prefix_lens, tree_mask, scale=scale, page_size=page_size,
                       out_dtype=out_dtype)

    return kernel


def _hang():
    pidfile = os.environ.get("KDTR_TEST_PIDFILE")
    if pidfile:
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
    while True:
        time.sleep(1)


def _raise():
    raise RuntimeError("planted failure in a Python kernel")


abort_on_big = _faulty(os.abort)
exit3_on_big = _faulty(lambda: os._exit(3))
segv_on_big = _faulty(lambda: ctypes.string_at(0))
raise_on_big = _faulty(_raise)
hang_on_big = _faulty(_hang)
