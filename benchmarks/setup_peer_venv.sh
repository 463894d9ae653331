#!/usr/bin/env bash
# Set up a peer's venv: a separate Python 3.11 venv holding one peer checkpointer, so
# benchmarks/save_load.py can compare against it without the project depending on it.
#
#     benchmarks/setup_peer_venv.sh [dlrover|lmres|tckpt]     (default: dlrover)
#
#   dlrover  .bench-venv    DLRover 0.6.1's flash checkpoint        (_dlrover_peer.py)
#   lmres    .bench-lmres   lm-resiliency 0.2.0, GEMINI in-memory   (_lmres_peer.py)
#   tckpt    .bench-tckpt   torch-checkpointing 0.1.1 (Meta)        (_tckpt_peer.py)
#
# torch is installed FIRST with the exact pin of constraints.txt (the CPU wheel here); any
# other spec would pull the multi-GB CUDA build. The peer is then installed under a constraint
# file that holds torch at the installed version: pip fails rather than silently replace it
# (the peer's other dependencies are its own, not the test venv's pins).
set -euo pipefail
cd "$(dirname "$0")/.."

PEER=${1:-dlrover}
TORCH=$(grep -m1 '^torch==' constraints.txt)
NUMPY=$(grep -m1 '^numpy==' constraints.txt)
PY=${PYTHON:-python3.11}

case "$PEER" in
dlrover)
    VENV=.bench-venv
    # dlrover's flash checkpoint imports grpc (declared only in its k8s extra).
    PACKAGES=("dlrover[torch]==0.6.1" grpcio)
    CHECK='import dlrover.trainer.torch.flash_checkpoint.ddp as m' ;;
lmres)
    VENV=.bench-lmres
    PACKAGES=(lm-resiliency==0.2.0)
    CHECK='import lm_resiliency.checkpointing as m' ;;
tckpt)
    VENV=.bench-tckpt
    PACKAGES=(torch-checkpointing==0.1.1)
    CHECK='import torch_checkpointing as m' ;;
*)
    echo "usage: $0 [dlrover|lmres|tckpt]" >&2
    exit 2 ;;
esac

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH" "$NUMPY"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$VENV/bin/python" -c 'import numpy, torch; print("torch==" + torch.__version__); print("numpy==" + numpy.__version__)' >"$constraints"
"$VENV/bin/python" -m pip install -q -c "$constraints" "${PACKAGES[@]}"
"$VENV/bin/python" -c "$CHECK"'; import torch; print("ok torch", torch.__version__, m.__name__)'
