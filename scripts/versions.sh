# Pinned versions and the install's flavour, shared by scripts/install.sh, scripts/build_horovod.sh
# and scripts/build_torchvision.sh.
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
# the torchvision release that pairs with TORCH_VERSION (built without its compiled ops)
TORCHVISION_VERSION=0.28.0
TF_VERSION=2.21.0
TF_KERAS_VERSION=2.21.0
MPI4PY_VERSION=4.1.2
# the compiled CPU kernels (horovod_sparse/ops/cpu); without it the numpy path runs
NUMBA_VERSION=0.68.1

# The flavour, the one switch HOROVOD_SPARSE_GPU=1 (make install GPU=1) decides:
#   mpi-gloo       torch and tensorflow-cpu; Horovod with MPI and Gloo, MPI operations on the CPU
#   nccl-mpi-gloo  torch from PyPI's default (CUDA) wheel, tensorflow, pip's NCCL; Horovod as above
#                  plus HOROVOD_GPU_OPERATIONS=NCCL, so GPU tensors are reduced on the GPU
# It is part of the cached wheel's key and of the install's stamp, so neither flavour reuses the other's
# build. NCCL_PACKAGE is the NCCL that torch $TORCH_VERSION's CUDA wheel itself depends on (CUDA 13):
# Horovod then links the library torch loads.
case ${HOROVOD_SPARSE_GPU:-0} in
    '' | 0) HOROVOD_FLAVOUR=mpi-gloo TF_PACKAGE=tensorflow-cpu GPU_PACKAGES=() ;;
    1) HOROVOD_FLAVOUR=nccl-mpi-gloo TF_PACKAGE=tensorflow GPU_PACKAGES=(nvidia-nccl-cu13) ;;
    *) echo "error: HOROVOD_SPARSE_GPU is '$HOROVOD_SPARSE_GPU'; it must be 1 (the GPU install) or 0" >&2; exit 2 ;;
esac
gpu_flavour() { [ "$HOROVOD_FLAVOUR" = nccl-mpi-gloo ]; }

# The CUDA toolkit the GPU build compiles with: $CUDA_HOME if set, else the nvcc on PATH's. Prints its
# root; fails naming what is missing (install.sh checks it before anything is downloaded). nvcc says
# where it lives (TOP in its dry run): the one on PATH is often a link or a wrapper script elsewhere.
cuda_home() {
    local nvcc top
    if [ -n "${CUDA_HOME:-}" ]; then nvcc=$CUDA_HOME/bin/nvcc; else nvcc=$(command -v nvcc || true); fi
    if [ -z "$nvcc" ] || [ ! -x "$nvcc" ]; then
        echo "error: the GPU install (HOROVOD_SPARSE_GPU=1) needs the CUDA toolkit's compiler, nvcc, and" \
             "found none (${CUDA_HOME:+not $CUDA_HOME/bin/nvcc from CUDA_HOME, }not on PATH)." \
             "Install the CUDA toolkit (13.x, the CUDA of torch $TORCH_VERSION's wheel) and put its bin/ on" \
             "PATH or set CUDA_HOME to it (e.g. export CUDA_HOME=/usr/local/cuda)" >&2
        return 1
    fi
    if [ -n "${CUDA_HOME:-}" ]; then echo "$CUDA_HOME"; return 0; fi
    top=$("$nvcc" -dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1 || true)
    if [ -n "$top" ] && [ -d "$top" ]; then (cd "$top" && pwd -P); else dirname "$(dirname "$nvcc")"; fi
}

# The folder of pip's NCCL package (include/nccl.h, lib/libnccl.so.2) in the Python $1.
nccl_home() {
    local dir
    dir=$("$1" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
    if [ -z "$dir" ] || [ ! -f "$dir/include/nccl.h" ] || [ ! -e "$dir/lib/libnccl.so.2" ]; then
        echo "error: no NCCL in $1: the GPU build takes NCCL's headers and library from pip's" \
             "${GPU_PACKAGES[*]} (nvidia/nccl/include/nccl.h, lib/libnccl.so.2), which is not installed" \
             "there; scripts/install.sh installs it under HOROVOD_SPARSE_GPU=1" >&2
        return 1
    fi
    echo "$dir"
}
