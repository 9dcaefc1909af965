"""scikit-learn's bundled digits as 3 x 32 x 32 images, split and normalised the same way every time.

The 1797 8x8 grey images (levels 0..16, ten classes) ship inside scikit-learn, so nothing is
downloaded. Each is upscaled to 32x32 (bilinear), repeated on 3 channels (the input an
ImageNet-style CNN expects) and normalised by the training images' mean and standard deviation.
The split is fixed: ``numpy.random.default_rng(0)`` permutes the 1797, the first 360 (20 %) are
the test set, the other 1437 the training set.

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


class Digits(NamedTuple):
    train_x: torch.Tensor  # float32 (1437, 3, 32, 32), normalised
    train_y: torch.Tensor  # int64 (1437,)
    test_x: torch.Tensor   # float32 (360, 3, 32, 32), normalised with the training statistics
    test_y: torch.Tensor   # int64 (360,)


def split_indices(n=1797):
    """``(train, test)`` indices of the fixed split: a seeded permutation, its first 360 for test."""
    order = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(n))
    return order[TEST_IMAGES:], order[:TEST_IMAGES]


@functools.lru_cache(maxsize=None)
def load():
    """The split, upscaled, normalised digits (loaded once per process, about 25 MB)."""
    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32))[:, None]  # (1797, 1, 8, 8)
    images = F.interpolate(images, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    train, test = split_indices(len(labels))
    mean, std = images[train].mean(), images[train].std()
    images = ((images - mean) / std).expand(-1, 3, -1, -1).contiguous()
    return Digits(images[train], labels[train], images[test], labels[test])
