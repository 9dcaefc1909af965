"""The compression warm-up's decisions (horovod_sparse.warmup), on one rank: the schedule, the
count each step selects, the regime reported, and the overflow rule (a skipped step does not
move the warm-up on)."""
import math

import numpy as np
import pytest
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.warmup import Warmup

N = 10_000


def test_dense_then_a_geometric_ramp_then_the_target_and_nothing_moves_after():
    w = Warmup(10)
    densities = [w.density(step, 0.01) for step in range(40)]
    assert densities[:10] == [1.0] * 10
    ramp = densities[10:20]
    assert all(a > b for a, b in zip(ramp, ramp[1:])) and ramp[-1] == pytest.approx(0.01)
    ratios = [b / a for a, b in zip(ramp, ramp[1:])]   # geometric: the same factor every step
    assert max(ratios) == pytest.approx(min(ratios)) == pytest.approx(0.01 ** 0.1)
    assert densities[20:] == [0.01] * 20               # steady: no change where the gradient is steady
    assert [w.phase(s) for s in (9, 10, 19, 20)] == ["dense", "ramp", "ramp", "steady"]
    assert Warmup(0).phase(0) == "steady" and Warmup(0).density(0, 0.01) == 0.01


@pytest.mark.parametrize("spec, ramps", [("topk:density=0.01,warmup_steps=3", True),
                                         ("topk:density=0.01,exchange=dsa,warmup_steps=3", True),
                                         ("topk:density=0.01,exchange=gtopk,warmup_steps=3", False),
                                         ("oktopk:density=0.01,warmup_steps=3", False)])
def test_each_step_selects_the_warm_ups_count(spec, ramps):
    rng = np.random.default_rng(0)
    with horovod_sparse.create(spec).make_pipeline(N, MPI.COMM_SELF) as sparsifier:
        counts, methods, regimes = [], [], []
        for _ in range(8):
            regimes.append(sparsifier.regime())
            sparsifier.step(rng.standard_normal(N).astype(np.float32))
            counts.append(int(sparsifier.last.local_indices.shape[0]))
            methods.append(sparsifier.last.method)
    assert methods[:3] == ["dense"] * 3 and "dense" not in methods[3:]
    assert counts[:3] == [N] * 3
    if ramps:
        assert counts[3:6] == [math.ceil(0.01 ** (i / 3) * N) for i in (1, 2, 3)] and counts[6:] == [100, 100]
        assert regimes[3] == "warm-up: density 0.2154, falling to 0.01 by step 6"
    elif spec.startswith("topk"):
        assert counts[3:] == [100] * 5
    assert regimes[0] == "warm-up: dense until step 3" and regimes[-1] == "steady: density 0.01"


def test_the_ramp_goes_dense_while_a_dense_allreduce_sends_fewer_bytes():
    """At P ranks a count of n / P or more costs more as (index, value) pairs than as a dense sum."""
    with horovod_sparse.create("topk:density=0.1,warmup_steps=4").make_pipeline(N, MPI.COMM_SELF) as s:
        ramp = [math.ceil(0.1 ** (i / 4) * N) for i in (1, 2, 3, 4)]   # 5624, 3163, 1779, 1000
        assert [s.k_at(step) for step in range(9)] == [N] * 4 + ramp + [1000]
        s.engine.size = 4   # as if at 4 ranks (the count is all the rule reads)
        assert [s.k_at(step) for step in range(9)] == [N] * 6 + ramp[2:] + [1000]


@pytest.mark.parametrize("spec", ["topk:density=0.1,warmup_steps=4", "topk:density=0.01,warmup_steps=100",
                                  "topk:density=0.2,exchange=dsa,warmup_steps=2", "topk:density=0.01,exchange=gtopk,warmup_steps=5",
                                  "oktopk:density=0.01,warmup_steps=3", "powersgd:warmup_steps=3", "topk:warmup_steps=0"])
def test_the_steps_the_frontend_hands_to_horovod_are_dense_in_every_pipeline(spec):
    """``dense_steps(P)``, the steps PyTorch's frontend hands to Horovod's allreduce, are steps on
    which every pipeline of the compressor, whatever its size, would send its whole buffer; the
    step after them is not, unless only the rounding up of its count makes it so (or a tiny
    buffer's k / n above the density)."""
    compressor = horovod_sparse.create(spec)
    for size in (1, 2, 3, 4, 8):
        carried = compressor.dense_steps(size)
        assert carried >= compressor.warmup_steps
        for n in (1, 7, 1000, 10_007, 250_000):
            with compressor.make_pipeline(n, MPI.COMM_SELF) as pipeline:
                if hasattr(pipeline, "engine"):
                    pipeline.engine.size = size   # as if at `size` ranks
                    assert all(pipeline.k_at(step) == n for step in range(carried)), (size, n)
                    # the step after them is dense only by rounding up (or, in a tiny buffer, by its
                    # k / n above the density: such a step goes out of band, dense)
                    if n >= 1000 and pipeline.k < n and pipeline.k_at(carried) == n:
                        assert 0.99 <= pipeline.warmup.density(carried, compressor.density) * size < 1 + 1e-9, (size, n)
                else:   # PowerSGD: dense steps only, no ramp
                    assert carried == compressor.warmup_steps and pipeline.warmup.phase(carried) != "dense"
    assert [horovod_sparse.create("topk:density=0.01,warmup_steps=100").dense_steps(p) for p in (1, 2, 4)] == \
        [100, 115, 130]


@pytest.mark.parametrize("spec", ["topk:density=0.01,warmup_steps=2", "powersgd:warmup_steps=2"])
def test_an_overflowed_step_does_not_move_the_warm_up_on(spec):
    rng = np.random.default_rng(1)
    grad = rng.standard_normal(N).astype(np.float32)
    with horovod_sparse.create(spec).make_pipeline(N, MPI.COMM_SELF) as pipeline:
        pipeline.step(grad)
        before = pipeline.state_dict()
        bad = grad.copy()
        bad[7] = np.inf
        with pytest.raises(NonFiniteGradientError):
            pipeline.step(bad)
        after = pipeline.state_dict()
        assert pipeline.step_count == 1 and pipeline.regime() == "warm-up: dense until step 2"
        assert before.keys() == after.keys()
        assert all(np.array_equal(before[k], after[k]) for k in before)
