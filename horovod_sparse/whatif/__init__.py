"""Should I compress? A what-if advisor: from a backward trace, a link and a cluster size,
predict the step time with each compressor and say which one to use, or none.

It follows "Is Network the Bottleneck of Distributed Training?" (Zhang et al., NetAI'20):
gradients become ready during backward, are bucketed and ring-allreduced one bucket at
a time, and the overhead beyond backward gives the scaling factor
t_batch / (t_batch + overhead). Unlike the paper's simulator it also charges the latency
of every message round and the compressor's own measured cost, uses the installed
Horovod's bucket rule (or the paper's, per layer, or one bucket), and models the fused
compressors' own exchanges. See docs/results/whatif.md.

    >>> from horovod_sparse.whatif import Network, Options, load, predict
    >>> p = predict(load("netai:resnet50"), Network.from_gbps(10), workers=16, ratio=5,
    ...             options=Options(rule="netai", latency=False, codec=False))
    >>> round(p.scaling, 3)
    0.998

Modules: :mod:`.trace` (formats), :mod:`.wire` (bytes per compressor), :mod:`.model`
(one prediction), :mod:`.advise` (sweeps and recommendations), :mod:`.profile`
(measuring a PyTorch model), :mod:`.plot`. The building blocks (cost models, plans, the
simulator) are in :mod:`horovod_sparse.schedule`.
"""
from horovod_sparse.whatif.advise import Recommendation, recommend, sweep
from horovod_sparse.whatif.model import RULES, Network, Options, Prediction, contention, predict
from horovod_sparse.whatif.trace import CodecCost, Gradient, Trace, load, read_bk_log

__all__ = ["RULES", "Network", "Options", "Prediction", "predict", "contention", "sweep", "recommend",
           "Recommendation", "Trace", "Gradient", "CodecCost", "load", "read_bk_log"]
