"""Step 1 of PowerSGD and of the FFT pipeline: acc = gradient + residual and whether acc is
finite, from one buffer or from its pieces read where they are.

Both pipelines take ``pieces`` (:attr:`~horovod_sparse.pipeline.Pipeline.takes_pieces`): a
list of 1-D float arrays that are the buffer back to back (a step's gradients, flattened),
so the frontends skip the fused copy. Each pipeline first checks the pieces
(:func:`~horovod_sparse.ops.pieces.as_piece`) and the total length, and fuses TensorFlow pieces itself (its kernels
make new tensors anyway); :func:`accumulate` then writes acc:

* with the compiled kernels (:func:`horovod_sparse.ops.cpu.enabled`, every piece float32 on
  the CPU, numpy's kernels on CPU tensors): one kernel call per piece into the piece's slice
  of the residual's spare, the overflow check on the way
  (:func:`~horovod_sparse.ops.cpu.memory.accumulate_finite`; without error feedback
  :func:`~horovod_sparse.ops.cpu.memory.copy_finite`, the pieces fused into the spare);
* otherwise the memory's own pass (:meth:`~horovod_sparse.memory.Memory.accumulate_pieces`,
  numpy or torch, float16/bfloat16 promoted exactly and float64 rounded to float32 first),
  then :func:`~horovod_sparse.ops.finite.all_finite`.

Either way acc holds the bits ``accumulate(concatenation of the pieces cast to float32)``
would: per element the same one float32 addition (or copy). The state is untouched until
the pipeline commits. A single buffer without error feedback is acc itself (no copy).

Example::

    acc, finite = accumulate(memory, pieces, numpy_on_cpu=True)
    if not finite(): ...
"""
from horovod_sparse.ops import cpu, views
from horovod_sparse.ops.cpu import memory as kernels
from horovod_sparse.ops.finite import all_finite
from horovod_sparse.ops.pieces import float32_views, is_pieces


def accumulate(memory, grad, numpy_on_cpu=True):
    """Step 1: ``(acc, finite)``, ``finite()`` telling whether acc is all finite.

    memory : the pipeline's :class:`~horovod_sparse.memory.ErrorFeedback` (only read).
    grad : one float32 1-D buffer of n elements (numpy, torch or TensorFlow), or a non-empty
        list of checked pieces (:func:`~horovod_sparse.ops.pieces.as_piece`; numpy or torch, n elements in all).
    numpy_on_cpu : the pipeline's choice (False: CPU tensors run torch's own kernels).
    """
    whole = not is_pieces(grad)
    if whole and not memory.enabled:
        return grad, lambda: all_finite(grad)  # acc is the gradient itself
    pieces = [grad] if whole else list(grad)
    found = float32_views(pieces) if numpy_on_cpu and cpu.enabled() else None
    if found is None:
        acc = memory.accumulate(grad) if whole else memory.accumulate_pieces(pieces)
        return acc, lambda: all_finite(acc)
    state, spare = memory.buffers("residual", pieces[0])
    residual, out = views.numpy_view(state), views.numpy_view(spare)
    ok, offset = True, 0
    for view in found:
        part = slice(offset, offset + view.shape[0])
        if memory.enabled:
            ok = kernels.accumulate_finite(view, residual[part], out[part]) and ok
        else:
            ok = kernels.copy_finite(view, out[part]) and ok
        offset = part.stop
    return spare, lambda: ok

