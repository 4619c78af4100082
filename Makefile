# Two commands do all set-up on a fresh machine: `make demo` and `make test` (see README.md).
# `make test` is what CI runs (.ci/run): lint, type check, the whole suite, the Hugging Face
# facing tests under the GPU image's transformers, then the fast suite again under the newest
# dependencies the pins allow on Python 3.12.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0, installed by pip: the small CPU build where the index serves one (this CI
# machine's does). On stock PyPI the Linux wheel is the multi-GB CUDA build; for the CPU one set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu. Override: make TORCH=torch==2.11.0
TORCH ?= torch==2.13.0
DEMO_OUT ?= demo_out
STAMP := $(VENV)/.installed
# The GPU image's Python (3.12), where numpy 2.5 and the newest releases install: python3.12 on
# PATH where it runs, otherwise pyenv's 3.12 (its shim answers only when 3.12 is pyenv's selected
# version, which CI's is not).
PYTHON_NEWEST ?= $(firstword $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; do $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo $$p; done))
VENV_NEWEST ?= .venv-newest
STAMP_NEWEST := $(VENV_NEWEST)/.installed
# torchtitan 0.3 pins datasets<4.8 (through it huggingface-hub<2), which transformers 5.x cannot
# take: the tests of its adapter get it without dependency resolution, with what its dataloader
# protocol imports (tests/trainer_shim/test_titan.py; it skips where torchtitan is absent).
TORCHTITAN := torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 tyro==1.0.17 spmd_types==0.2.3 einops safetensors docstring-parser
# The GPU image's transformers, older than the main venv's: its arguments move between releases
# (the DSA indexer cache's is `past_key_values` in 5.17, `cache` in 5.25), so the tests that
# touch transformers and TRL run again with it, installed without resolution into a directory
# put first on PYTHONPATH (the rest comes from the main venv). huggingface-hub 2 needs a newer one;
# hub 1.x downloads through httpx (and httpcore), which the main venv's hub 2 does not bring.
GPU_IMAGE_TRANSFORMERS := 5.17.0
GPU_IMAGE_HF_DIR := .venv-gpu-image-hf
HF_TESTS := tests/kernels/test_hf_dsa.py tests/trainer_shim/test_hf_collator.py tests/trainer_shim/test_hf_dataset.py \
	tests/integration/test_hf_trainer.py tests/integration/test_hf_trainer_ddp.py \
	tests/pipeline/test_tokenization.py tests/pipeline/test_tokenizer_source.py
# Type-checked packages (pyproject.toml [tool.mypy] holds the settings).
TYPED := packshard/packers packshard/pipeline packshard/trainer_shim

.PHONY: install demo test test-suite test-gpu-image-hf test-newest lint typecheck format clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	$(BIN)/pip install -q "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python --constraint $(VENV)/constraints.txt -e '.[all,dev]'
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps $(TORCHTITAN)
	touch $@

# No torch pin here: the newest torch the pins allow (a CUDA build; its tests run on the CPU).
# Its uv cache lives in the venv: uv fetched that ~6 GB build again into the shared cache on
# every fresh clone (13 copies, 76 GB, on the development machine), and goes with the venv.
$(STAMP_NEWEST): pyproject.toml Makefile
	@test -n "$(PYTHON_NEWEST)" || { echo "make test-newest needs Python 3.12: put python3.12 on PATH, install it with pyenv, or pass PYTHON_NEWEST=/path/to/python3.12"; exit 1; }
	$(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/pip install -q --upgrade pip uv
	UV_CACHE_DIR=$(VENV_NEWEST)/.uv-cache $(VENV_NEWEST)/bin/uv pip install -q --upgrade --python $(VENV_NEWEST)/bin/python -e '.[all,dev]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/packshard pack --demo --output $(DEMO_OUT) --overwrite

test: lint typecheck test-suite test-gpu-image-hf test-newest

test-suite: $(STAMP)
	$(BIN)/python -m pytest --durations=15

test-gpu-image-hf: $(STAMP)
	rm -rf $(GPU_IMAGE_HF_DIR)
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps --target $(GPU_IMAGE_HF_DIR) "transformers==$(GPU_IMAGE_TRANSFORMERS)" "huggingface-hub>=1.5,<2" "httpx>=0.23,<1" "httpcore>=1,<2"
	PYTHONPATH=$(GPU_IMAGE_HF_DIR) $(BIN)/python -c "import transformers, huggingface_hub; print('gpu image hf: transformers', transformers.__version__, 'huggingface-hub', huggingface_hub.__version__); assert transformers.__version__ == '$(GPU_IMAGE_TRANSFORMERS)'"
	PYTHONPATH=$(GPU_IMAGE_HF_DIR) $(BIN)/python -m pytest -q $(HF_TESTS)

test-newest: $(STAMP_NEWEST)
	$(VENV_NEWEST)/bin/python -c "import numpy, pyarrow, transformers, torch, sys; print('newest:', sys.version.split()[0], 'numpy', numpy.__version__, 'pyarrow', pyarrow.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	$(VENV_NEWEST)/bin/python -m pytest -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy $(TYPED)

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(VENV_NEWEST) $(DEMO_OUT) .pytest_cache .ruff_cache .mypy_cache
