"""Framework-free sparse allreduce over mpi4py (numpy buffers, uppercase calls only).

    from horovod_sparse.exchange import SparseAllreduce
    with SparseAllreduce(n, algorithm="oktopk", k=k) as ex:
        res = ex.allreduce(indices, values)   # res.indices, res.values, res.selected

Modules, in data-flow order: validation (local checks + agreement), regions,
split_reduce (phase 1), selection (exact global top-k), balance (phase 2),
tree (gTop-k), the algorithms (dense, allgather, oktopk, gtopk, dsa), comm
(the only MPI calls, counted into Traffic), engine (the public class and its result).
"""
from .comm import Traffic
from .engine import ALGORITHMS, ExchangeResult, SparseAllreduce
from horovod_sparse.errors import ExchangeError, NonFiniteGradientError
from .sparse_ops import intersect_sorted, mask_in_sorted

__all__ = ["SparseAllreduce", "ExchangeResult", "Traffic", "ALGORITHMS", "ExchangeError", "NonFiniteGradientError",
           "intersect_sorted", "mask_in_sorted"]
