"""The Python standard library's own source files as bytes: real text that every install has.

Files: every ``*.py`` under the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, i.e. ``sys.base_prefix``'s ``lib/python3.X``, from a venv
too), ``site-packages`` and ``dist-packages`` left out, in sorted order of their relative paths.
Split by file: a file is for validation when the CRC-32 of its relative path is 0 mod 10 (about
a tenth of the files; the split of a file does not move when other files come or go). Each side
is its files' bytes concatenated in that order and cut at a cap, :data:`TRAIN_BYTES` (16 MiB)
and :data:`VALIDATION_BYTES` (1 MiB), so loading reads about 17 MB and takes well under a
second. The same on every run of the same interpreter.

    >>> text = load()
    >>> len(text.train) == TRAIN_BYTES, text.train.dtype
    (True, torch.uint8)
"""
import functools
import sysconfig
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

TRAIN_BYTES = 16 * 2**20
VALIDATION_BYTES = 1 * 2**20
_LEFT_OUT = {"site-packages", "dist-packages"}


class StdlibText(NamedTuple):
    root: Path
    train: torch.Tensor       # uint8, at most TRAIN_BYTES
    validation: torch.Tensor  # uint8, at most VALIDATION_BYTES
    train_files: tuple        # relative paths read, in order (the last one maybe cut)
    validation_files: tuple


def stdlib_root():
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root):
    """Sorted relative paths of the standard library's ``*.py`` files."""
    return sorted(path.relative_to(root) for path in root.rglob("*.py")
                  if not _LEFT_OUT & set(path.relative_to(root).parts) and path.is_file())


def is_validation(relative_path):
    """The fixed split: about one file in ten, by a hash of its relative path."""
    return zlib.crc32(relative_path.as_posix().encode()) % 10 == 0


def _read_capped(root, files, cap):
    chunks, used, total = [], [], 0
    for relative in files:
        if total >= cap:
            break
        data = (root / relative).read_bytes()[:cap - total]
        chunks.append(data)
        used.append(relative.as_posix())
        total += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8), tuple(used)


@functools.lru_cache(maxsize=None)
def load(root=None):
    """The split, capped text of the standard library at ``root`` (default: this interpreter's)."""
    root = Path(root) if root is not None else stdlib_root()
    files = source_files(root)
    train, train_files = _read_capped(root, [f for f in files if not is_validation(f)], TRAIN_BYTES)
    validation, validation_files = _read_capped(root, [f for f in files if is_validation(f)], VALIDATION_BYTES)
    return StdlibText(root, train, validation, train_files, validation_files)
