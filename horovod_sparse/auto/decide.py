"""What ``Compression.auto`` decides, framework-free: per gradient, keep it dense on Horovod's
allreduce (fp32 or fp16) or hand it to one out-of-band compressor, from a measured profile.

A *plan* maps every gradient key to a *choice*: ``"none"`` (Horovod's allreduce, fp32),
``"fp16"`` (Horovod's allreduce in 16 bits) or a candidate's spec (``"topk:density=0.01"``:
that compressor's fused out-of-band exchange, error feedback included).

1. The profile (:class:`StepProfile`): the gradients in backward order, their sizes, the
   backward compute before each and after the last, from the first steps of training.
2. The costs (:class:`Costs`), fitted on the job's own ranks: Horovod's allreduce of M bytes,
   and each candidate's exchange of M float32 bytes, codec included.
3. :func:`predict` one plan: Horovod carries the dense gradients one after the other as
   backward produces them (an allreduce that ends before backward does is hidden behind it);
   the out-of-band exchanges start when every one of Horovod's allreduces is done (Horovod
   calls ``decompress`` then), one fused exchange per candidate.
4. :func:`make_plans`: the plans worth predicting: every choice alone (each candidate as a
   fixed compressor would run, small gradients dense), and mixes: a candidate for the
   gradients from a size up, or for those whose dense allreduce would not be hidden behind
   backward (Espresso's rule, measured instead of hard-coded), the rest on a dense carrier.
5. :func:`shortlist`: the plans predicted within ``prune`` x the best, fastest first, at most
   ``max_trials``; the run then measures them (as ``schedule="auto"`` does) and keeps the fastest.

The quality guard (:func:`check_candidates` at construction, :func:`guard_violations` while
training) is stated in docs/auto.md.

    profile = StepProfile(("fc2.weight", "fc1.weight"), (4096, 1 << 20), (0.0, 0.01), 0.002)
    costs = Costs(dense=CostModel(1e-4, 8e-9), candidates={"topk:density=0.01": CostModel(3e-3, 1e-10)})
    plans = make_plans(profile, costs, ["fp16", "topk:density=0.01"], dense_below=1024)
    trials = shortlist(plans, profile, costs, prune=1.5, max_trials=4)  # [(name, plan, predicted s)]
"""
import math
from dataclasses import dataclass, field

from horovod_sparse import registry
from horovod_sparse.schedule.cost import CostModel

#: the dense choices, carried by Horovod's own allreduce
NONE, FP16 = "none", "fp16"
DENSE_CHOICES = (NONE, FP16)
#: bytes per element Horovod carries for each dense choice
_DENSE_BYTES = {NONE: 4, FP16: 2}
#: the defaults of ``candidates=``
DEFAULT_CANDIDATES = ("fp16", "topk:density=0.01", "powersgd:rank=2", "qsgd:levels=127,error_feedback=true", "int4")
#: element counts from which a size-threshold mix hands gradients to a candidate
THRESHOLDS = (1 << 14, 1 << 17, 1 << 20)


@dataclass(frozen=True)
class StepProfile:
    """One step's backward, as measured: ``order`` (gradient keys as they arrive), ``sizes``
    (elements), ``compute`` (seconds of backward before each; 0 for the first), ``tail_s``
    (from the last gradient to the end of backward), ``overlap`` (whether an exchange can run
    while backward goes on: on a GPU; on a CPU backward and Horovod's thread share the cores,
    and the exchanges wait for backward's end, as :mod:`horovod_sparse.whatif` assumes too)."""

    order: tuple
    sizes: tuple
    compute: tuple
    tail_s: float = 0.0
    overlap: bool = True

    @property
    def ready(self):
        """Seconds after backward starts at which each gradient is ready."""
        out, t = [], 0.0
        for c in self.compute:
            t += c
            out.append(t)
        return out

    @property
    def backward_end(self):
        return (self.ready[-1] if self.order else 0.0) + self.tail_s


@dataclass(frozen=True)
class Costs:
    """Fitted costs, seconds: ``dense(bytes)`` of one Horovod allreduce, and per candidate
    spec ``candidates[spec](bytes)`` of its fused exchange of that many float32 bytes."""

    dense: CostModel
    candidates: dict = field(default_factory=dict)


def predict(plan, profile, costs, carried_by_horovod=True):
    """Seconds from backward's start to the end of the step's exchanges under ``plan``.
    ``carried_by_horovod`` False (TensorFlow): every gradient goes through the frontend's own
    exchange, one after the other as they come, each by its choice."""
    end = 0.0 if profile.overlap else profile.backward_end
    fused = {}
    for key, n, ready in zip(profile.order, profile.sizes, profile.ready):
        choice = plan[key]
        if choice in DENSE_CHOICES:  # Horovod's allreduces, one at a time as gradients come
            end = max(end, ready) + costs.dense(_DENSE_BYTES[choice] * n)
        elif not carried_by_horovod:
            end = max(end, ready) + costs.candidates[choice](4 * n)
        else:
            fused[choice] = fused.get(choice, 0) + 4 * n
    end = max(end, profile.backward_end)
    for choice in sorted(fused):  # after Horovod's allreduces, one exchange per candidate
        end += costs.candidates[choice](fused[choice])
    return end


