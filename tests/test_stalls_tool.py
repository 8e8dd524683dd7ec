"""tools/stalls.py reads ncu's source page back: its --sections split (the stretches between block-wide barriers,
each with its share of the stall samples and its instructions a pass) on a small hand-made CSV, the shape ncu
writes (a preamble, then a header row starting with Address)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from tool_loader import load_tool

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "stalls.py"


def _stalls():
    return load_tool("stalls")


ROWS = [  # (SASS, samples, executions, wait, barrier): a prologue, then 100 passes of a two-barrier loop
    ("MOV R1, R2", 1, 10, 1, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 0, 100, 0, 0),
    ("HMMA.16816.F32.BF16 R4, R8, R12, R4", 160, 100, 150, 10),
    ("LDSM.16.M88.4 R12, [R3]", 10, 100, 10, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 0, 100, 0, 0),
    ("FMUL R4, R4, R5", 29, 300, 4, 25),
]


def _write(path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["==PROF== a preamble line ncu writes"])
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
                    "stall_barrier", "stall_wait (Not Issued)"])
        for k, (src, samples, executed, wait, barrier) in enumerate(ROWS):
            w.writerow([hex(16 * k), src, samples, executed, wait, barrier, wait])


def test_sections_split_at_each_barrier_with_its_passes(tmp_path):
    path = tmp_path / "stalls.csv"
    _write(path)
    ins = _stalls().load(str(path))
    assert len(ins) == len(ROWS) and ins[2][3] == {"wait": 150.0, "barrier": 10.0}  # "(Not Issued)" columns left out
    got = _stalls().sections(ins)
    assert [(a, b) for a, b, *_ in got] == [(0, 0), (1, 3), (4, 5)]
    top, loop, tail = got
    assert loop[2] == 170 and loop[3] == {"wait": 160.0, "barrier": 10.0} and loop[4] / loop[5] == 3  # 3 a pass
    assert tail[2] == 29 and tail[4] / tail[5] == 4  # the FMUL executes 3 times a pass: 1 + 3
    assert top[5] == 10  # no barrier above the first stretch: its first instruction's count


def test_the_sections_table_prints_each_stretch_share(tmp_path):
    path = tmp_path / "stalls.csv"
    _write(path)
    proc = subprocess.run([sys.executable, str(TOOL), str(path), "2", "--sections"], capture_output=True, text=True,
                         timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("6 instructions, 200 samples")
    assert any(line.split()[:2] == ["1-3", "85.0%"] and "3 instructions x 100 passes" in line for line in lines), lines
    assert any(line.split()[:2] == ["4-5", "14.5%"] for line in lines), lines
    assert not any(line.split()[:1] == ["0-0"] for line in lines)  # 0.5 % of the samples: under the 1 % shown


def test_a_csv_without_the_sample_column_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("Address,Source\n0x0,MOV R1, R2\n")
    proc = subprocess.run([sys.executable, str(TOOL), str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Warp Stall Sampling" in proc.stderr, proc.stderr
