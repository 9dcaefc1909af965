"""PowerSGD's products over runs of same-shape matrices: one batched kernel per run, not
one per matrix (the device path: torch's own ops, as on a GPU).

A model's gradients repeat a handful of shapes (the layers of a transformer block, a
ResNet stage's convolutions), laid out one after the other in the fused buffer, often
with a bias between them: equally spaced. A :class:`Run` is such a sequence of plan
matrices of one ``(rows, cols, rank)``, each a whole matrix (no short last row), at equal
distances in the buffer (the pipeline lays their factors out by shape, so that the same
shapes of a transformer's consecutive layers form one run). Its matrices are one strided 3-D view
of the buffer (no copy), and their P's and Q's are consecutive in the factor buffers, so
one ``bmm`` projects them all, as PyTorch's ``batched_powerSGD_hook`` and its per-shape
batching do. The launches of a step then grow with the number of distinct runs, not of
gradients.

The products ``bmm`` makes are the library's BLAS (each rank's own, summed afterwards, so
no agreement is needed, as :func:`.factors.project`). :func:`expand` is the same
element-wise products and additions in the same order as :func:`.factors.expand`, so a
run gives exactly the bits the per-matrix code gives.

Example::

    for run in make_runs(spans):
        project(torch, matrices(acc, run), factor(start, run.q, run, run.cols),
                factor(send, run.p, run, run.rows))
"""
from dataclasses import dataclass

#: elements one batched element-wise launch may write (16 MiB of float32 per scratch buffer,
#: unless one matrix is larger): bounds step 6's scratch on the device, while a step stays a
#: handful of launches per run
RUN_CHUNK = 1 << 22


@dataclass(frozen=True)
class Run:
    """``count`` matrices ``(rows, cols)`` of rank ``rank``, the first at buffer ``offset``, each
    ``stride`` elements after the one before; their P's are ``p`` of the P buffer and their
    Q's ``q`` of the Q buffer (slices, back to back)."""

    offset: int
    stride: int
    count: int
    rows: int
    cols: int
    rank: int
    p: slice
    q: slice

    @property
    def size(self):
        """Elements of one matrix."""
        return self.rows * self.cols


def make_runs(spans):
    """The plan's matrices as runs, in the order of their factors in the P buffer: ``spans`` is
    the pipeline's ``(block, p_span, q_span)`` list (its factors lie by shape, so same-shape
    matrices are neighbours there). Returns ``(runs, rest)``: ``rest`` the spans of the
    matrices no run can view (a zero-padded one, whose last row is short), for the
    per-matrix code."""
    runs, rest = [], []
    for block, p_span, q_span in sorted(spans, key=lambda span: span[1].start):
        if block.size != block.rows * block.cols:
            rest.append((block, p_span, q_span))
            continue
        last = runs[-1] if runs else None
        if last is not None and (last.rows, last.cols, last.rank) == (block.rows, block.cols, block.rank) \
                and last.p.stop == p_span.start and last.q.stop == q_span.start:
            gap = block.offset - (last.offset + (last.count - 1) * last.stride)  # from the run's last matrix
            if gap >= block.size and (last.count == 1 or gap == last.stride):  # no overlap, equally spaced
                runs[-1] = Run(last.offset, gap, last.count + 1, block.rows, block.cols, block.rank,
                               slice(last.p.start, p_span.stop), slice(last.q.start, q_span.stop))
                continue
        runs.append(Run(block.offset, block.size, 1, block.rows, block.cols, block.rank, p_span, q_span))
    return runs, rest


def matrices(flat, run, first=0, count=None):
    """Matrices ``first .. first + count`` of ``run`` in the 1-D tensor ``flat``, as one
    ``(count, rows, cols)`` view (no copy)."""
    count = run.count - first if count is None else count
    return flat.as_strided((count, run.rows, run.cols), (run.stride, run.cols, 1),
                           flat.storage_offset() + run.offset + first * run.stride)


def factor(flat, span, run, rows, first=0, count=None):
    """Factors ``first .. first + count`` of ``run`` at ``span`` of a flat factor buffer, as
    ``(count, rows, rank)`` (a view; ``rows`` is the run's rows for P, its cols for Q)."""
    count = run.count - first if count is None else count
    per = rows * run.rank
    return flat[span.start + first * per:span.start + (first + count) * per].view(count, rows, run.rank)


def project(torch, m, q, p):
    """``p = m q`` for every matrix of the run: one ``bmm`` into ``p`` (count, rows, rank)."""
    return torch.bmm(m, q, out=p)


def back_project(torch, m, p, q):
    """``q = m^T p`` for every matrix of the run: one ``bmm`` into ``q`` (count, cols, rank)."""
    return torch.bmm(m.transpose(1, 2), p, out=q)


def expand(torch, target, p, q, scratch, subtract=False):
    """``target`` (count, rows, cols), a strided view of the buffer, ``= p q^T`` or, with
    ``subtract``, ``-= p q^T``, each matrix's product as r element-wise outer products added
    in column order (:func:`.factors.expand`'s bits). ``p`` (count, rows, r) and ``q``
    (count, cols, r); ``scratch``: two 1-D tensors of at least ``count * rows * cols``
    elements (one when r = 1 and not subtracting)."""
    p_t, q_t = p.transpose(1, 2).contiguous(), q.transpose(1, 2).contiguous()  # contiguous rows broadcast fast
    shape = target.shape
    product = scratch[0][:target.numel()].view(shape) if subtract else target
    torch.mul(p_t[:, 0, :, None], q_t[:, 0, None, :], out=product)
    if p_t.shape[1] > 1:
        tmp = scratch[1][:target.numel()].view(shape)
        for j in range(1, p_t.shape[1]):
            torch.mul(p_t[:, j, :, None], q_t[:, j, None, :], out=tmp)
            torch.add(product, tmp, out=product)
    if subtract:
        torch.sub(target, product, out=target)


def chunks(run, chunk_elements):
    """``(first, count)`` pieces of the run of at most ``chunk_elements`` elements each (at
    least one matrix): step 6's launches, each within the scratch buffers."""
    per = max(1, chunk_elements // run.size)
    return [(first, min(per, run.count - first)) for first in range(0, run.count, per)]


def scratch_elements(runs, chunk_elements):
    """Elements each of :func:`expand`'s two scratch buffers needs for ``runs`` in pieces of
    :func:`chunks` ``(run, chunk_elements)``."""
    return max([min(run.count, max(1, chunk_elements // run.size)) * run.size for run in runs] or [0])
