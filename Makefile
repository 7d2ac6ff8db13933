# pagedllm: `make demo` and `make test` work on a fresh clone (they create .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Reinstall only when the dependency list changes.
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: setup demo test test-cpu lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch is pinned to 2.13.0 in pyproject.toml: never a bare `torch` (a multi-GB CUDA build).
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(BIN)/python -m pagedllm.entrypoints.demo

test: test-cpu

test-cpu: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .venvs build *.egg-info
