"""The CUDA sources travel with the package: a wheel installs them, kdtr.nvrtc finds them."""

from __future__ import annotations

import glob
import tomllib
from pathlib import Path

from kdtr.kernels.nvrtc import CUDA_DIR, find_cuda_dir

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_data_files_cover_every_cuda_source():
    """A new .cu / .cuh / .h under cuda/ that the wheel would leave out fails here."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = conf["tool"]["setuptools"]["data-files"]["share/kdtr/cuda"]
    shipped = {Path(p).name for pat in patterns for p in glob.glob(str(ROOT / pat))}
    sources = {p.name for p in (ROOT / "cuda").iterdir() if p.is_file()}
    assert sources and shipped == sources


def test_cuda_dir_lookup_order(tmp_path):
    tree, prefix = tmp_path / "src" / "cuda", tmp_path / "venv"
    installed = prefix / "share" / "kdtr" / "cuda"
    installed.mkdir(parents=True)
    assert find_cuda_dir(None, tree, [prefix]) == installed  # wheel install: no source tree
    tree.mkdir(parents=True)
    assert find_cuda_dir(None, tree, [prefix]) == tree  # a checkout or editable install
    assert find_cuda_dir(str(tmp_path / "mine"), tree, [prefix]) == tmp_path / "mine"  # $KDTR_CUDA_DIR
    assert find_cuda_dir(None, tmp_path / "none", [tmp_path / "empty"]) == tmp_path / "none"


def test_this_checkout_uses_its_own_sources():
    assert (CUDA_DIR / "kdtr_abi.h").is_file()
