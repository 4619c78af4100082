# Two commands do all set-up on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The small CPU build of torch; override for a CUDA machine, e.g. make TORCH=torch==2.11.0 test
TORCH ?= torch==2.13.0
DEMO_OUT ?= demo_out
STAMP := $(VENV)/.installed

.PHONY: install demo test lint format clean

$(STAMP): pyproject.toml Makefile packshard/packers/_native.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	$(BIN)/pip install -q "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python --constraint $(VENV)/constraints.txt -e '.[all,dev]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/packshard pack --demo --output $(DEMO_OUT) --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .ruff_cache
