"""TF1-style graph mode (a ``tf.Graph`` run by a ``Session``): no automatic control dependencies.

Inside a ``tf.function`` TensorFlow runs every stateful op and runs ops on one resource in
program order. A plain graph does neither: an op runs only if a fetched tensor needs it,
and ops with no data path between them run in any order. Horovod builds the same
``tf.cond`` per gradient in both modes, so two things are done by hand here:

- a compressor's state updates (residual, step counter) are made to run, after the reads,
  by :func:`run_state_updates`;
- out-of-band exchanges (one ``tf.numpy_function`` in each ``tf.cond``) must run in one order
  on every rank: :class:`GraphExchangeChain` gives each exchange an input from the previous
  exchange's ``tf.cond``.
"""
import contextlib
import weakref

import tensorflow as tf
from tensorflow.python.framework.auto_control_deps import AutomaticControlDependencies
from tensorflow.python.ops.control_flow_v2_func_graphs import CondBranchFuncGraph


def in_graph_mode():
    """True when building a plain graph (TF1 style), not a ``tf.function`` nor eager code."""
    return not tf.compat.v1.executing_eagerly_outside_functions()


@contextlib.contextmanager
def run_state_updates():
    """Within it, stateful ops run in program order and ``mark(tensor)`` returns ``tensor``
    made to depend on them all; outside graph mode ``mark`` is the identity.

    Example::

        with run_state_updates() as mark:
            payload, ctx = compressor.compress_slot(tensor, key)
            payload = mark(payload)
    """
    if not in_graph_mode():
        yield lambda tensor: tensor
        return
    with AutomaticControlDependencies() as deps:
        yield deps.mark_as_return


def _outermost_branch_parent(graph):
    while isinstance(graph, CondBranchFuncGraph):
        graph = graph.outer_graph
    return graph


def outermost_graph():
    """The graph being traced around any ``tf.cond`` branches (Horovod puts each gradient's
    allreduce in one): where a whole step's exchange is traced, so that every branch can use
    its results."""
    return _outermost_branch_parent(tf.compat.v1.get_default_graph())


class GraphExchangeChain:
    """Orders a plain graph's exchanges: each one takes an input from the previous one's
    ``tf.cond`` (or from the previous exchange itself, traced outside any ``tf.cond``).

    A data input, not a control input: TensorFlow lowers a plain graph's ``If`` ops to
    switch/merge, and ops inside a branch do not wait for the ``If``'s control inputs
    (measured: two exchanges ran at once and deadlocked at P=3). When exchange i+1 is
    traced, exchange i's ``tf.cond`` is complete: it is the first ``If`` op created in the
    enclosing graph since exchange i was traced. One element of each of its outputs is
    passed, so the dependency costs nothing.

    Example::

        summed = tf.numpy_function(exchange, [flat, *chain.after_previous()], tf.float32)
        chain.traced(summed)
    """

    def __init__(self):
        self._previous = weakref.WeakKeyDictionary()  # enclosing graph -> op count, or the last exchange's output

    def after_previous(self):
        """Tensors the exchange being traced must take as inputs (none for the first of its graph)."""
        graph = _outermost_branch_parent(tf.compat.v1.get_default_graph())
        previous = self._previous.get(graph)
        if previous is None:
            return []
        if isinstance(previous, int):
            conds = [op for op in graph.get_operations()[previous:] if op.type in ("If", "StatelessIf")]
            outputs = conds[0].outputs if conds else []
        else:
            outputs = [previous]
        return [tf.reshape(output, [-1])[:1] for output in outputs]

    def traced(self, summed):
        """Record the exchange just traced, producing ``summed``."""
        current = tf.compat.v1.get_default_graph()
        graph = _outermost_branch_parent(current)
        self._previous[graph] = summed if current is graph else len(graph.get_operations())
