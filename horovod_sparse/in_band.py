"""What the PyTorch, TensorFlow and numpy frontends share for the in-band compressors
(``none``, ``fp16``, ``randomk``: payloads Horovod's own allreduce sums): binding a
compressor's math to one framework's ops and to the per-tensor state.

A frontend subclass decides only how a gradient is identified (its slot key), since
Horovod's ``compress(tensor)`` carries no name; everything else is here. The out-of-band
compressors' counterpart is :mod:`horovod_sparse.out_of_band`.
"""
from horovod_sparse import registry, switches
from horovod_sparse.agreement import check_same_on_every_rank, communicator_of, raise_on_every_rank
from horovod_sparse.compressors.base import WIRE_DTYPE
from horovod_sparse.horovod_frames import caller_process_set
from horovod_sparse.nonfinite import check_nonfinite
from horovod_sparse.out_of_band import refuse_what_the_transport_cannot_carry
from horovod_sparse.slots import CompressorState


#: what ``nonfinite="raise"`` says (:func:`horovod_sparse.nonfinite.raise_with_hint` adds the remedy)
NONFINITE_MESSAGE = ("a gradient reduced by Horovod's allreduce holds inf or NaN: some rank's gradient (with its "
                     "residual) overflowed this step, as a loss scaler's does; no compressor state changed")


