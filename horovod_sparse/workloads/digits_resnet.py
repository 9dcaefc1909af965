"""Workload ``digits_resnet``: torchvision's ResNet-18 on scikit-learn's digits at 32x32.

The model is ``torchvision.models.resnet18(num_classes=10)`` as torchvision defines it (the
ImageNet stem: 7x7 stride-2 convolution and max-pool, so 32x32 inputs reach layer4 at 1x1):
11,181,642 parameters in 62 tensors, BatchNorm and bias tensors beside the convolutions,
trained from scratch (no weights are downloaded). Data: :mod:`.digits_data` (1437 training,
360 test images). Metric: test accuracy, beside the test loss.

BatchNorm's running statistics are buffers, not parameters: each rank updates its own from
its own shard, as with any stock ``hvd.DistributedOptimizer``, so ``evaluate`` can differ
slightly between ranks while the parameters are identical. Evaluate one rank's model, or
broadcast the buffers first.

    >>> from horovod_sparse.workloads import digits_resnet as w
    >>> model = w.build_model(seed=0)
    >>> x, y = next(w.batches(rank=0, size=2, batch=16))
    >>> w.loss(model, (x, y)).backward()
    >>> sorted(w.evaluate(model))
    ['accuracy', 'loss']
"""
import torch
import torch.nn.functional as F
from torchvision.models import resnet18

from horovod_sparse.workloads.digits_data import load
from horovod_sparse.workloads.recipes import Recipe
from horovod_sparse.workloads.sharding import shard_indices

NAME = "digits_resnet"
METRIC = "accuracy"
HIGHER_IS_BETTER = True
#: one line for benchmark tables
DESCRIPTION = "torchvision's ResNet-18 on scikit-learn's digits at 3x32x32, cross-entropy"
#: images per rank and step in the step-time measurements
BATCH = 32
_EVAL_BATCH = 120
#: what users train CNNs with (:mod:`.recipes`). Plain SGD without momentum at lr 0.02 (0.947
#: accuracy after 20 steps at global batch 64, 0.983 after 60; 0.05: 0.611, 0.972): BatchNorm's
#: running statistics, used in evaluation, lag a model that moves fast.
RECIPE = "momentum"
RECIPES = {"sgd": Recipe("sgd", lr=0.02),
           "momentum": Recipe("momentum", lr=0.02, momentum=0.9, weight_decay=1e-4, warmup=0.1, decay="cosine")}


def build_model(seed=0):
    """ResNet-18 with 10 classes, initialised from ``seed`` (the caller's RNG state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return resnet18(num_classes=10)


def batches(rank, size, batch=BATCH, seed=0):
    """``(images, labels)`` of rank ``rank`` for each global step, without end (see :mod:`.sharding`)."""
    return batches_of(load(), rank, size, batch, seed)


def batches_of(data, rank, size, batch, seed):
    """:func:`batches` over the training images of ``data`` (a :class:`~.digits_data.Digits`)."""
    for index in shard_indices(len(data.train_y), rank, size, batch, seed):
        index = torch.from_numpy(index)
        yield data.train_x[index], data.train_y[index]


def loss(model, batch):
    """Mean cross-entropy of ``model`` on one ``(images, labels)`` batch."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def evaluate(model):
    """``{"loss", "accuracy"}`` on the 360 test images, in eval mode (running BatchNorm statistics)."""
    return evaluate_on(model, load())


def evaluate_on(model, data):
    """:func:`evaluate` on the test images of ``data`` (a :class:`~.digits_data.Digits`)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = torch.cat([model(data.test_x[i:i + _EVAL_BATCH])
                                for i in range(0, len(data.test_y), _EVAL_BATCH)])
    finally:
        model.train(was_training)
    return {"loss": F.cross_entropy(logits, data.test_y).item(),
            "accuracy": (logits.argmax(1) == data.test_y).double().mean().item()}
