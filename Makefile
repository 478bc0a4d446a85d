# The two commands a fresh clone needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SWAP_DIR ?= swap

.PHONY: test demo lint format bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch 2.13.0's CPU wheel lies on these machines; pin it so pip never pulls a CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev,bench,hf,lightning,compact]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m mypy tierswap
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -m "not slow" -q

demo: $(STAMP)
	$(BIN)/python examples/demo.py --swap-dir $(SWAP_DIR)

lint:
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python bench/io_throughput.py

clean:
	rm -rf $(VENV) $(SWAP_DIR) .pytest_cache .ruff_cache
