"""tools/clocks.py without a GPU: bad input refused in one line before any GPU work, and nvidia-smi's samples read
back (medians, the clock-event reasons by NVML's bits, lines that do not parse counted and left out)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tool_loader import load_tool

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "clocks.py"


@pytest.mark.parametrize("argv, says", [
    ([], "name one spec or more"),
    (["-k", "flash-sm90", "--seconds", "0.5"], "--seconds 0.5"),
    (["-k", "flash-sm90", "--seconds", "nan"], "--seconds nan"),
    (["-k", "no-such-kernel"], "no-such-kernel"),
    (["-k", "flash-sm90", "--model", "no-such-model"], "no-such-model"),
])
def test_bad_input_gets_one_line_and_exit_2_before_any_gpu_work(argv, says):
    done = subprocess.run([sys.executable, str(TOOL), *argv], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_samples_give_medians_and_the_reasons_of_a_quarter_of_them():
    clocks = load_tool("clocks")
    lines = ["1980, 350.5, 0x0000000000000000", "1755, 540.0, 0x0000000000000004", "1740, 536.2, 0x0000000000000004",
             "1695, 560.1, 0x0000000000000024", "[N/A], 10, 0x0", "garbage"]
    got = clocks.summarize_samples(lines)
    assert got["samples"] == 4 and got["unparsed"] == 2
    assert got["mhz"] == pytest.approx(1747.5) and got["watts"] == pytest.approx(538.1)
    assert got["reasons"] == ["sw-power-cap", "sw-thermal"]  # thermal in 1 of 4: a quarter counts
    assert clocks.summarize_samples(["x"]) == {"samples": 0, "unparsed": 1, "mhz": None, "watts": None, "reasons": []}


def test_reason_bits_are_named_and_unknown_ones_kept():
    clocks = load_tool("clocks")
    assert clocks.reason_names(0x84) == ["sw-power-cap", "hw-power-brake"]
    assert clocks.reason_names(0x1000 | 0x8) == ["hw-slowdown", "0x1000"]
    assert clocks.reason_names(0) == []
