"""Real workloads that run offline: a model, a sharded stream of batches, a validation metric.

* ``digits_resnet`` (:mod:`.digits_resnet`): torchvision's ResNet-18 (11.2M parameters in 62
  tensors) on scikit-learn's bundled digits upscaled to 3 x 32 x 32; metric: test accuracy.
* ``stdlib_lm`` (:mod:`.stdlib_lm`): a 6 x 512 causal ``nn.TransformerEncoder`` byte-level
  language model (19.2M parameters in 78 tensors) on the Python standard library's source;
  metric: validation bits per byte.
* ``cluttered_resnet`` (:mod:`.cluttered_resnet`): the same ResNet-18 on a harder image task
  made from the same digits (each at a random place among fragments of others, under noise),
  where accuracy does not saturate; metric: test accuracy.

Every workload module has the same shape: ``NAME``, ``METRIC``, ``HIGHER_IS_BETTER``, ``BATCH``
(per rank), ``DESCRIPTION`` (one line for benchmark tables), and

* ``build_model(seed=0)``: the model, the same on every rank for the same seed;
* ``batches(rank, size, batch=BATCH, seed=0)``: rank ``rank``'s shard of one global stream of
  batches, the same on every run (:mod:`.sharding`);
* ``loss(model, batch)``: the training loss of one batch;
* ``evaluate(model)``: ``{"loss": ..., METRIC: ...}`` on a fixed validation set.

Nothing is downloaded: the data ship with scikit-learn and with Python itself, and the models
are trained from scratch.

    >>> from horovod_sparse import workloads
    >>> lm = workloads.get("stdlib_lm")
    >>> lm.METRIC, lm.HIGHER_IS_BETTER
    ('bits_per_byte', False)
"""
import importlib

NAMES = ("digits_resnet", "stdlib_lm", "cluttered_resnet")


def parse_size(text):
    """A model size as the benchmarks' ``--model`` takes it: ``"layers=4,d_model=256"`` ->
    ``{"layers": 4, "d_model": 256}`` (keyword arguments of a workload's ``build_model``).

    >>> parse_size("layers=4,d_model=256")
    {'layers': 4, 'd_model': 256}
    """
    import argparse   # argparse's error type, so that a bad value reads as a usage error
    try:
        return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(",") if part.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=INT,..., got {text!r}") from None


def get(name):
    """The workload module called ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")
