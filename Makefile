# pagedllm: `make demo` and `make test` work on a fresh clone (they create .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Reinstall only when the dependency list changes.
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: setup demo test test-cpu test-gpu test-xpu lint bench clean

# The C++ CPU kernels are built here for this processor (minutes, once; a no-op when cached), not
# silently inside the first `pagedllm serve`. A failed build is not fatal: the CPU backend then
# runs PyTorch ops.
setup: $(STAMP)
	-$(BIN)/python -m pagedllm.backends.cpu.build

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch is pinned to 2.13.0 in pyproject.toml: never a bare `torch` (a multi-GB CUDA build).
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(BIN)/python -m pagedllm.entrypoints.demo

# The whole per-backend matrix (cpu, gpu via the Triton interpreter, xpu via IPEX's CPU build).
test: setup
	bash ci/matrix.sh cpu gpu xpu

test-cpu: setup
	bash ci/matrix.sh cpu

test-gpu: setup
	bash ci/matrix.sh gpu

test-xpu:
	bash ci/matrix.sh xpu

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .venvs build *.egg-info
