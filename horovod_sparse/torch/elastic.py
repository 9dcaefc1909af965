"""Elastic Horovod: a compressor's state in ``hvd.elastic.TorchState``, through commits,
restores and changes of world size.

Elastic Horovod (``horovodrun --min-np/--max-np --host-discovery-script``) re-forms the world
whenever workers come or go: it restores the last commit (after a failure), shuts Horovod down,
initialises it again with the new ranks and syncs the state from rank 0. A compressor's
state cannot simply be broadcast: residuals belong to their ranks. Passed to the state as a
keyword, as a model and an optimizer are, the compressor gets a
:class:`CompressionStateHandler` (registered in Horovod's handler registry when
:mod:`horovod_sparse.torch` is imported), which does:

1. ``commit()`` (``save``): a copy of this rank's ``state_dict()``, and the world it was
   taken in;
2. ``restore()``: that copy back into the compressor;
3. ``sync()``, after every (re-)initialisation, and at the first step in a smaller world
   (elastic Horovod skips its sync where hosts were only removed): the ranks gather whether
   each has committed and in what world (one Horovod allgather of two int64 per rank) and
   agree on what carries over:

   * the same world (every rank committed in a world of this size): the whole state, so
     the job goes on bit for bit as if nothing had happened;
   * a new world: each surviving rank keeps its own gradients' residuals (and velocities,
     momenta: every per-element field, by parameter name), a joining rank starts them at
     zero, and the residuals of departed ranks are lost: that gradient mass never reaches
     the model. The step counters (warm-up, exact steps) and ``auto``'s decision (phase,
     plan, trials) continue from the first surviving rank's, broadcast as
     :mod:`~horovod_sparse.state_format` bytes (no pickle). Everything that depends on the
     world (the exchange's call counters and operation names, the size P, server residuals
     and regions, PowerSGD's warm-start Q's, the carried thresholds) starts afresh,
     identically on every rank;

   then the compressor makes its exchanges again on the new world's ranks at its next step
   (:meth:`~horovod_sparse.torch.TorchOutOfBandCompressor.rejoin`). What happened is
   ``compression.elastic_report`` (an :class:`ElasticReport`, the same on every rank) and a
   warning on the ``horovod_sparse.elastic`` logger on rank 0.

Under elastic Horovod a compressor that keeps state and is in no elastic state is refused
at its first step on every rank (:data:`horovod_sparse.out_of_band.ELASTIC_MESSAGE`); so is the
in-band ``randomk``, which is not carried yet.

Example::

    compression = hvds.Compression.from_spec("topk:density=0.01")
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, compression=compression, epoch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()
"""
import copy
import logging
from dataclasses import dataclass

import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch.elastic import state as horovod_state

from horovod_sparse import state_format, world
from horovod_sparse.layout_pipeline import PIPELINE_KEY
from horovod_sparse.torch.auto import TorchAutoCompressor
from horovod_sparse.torch.out_of_band import STEPS_KEY, TorchOutOfBandCompressor

log = logging.getLogger("horovod_sparse.elastic")


@dataclass(frozen=True)
class ElasticReport:
    """What the last change of world carried over, the same on every rank.

    size_before, size : the world's size at the last commit and now.
    departed : ranks whose residuals were lost (in the old world, not in the new one).
    joined : ranks that started with zero residuals.
    step : the step counter every rank goes on from.
    """

    size_before: int
    size: int
    departed: int
    joined: int
    step: int

    def __str__(self):
        return (f"world of {self.size_before} -> {self.size} ranks: the residuals of {self.departed} departed "
                f"rank(s) are lost, {self.joined} joined rank(s) start at zero, surviving ranks keep their own; "
                f"steps go on from {self.step}; the exchanges start afresh on the new ranks")


def shared_part(state):
    """What every rank takes from one surviving rank's ``state`` (a compressor's ``state_dict()``)
    in a new world: the step counters, and ``auto``'s decision (its phase, plan, trials, step)
    with each candidate's counters. The rest of the whole-buffer state starts afresh."""
    if "auto" in state:
        return {"auto": state["auto"],
                "candidates": {spec: shared_part(part) for spec, part in state.get("candidates", {}).items()}}
    shared = {PIPELINE_KEY: {"step": int((state.get(PIPELINE_KEY) or {}).get("step", 0))}}
    if STEPS_KEY in state:
        shared[STEPS_KEY] = {"step": int(state[STEPS_KEY].get("step", 0))}
    return shared


