#!/bin/bash
# Session 8, call 3: two diagnostics. pdl_chain.py: one-row layer chains (cuBLAS vs Triton GEMV,
# with and without programmatic dependent launch) for the batch-1 gap; attn_b256.py: decode
# attention of the 256-request run over tile configs, for the 15x gap.
export PYTHONPATH=$PWD SPECSERVE_TOKENIZER=$PWD/.devcarry/tokenizer SPECSERVE_CACHE=$PWD/.devcarry/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
/usr/bin/time -f "%e s" timeout 260 python3 results/h200/diag/pdl_chain.py 2>&1 | tail -14
/usr/bin/time -f "%e s" timeout 200 python3 results/h200/diag/attn_b256.py 2>&1 | tail -6
