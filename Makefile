# horovod_sparse: the two commands of the README, and the steps behind them.
#   make demo   the main job: a 4-rank training run, dense vs each compressor
#   make test   the whole test suite (unit, then mpirun -np 2/3/4 parallel groups)
SHELL := /bin/bash
PYTHON := $(CURDIR)/.venv/bin/python
NP ?= 4
# Ranks may outnumber cores here: one thread each, and yield while waiting in MPI.
export OMP_NUM_THREADS ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: install test demo clean

# one line per step (full output in results/install.log); V=1 or VERBOSE=1 streams everything;
# GPU=1 (or HOROVOD_SPARSE_GPU=1) installs the GPU flavour: CUDA torch, NCCL in Horovod (docs/gpu.md)
install:
	@VERBOSE=$(or $(V),$(VERBOSE)) HOROVOD_SPARSE_GPU=$(or $(GPU),$(HOROVOD_SPARSE_GPU)) bash scripts/install.sh

test: install
	$(PYTHON) scripts/run_tests.py

demo: install
	$(CURDIR)/.venv/bin/horovodrun -np $(NP) -H localhost:$(NP) \
	    --mpi-args="--oversubscribe --mca mpi_yield_when_idle 1" \
	    $(PYTHON) scripts/demo.py

clean:
	rm -rf .venv results build *.egg-info
