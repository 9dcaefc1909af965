"""Counted, not guessed: the torch ops, host synchronisations and host transfers of a step.

On a GPU every aten op is (at least) a kernel launch, every op whose result the host must
read (a scalar, or an output whose shape depends on the data) stalls the host until the
device has caught up, and every crossing to the host is a copy. :class:`DeviceCounts`
counts all three while it is active, on any device: under the device path
(``HOROVOD_SPARSE_KERNELS=torch``) a CPU tensor runs the ops a CUDA tensor runs, so the CPU
counts are the GPU's (the budgets: docs/cuda.md, "Counted on the CPU";
``tests/parallel/torch/test_device_counts.py``).

Ops are counted by a ``TorchDispatchMode`` (per thread, as torch's modes are: what a channel
thread runs is not seen). ``.tolist()``, ``.numpy()`` and ``.cpu()`` on a CPU tensor never reach
the dispatcher, so crossings are counted where they happen, in
:mod:`horovod_sparse.ops.host` (:data:`~horovod_sparse.ops.host.HOST_TRAFFIC`), and read
here as the difference over the active blocks.

Example::

    counts = DeviceCounts()
    with counts:                 # may be entered again: the counts add up
        pipe.step(grad)
    counts.summary()             # {"ops": 412, "not_views": 230, "syncs": 9, "transfers_out": 1, ...}
"""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from horovod_sparse.ops.host import HOST_TRAFFIC

#: aten ops after which the host must wait for the device: a value read by the host
#: (``.item()``, ``int(t)``, ``bool(t)``, ``torch.equal``) or an output whose shape depends on
#: the data (the allocation needs the count first)
SYNC_OPS = (
    "_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "equal",                # torch.equal returns a Python bool
    "nonzero",              # and what decomposes to it: argwhere, t[mask], index_put_ with a mask
    "masked_select",
    "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "repeat_interleave",    # repeats given as a tensor
    "bincount",             # length max(t) + 1
    "_to_sparse", "to_sparse",  # nnz
)
#: aten ops that synchronise when indexed by a boolean mask (``t[mask]``, ``t[mask] = v``: the
#: kernel finds the mask's nonzeros, below the dispatcher)
MASK_INDEXED_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")


def _masked(args):
    indices = args[1] if len(args) > 1 else ()
    return any(getattr(i, "dtype", None) in (torch.bool, torch.uint8) for i in indices or ())


class _Mode(TorchDispatchMode):
    def __init__(self, ops, views, syncs):
        super().__init__()
        self.ops, self.views, self.syncs = ops, views, syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if func.is_view:  # detach, view, slice...: a new header on the same memory, no kernel
            self.views[name] += 1
        if name in SYNC_OPS or (name in MASK_INDEXED_OPS and _masked(args)):
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))


class DeviceCounts:
    """Counts of the blocks run inside ``with counts:`` (re-entered blocks add up):
    ``ops`` (aten op name -> dispatches), ``views`` and ``sync_ops`` (those of them that are
    views, that synchronised) and the host traffic's counters
    (:meth:`~horovod_sparse.ops.host.HostTraffic.snapshot`); :meth:`summary` gives the totals."""

    def __init__(self):
        self.ops, self.views, self.sync_ops = collections.Counter(), collections.Counter(), collections.Counter()
        self.host = collections.Counter()
        self._stack = []

    def __enter__(self):
        mode = _Mode(self.ops, self.views, self.sync_ops)
        self._stack.append((mode, HOST_TRAFFIC.snapshot()))
        mode.__enter__()
        return self

    def __exit__(self, *exc):
        mode, before = self._stack.pop()
        mode.__exit__(*exc)
        after = HOST_TRAFFIC.snapshot()
        self.host.update({key: after[key] - before[key] for key in after})
        return False

    def syncs(self):
        """Host synchronisations: the dispatched :data:`SYNC_OPS`, the :data:`MASK_INDEXED_OPS`
        given a mask, and the host's reads (:func:`~horovod_sparse.ops.host.to_list`)."""
        return sum(self.sync_ops.values()) + self.host["reads"]

    def summary(self):
        """``{"ops", "not_views", "syncs", "transfers_out", "bytes_out", "transfers_in", "bytes_in",
        "handed_out", "handed_in"}`` (``not_views``: the ops that are not views, the ones that can
        launch a kernel; ``handed_*``: device buffers given to MPI as they are, and received)."""
        ops = sum(self.ops.values())
        return {"ops": ops, "not_views": ops - sum(self.views.values()), "syncs": self.syncs(),
                **{key: self.host[key] for key in ("transfers_out", "bytes_out", "transfers_in", "bytes_in",
                                                   "handed_out", "handed_in")}}
