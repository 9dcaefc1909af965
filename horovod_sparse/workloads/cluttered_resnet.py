"""Workload ``cluttered_resnet``: :mod:`.digits_resnet`'s ResNet-18 on the cluttered digits.

The same model, input shape (3 x 32 x 32), batch and recipes as ``digits_resnet``, so its step
takes the same time; the data are :func:`~.digits_data.load_cluttered`'s (12,000 training and
2,000 test images, each a digit at a random place among fragments of others, under noise),
where ResNet-18 does not saturate: the digits reach 98.9% test accuracy within a few hundred
steps and then one test image (0.28%) separates the runs; here dense ends at 81-83% after
1000 steps of the momentum recipe (docs/results/accuracy.md). Metric: test accuracy, beside the test loss.

    >>> from horovod_sparse.workloads import cluttered_resnet as w
    >>> x, y = next(w.batches(rank=0, size=2, batch=16))
    >>> tuple(x.shape), w.evaluate(w.build_model(seed=0))["accuracy"] < 0.5
    ((16, 3, 32, 32), True)
"""
from horovod_sparse.workloads import digits_resnet as plain
from horovod_sparse.workloads.digits_data import load_cluttered

NAME = "cluttered_resnet"
DESCRIPTION = "torchvision's ResNet-18 on cluttered digits at 3x32x32 (12,000 training images), cross-entropy"
METRIC, HIGHER_IS_BETTER, BATCH = plain.METRIC, plain.HIGHER_IS_BETTER, plain.BATCH
RECIPE, RECIPES = plain.RECIPE, plain.RECIPES
build_model, loss = plain.build_model, plain.loss


def batches(rank, size, batch=BATCH, seed=0):
    """``(images, labels)`` of rank ``rank`` for each global step, without end (see :mod:`.sharding`)."""
    return plain.batches_of(load_cluttered(), rank, size, batch, seed)


def evaluate(model):
    """``{"loss", "accuracy"}`` on the 2,000 test images, in eval mode (running BatchNorm statistics)."""
    return plain.evaluate_on(model, load_cluttered())
