"""Forcing a flash plan by a kernel-spec suffix (kdtr/kernels/flash/force.py), without a GPU: every key
parses to its Force field, the kernel's name round-trips, a bad suffix is one KernelSpecError line
that names the key and what it takes, and the enums are cuda/flash_sm90.cu's."""

from __future__ import annotations

import re

import pytest

from kdtr.errors import KernelSpecError
from kdtr.kernels.bugs import Bug
from kdtr.kernels.flash.force import KEYS, Force, Merge, RowLayout
from kdtr.kernels.nvrtc import CUDA_DIR
from kdtr.kernels.registry import resolve_kernel


@pytest.mark.parametrize("spec, force", [
    ("flash[mt=2]", Force(mt=2)),
    ("flash-sm90[xr=1,splits=4]", Force(splits=4, xr=True)),
    ("flash-sm90[ xr = 0 ]", Force(xr=False)),
    ("flash-sm90[merge=combine]", Force(merge=Merge.COMBINE)),
    ("flash-sm90[merge=kernel]", Force(merge=Merge.IN_KERNEL)),
    ("flash-sm90[combine=narrow32]", Force(combine="narrow32")),
    ("flash[combine=split,splits=7]", Force(splits=7, combine="split")),
    ("flash-sm90[segments=0]", Force(segments=0)),
    ("flash-sm90[segments=1]", Force(segments=1)),
    ("flash-sm90[segments=16]", Force(segments=16)),
    ("flash-sm90[mt=4]", Force(mt=4)),
    ("flash[occupancy=sm_120]", Force(occupancy="sm_120")),
    ("flash[occupancy=sm_120,mt=2]", Force(mt=2, occupancy="sm_120")),
])
def test_every_key_parses_to_its_field(spec, force):
    k = resolve_kernel(spec)
    assert k.force == force and k.bug == Bug.NONE


def test_the_name_is_the_canonical_spec_and_resolves_to_the_same_kernel():
    k = resolve_kernel("flash-sm90[xr=1,splits=4]")
    assert k.name == "flash-sm90[splits=4,xr=1]"  # keys in Force's field order
    assert resolve_kernel(k.name).force == k.force
    full = Force(mt=4, splits=3, merge=Merge.COMBINE, combine="rows", xr=False, segments=0)
    assert full.suffix() == "[mt=4,splits=3,merge=combine,combine=rows,xr=0,segments=0]"
    assert resolve_kernel("flash-sm90" + full.suffix()).force == full
    assert Force().suffix() == "" and resolve_kernel("flash-sm90").name == "flash-sm90"
    assert tuple(KEYS) == ("mt", "splits", "merge", "combine", "xr", "segments", "occupancy")  # the user contract's keys


def test_an_emulated_occupancy_is_its_own_kernel_name_beside_flash():
    """flash[occupancy=sm_120] is a kernel of its own name: `kdtr bench -k flash -k 'flash[occupancy=sm_120]'` gives
    both rows, the padded beside the unpadded; the name resolves to the same force (isolation, reports)."""
    k = resolve_kernel("flash[occupancy=sm_120, mt=1]")
    assert k.name == "flash[mt=1,occupancy=sm_120]" and Force(mt=1, occupancy="sm_120").suffix() == "[mt=1,occupancy=sm_120]"
    assert resolve_kernel(k.name).force == k.force and k.variant is resolve_kernel("flash").variant
    assert resolve_kernel("flash-bug=scale-off[occupancy=sm_120]").name == "flash-bug=scale-off[occupancy=sm_120]"


def test_a_planted_bug_takes_a_suffix_too():
    k = resolve_kernel("flash-sm90-bug=merge-wrong-max[xr=1]")
    assert k.bug == Bug.MERGE_WRONG_MAX and k.force == Force(xr=True)
    assert k.name == "flash-sm90-bug=merge-wrong-max[xr=1]"
    assert resolve_kernel("flash-bug=scale-off[mt=1]").name == "flash-bug=scale-off[mt=1]"


@pytest.mark.parametrize("spec, says", [
    ("flash-sm90[foo=1]", "unknown key 'foo'; keys: mt, splits, merge, combine, xr, segments, occupancy"),
    ("flash-sm90[xr]", "'xr' is not KEY=VALUE"),
    ("flash-sm90[]", "an empty plan suffix"),
    ("flash-sm90[splits=2,splits=3]", "splits given twice"),
    ("flash[mt=3]", "mt=3: flash takes mt=1, 2 or 4"),
    ("flash-sm90[mt=2]", "mt=2: flash-sm90 takes mt=4"),
    ("flash-sm90[splits=0]", "splits=0: give N >= 1"),
    ("flash-sm90[splits=many]", "splits=many: give N >= 1"),
    ("flash-sm90[merge=2]", "merge=2: give merge=combine"),
    ("flash[merge=kernel]", "flash merges its splits by a combine launch only"),
    ("flash-sm90[combine=warp]", "combine=warp: give one of rows, split, narrow, narrow32, narrow64"),
    ("flash-sm90[xr=2]", "xr=2: give xr=0"),
    ("flash[xr=1]", "flash has no transposed rows"),
    ("flash[segments=1]", "flash takes no work table"),
    ("flash-sm90[segments=x]", "segments=x: give 0 (never), 1"),
    ("flash-sm90[merge=kernel,xr=1]", "transposed rows never merge in the kernel"),
    ("flash-sm90[merge=kernel,segments=2]", "a work table never merges in the kernel"),
    ("flash-sm90[xr=1,segments=2]", "transposed rows never take a work table"),
    ("flash[occupancy=sm_89]", "occupancy=sm_89: give occupancy=sm_120 (that arch's CTAs an SM, emulated on this GPU)"),
    ("flash[occupancy=SM_120]", "occupancy=SM_120: give occupancy=sm_120"),
    ("flash-sm90[occupancy=sm_120]", "occupancy=sm_120: flash-sm90 runs on sm_90a alone, where no other arch's "
                                     "residency applies; the portable flash takes occupancy="),
    ("naive[mt=1]", "applies to the flash kernels only"),
    ("emulate-flash[splits=2]", "applies to the flash kernels only"),
    ("flsh[mt=1]", "unknown kernel 'flsh' (did you mean 'flash'?)"),
    ("flash-sm90-bug=nope[xr=1]", "unknown bug 'nope'"),
])
def test_a_bad_suffix_is_one_line_naming_what_to_do(spec, says):
    with pytest.raises(KernelSpecError) as info:
        resolve_kernel(spec)
    text = str(info.value)
    assert says in text and "\n" not in text, text


def test_the_enums_are_the_kernels():
    """cuda/flash_sm90.cu's enum Merge and enum RowLayout hold the values kdtr/kernels/flash/force.py names."""
    text = (CUDA_DIR / "flash_sm90.cu").read_text()

    def values(enum: str, prefix: str) -> dict[str, int]:
        body = re.search(rf"enum {enum} : int \{{(.*?)\}};", text, re.S)
        assert body, enum
        return {n[len(prefix):]: int(v) for n, v in re.findall(rf"\b({prefix}\w+) = (\d+)", body.group(1))}

    assert values("Merge", "MERGE_") == {m.name: int(m) for m in Merge}
    assert values("RowLayout", "ROWS_") == {r.name: int(r) for r in RowLayout}
