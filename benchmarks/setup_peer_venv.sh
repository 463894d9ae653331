#!/usr/bin/env bash
# Set up a peer's venv: a separate Python 3.11 venv holding one peer checkpointer, so
# benchmarks/save_load.py can compare against it without the project depending on it.
#
#     benchmarks/setup_peer_venv.sh [dlrover|lmres|tckpt|mlf]     (default: dlrover)
#
#   dlrover  .bench-venv    DLRover 0.6.1's flash checkpoint        (_dlrover_peer.py)
#   lmres    .bench-lmres   lm-resiliency 0.2.0, GEMINI in-memory   (_lmres_peer.py)
#   tckpt    .bench-tckpt   torch-checkpointing 0.1.1 (Meta)        (_tckpt_peer.py)
#   mlf      .bench-mlf     ml-flashpoint 0.0.10 (Google)           (_mlf_peer.py)
#
# ml-flashpoint is an sdist whose built wheel lacks its two C++ extensions, and whose CMake
# clones abseil-cpp from GitHub: this script builds the extensions in the unpacked sdist
# (cmake, g++; Debian: apt-get install cmake g++) and puts its src/ on the venv's path. Where
# GitHub cannot be reached, give a local abseil-cpp tree at tag 20250814.1:
#     ABSEIL_SRC=/path/to/abseil-cpp benchmarks/setup_peer_venv.sh mlf
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
mlf)
    VENV=.bench-mlf
    PACKAGES=(typing-extensions pybind11==3.0.1 ninja)
    CHECK='import ml_flashpoint.adapter.pytorch.memory_storage_writer as m' ;;
*)
    echo "usage: $0 [dlrover|lmres|tckpt|mlf]" >&2
    exit 2 ;;
esac

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH" "$NUMPY"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$VENV/bin/python" -c 'import numpy, torch; print("torch==" + torch.__version__); print("numpy==" + numpy.__version__)' >"$constraints"
"$VENV/bin/python" -m pip install -q -c "$constraints" "${PACKAGES[@]}"
if [ "$PEER" = mlf ]; then
    # the sdist, unpacked under the venv; its extensions built in place (CMake writes them into src/)
    src="$VENV/src/ml_flashpoint-0.0.10"
    if [ ! -d "$src" ]; then
        mkdir -p "$VENV/src"
        "$VENV/bin/python" -m pip download -q --no-deps --no-binary ml-flashpoint -d "$VENV/src" \
            ml-flashpoint==0.0.10 2>/dev/null || true
        test -f "$VENV/src/ml_flashpoint-0.0.10.tar.gz" || "$VENV/bin/python" - "$VENV/src" <<'PYEOF'
import json, sys, urllib.request
meta = json.load(urllib.request.urlopen("https://pypi.org/pypi/ml-flashpoint/0.0.10/json"))
url = next(u["url"] for u in meta["urls"] if u["packagetype"] == "sdist")
urllib.request.urlretrieve(url, f"{sys.argv[1]}/ml_flashpoint-0.0.10.tar.gz")
PYEOF
        tar xzf "$VENV/src/ml_flashpoint-0.0.10.tar.gz" -C "$VENV/src"
    fi
    abseil=()
    if [ -n "${ABSEIL_SRC:-}" ]; then
        abseil=(-DFETCHCONTENT_FULLY_DISCONNECTED=ON "-DFETCHCONTENT_SOURCE_DIR_ABSEIL-CPP=$ABSEIL_SRC")
    fi
    cmake -S "$src" -B "$VENV/src/build" -G Ninja -DCMAKE_MAKE_PROGRAM="$PWD/$VENV/bin/ninja" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_TESTING=OFF "${abseil[@]}" -Dpybind11_DIR="$("$VENV/bin/python" -m pybind11 --cmakedir)" \
        -DPython_EXECUTABLE="$VENV/bin/python" >/dev/null
    cmake --build "$VENV/src/build" -j"$(nproc)" --target buffer_object_ext transfer_service_ext >/dev/null
    echo "$(cd "$src/src" && pwd)" >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ml_flashpoint_src.pth"
fi
"$VENV/bin/python" -c "$CHECK"'; import torch; print("ok torch", torch.__version__, m.__name__)'
