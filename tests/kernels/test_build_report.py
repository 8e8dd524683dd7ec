"""`kdtr compile`: ptxas's report per build, on a CPU. Each failing status is produced by a real
kernel (tests/cuda/) and must fail the command; the shipped kernels must come out clean."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdtr.kernels import build_report, cubin, registry as kernels, nvrtc
from kdtr.kernels.flash import combine
from kdtr.kernels.bugs import LAUNCH_BUGS, Bug
from kdtr.kernels.build_report import BuildStatus
from kdtr.cli import main

CUDA = Path(__file__).resolve().parents[1] / "cuda"
SPILLS = f"{CUDA / 'spills.cu'}:spills_verify<{{kv}}, {{out}}>"
BIG_SMEM = f"{CUDA / 'big_smem.cu'}:big_smem_verify<{{kv}}, {{out}}>"


def compile_json(*args):
    r = CliRunner().invoke(main, ["compile", "--json", *args])
    return r.exit_code, (json.loads(r.output) if r.output.lstrip().startswith("{") else r.output)


@pytest.mark.nvrtc
def test_shipped_kernels_are_clean_and_read_their_own_launch_constants():
    code, d = compile_json("-k", "naive", "-k", "flash", "-k", "flash-sm90")
    assert code == 0 and d["failed"] == 0, d
    rows = d["rows"]
    assert {r["status"] for r in rows} == {"CLEAN"} and all(r["registers"] > 0 for r in rows)
    assert {r["arch"] for r in rows if r["label"] == "flash"} == {"sm_80", "sm_90", "sm_120"}
    assert {r["arch"] for r in rows if r["label"] == "flash-sm90"} == {"sm_90a"}
    main90 = [r for r in rows if r["kernel"].startswith("kdtr_flash_sm90_verify<")]
    # sm_90a's 227 KB a CTA, read back; the all-transposed build ({xr} = 1) two CTAs to an SM's 228 KB
    assert main90 and all(64 * 1024 < r["dynamic_smem"] <= 227 * 1024 for r in main90)
    transposed = [r for r in main90 if r["kernel"].endswith(", 1>")]
    assert transposed and all(2 * (r["dynamic_smem"] + 1024) <= 228 * 1024 for r in transposed)
    assert all(r["dynamic_smem"] == 0 for r in rows if r["kernel"].startswith("kdtr_flash_combine"))
    naive = [r for r in rows if r["label"] == "naive"]
    assert len(naive) == 4 * 3 and len({r["dynamic_smem"] for r in naive}) == 1 and naive[0]["dynamic_smem"] > 48 * 1024
    assert {r["smem_limit"] for r in naive if r["arch"] == "sm_120"} == {99 * 1024}


@pytest.mark.nvrtc
def test_config_arrays_read_from_the_cubin_match_the_python_side():
    """The flash kernels' config arrays, read from the file (no GPU), agree with the Python side that
    builds their inputs: MAX_T is the caps' max_T, the work tables' widths, the TMA box."""
    for base, (variant, caps) in kernels.FLASH_VARIANTS.items():
        c = nvrtc.compile_file(variant.source, [combine.COMBINE.format(out="float")], variant.arch or "sm_80")
        cfg = variant.read_config(lambda symbol, n: cubin.global_ints(c.cubin, symbol, n))
        assert cfg["MAX_T"] == caps.max_T, base
        limit = 227 * 1024 if variant.arch == "sm_90a" else 99 * 1024  # sm_90a only, or within sm_120's 99 KB
        assert all(cfg[f"SMEM_MT{mt}"] <= limit for mt in variant.mts), (base, cfg)
        assert cubin.global_ints(c.cubin, "no_such_symbol", 4) is None
        if "WORK_INTS" in cfg:  # the work / job tables kdtr/kernels/flash/schedule.py writes for the kernel's work table
            from kdtr.kernels.flash.schedule import JOB_FIELDS, WORK_FIELDS

            assert (cfg["WORK_INTS"], cfg["JOB_INTS"]) == (len(WORK_FIELDS), len(JOB_FIELDS))
        if "TMA_BOX_COLS" in cfg:  # the TMA box tiles a 576-wide cache row (kdtr/kernels/flash/tma.py)
            from kdtr.inputs.presets import DK

            assert cfg["TMA_BOX_COLS"] * cfg["TMA_BOX_SLABS"] == DK


@pytest.mark.nvrtc
def test_a_spilling_kernel_fails_with_ptxas_byte_counts():
    code, d = compile_json("-k", SPILLS, "--arch", "sm_90")
    assert code == 1 and d["failed"] == 4, d
    assert {r["status"] for r in d["rows"]} == {"SPILLS"}
    assert all(r["spill_stores"] > 0 and f"{r['spill_stores']} B spill stores" in r["message"] for r in d["rows"])


@pytest.mark.nvrtc
def test_shared_memory_is_held_against_each_archs_limit():
    code, d = compile_json("-k", BIG_SMEM, "--arch", "sm_80,sm_90,sm_120")
    assert code == 1, d
    by_arch = {a: {r["status"] for r in d["rows"] if r["arch"] == a} for a in ("sm_80", "sm_90", "sm_120")}
    assert by_arch == {"sm_80": {"CLEAN"}, "sm_90": {"CLEAN"}, "sm_120": {"SMEM_OVER_LIMIT"}}
    assert all(r["dynamic_smem"] == 120 * 1024 for r in d["rows"])


@pytest.mark.nvrtc
def test_a_compile_error_is_a_failed_row_naming_the_error():
    code, d = compile_json("-k", f"{CUDA / 'broken.cu'}:broken", "--arch", "sm_80")
    assert code == 1 and [r["status"] for r in d["rows"]] == ["COMPILE_ERROR"]
    assert "broken.cu" in d["rows"][0]["message"] and "error" in d["rows"][0]["message"]


def test_wgmma_serialization_is_charged_to_the_kernel_ptxas_names(monkeypatch):
    """ptxas's C7514 line names one function: that kernel fails, its neighbour in the build does not."""
    res = nvrtc.Resources(registers=168)
    fake = nvrtc.Compiled(
        cubin=b"", lowered={"a<1>": "_Z1aILi1EE", "b<1>": "_Z1bILi1EE"}, warnings=[], arch="sm_90a", options=(), key="k",
        log="ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "... in the function '_Z1aILi1EE'\n",
        resources={"_Z1aILi1EE": res, "_Z1bILi1EE": res})
    monkeypatch.setattr(nvrtc, "compile_file", lambda *a, **k: fake)
    monkeypatch.setattr(cubin, "global_ints", lambda *a, **k: None)
    target = build_report.BuildTarget("t", Path("t.cu"), ("a<1>", "b<1>"), ("sm_90a",))
    rows = build_report.build_report([target])
    assert [(r.kernel, r.status) for r in rows] == [("a<1>", BuildStatus.WGMMA_SERIALIZED), ("b<1>", BuildStatus.CLEAN)]
    assert BuildStatus.WGMMA_SERIALIZED.failed and not BuildStatus.STACK.failed


