#!/usr/bin/env bash
# Set up .bench-venv: a separate Python 3.11 venv holding DLRover's flash checkpoint,
# so benchmarks/save_load.py can compare against it without the project depending on it.
# torch is installed FIRST with the exact pin (the CPU wheel here); any other spec would
# pull the multi-GB CUDA build. DLRover is then installed without letting it touch torch.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.bench-venv
TORCH=torch==2.13.0
DLROVER="dlrover[torch]==0.6.1"
PY=${PYTHON:-python3.11}

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH"
# Resolve DLRover's dependencies with torch held at the installed version: a constraint
# file makes pip fail rather than silently replace torch.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__)' >"$constraints"
"$VENV/bin/python" -m pip install -q -c "$constraints" "$DLROVER"
# dlrover's flash checkpoint imports grpc (declared only in its k8s extra) and numpy.
"$VENV/bin/python" -m pip install -q -c "$constraints" grpcio "numpy<2"
"$VENV/bin/python" -c 'import torch, dlrover.trainer.torch.flash_checkpoint.ddp as d; print("ok torch", torch.__version__, d.__name__)'
