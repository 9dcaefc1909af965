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
   (elastic Horovod skips its sync where hosts were only removed): the ranks gather what each holds (one
   Horovod allgather of four int64 per rank, no pickle) and agree on what carries over:

   * the same world (every rank committed in a world of this size): the whole state, so
     the job goes on bit for bit as if nothing had happened;
   * a new world: each surviving rank keeps its own gradients' residuals (and velocities,
     momenta: every per-element field, by parameter name), a joining rank starts them at
     zero, and the residuals of departed ranks are lost: that gradient mass never reaches
     the model. The step counters (warm-up, exact steps) continue from the first surviving
     rank's. Everything that depends on the world (the exchange's call counters and
     operation names, the size P, server residuals and regions, PowerSGD's warm-start Q's,
     the carried thresholds) starts afresh, identically on every rank;

   then the compressor makes its exchanges again on the new world's ranks at its next step
   (:meth:`~horovod_sparse.torch.TorchOutOfBandCompressor.rejoin`). What happened is
   ``compression.elastic_report`` (an :class:`ElasticReport`, the same on every rank) and a
   warning on the ``horovod_sparse.elastic`` logger on rank 0.

Under elastic Horovod a compressor that keeps state and is in no elastic state is refused
at its first step on every rank (:data:`horovod_sparse.out_of_band.ELASTIC_MESSAGE`).
``auto`` and the in-band ``randomk`` are not carried yet (they stay refused).

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

from horovod_sparse import world
from horovod_sparse.layout_pipeline import PIPELINE_KEY
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


def carried_across_resize(state, step, steps_exchanged=None):
    """What of one rank's ``state`` (the compressor's ``state_dict()``, or ``{}`` for a rank that
    has none) goes into a new world: each gradient's own per-element fields, by name, and the
    step counters every rank agreed on (the whole-buffer state starts afresh).

    Example: ``carried_across_resize({"w": {"memory_residual": r}, "(fused)": {...}}, 30)`` is
    ``{"w": {"memory_residual": r}, "(fused)": {"step": 30}}``."""
    carried = {key: fields for key, fields in state.items() if key not in (PIPELINE_KEY, STEPS_KEY)}
    carried[PIPELINE_KEY] = {"step": int(step)}
    if steps_exchanged is not None:
        carried[STEPS_KEY] = {"step": int(steps_exchanged)}
    return carried


def _counters(state):
    """(step, steps exchanged or -1) of a compressor's ``state_dict()``; (0, -1) when empty."""
    step = int((state.get(PIPELINE_KEY) or {}).get("step", 0))
    steps = state.get(STEPS_KEY)
    return step, -1 if steps is None else int(steps.get("step", 0))


class CompressionStateHandler(horovod_state.StateHandler):
    """Horovod's handler of a compressor in ``hvd.elastic.TorchState`` (module docstring)."""

    def __init__(self, compression):
        super().__init__(compression)
        compression.in_elastic_state, compression.elastic_handler = True, self
        self._commits = 0
        self.save()
        self._commits = 0  # the state as it was built: no rank has carried anything yet

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())  # numpy arrays and numbers: host copies
        self._saved_size = hvd.size() if hvd.is_initialized() else 0
        self._commits += 1

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self):
        world.forget()  # Horovod may have been initialised anew: its world is mapped again
        size = hvd.size()
        step, steps = _counters(self._saved)
        mine = torch.tensor([[int(self._commits > 0), self._saved_size, step, steps]], dtype=torch.int64)
        table = hvd.allgather(mine, name="horovod_sparse.elastic.sync").numpy()
        survivors = table[table[:, 0] == 1]
        if len(survivors) == size and np.all(survivors[:, 1] == size):
            self.value.rejoin(copy.deepcopy(self._saved))  # the same world: everything carries over
            return
        if len(survivors) == 0:  # a new job (or a failure before any commit): every rank as built
            self.value.rejoin(copy.deepcopy(self._saved))
            return
        first = survivors[0]
        carried = carried_across_resize(copy.deepcopy(self._saved) if self._commits > 0 else {},
                                        first[2], None if first[3] < 0 else first[3])
        self.value.rejoin(carried)
        size_before = int(survivors[:, 1].max())
        report = ElasticReport(size_before, size, size_before - len(survivors), size - len(survivors), int(first[2]))
        self.value.elastic_report = report
        if hvd.rank() == 0:
            log.warning("horovod_sparse %s: %s", self.value.algorithm.name, report)


def register():
    """Let ``hvd.elastic.TorchState`` hand our compressors to :class:`CompressionStateHandler`
    (once; :mod:`horovod_sparse.torch` calls it on import)."""
    registry = horovod_state.get_handler_registry()
    if not any(handler is CompressionStateHandler for _, handler in registry):
        horovod_state.set_handler_registry([(TorchOutOfBandCompressor, CompressionStateHandler)] + list(registry))
