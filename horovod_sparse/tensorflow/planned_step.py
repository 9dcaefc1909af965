"""A planned schedule (``mgwfbp``, ``optimal``, ``asc``, ``auto``) inside a traced TensorFlow step.

TensorFlow traces the step once and then runs the same graph every step, but which
gradients travel together need not be written into the graph: the graph hands each
gradient to the schedule's runtime (:class:`~horovod_sparse.step.exchanges.StepExchanges`,
the PyTorch frontend's), which decides at run time, as in PyTorch: the first steps are
one exchange after backward, timed; then a plan is made and each planned bucket is
exchanged on a channel thread as soon as its gradients are in, while backward goes on.
The traced step holds:

1. one *arrival* host call per gradient, traced in the reverse of the variables' order
   (backward's order): it hands the gradient to the runtime (``arrived``) and returns at
   once, so TensorFlow goes on with backward while a channel thread exchanges a complete
   bucket. On the CPU it is a stateless ``tf.numpy_function``, which TensorFlow runs as soon as
   its gradient exists, in no fixed order: the channels order the collectives, the same on
   every rank, whatever order the gradients arrive in;
2. one *collecting* host call that takes every arrival's output, traced in order with the
   step's other exchanges (:class:`~horovod_sparse.tensorflow.bucket_exchange.InOrderHostExchanges`):
   ``finish`` waits for every bucket (or, while profiling, exchanges the whole step) and it
   returns each gradient's part;
3. TensorFlow ops scatter each part into its gradient (:meth:`BucketPart.to_gradient`).

With ``on_device`` the host calls are ``tf.py_function``s and the arrays eager tensors
(:mod:`horovod_sparse.tensorflow.step_arrays`). TensorFlow chains those in trace order, so a
gradient computed out of backward's order waits for the ones traced before it.

    planned = PlannedStep(StepExchanges(algorithm, HOST_ARRAYS, "mgwfbp"), lambda: comm, compressor.nonfinite_parts)
    parts = planned.trace(in_order, [(key, gradient), ...], layout, sparse=True, on_device=False)
"""
import functools
import threading

import numpy as np
import tensorflow as tf

from horovod_sparse.errors import NonFiniteGradientError


class PlannedStep:
    """The traced step's side of a planned schedule, around one :class:`StepExchanges`."""

    def __init__(self, exchanges, comm_of, nonfinite_parts):
        self.exchanges = exchanges
        self.comm_of = comm_of  # the compressor's communicator, known at the first step
        # (error, layout) -> the parts of a step whose gradient overflowed (NaN), or raises
        self.nonfinite_parts = nonfinite_parts
        # arrival calls may run on several of TensorFlow's threads at once
        self._lock = threading.Lock()
        self._recorded = None  # key -> gradient (numpy, or eager tensor) this step; None between steps

    def trace(self, in_order, step, layout, sparse, on_device, carried=()):
        """Trace the step's arrivals and its collecting call for the gradients ``step``
        (``[(key, tensor)]``, laid out by ``layout``; ``carried``: the step's gradients Horovod
        carries as they are, whose overflow skips the step's exchange too); returns
        ``{key: BucketPart}``."""
        arrivals = []
        for key, g in reversed(step):  # backward's order: the last variable's gradient comes first
            piece = tf.reshape(g, [-1])
            if on_device:
                arrival = tf.py_function(functools.partial(self.arrive, key), [piece], tf.int64)
            else:
                arrival = tf.numpy_function(functools.partial(self.arrive, key), [piece], tf.int64,
                                            stateful=False)
            arrivals.append(arrival)
        return in_order.run(lambda _, finite: self.collect(layout, finite), step, layout, sparse=sparse,
                            on_device=on_device, ready=arrivals, carried=list(carried))

    def arrive(self, key, piece):
        """One gradient handed to the runtime (in its arrival call): a bucket it completes
        starts on its channel now."""
        with self._lock:
            if self._recorded is None:  # the step's first gradient
                self._recorded = {}
                self.exchanges.start_step(self.comm_of())
            self._recorded[key] = piece
            self.exchanges.arrived(key, self._recorded, {})
        return np.int64(0)

    def collect(self, layout, finite=True):
        """Every gradient's part of the step's sum, in ``layout``'s order (in the collecting call)."""
        with self._lock:
            recorded, self._recorded = self._recorded or {}, None
        try:
            results = self.exchanges.finish(recorded, {}, finite)
        except NonFiniteGradientError as error:
            return self.nonfinite_parts(error, layout)
        return [results.part(e.key) for e in layout.entries]
