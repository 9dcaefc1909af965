"""The oracle of a planned schedule's exchanges, for both frontends' schedule tests: numpy
pipelines per planned bucket, fed this rank's local gradients and summed with mpi4py."""
import numpy as np

import horovod_sparse
from horovod_sparse.layout import GradientLayout
from horovod_sparse.layout_pipeline import cut, per_element_fields


class BucketOracle:
    """numpy pipelines of ``spec``: one over the whole step (sorted by name) until
    :meth:`plan`, then one per bucket. At each new plan every gradient's residual slices go
    to its new bucket; a bucket of the same gradients in the same order as one before keeps
    that one's whole state, the others take the step counter (what the compressor must do)."""

    def __init__(self, spec, comm, shapes):
        self.spec, self.comm, self.shapes = spec, comm, shapes
        self.buckets = [self._make(sorted(shapes))]

    @property
    def names(self):
        return [[e.key for e in layout.entries] for layout, _ in self.buckets]

    def _make(self, names):
        layout = GradientLayout([(name, self.shapes[name], "float32") for name in names])
        return layout, horovod_sparse.create(self.spec).make_pipeline(layout.n, self.comm, layout=layout)

    def plan(self, buckets):
        slices, wholes = {}, {}
        for layout, reference in self.buckets:
            cut_slices, rest = cut(layout, reference.state_dict())
            slices.update(cut_slices)
            wholes[tuple(e.key for e in layout.entries)] = rest
            reference.close()
        self.buckets = [self._make(names) for names in buckets]
        for names, (layout, reference) in zip(buckets, self.buckets):
            state = reference.state_dict()
            state.update(wholes.get(tuple(names), {}))
            for field in per_element_fields(state, layout.n):
                state[field] = np.concatenate([slices[e.key][field] for e in layout.entries])
            if "step" in rest:
                state["step"] = rest["step"]
            reference.load_state_dict(state)

    def check(self, reduced, grads):
        for layout, reference in self.buckets:
            summed = np.asarray(reference.step(layout.fuse([grads[e.key] for e in layout.entries]), tag=layout.tag))
            for e, want in zip(layout.entries, layout.split(summed / np.float32(self.comm.Get_size()))):
                np.testing.assert_allclose(reduced[e.key], want, rtol=1e-5, atol=1e-6, err_msg=e.key)

    def close(self):
        for _, reference in self.buckets:
            reference.close()
