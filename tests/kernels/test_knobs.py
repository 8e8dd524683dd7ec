"""The flash kernels' experiment knobs (kdtr/kernels/knobs.py), without a GPU: every value the docs name
parses, junk names its variable, and the CLI turns junk into one line and exit code 2 before it
runs anything (it used to surface as an error in every verified case, and only on a GPU)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from kdtr.cli import main
from kdtr.kernels.flash import plan as flash_plan
from kdtr.kernels.flash import tma
from kdtr.kernels.knobs import COMBINE_FORCES, TMA_PROMOTIONS, FlashKnobs, merge_knob, pdl_knob, segments_knob


def test_defaults_are_the_plans_own():
    assert FlashKnobs.from_env({}) == FlashKnobs()
    assert FlashKnobs() == FlashKnobs(mt=0, splits=0, merge_units=1, combine="", xr="", tail="", segments="", pdl=True,
                                      tma_promotion="")


def test_every_documented_value_parses():
    env = {"KDTR_FLASH_MT": "2", "KDTR_FLASH_SPLITS": "7", "KDTR_FLASH_MERGE": "0", "KDTR_FLASH_COMBINE": "rows",
           "KDTR_FLASH_XR": "1", "KDTR_FLASH_TAIL": "0", "KDTR_FLASH_SEGMENTS": "3", "KDTR_PDL": "0"}
    assert FlashKnobs.from_env(env) == FlashKnobs(2, 7, 0, "rows", "1", "0", "3", False)
    assert [merge_knob(v) for v in ("", "0", "1", "4")] == [1, 0, 1, 4]
    assert [segments_knob(v) for v in ("", "0", "1", "2", "16")] == ["", "0", "1", "2", "16"]
    assert [pdl_knob(v) for v in ("", "1", "0")] == [True, True, False]


def test_the_combine_widths_are_the_plans():
    """knobs.py cannot import flash_plan (which imports it), so it lists the narrow widths by hand."""
    assert {f for f in COMBINE_FORCES if f.startswith("narrow") and f != "narrow"} == {
        f"narrow{c}" for c in flash_plan.NARROW_COLS}
    for force in COMBINE_FORCES:
        assert FlashKnobs.from_env({"KDTR_FLASH_COMBINE": force}).combine == force
    with pytest.raises(ValueError, match="^KDTR_FLASH_COMBINE='narrow128'"):
        FlashKnobs.from_env({"KDTR_FLASH_COMBINE": "narrow128"})


def test_every_promotion_parses_to_its_tensor_map_value():
    assert TMA_PROMOTIONS[0] == "" and tma.l2_promotion("") == tma.L2_PROMOTION == tma.L2_PROMOTION_128B
    for name in TMA_PROMOTIONS[1:]:
        assert FlashKnobs.from_env({"KDTR_TMA_PROMOTION": name}).tma_promotion == name
        assert tma.l2_promotion(name) == tma.L2_PROMOTIONS[name]
    assert [tma.l2_promotion(n) for n in ("none", "64", "128", "256")] == [0, 1, 2, 3]  # cuda.h's enum
    with pytest.raises(ValueError, match="^KDTR_TMA_PROMOTION='512': none, 64, 128, 256 "):
        FlashKnobs.from_env({"KDTR_TMA_PROMOTION": "512"})


@pytest.mark.parametrize("bad", ["x", "-1", "1.5"])
def test_merge_knob_says_what_it_takes(bad):
    with pytest.raises(ValueError, match=f"KDTR_FLASH_MERGE='{re.escape(bad)}': 0 \\(the combine launch\\)"):
        merge_knob(bad)


@pytest.mark.parametrize("name,value", [
    ("KDTR_FLASH_MT", "3"), ("KDTR_FLASH_MT", "x"), ("KDTR_FLASH_SPLITS", "-1"), ("KDTR_FLASH_SPLITS", "7k"),
    ("KDTR_FLASH_MERGE", "yes"), ("KDTR_FLASH_COMBINE", "warp"), ("KDTR_FLASH_XR", "2"), ("KDTR_FLASH_TAIL", "yes"),
    ("KDTR_FLASH_SEGMENTS", "x"), ("KDTR_PDL", "on"), ("KDTR_PDL", " 0"),
])
def test_junk_names_its_variable(name, value):
    with pytest.raises(ValueError, match=f"^{name}="):
        FlashKnobs.from_env({name: value})


@pytest.mark.parametrize("command", [["verify", "-k", "emulate-flash", "smoke"],
                                     ["bench", "-k", "emulate-flash", "--model", "kimi-k2", "--prefix", "1k", "--no-check"]])
def test_the_cli_stops_on_junk_with_one_line_and_exit_2(command, monkeypatch):
    monkeypatch.setenv("KDTR_FLASH_SPLITS", "many")
    r = CliRunner().invoke(main, command)
    assert r.exit_code == 2, (r.exit_code, r.output)
    text = r.output.strip()
    assert "KDTR_FLASH_SPLITS='many'" in text and "Traceback" not in text and len(text.splitlines()) == 1, text
