"""What one exchange returns."""
import numpy as np


class ExchangeResult:
    """The result of :meth:`SparseAllreduce.allreduce`, identical on every rank.

    indices : sorted unique int64 array, the result's support.
    values : values at ``indices`` (sum over ranks, or average if requested).
    selected : for oktopk/gtopk the globally selected indices (sorted); the
        compressor clears its residual at local ∩ selected
        (:func:`horovod_sparse.exchange.sparse_ops.mask_in_sorted`).  For the
        other algorithms equal to ``indices``.
    traffic : :class:`Traffic` of this call on this rank.
    n : dense length.
    sent_indices : this rank's input indices, sorted (int64).
    sent_values : this rank's input values aligned with ``sent_indices``, as the
        receivers decoded them (with a value codec; else as given, float16 as float32).
    """

    def __init__(self, n, indices, values, selected, traffic, dense_values=None,
                 sent_indices=None, sent_values=None):
        self.n = n
        self.sent_indices, self.sent_values = sent_indices, sent_values
        self._indices, self.values_, self._selected = indices, values, selected
        self._dense = dense_values
        self.traffic = traffic

    @property
    def indices(self):
        if self._indices is None:  # dense algorithm: the support is everything
            self._indices = np.arange(self.n, dtype=np.int64)
        return self._indices

    @property
    def values(self):
        if self.values_ is None:
            self.values_ = self._dense
        return self.values_

    @property
    def selected(self):
        return self.indices if self._selected is None else self._selected

    def dense(self):
        """Dense numpy vector of length n (zeros outside ``indices``)."""
        if self._dense is not None:
            return self._dense.copy()
        out = np.zeros(self.n, dtype=self.values.dtype)
        out[self.indices] = self.values
        return out

    def __repr__(self):
        return (f"ExchangeResult(n={self.n}, nnz={self.indices.size}, "
                f"selected={self.selected.size}, traffic={self.traffic})")
