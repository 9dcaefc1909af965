# Pinned versions shared by scripts/install.sh, scripts/build_horovod.sh and scripts/build_torchvision.sh.
HOROVOD_VERSION=0.28.1
# what the build holds (scripts/build_horovod.sh): part of the cached wheel's key and of the install's stamp
HOROVOD_FLAVOUR=mpi-gloo
TORCH_VERSION=2.13.0
# the torchvision release that pairs with TORCH_VERSION (built without its compiled ops)
TORCHVISION_VERSION=0.28.0
TF_VERSION=2.21.0
TF_KERAS_VERSION=2.21.0
MPI4PY_VERSION=4.1.2
# the compiled CPU kernels (horovod_sparse/ops/cpu); without it the numpy path runs
NUMBA_VERSION=0.68.1