def test_all_variants_adds_every_planted_bug_build():
    """Every bug planted in a kernel is a build of its own; a bug planted in the launch runs the correct build."""
    shipped = build_report.targets_for("naive")[0]
    every = build_report.targets_for("naive", all_variants=True)[0]
    assert len(every.names) == len(shipped.names) * (len(Bug) - len(LAUNCH_BUGS)) and set(shipped.names) < set(every.names)
    assert build_report.targets_for("naive-bug=sibling-visible")[0].names != shipped.names
    assert build_report.targets_for("naive-bug=baked-lengths")[0].names == shipped.names


@pytest.mark.parametrize("spec, head", [("flash[occupancy=sm_120]", "flash"), ("flash[mt=2]", "flash"),
                                        ("flash-bug=scale-off[splits=3]", "flash-bug=scale-off")])
def test_a_forced_plan_reports_the_builds_of_its_kernel(spec, head):
    """A plan suffix changes launches, not builds: kdtr compile -k 'flash[occupancy=sm_120]' lists flash's."""
    assert build_report.targets_for(spec, ("sm_120",))[0].names == build_report.targets_for(head, ("sm_120",))[0].names


def test_global_ints_reads_an_initialised_array_from_an_elf_file():
    """A hand-built ELF64: .symtab, .strtab and one data section holding {7, -2, 99}."""
    data = struct.pack("<3i", 7, -2, 99)
    strtab = b"\0arr\0"
    symtab = bytes(24) + struct.pack("<IBBHQQ", 1, 0x11, 0, 3, 0, 12)
    shstr = b"\0.symtab\0.strtab\0.data\0.shstrtab\0"
    body_off = 64
    offs, blob = [], b""
    for part in (symtab, strtab, data, shstr):
        offs.append(body_off + len(blob))
        blob += part
    shoff = body_off + len(blob)
    sec = struct.Struct("<IIQQQQIIQQ")
    headers = bytes(64) + sec.pack(1, 2, 0, 0, offs[0], len(symtab), 2, 1, 8, 24) + sec.pack(9, 3, 0, 0, offs[1], len(strtab), 0, 0, 1, 0)
    headers += sec.pack(17, 1, 0, 0, offs[2], len(data), 0, 0, 4, 0) + sec.pack(23, 3, 0, 0, offs[3], len(shstr), 0, 0, 1, 0)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    head = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 5, 4)
    elf = head + blob + headers
    assert cubin.global_ints(elf, "arr", 3) == (7, -2, 99)
    assert cubin.global_ints(elf, "other", 3) is None
    with pytest.raises(cubin.CubinError):
        cubin.global_ints(elf, "arr", 4)  # 12 bytes hold 3 ints
    with pytest.raises(cubin.CubinError):
        cubin.global_ints(b"not an elf file at all", "arr", 1)


@pytest.mark.parametrize("args,fragment", [
    (["--arch", "turing"], "--arch turing"),
    (["-k", "emulate-flash"], "not a CUDA kernel"),
    (["-k", "flash-sm90", "--arch", "sm_120"], "sm_90a only"),
    (["-k", "nope.cu:k"], "no such CUDA file"),
])
def test_bad_input_is_one_line_exit_2(args, fragment):
    r = CliRunner().invoke(main, ["compile", *args])
    assert r.exit_code == 2 and fragment in r.output and "Traceback" not in r.output, r.output
