"""The float32 sum over ranks by one ``MPI_Allreduce``, as Horovod's own dense allreduce
computes it: the pipeline of the ``dense`` compressor's default method, the baseline that
the schedules (``schedule="wfbp"``, ...) run out of band.

    with PlainSumPipeline(n, comm) as pipeline:
        total = pipeline.step(grad)           # the sum over ranks, in grad's library and device

MPI's reduction is what Horovod relies on too: for a commutative sum Open MPI gives every
rank the same bits (each chunk is reduced once and the result passed on), which the tests
check (replicas bitwise identical).
"""
import sys
from dataclasses import dataclass

import numpy as np

from horovod_sparse.exchange.comm import CountingComm, Traffic
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.ops import host, namespace
from horovod_sparse.ops.finite import all_finite
from horovod_sparse.pipeline import Pipeline


@dataclass(frozen=True)
class PlainSumStepInfo:
    """What one step did on this rank: its number and :class:`Traffic`."""

    step: int
    traffic: Traffic


class PlainSumPipeline(Pipeline):
    """Sum a float32 buffer of ``n`` elements over ``comm`` (duplicated: collective). No state
    but a step counter; a :class:`~horovod_sparse.pipeline.Pipeline`."""

    def __init__(self, n, comm):
        self.n = int(n)
        self.comm = CountingComm(comm)
        self._exchanges = (self.comm,)
        self._sum = np.empty(self.n, dtype=np.float32)

    def step(self, grad, tag=0, finite=True):
        """The sum over ranks of ``grad`` (1-D, length n, cast to float32) in grad's library
        and device: a buffer of this pipeline, valid until its next step (an eager TensorFlow
        tensor: a new one). ``tag`` is unused (the caller agreed on the layout). A sum that is not
        finite raises NonFiniteGradientError on every rank (the step is not counted); so does
        ``finite=False`` on any rank (another gradient of its step overflowed)."""
        if namespace.is_tensorflow(grad):  # on its device until the sum's own payload crosses
            tf = sys.modules["tensorflow"]
            g = tf.reshape(tf.cast(grad, tf.float32), [-1])
        else:
            g = grad.detach().reshape(-1).float() if namespace.is_torch(grad) else np.asarray(grad, np.float32).ravel()
        if g.shape[0] != self.n:
            raise ValueError(f"the gradient has {g.shape[0]} elements, this pipeline sums {self.n}")
        before = self.traffic
        # another gradient of this rank's step overflowed: a NaN contribution tells every rank
        sent = host.to_wire(g, self.comm) if finite else np.full(self.n, np.nan, np.float32)
        total = self.comm.allreduce(sent, self._sum)  # beside a device buffer handed over as it is
        if not all_finite(total):  # the same sum, so the same answer, on every rank
            raise NonFiniteGradientError("dense sum skipped on every rank: a gradient holds inf or NaN "
                                         "(a loss scaler's overflow?); no state changed")
        self.last = PlainSumStepInfo(self.step_count, self.traffic - before)
        self.step_count += 1
        return host.from_wire(total, g)

    def _identity(self):
        return {"n": self.n}  # no format number: its saved states never had one
