"""What ``Compression.auto`` would pick for a profiled model, a cluster size and a link, per
gradient: the same decision (:mod:`horovod_sparse.auto.decide`) on costs taken from the trace
and the link instead of measured on the job.

* Horovod's allreduce of M bytes: a ring, 2(P-1) rounds of latency + 2(P-1)/P M / bandwidth.
* A candidate's fused exchange of M float32 bytes: its rounds of latency, then its codec (the
  trace's measured time for the whole model, shared out by bytes) and its wire bytes
  (:func:`~horovod_sparse.whatif.wire.fused_exchange`, per byte of the model) at the link's rate.

What the run adds, and this cannot: the trials that measure the shortlist on the real job.

    >>> from horovod_sparse.whatif import load
    >>> trace = load("netai:resnet50")
    >>> name, plan, seconds = auto_choice(trace, workers=16, gbps=1, candidates=["fp16", "topk:density=0.01"])
"""
from horovod_sparse.auto.decide import DENSE_CHOICES, Costs, StepProfile, check_candidates, make_plans, shortlist
from horovod_sparse.out_of_band import DEFAULT_DENSE_BELOW
from horovod_sparse.schedule.cost import CostModel
from horovod_sparse.whatif import wire
from horovod_sparse.whatif.model import Network


def step_profile(trace):
    """The trace's backward as a :class:`StepProfile` (sizes in float32 elements; overlap on a GPU)."""
    return StepProfile(order=tuple(g.name for g in trace.gradients),
                       sizes=tuple(max(1, g.nbytes // 4) for g in trace.gradients),
                       compute=tuple(g.wait_s for g in trace.gradients), tail_s=trace.tail_s,
                       overlap=trace.on_gpu)


def costs_for(trace, workers, network, candidates):
    """:class:`Costs` of ``candidates`` (their specs) for ``workers`` ranks on ``network``."""
    p, total = workers, max(1, trace.nbytes)
    dense = CostModel(2 * (p - 1) * network.latency_s, 2 * (p - 1) / p * 8 / network.bandwidth_bps)
    fitted = {}
    for spec in candidates:
        if spec in DENSE_CHOICES:
            continue
        codec = trace.compressors.get(spec)
        codec_s = codec.codec_s if codec is not None else 0.0
        shapes = [g.shape for g in trace.gradients if g.shape]
        sent, rounds = wire.fused_exchange(spec, total // 4, p, shapes=shapes or None,
                                           sent_fraction=getattr(codec, "sent_fraction", None))
        fitted[spec] = CostModel(rounds * network.latency_s, codec_s / total + sent / total * 8 / network.bandwidth_bps)
    return Costs(dense=dense, candidates=fitted)


def auto_choice(trace, workers, gbps, candidates, latency_s=0.0, dense_below=DEFAULT_DENSE_BELOW, shortlisted=1,
                min_density=0.01, min_rank=1):
    """``(plan name, {gradient: choice}, predicted seconds from backward's start)`` of the best
    predicted plan (or the first ``shortlisted`` of them, as a list, if more than 1); the
    candidates pass auto's quality guard (``min_density``, ``min_rank``) or ValueError."""
    candidates = check_candidates(candidates, min_density=min_density, min_rank=min_rank)
    profile = step_profile(trace)
    costs = costs_for(trace, workers, Network.from_gbps(gbps, latency_s), candidates)
    plans = make_plans(profile, costs, candidates, dense_below)
    short = shortlist(plans, profile, costs, prune=float("inf"), max_trials=shortlisted)
    return short[0] if shortlisted == 1 else short