class InBandCompressorBase:
    """A framework-free compressor bound to ``ops``, with its state.

    Attributes:
        algorithm: the :class:`~horovod_sparse.compressors.Compressor` doing the math.
        state: the :class:`~horovod_sparse.slots.CompressorState` (one slot per gradient).
        nonfinite: what ``decompress`` does with a reduced payload that holds inf or NaN (some
            rank's gradient overflowed, :mod:`horovod_sparse.nonfinite`): ``"propagate"``
            returns it non-finite (NaN for ``randomk``), as Horovod's own allreduce does, so
            a loss scaler skips the step; ``"raise"`` raises
            :class:`~horovod_sparse.exchange.NonFiniteGradientError` (every rank sees the same
            payload, so every rank raises). Either way the step leaves ``randomk``'s state as it
            was (:mod:`horovod_sparse.slots`).
    """

    ops = None  # an ArrayOps instance, set by each frontend

    def __init__(self, algorithm, nonfinite="propagate"):
        self.algorithm = algorithm
        self.nonfinite = check_nonfinite(nonfinite)
        self.state = CompressorState()
        self._pending = {}  # slot key -> (residual, step) loaded before the slot existed
        self._agreed = False  # parameters checked across ranks (once, at the first compress)
        self._unsettled = False  # a step was decompressed and is not yet settled (horovod_sparse.slots)

    @classmethod
    def from_spec(cls, spec, **params):
        """Build from a spec string, e.g. ``from_spec("randomk:density=0.01", nonfinite="raise")``."""
        name, merged = registry.parse_spec(spec)
        merged.update(params)
        nonfinite = merged.pop("nonfinite", "propagate")
        return cls(registry.create(name, **merged), nonfinite=nonfinite)

    def compress_slot(self, tensor, key, in_place=True):
        """Compress ``tensor`` as the gradient identified by ``key``; returns ``(payload, ctx)``.

        Buffers (where the framework's tensors are mutable, :mod:`horovod_sparse.ops.torch_ops`):
        the payload may be the slot's wire buffer, valid until the same gradient's next
        ``compress`` (Horovod reduces it in place and hands it to ``decompress`` before then);
        with ``in_place``, ``decompress`` writes its result into ``tensor`` itself and returns
        it, as Horovod's optimizer makes the result the gradient. Without it (a caller that
        keeps ``tensor``: ``hvd.allreduce``) the result is a new tensor. Either way the result
        is never a buffer of the compressor's, which a later call would overwrite.
        """
        ops = self.ops
        if not self._agreed:
            self.agree_across_ranks()
            self._agreed = True
        if key is None:  # no identity for this gradient: only stateless compressors can run
            return self.algorithm.compress(ops, tensor, None)  # (no slot: no buffers, nothing in place)
        if self._unsettled:  # the first compress of a step: the previous one is complete
            self.settle()
        slot = self.slot_for(tensor, key)
        payload, ctx = self.algorithm.compress(ops, tensor, slot, in_place=in_place)
        slot.payload_nbytes = ops.nbytes(payload)
        slot.dense_nbytes = ops.nbytes(tensor)
        return payload, ctx

    def slot_for(self, tensor, key):
        """The slot of the gradient ``tensor`` known by ``key``, made (and its state initialised,
        from a loaded checkpoint where there is one) on first use."""
        ops, dtype = self.ops, self.ops.dtype_name(tensor)
        # A stateless compressor has nothing to mix up when the order of gradients changes
        # (a parameter without a gradient this step, synchronize() then step()): its slot
        # only counts bytes, so it is replaced instead of checked.
        slot = self.state.get(key, ops.shape(tensor), dtype, replace=not self.algorithm.stateful)
        if self.algorithm.stateful and slot.residual is None:
            ops.init_slot(slot, WIRE_DTYPE.get(dtype, dtype), like=tensor, saved=self._pending.pop(key, None))
        return slot

    def settle(self):
        """Settle the step last decompressed (:mod:`horovod_sparse.slots`): if any of its
        gradients overflowed, roll back those that committed. Runs at the next step's first
        ``compress`` and before the state is saved or loaded."""
        self._unsettled = False
        if self.algorithm.stateful and self.settles_eagerly():
            self.ops.settle([slot for slot in self.state.slots.values() if slot.residual is not None])

    def settles_eagerly(self):
        """Whether :meth:`settle` runs now, in Python (not in a TensorFlow graph being traced)."""
        return True

    def agree_across_ranks(self):
        """Check once, on the ranks of the caller's process set, that all pass this compressor
        with valid environment switches, and that the launch can carry it (a stateful one is
        refused under elastic Horovod). These ride Horovod's allreduce: no exchange header of
        their own checks the switches (:mod:`horovod_sparse.switches`)."""
        comm = communicator_of(caller_process_set())
        refuse_what_the_transport_cannot_carry(comm, [self.algorithm])
        check_same_on_every_rank(self.algorithm.spec, comm, "compressors or parameters")
        raise_on_every_rank(comm, switches.problem_here())

    def decompress(self, tensor, ctx):
        """The gradient from a reduced payload (Horovod's ``decompress``): where the payload is
        not finite, non-finite with no state changed, or the error with ``nonfinite="raise"``."""
        result = self.algorithm.decompress(self.ops, tensor, ctx)
        if self.algorithm.stateful and ctx is not None:
            self._unsettled = self.settles_eagerly()
        if self.nonfinite == "raise" and ctx is not None and self.ops.is_float(tensor):
            result = self.ops.raise_unless_finite(self.ops.all_finite(tensor), NONFINITE_MESSAGE, result)
        return result

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self):
        """Residuals and step counters as ``{slot key: {"residual": ndarray, "step": int}}``.

        Save it beside the optimizer's state (``torch.save({"optimizer": opt.state_dict(),
        "compression": compression.state_dict()}, path)``); each rank saves its own,
        since residuals differ across ranks. A step that overflowed leaves no trace in it.
        """
        self.settle()
        out = {}
        for key, slot in self.state.slots.items():
            if slot.residual is None:
                continue
            residual, step = self.ops.slot_to_numpy(slot)
            out[key] = {"residual": residual, "step": step}
        return out

    def load_state_dict(self, state_dict):
        """Restore what :meth:`state_dict` returned; slots not yet created are restored on first use."""
        self.settle()
        for key, entry in state_dict.items():
            slot = self.state.slots.get(key)
            if slot is not None and slot.residual is not None:
                self.ops.load_slot(slot, entry["residual"], entry["step"])
            else:
                self._pending[key] = (entry["residual"], entry["step"])

    # -- accounting --------------------------------------------------------------------
    @property
    def payload_bytes_per_step(self):
        """Bytes this rank hands to the allreduce per step, summed over gradients."""
        return self.state.payload_bytes_per_step

    @property
    def dense_bytes_per_step(self):
        """Bytes the same gradients take uncompressed."""
        return self.state.dense_bytes_per_step

    def bytes_sent_per_step(self, world_size):
        """Bytes this rank sends per step if Horovod's allreduce is a ring: 2(P-1)/P x payload."""
        from horovod_sparse.out_of_band import ring_bytes
        return ring_bytes(self.payload_bytes_per_step, world_size)

    def __repr__(self):
        return f"{type(self).__name__}({self.algorithm.spec!r})"
