#!/usr/bin/env bash
# Builds a Horovod wheel (MPI and Gloo controllers, PyTorch + TensorFlow ops) from the PyPI sdist and
# prints its path. Gloo is what `horovodrun --gloo`, elastic Horovod, Spark and Ray launch over.
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
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/versions.sh
PY=${PYTHON:-.venv/bin/python}

cache=${HOROVOD_SPARSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod_sparse}/horovod-$HOROVOD_VERSION-$HOROVOD_FLAVOUR-torch$TORCH_VERSION-tf$TF_VERSION
if ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
    ls "$cache"/horovod-*.whl | head -n1
    exit 0
fi
[ "${1-}" != --cached ] || exit 1

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
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
HOROVOD_WITH_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 \
HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
    $PY -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$src" >&2
cp "$work"/dist/horovod-*.whl "$cache"/
ls "$cache"/horovod-*.whl | head -n1
