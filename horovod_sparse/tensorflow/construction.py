"""Refuse a stateful compressor built inside a traced ``tf.function``.

Horovod users write ``hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)``
inside the train step; a compressor *made* there is made again at every trace. TensorFlow
traces a step twice when its first trace creates variables (residuals, the exchange-order
token), and the second trace's new variables fail with "tf.function only supports singleton
tf.Variables"; a later retrace (new input shapes) would silently restart error feedback.
Nothing made inside the trace can tell one trace's compressor from another's (two steps,
or one helper called for two models, look alike), so rather than guess at a cache we fail
at construction, on every rank alike, before any collective. Stateless compressors keep
nothing and work anywhere.
"""
import tensorflow as tf


def refuse_inside_trace(algorithm):
    """Raise RuntimeError if the default graph is a function being traced.

    Example::

        @tf.function
        def step():
            hvds.Compression.topk(density=0.01)   # RuntimeError: build it outside the step
    """
    if getattr(tf.compat.v1.get_default_graph(), "building_function", False):
        call = f"{algorithm.name}(...)"
        raise RuntimeError(
            f"Compression.{call} was created inside a tf.function (the traced train step). It keeps "
            "state (residuals, exchange order) that must outlive the trace, and every trace would "
            "make a new one. Build the compressor once, outside the step, next to the optimizer "
            f"(compression = hvds.Compression.{call}) and pass that object to "
            "hvd.DistributedGradientTape(tape, compression=compression)")
