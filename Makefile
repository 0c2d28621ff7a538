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
	# the wheels the device's Python 3.12 image lacks, carried as .whl (h200.sh installs them):
	# gguf and xgrammar with theirs, and jsonschema with theirs for tests/gpu/test_overlap.py
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp $(foreach p,$(DEVICE_PLATFORMS),--platform $(p)) -d .whl \
	  $(DEVICE_WHEELS)

DEVICE_PLATFORMS := manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
DEVICE_WHEELS := gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 jsonschema==4.26.0 \
  attrs==26.1.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1

clean:
	rm -rf $(VENV) build *.egg-info
