# Two entry points: `make run` (install + generate on the default model), `make test` (install + tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a haiku about speculative decoding.

.PHONY: install run test lint format bench clean devcarry

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch, pinned (an unpinned torch pulls several GB of CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# the CPU kernels (attention, GEMM, elementwise ops, the layer stack that calls them),
	# compiled into $$SPECSERVE_CACHE/kernels (else built on first use; without a compiler: one
	# warning each, the torch path)
	$(PY) -c "from specserve.ops import cpu_layer; cpu_layer.kernels()"
	touch $@

run: install
	$(VENV)/bin/specserve generate "$(PROMPT)" --max-tokens 128

lint: install
	$(VENV)/bin/ruff check specserve tests tools
	$(VENV)/bin/ruff format --check specserve tests tools

format: install
	$(VENV)/bin/ruff format specserve tests tools
	$(VENV)/bin/ruff check --fix specserve tests tools

# pytest exits 5 when no test ran: that fails the target like any other failure
test: install lint
	$(VENV)/bin/python -m pytest -q -m "not gpu" -p no:cacheprovider

# What GPU runs carry to the device machine (tokenizer + ShareGPT pairs; see the module).
# GPT_FAST=CLONE also copies gpt-fast's model.py (h200.sh anchor) from a clone of it.
devcarry: install
	$(PY) tools/devcarry.py $(if $(GPT_FAST),--gpt-fast $(GPT_FAST))
	grep -qx '.devcarry' .git/info/exclude 2>/dev/null || echo .devcarry >> .git/info/exclude

clean:
	rm -rf $(VENV) build *.egg-info
