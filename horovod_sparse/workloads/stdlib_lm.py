"""Workload ``stdlib_lm``: a byte-level transformer language model on the standard library's source.

Model: :class:`.byte_transformer.ByteTransformer` at its default size (6 layers x d_model 512,
8 heads, context 64 bytes, vocabulary 256: 19.2M parameters in 78 tensors). Data:
:mod:`.stdlib_text` (16 MiB of training text, 1 MiB of validation text). A training example
is a window of 65 bytes starting at a multiple of 64 (inputs its first 64, targets its last 64).
Metric: validation loss in bits per byte on :data:`EVAL_WINDOWS` windows spread evenly over
the validation text (the same windows every time), beside the same loss in nats.

    >>> from horovod_sparse.workloads import stdlib_lm as w
    >>> model = w.build_model(seed=0, layers=1, d_model=32, heads=2)
    >>> inputs, targets = next(w.batches(rank=1, size=2, batch=4))
    >>> tuple(inputs.shape), tuple(targets.shape)
    ((4, 64), (4, 64))
    >>> round(w.evaluate(model)["bits_per_byte"]) in range(7, 10)  # untrained: about log2(256)
    True
"""
import math

import torch
import torch.nn.functional as F

from horovod_sparse.workloads.byte_transformer import ByteTransformer
from horovod_sparse.workloads.recipes import Recipe
from horovod_sparse.workloads.sharding import shard_indices
from horovod_sparse.workloads.stdlib_text import load

NAME = "stdlib_lm"
METRIC = "bits_per_byte"
HIGHER_IS_BETTER = False
#: one line for benchmark tables
DESCRIPTION = "6 x 512 causal TransformerEncoder, byte-level LM on the stdlib's source, context 64"
#: windows per rank and step in the step-time measurements
BATCH = 4
CONTEXT = 64
EVAL_WINDOWS = 128
#: what users train transformers with (:mod:`.recipes`); plain SGD at the rate of a few dozen
#: steps of one process (full size, global batch 8: lr 0.03 reaches 4.50 bits per byte after 40
#: steps; 0.1 5.82; 0.01 4.93)
RECIPE = "adamw"
RECIPES = {"sgd": Recipe("sgd", lr=0.03)}
_EVAL_BATCH = 32


def build_model(seed=0, **size):
    """The language model initialised from ``seed`` (the caller's RNG state is left as it was);
    ``size`` overrides :class:`ByteTransformer`'s defaults (``layers``, ``d_model``, ``heads``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ByteTransformer(context=CONTEXT, **size)


def windows(text):
    """``(n, CONTEXT + 1)`` view of ``text``: window ``i`` starts at byte ``i * CONTEXT``."""
    return text.unfold(0, CONTEXT + 1, CONTEXT)


def batches(rank, size, batch=BATCH, seed=0):
    """``(inputs, targets)`` int64 ``(batch, 64)`` of rank ``rank`` for each global step, without end."""
    train = windows(load().train)
    for index in shard_indices(len(train), rank, size, batch, seed):
        chosen = train[torch.from_numpy(index)].long()
        yield chosen[:, :-1], chosen[:, 1:]


def loss(model, batch):
    """Mean next-byte cross-entropy in nats."""
    inputs, targets = batch
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def evaluate(model, count=EVAL_WINDOWS):
    """``{"loss" (nats per byte), "bits_per_byte"}`` on ``count`` validation windows spread evenly
    over the validation text (fewer for a quick look; the same ones for the same ``count``)."""
    validation = windows(load().validation)
    chosen = validation[torch.linspace(0, len(validation) - 1, count).long()].long()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            total = sum(loss(model, (part[:, :-1], part[:, 1:])).item() * len(part)
                        for part in chosen.split(_EVAL_BATCH))
    finally:
        model.train(was_training)
    nats = total / len(chosen)
    return {"loss": nats, "bits_per_byte": nats / math.log(2)}
