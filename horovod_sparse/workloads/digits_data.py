"""scikit-learn's bundled digits as 3 x 32 x 32 images, split and normalised the same way every time.

The 1797 8x8 grey images (levels 0..16, ten classes) ship inside scikit-learn, so nothing is
downloaded. The split is fixed: ``numpy.random.default_rng(0)`` permutes the 1797, the first 360
(20 %) are the test set, the other 1437 the training set. Two sets of images are made from it:

* :func:`load`: each digit upscaled to 32x32 (bilinear). ResNet-18 saturates on it (98.9% after
  a few hundred steps: one test image is 0.28%), so it says little about quality.
* :func:`load_cluttered`: each digit upscaled to 16x16 and placed at a random position of a
  32x32 canvas, beside fragments cut from other digits of the same split, under Gaussian noise
  (cluttered MNIST's construction, Jaderberg et al., NeurIPS'15): 12,000 training and 2,000 test
  images, made from the training and the test digits respectively, seeded. A harder task that
  does not saturate within the studies' budgets.

Both are repeated on 3 channels (the input an ImageNet-style CNN expects) and normalised by the
training images' mean and standard deviation.

    >>> data = load()
    >>> tuple(data.train_x.shape), tuple(data.test_x.shape), data.train_y.dtype
    ((1437, 3, 32, 32), (360, 3, 32, 32), torch.int64)
"""
import functools
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

SIDE = 32
TEST_IMAGES = 360
SPLIT_SEED = 0
#: the cluttered set: images made, the digit's side, fragments per image and their side, noise
#: (standard deviation, the digits' levels scaled to [0, 1]), and the seeds of the two sets
CLUTTERED_TRAIN, CLUTTERED_TEST = 12000, 2000
DIGIT_SIDE, FRAGMENTS, FRAGMENT_SIDE, NOISE = 16, 6, 6, 0.15
CLUTTER_SEEDS = {"train": 1, "test": 2}


class Digits(NamedTuple):
    train_x: torch.Tensor  # float32 (N, 3, 32, 32), normalised
    train_y: torch.Tensor  # int64 (N,)
    test_x: torch.Tensor   # float32 (M, 3, 32, 32), normalised with the training statistics
    test_y: torch.Tensor   # int64 (M,)


def split_indices(n=1797):
    """``(train, test)`` indices of the fixed split: a seeded permutation, its first 360 for test."""
    order = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(n))
    return order[TEST_IMAGES:], order[:TEST_IMAGES]


def _digits(side):
    """``(images, labels)``: the 1797 digits (levels 0..16) upscaled to ``side`` x ``side``."""
    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32))[:, None]  # (1797, 1, 8, 8)
    images = F.interpolate(images, size=(side, side), mode="bilinear", align_corners=False)
    return images, torch.from_numpy(bunch.target.astype(np.int64))


def _normalised(train, test, train_y, test_y):
    """:class:`Digits` of 1-channel images: normalised by the training statistics, on 3 channels.
    The statistics are numpy's float64 sums, which do not depend on torch's thread count (a
    float32 sum of the noisy cluttered set does)."""
    values = train.numpy().astype(np.float64)
    mean, std = torch.tensor(values.mean(), dtype=torch.float32), torch.tensor(values.std(ddof=1), dtype=torch.float32)
    return Digits(((train - mean) / std).expand(-1, 3, -1, -1).contiguous(), train_y,
                  ((test - mean) / std).expand(-1, 3, -1, -1).contiguous(), test_y)


@functools.lru_cache(maxsize=None)
def load():
    """The split, upscaled, normalised digits (loaded once per process, about 25 MB)."""
    images, labels = _digits(SIDE)
    train, test = split_indices(len(labels))
    return _normalised(images[train], images[test], labels[train], labels[test])


def clutter(digits, labels, count, seed):
    """``(images, labels)``: ``count`` cluttered images (numpy float32, ``count`` x 32 x 32) made
    from ``digits`` (numpy, N x 16 x 16 in [0, 1]) and their ``labels``.

    Each image: :data:`FRAGMENTS` squares of :data:`FRAGMENT_SIDE` cut from random digits at random
    places, then a random digit at a random place (where they overlap, the brighter pixel), then
    noise. Its label is that digit's.
    """
    rng = np.random.default_rng(seed)
    n, room = len(labels), SIDE - DIGIT_SIDE + 1
    canvas = np.zeros((count, SIDE, SIDE), np.float32)
    for _ in range(FRAGMENTS):
        source = rng.integers(0, n, count)
        cut_y, cut_x = rng.integers(0, DIGIT_SIDE - FRAGMENT_SIDE + 1, (2, count))
        at_y, at_x = rng.integers(0, SIDE - FRAGMENT_SIDE + 1, (2, count))
        for i in range(count):
            _brighter(canvas[i], at_y[i], at_x[i],
                      digits[source[i], cut_y[i]:cut_y[i] + FRAGMENT_SIDE, cut_x[i]:cut_x[i] + FRAGMENT_SIDE])
    chosen = rng.integers(0, n, count)
    at_y, at_x = rng.integers(0, room, (2, count))
    for i in range(count):
        _brighter(canvas[i], at_y[i], at_x[i], digits[chosen[i]])
    canvas += rng.normal(0.0, NOISE, canvas.shape).astype(np.float32)
    return canvas, labels[chosen]


def _brighter(canvas, y, x, patch):
    """Paste ``patch`` at ``(y, x)``, keeping the brighter pixel where something is there already."""
    region = canvas[y:y + patch.shape[0], x:x + patch.shape[1]]
    np.maximum(region, patch, out=region)


@functools.lru_cache(maxsize=None)
def load_cluttered():
    """The cluttered digits (:func:`clutter`; made once per process, in about a second: 12,000
    training images from the 1437 training digits, 2,000 test images from the 360 test digits)."""
    images, labels = _digits(DIGIT_SIDE)
    images, labels = images[:, 0].numpy() / 16, labels.numpy()
    train, test = (index.numpy() for index in split_indices(len(labels)))
    made = {part: clutter(images[index], labels[index], count, CLUTTER_SEEDS[part])
            for part, index, count in (("train", train, CLUTTERED_TRAIN), ("test", test, CLUTTERED_TEST))}
    (train_x, train_y), (test_x, test_y) = made["train"], made["test"]
    return _normalised(torch.from_numpy(train_x)[:, None], torch.from_numpy(test_x)[:, None],
                       torch.from_numpy(train_y), torch.from_numpy(test_y))
