# kdtr: `make test` and `make demo` do all set-up on a fresh machine (Python >= 3.11 with venv).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
KDTR    := $(BIN)/kdtr
STAMP   := $(VENV)/.installed
EXTRAS  ?= test,nvrtc,plot

.PHONY: test test-gpu demo goldens check-goldens clean install

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

# NVRTC 13.0, the oldest minor pyproject.toml allows (13.0.88: the lent GPUs' release), unpacked beside the venv, where
# tests/kernels/test_compile_oldest_nvrtc.py compiles every shipped build with it.
NVRTC_MIN  ?= 13.0.88
NVRTC_DIR  := $(VENV)/nvrtc-$(NVRTC_MIN)

$(NVRTC_DIR)/.unpacked: | $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d $(NVRTC_DIR) 'nvidia-cuda-nvrtc==$(NVRTC_MIN)'
	$(BIN)/python -m zipfile -e $(NVRTC_DIR)/nvidia_cuda_nvrtc-$(NVRTC_MIN)-*.whl $(NVRTC_DIR)
	rm -f $(NVRTC_DIR)/*.whl
	touch $@

install: $(STAMP)

## Every test this machine can run (GPU tests skip cleanly without a GPU).
test: $(STAMP) $(NVRTC_DIR)/.unpacked
	$(BIN)/python -m pytest -q

## GPU tests only (on a machine with a CUDA GPU and cupy: EXTRAS=test,cuda13 or test,cuda12).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu -rs

## Generate the smoke suite, show a bundle, verify (GPU kernels if a GPU is present, else emulate-flash).
demo: $(STAMP)
	$(KDTR) gen --suite smoke --out out/demo
	$(KDTR) show out/demo/dsv3-h16-p0.70-ddtree16m-pg64-bf16-s0.kdtr
	$(BIN)/python -m kdtr.cli.demo out/demo

## Regenerate the committed ci and graph goldens, and confirm them.
goldens: $(STAMP)
	$(KDTR) gen --suite ci --out goldens/ci -j 2
	$(KDTR) gen --suite graph --out goldens/graph -j 2
check-goldens: $(STAMP)
	$(KDTR) gen --check --out goldens/ci
	$(KDTR) gen --check --out goldens/graph

clean:
	rm -rf $(VENV) out build *.egg-info .pytest_cache
