#!/usr/bin/env bash
# Builds a Horovod wheel (MPI and Gloo controllers, PyTorch + TensorFlow ops) from the PyPI sdist and
# prints its path. Gloo is what `horovodrun --gloo`, elastic Horovod, Spark and Ray launch over.
# Under HOROVOD_SPARSE_GPU=1 (scripts/versions.sh: the nccl-mpi-gloo flavour) it also builds NCCL
# operations for GPU tensors, with the CUDA toolkit of CUDA_HOME or nvcc on PATH and pip's NCCL.
#
# Horovod 0.28.1, the last release, does not build as published against torch 2.13 and
# TensorFlow 2.21. Two changes make it build:
#   1. C++17 instead of C++14 (torch >= 2.1 headers need it; upstream PR #3998 on master);
#   2. drop horovod/tensorflow/xla_mpi_ops.cc from TF_SOURCES: it includes XLA headers whose
#      dependencies the TF wheel does not ship, and serves only the opt-in XLA ops.
# The wheel is cached outside the repo, keyed by the Horovod, torch and TensorFlow versions,
# so later installs (and fresh clones on the same machine) skip the ~8 minute build.
# Usage: scripts/build_horovod.sh   (uses .venv/bin/python; all logs go to stderr)
#        scripts/build_horovod.sh --cached   only prints the cached wheel's path; fails when there is none
#        scripts/build_horovod.sh --print-plan   prints the flavour, the cache folder and the build's
#            settings, then exits: nothing is downloaded or built (tests/unit/test_install_flavour.py)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/versions.sh
PY=${PYTHON:-.venv/bin/python}

cache=${HOROVOD_SPARSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod_sparse}/horovod-$HOROVOD_VERSION-$HOROVOD_FLAVOUR-torch$TORCH_VERSION-tf$TF_VERSION
if gpu_flavour; then
    # checked first, before anything is made or downloaded: without them no GPU build can follow
    cuda=$(cuda_home)
    nccl=$(nccl_home "$PY")
fi
work='<build folder>'   # (named only, for --print-plan)
if [ "${1-}" != --print-plan ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
settings=(HOROVOD_WITH_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1
          HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI)
if gpu_flavour; then
    # pip's NCCL has no unversioned libnccl.so, the name CMake links: a folder of one link gives it
    # one; the run-time path makes Horovod load the library torch loads, without LD_LIBRARY_PATH
    settings+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME="$cuda" HOROVOD_NCCL_HOME="$nccl"
               HOROVOD_NCCL_LINK=SHARED HOROVOD_NCCL_LIB="$work/nccl-lib"
               LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,-rpath,$nccl/lib")
fi
if [ "${1-}" = --print-plan ]; then
    echo "flavour: $HOROVOD_FLAVOUR"
    echo "cache: $cache"
    printf '%s\n' "${settings[@]}"
    exit 0
fi
if ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
    ls "$cache"/horovod-*.whl | head -n1
    exit 0
fi
[ "${1-}" != --cached ] || exit 1

echo "[build_horovod] downloading horovod==$HOROVOD_VERSION sdist" >&2
$PY -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work" >&2
tar -xzf "$work"/horovod-$HOROVOD_VERSION.tar.gz -C "$work"
src=$work/horovod-$HOROVOD_VERSION

echo "[build_horovod] patching: C++17, no xla_mpi_ops.cc" >&2
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" || { echo "patch 1 did not apply" >&2; exit 1; }
sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"

echo "[build_horovod] building (about 8 minutes on 2 cores)" >&2
$PY -m pip install -q cmake packaging psutil pyyaml cloudpickle >&2
mkdir -p "$cache"
if gpu_flavour; then
    mkdir -p "$work/nccl-lib"
    ln -s "$nccl/lib/libnccl.so.2" "$work/nccl-lib/libnccl.so"
fi
echo "[build_horovod] settings: ${settings[*]}" >&2
env "${settings[@]}" \
    $PY -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$src" >&2
cp "$work"/dist/horovod-*.whl "$cache"/
ls "$cache"/horovod-*.whl | head -n1
