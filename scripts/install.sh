#!/usr/bin/env bash
# Installs everything horovod_sparse needs, idempotently:
#   1. Open MPI from Debian (when mpirun is missing),
#   2. a virtualenv at .venv with pinned torch / TensorFlow / mpi4py / numba / test tools,
#   3. Horovod 0.28.1 built from its sdist (patched, cached wheel; scripts/build_horovod.sh),
#   4. torchvision for the workloads' ResNet-18, without its compiled ops (cached wheel;
#      scripts/build_torchvision.sh says why),
#   5. this package in editable mode,
# then checks that `horovodrun --check-build` lists MPI, PyTorch and TensorFlow.
# A second run with a warm cache takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/versions.sh

log() { printf '\033[1m[install]\033[0m %s\n' "$*"; }

# -- 1. Open MPI -------------------------------------------------------------
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "error: Open MPI is missing and this is not root." >&2
        echo "       install it first:  sudo apt-get install -y openmpi-bin libopenmpi-dev" >&2
        exit 1
    fi
    log "installing Open MPI (openmpi-bin libopenmpi-dev)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

# -- 2. virtualenv -----------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
    log "creating .venv"
    python3 -m venv .venv
fi
PY=.venv/bin/python
stamp=.venv/.deps-$(printf '%s' "$TORCH_VERSION $TF_VERSION $TF_KERAS_VERSION $MPI4PY_VERSION $NUMBA_VERSION $(cat requirements-dev.txt)" | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
    log "installing pinned dependencies into .venv"
    $PY -m pip install -q --upgrade pip setuptools wheel
    $PY -m pip install -q "torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" \
        "tf-keras==$TF_KERAS_VERSION" "mpi4py==$MPI4PY_VERSION" \
        "numba==$NUMBA_VERSION" -r requirements-dev.txt
    touch "$stamp"
fi

# -- 3. Horovod --------------------------------------------------------------
if ! $PY -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null; then
    wheel=$(scripts/build_horovod.sh)
    log "installing $wheel"
    $PY -m pip install -q --no-deps --force-reinstall "$wheel"
    $PY -m pip install -q cloudpickle psutil pyyaml packaging
fi

# -- 4. torchvision ----------------------------------------------------------
# (the metadata check is the stamp: no torch import, so a second run stays fast)
tv_want=$TORCHVISION_VERSION+noops
if ! $PY -c "import importlib.metadata as m, sys; sys.exit(m.version('torchvision') != '$tv_want')" 2>/dev/null; then
    wheel=$(scripts/build_torchvision.sh)
    log "installing $wheel"
    # its dependencies (torch==$TORCH_VERSION, numpy, pillow) are already here: torch's +cpu build satisfies ==
    $PY -m pip install -q "$wheel"
fi

# -- 5. this package ---------------------------------------------------------
# (checked from / so that the checkout itself on sys.path does not count as installed;
# setup.py's hash in the stamp reinstalls when its entry points or package data change)
pkg_stamp=.venv/.pkg-$(sha1sum setup.py | cut -c1-12)
if [ ! -f "$pkg_stamp" ] || ! (cd / && "$OLDPWD/$PY" -c "import horovod_sparse") 2>/dev/null; then
    log "installing horovod_sparse (editable)"
    $PY -m pip install -q --no-deps --no-build-isolation -e .
    rm -f .venv/.pkg-*
    touch "$pkg_stamp"
fi

# -- check -------------------------------------------------------------------
check=$(.venv/bin/horovodrun --check-build)
for want in "\[X\] MPI" "\[X\] PyTorch" "\[X\] TensorFlow"; do
    if ! grep -q "$want" <<<"$check"; then
        echo "$check" >&2
        echo "error: horovodrun --check-build does not list ${want//\\/} as available" >&2
        exit 1
    fi
done
$PY -c "import torchvision.models; torchvision.models.resnet18(num_classes=10)" || {
    echo "error: torchvision does not import with this torch" >&2; exit 1; }
log "ok: Horovod $HOROVOD_VERSION with MPI, PyTorch and TensorFlow, torchvision $tv_want in .venv"
