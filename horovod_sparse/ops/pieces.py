"""A step's gradients as pieces: the 1-D float arrays that are one buffer back to back.

The frontends hand a pipeline that takes pieces (``Pipeline.takes_pieces``) the step's
gradients flattened, where they are, instead of a fused copy; the pipeline checks each
piece and reads them in place (:mod:`horovod_sparse.memory`'s ``accumulate_pieces``, or a
fused kernel of :mod:`horovod_sparse.ops.cpu` per piece).

Example::

    pieces = [as_piece(p) for p in grad] if is_pieces(grad) else [grad]
"""
import numpy as np

from horovod_sparse.ops import namespace, views


def is_pieces(grad):
    """Whether ``grad`` is a list of pieces rather than one buffer."""
    return isinstance(grad, (list, tuple))


def as_piece(piece):
    """``piece`` as a contiguous 1-D float array of its own library and dtype (itself where it is
    one, detached), or None when it is not 1-D float data."""
    if namespace.is_tensorflow(piece):
        return piece if piece.shape.rank == 1 and piece.dtype.is_floating else None
    if namespace.is_torch(piece):
        p = piece.detach()
        return p.contiguous() if p.dim() == 1 and p.is_floating_point() else None
    p = np.asarray(piece)
    return np.ascontiguousarray(p) if p.ndim == 1 and p.dtype.kind == "f" else None


def float32_views(pieces):
    """numpy views of the pieces when every one is float32 on the CPU (numpy, or a CPU tensor
    through a zero-copy view), else None: what the compiled kernels of
    :mod:`horovod_sparse.ops.cpu` can read (a TensorFlow tensor, another dtype or device takes
    the framework's own path; numpy has no bfloat16 to view)."""
    found = []
    for piece in pieces:
        if namespace.is_tensorflow(piece) or str(piece.dtype) not in ("float32", "torch.float32"):
            return None
        view = views.numpy_view(piece)
        if view is None:
            return None
        found.append(view)
    return found
