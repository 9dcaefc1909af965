"""How the TensorFlow frontends identify a gradient: by its variable's name when Horovod's
gradient allreduce calls the compressor, else by its position in the traced function.

Horovod's ``compress(tensor)`` carries no name. ``DistributedGradientTape`` and the Keras
``DistributedOptimizer`` both reduce through one inner function, ``allreduce_grads(grads,
vars)``, whose frame holds the gradient list beside its variables: the gradient passed to
``compress`` is found there by identity, and its variable's name is the key. A name stays
with its variable when another variable has no gradient (Horovod skips ``None``) or leaves
the list (frozen), so residuals never move to another variable; positions would shift.
"""
import sys
import weakref

import tensorflow as tf
from tensorflow.python.ops.control_flow_v2_func_graphs import CondBranchFuncGraph

from horovod_sparse.horovod_frames import _frames


class TracePositions:
    """Positions of ``compress`` calls within each traced function (the fallback keys)."""

    def __init__(self):
        self._next = weakref.WeakKeyDictionary()  # traced graph -> next position

    def next(self, algorithm):
        """The calling gradient's position; None (no state) for a stateless compressor called eagerly."""
        if tf.executing_eagerly():
            if algorithm.stateful:
                raise ValueError(
                    f"{algorithm.name} keeps per-gradient state and was called eagerly without "
                    "a name; call it inside tf.function (as hvd.DistributedGradientTape and the "
                    "Keras DistributedOptimizer do) or as compress(tensor, name=...)")
            return None
        # Horovod wraps each allreduce in tf.cond: count in the function around the branches.
        graph = tf.compat.v1.get_default_graph()
        while isinstance(graph, CondBranchFuncGraph):
            graph = graph.outer_graph
        position = self._next.get(graph, 0)
        self._next[graph] = position + 1
        return position


class GradientKeys:
    """A gradient's key: ``name`` if given, its variable's name under Horovod's gradient
    allreduce, else its trace position (plain ``hvd.allreduce(g, compression=...)``).

    Example::

        keys = GradientKeys()
        key = keys.of(tensor, algorithm)   # "dense/kernel:0" under DistributedGradientTape
    """

    def __init__(self):
        self._positions = TracePositions()

    # Frame walks, run at trace time: autograph must not rewrite their loops (nor add frames).
    @tf.autograph.experimental.do_not_convert
    def of(self, tensor, algorithm, name=None):
        if name is not None:
            return name
        variable_name = horovod_variable_name(tensor)
        return variable_name if variable_name is not None else self._positions.next(algorithm)


@tf.autograph.experimental.do_not_convert
def horovod_variable_name(tensor, depth=64):
    """The name of the variable whose gradient ``tensor`` is, read from Horovod's
    ``allreduce_grads(grads, vars)`` frame; None where no such frame holds ``tensor``.

    Two variables of one name in the list (raw ``tf.Variable``s are not uniquified) get
    ``name#0``, ``name#1`` in list order. ``depth`` leaves room for autograph's frames.
    """
    found = horovod_gradients(tensor, depth)
    if found is None:
        return None
    return next(name for name, grad in found if grad is tensor)


@tf.autograph.experimental.do_not_convert
def horovod_gradients(tensor, depth=64):
    """``[(variable name, gradient or None)]`` of the whole list in Horovod's
    ``allreduce_grads(grads, vars)`` frame that holds ``tensor`` (names as in
    :func:`horovod_variable_name`); None where no such frame holds it."""
    for frame in _frames(sys._getframe(1), depth):
        local = frame.f_locals
        grads, variables = local.get("grads"), local.get("vars")
        if isinstance(grads, (list, tuple)) and isinstance(variables, (list, tuple)) \
                and len(grads) == len(variables) and any(grad is tensor for grad in grads):
            names = [v.name for v in variables]
            return [(name if names.count(name) == 1 else f"{name}#{names[:i].count(name)}", grad)
                    for i, (name, grad) in enumerate(zip(names, grads))]
    return None