def own_part(state):
    """What stays with its rank in a new world: each gradient's per-element fields (residuals,
    velocities, momenta) by name; ``auto``'s per candidate, and the residuals it left behind."""
    if "auto" in state:
        return {"candidates": {spec: own_part(part) for spec, part in state.get("candidates", {}).items()},
                "drain": dict(state.get("drain", {}))}
    return {key: fields for key, fields in state.items() if key not in (PIPELINE_KEY, STEPS_KEY)}


def carried_across_resize(shared, own):
    """The state a rank loads in a new world: ``shared`` (:func:`shared_part` of a surviving rank's,
    the same on every rank) with ``own`` (:func:`own_part` of its own; ``{}`` for a rank that joins).

    Example: ``carried_across_resize({"(fused)": {"step": 30}}, {"w": {"memory_residual": r}})`` is
    ``{"(fused)": {"step": 30}, "w": {"memory_residual": r}}``."""
    carried = dict(shared)
    for key, value in own.items():
        if isinstance(value, dict) and isinstance(carried.get(key), dict) and key != "drain":
            carried[key] = carried_across_resize(carried[key], value)
        else:
            carried[key] = value
    return carried


def _step_of(shared):
    return int(shared["auto"].get("steps", 0)) if "auto" in shared else int(shared[PIPELINE_KEY]["step"])


def _broadcast_state(state, root):
    """``state`` (numbers, strings, arrays) from Horovod rank ``root`` to every rank, as
    :mod:`~horovod_sparse.state_format` bytes in two Horovod broadcasts (no pickle)."""
    mine = hvd.rank() == root
    blob = state_format.encode(state) if mine else None
    length = hvd.broadcast(torch.tensor([blob.size if mine else 0], dtype=torch.int64), root,
                          name="horovod_sparse.elastic.length")
    data = torch.from_numpy(blob) if mine else torch.zeros(int(length[0]), dtype=torch.uint8)
    return state_format.decode(hvd.broadcast(data, root, name="horovod_sparse.elastic.state").numpy())


class CompressionStateHandler(horovod_state.StateHandler):
    """Horovod's handler of a compressor in ``hvd.elastic.TorchState`` (module docstring)."""

    def __init__(self, compression):
        super().__init__(compression)
        compression.elastic_handler = self
        self._keep()
        self._committed = False  # the state as it was built: no rank has carried anything yet

    def save(self):
        self._keep()
        self._committed = True

    def _keep(self):
        self._saved = copy.deepcopy(self.value.state_dict())  # numpy arrays and numbers: host copies
        self._saved_size = hvd.size() if hvd.is_initialized() else 0

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def follow_removals(self, world_size):
        """At a step's first ``compress``, with ``world_size`` the size the compressor's exchanges
        were made for: :meth:`sync` if Horovod's world is another now (elastic Horovod skips its
        own sync where hosts were only removed). Every rank of the new world sees the same sizes."""
        if hvd.size() != world_size:
            self.sync()

    def sync(self):
        world.forget()  # Horovod may have been initialised anew: its world is mapped again
        size = hvd.size()
        mine = torch.tensor([[int(self._committed), self._saved_size]], dtype=torch.int64)
        table = hvd.allgather(mine, name="horovod_sparse.elastic.sync").numpy()
        survivors = np.flatnonzero(table[:, 0] == 1)
        same_world = len(survivors) == size and np.all(table[:, 1] == size)
        if same_world or len(survivors) == 0:  # the same world, or a new job: every rank as it is
            self.value.rejoin(copy.deepcopy(self._saved))
            return
        shared = _broadcast_state(shared_part(self._saved) if hvd.rank() == survivors[0] else None,
                                  int(survivors[0]))
        own = own_part(copy.deepcopy(self._saved)) if self._committed else {}
        self.value.rejoin(carried_across_resize(shared, own))
        size_before = int(table[survivors, 1].max())
        report = ElasticReport(size_before, size, size_before - len(survivors), size - len(survivors),
                               _step_of(shared))
        self.value.elastic_report = report
        if hvd.rank() == 0:
            log.warning("horovod_sparse %s: %s", getattr(getattr(self.value, "algorithm", None), "name", "auto"),
                        report)


def register():
    """Let ``hvd.elastic.TorchState`` hand our compressors to :class:`CompressionStateHandler`
    (once; :mod:`horovod_sparse.torch` calls it on import)."""
    registry = horovod_state.get_handler_registry()
    if not any(handler is CompressionStateHandler for _, handler in registry):
        ours = [(kind, CompressionStateHandler) for kind in (TorchOutOfBandCompressor, TorchAutoCompressor)]
        horovod_state.set_handler_registry(ours + list(registry))
