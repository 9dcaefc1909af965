"""How the TensorFlow frontends identify a gradient: its position in the traced function."""
import weakref

import tensorflow as tf
from tensorflow.python.ops.control_flow_v2_func_graphs import CondBranchFuncGraph


class TracePositions:
    """Positions of ``compress`` calls within each traced function (the gradients' keys)."""

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
