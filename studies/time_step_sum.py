"""What writing a sparse step's sum back into the gradients costs (PyTorch's ``StepSum``).

A sparsifier's sum is (sorted indices into the fused buffer, values); ``StepSum`` finds where each
gradient's pairs start and writes them into that gradient (zeros elsewhere). Timed here for
ResNet-18's 62 gradients (11.2M elements) at a ramp step's densities and the steady one, with
random sorted indices: the construction plus every gradient's ``write``, median of 9, one thread.

    PYTHONPATH=<tree> python studies/time_step_sum.py 0.3 0.1 0.01

Run it with ``PYTHONPATH`` on two trees (a git worktree of the commit before) back to back to
compare them; the answer is in docs/results/performance.md.
"""
import statistics
import sys
import time

import numpy as np
import torch

from horovod_sparse.layout import GradientLayout
from horovod_sparse.torch.buckets import StepSum
from horovod_sparse.workloads.digits_resnet import build_model


def main(densities):
    torch.set_num_threads(1)
    params = list(build_model().named_parameters())
    layout = GradientLayout([(name, tuple(p.shape), "float32") for name, p in params])
    gradients = {name: torch.zeros_like(p) for name, p in params}
    rng = np.random.default_rng(0)
    for density in densities:
        k = int(density * layout.n)
        indices = torch.from_numpy(np.sort(rng.choice(layout.n, k, replace=False)).astype(np.int64))
        values = torch.from_numpy(rng.standard_normal(k).astype(np.float32))
        times = []
        for _ in range(9):
            start = time.perf_counter()
            step_sum = StepSum(layout, gradients, (indices, values))
            for name, _ in params:
                step_sum.write(name, 0.5)
            times.append(time.perf_counter() - start)
        print(f"n={layout.n} density={density} pairs={k}: median {statistics.median(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main([float(a) for a in sys.argv[1:]] or [0.3, 0.1, 0.01])