def hidden_behind_backward(profile, costs, carrier):
    """Keys whose allreduce on ``carrier`` ends before backward does, in backward order, when
    every gradient before them is carried the same way (the ones after cannot delay them).
    None without overlap."""
    hidden, end = set(), 0.0
    if not profile.overlap:
        return hidden
    for key, n, ready in zip(profile.order, profile.sizes, profile.ready):
        finish = max(end, ready) + costs.dense(_DENSE_BYTES[carrier] * n)
        if finish > profile.backward_end:
            break
        hidden.add(key)
        end = finish
    return hidden


def make_plans(profile, costs, candidates, dense_below):
    """``{name: plan}``: each choice alone, and the mixes of one out-of-band candidate with a
    dense carrier (see the module docstring). Gradients under ``dense_below`` elements stay
    ``"none"`` wherever a candidate would take them, as they do for a fixed compressor."""
    keys, sizes = profile.order, dict(zip(profile.order, profile.sizes))
    carriers = [NONE] + [c for c in candidates if c == FP16]
    out_of_band = [c for c in candidates if c not in DENSE_CHOICES]

    def plan(take, choice, carrier):
        return {k: NONE if sizes[k] < dense_below else choice if take(k) else carrier for k in keys}

    plans = {NONE: {k: NONE for k in keys}}
    if FP16 in candidates:
        plans[FP16] = {k: FP16 for k in keys}  # as hvd.Compression.fp16 does: every gradient
    for choice in out_of_band:
        plans[choice] = plan(lambda k: True, choice, NONE)
        for carrier in carriers:
            hidden = hidden_behind_backward(profile, costs, carrier)
            if hidden:
                plans[f"{choice}, {carrier} where hidden"] = plan(lambda k: k not in hidden, choice, carrier)
            for threshold in THRESHOLDS:
                plans[f"{choice} from {threshold} elements, {carrier} below"] = plan(
                    lambda k: sizes[k] >= threshold, choice, carrier)
    return plans


def shortlist(plans, profile, costs, prune=1.5, max_trials=5, carried_by_horovod=True):
    """``[(name, plan, predicted seconds)]``: the distinct plans predicted within ``prune`` x the
    best, at most ``max_trials``, fastest first (ties: the earlier made, the simpler). Each
    choice alone comes first (the fixed compressors a user would otherwise pick, so that a
    wrong prediction cannot keep one of them from being measured), then the mixes."""
    predicted = [(predict(p, profile, costs, carried_by_horovod), i, name) for i, (name, p) in enumerate(plans.items())]
    predicted.sort()
    best = predicted[0][0]
    distinct, seen = [], set()
    for seconds, i, name in predicted:
        signature = tuple(sorted(plans[name].items(), key=lambda kv: str(kv[0])))
        if signature not in seen and seconds <= prune * best:
            seen.add(signature)
            distinct.append((seconds, i, name))
    alone = [e for e in distinct if e[2] in plans[e[2]].values()]  # named after its one choice
    mixes = [e for e in distinct if e not in alone]
    chosen = sorted(alone[:max_trials] + mixes[:max(0, max_trials - len(alone))])
    return [(name, plans[name], seconds) for seconds, _, name in chosen]


# -- the quality guard -------------------------------------------------------------------
def check_candidates(candidates, min_density, min_rank):
    """The candidates as specs, each checked (ValueError naming ``candidates``): ``"none"``,
    ``"fp16"``, or an out-of-band compressor with error feedback on, a density of at least
    ``min_density`` (sparsifiers) and a rank of at least ``min_rank`` (PowerSGD)."""
    if isinstance(candidates, str) or not candidates:
        raise ValueError(f"candidates must be a non-empty list of spec strings, got {candidates!r}")
    out, canonical = [], []
    for spec in candidates:
        if not isinstance(spec, str):
            raise ValueError(f"candidates must be spec strings, got {spec!r}")
        algorithm = registry.create_steady(spec)
        canonical.append(algorithm.spec)
        if algorithm.name in DENSE_CHOICES:
            out.append(algorithm.name)
            continue
        if not getattr(algorithm, "out_of_band", False):
            raise ValueError(f"candidates: {spec!r} rides Horovod's allreduce with state of its own; auto takes "
                             f"'none', 'fp16' and out-of-band compressors with error feedback")
        if getattr(algorithm, "error_feedback", None) is not True:
            raise ValueError(f"candidates: {spec!r} has no error feedback on; auto's quality guard takes lossy "
                             "compressors with error feedback only (topk, oktopk, gaussiank, powersgd, efsignsgd, ...)")
        density = getattr(algorithm, "density", None)
        if density is not None and density < min_density:
            raise ValueError(f"candidates: {spec!r} has density {density}, below min_density={min_density} "
                             "(lower min_density to allow it)")
        rank = getattr(algorithm, "rank", None)
        if rank is not None and rank < min_rank:
            raise ValueError(f"candidates: {spec!r} has rank {rank}, below min_rank={min_rank}")
        out.append(spec.strip())
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"candidates must be distinct compressors, got {list(candidates)}")
    return out


def guard_violations(ratios, bound):
    """Keys whose residual norm over gradient norm (``{key: ratio}``, the slowest rank's) is
    above ``bound``, sorted: their error feedback no longer keeps up (docs/auto.md). A ratio
    that is not finite is ignored: an inf or NaN comes from a norm past float's range (a loss
    scaler's overflow), not from error feedback falling behind, and moving a gradient off its
    candidate for it would throw away a plan the next finite step may well confirm."""
    return sorted((k for k, r in ratios.items() if math.isfinite(r) and r > bound), key=str)
