"""Sweep the what-if model over cluster sizes and links, and say what to use.

    >>> from horovod_sparse.whatif.trace import load
    >>> rows = sweep(load("netai:vgg16"), workers=[16], gbps=[10, 100], ratios=[1, 5],
    ...              options=Options(rule="netai", latency=False, codec=False))
    >>> [(p.label, p.gbps, round(p.scaling, 2)) for p in rows]
    [('x1', 10.0, 0.21), ('x1', 100.0, 1.0), ('x5', 10.0, 0.77), ('x5', 100.0, 1.0)]
    >>> [(r.workers, r.gbps, r.choice) for r in recommend(rows)]
    [(16, 10.0, 'x5'), (16, 100.0, 'none')]
"""
from dataclasses import dataclass

from horovod_sparse.whatif import wire
from horovod_sparse.whatif.model import DEFAULT_LATENCY_S, Network, Options, predict, with_speedups

#: A compressor must beat dense by this fraction of the step to be recommended.
DEFAULT_MARGIN = 0.05
#: Predictions this close (relative) count as equally fast.
TIE = 1e-3


def sweep(trace, workers, gbps=None, compressors=None, ratios=None, options=None,
          latency_s=DEFAULT_LATENCY_S, network=None):
    """Predictions for every compressor (or ratio) x workers x bandwidth, with speed-ups
    over dense (added to the list when missing, and dropped again). ``network``, a callable
    ``workers -> Network`` (e.g. from a fitted a + b*M), replaces ``gbps``."""
    options = options or Options()
    if (compressors is None) == (ratios is None):
        raise ValueError("give compressors or ratios")
    if ratios is not None:
        items = [("ratio", r) for r in ratios]
        extra = [] if any(r == 1 for r in ratios) else [("ratio", 1)]
    else:
        items = [("compressor", c) for c in compressors]
        has_dense = any(wire.canonical(c) == "none" for c in compressors)
        extra = [] if has_dense else [("compressor", "dense")]
    links = [(None, network)] if network is not None else [(g, None) for g in gbps]
    out, added = [], set()
    for kind, value in items + extra:
        for p in workers:
            for g, make in links:
                net = make(p) if make is not None else Network.from_gbps(g, latency_s)
                pred = predict(trace, net, p, options=options, **{kind: value})
                if (kind, value) in extra:
                    added.add(id(pred))
                out.append(pred)
    with_speedups(out)
    return [p for p in out if id(p) not in added]


@dataclass
class Recommendation:
    """For one cluster size and link: the compressor (or ratio) with the shortest predicted
    step, or ``"none"`` when nothing beats dense by ``margin``."""

    workers: int
    gbps: float
    choice: str
    best: str
    speedup: float
    dense_scaling: float


def recommend(predictions, margin=DEFAULT_MARGIN):
    """One :class:`Recommendation` per (workers, bandwidth), in the order first seen."""
    groups = {}
    for p in predictions:
        groups.setdefault((p.workers, p.gbps), []).append(p)
    out = []
    for (workers, gbps), preds in groups.items():
        dense = [p for p in preds if p.ratio == 1 or (p.compressor and wire.canonical(p.compressor) == "none")]
        fastest = min(p.step_s for p in preds)
        # near-ties (0.1%) go to dense, else to the first listed (the milder compression)
        ties = [p for p in preds if p.step_s <= fastest * (1 + TIE)]
        best = next((p for p in ties if p in dense), ties[0])
        speedup = best.speedup if best.speedup is not None else 1.0
        dense_scaling = dense[0].scaling if dense else best.scaling / speedup
        is_dense = best in dense
        choice = "none" if is_dense or speedup < 1.0 + margin else best.label
        out.append(Recommendation(workers, gbps, choice, best.label, speedup, dense_scaling))
    return out


__all__ = ["sweep", "recommend", "Recommendation", "DEFAULT_MARGIN", "Options"]
