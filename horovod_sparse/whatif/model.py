"""Predict one training step on P workers from a backward trace: the NetAI'20 what-if model,
plus the latency term, the codec's own cost and the installed Horovod's bucket rule.

The step, for a compressor carried by Horovod (dense, fp16, randomk):

1. gradient i is ready at sum_{j<=i} (wait_j + compress_j), where compress_j is the
   compressor's measured ``compress`` time shared out by bytes (it runs in the hook);
2. the bucket rule groups ready gradients (``netai``: 5 ms / 64 MiB; ``horovod``: the
   background loop every HOROVOD_CYCLE_TIME ms, fused up to HOROVOD_FUSION_THRESHOLD bytes;
   ``wfbp``: one per gradient; ``single``: one after backward); buckets are ring
   allreduces served one at a time: 2(P-1) latency + 2M(P-1)/P / bandwidth + (P-1)
   additions of M/P bytes (from the trace's reduction table, if any);
3. then every ``decompress``.

An out-of-band compressor (sparsifiers, quantizers, PowerSGD, FFT) hands Horovod one-float probes
during backward, then runs its whole pipeline and its own exchange after backward:
``decompress`` time (as profiled) + rounds x latency + bytes sent per rank / bandwidth
(:mod:`.wire`).

With ``compute_scale`` c (:func:`contention`: a measured forward + backward over the
profiled one) every compute time of the profile (forward, backward, update) and every codec
time is multiplied by c: the slowdown of P ranks sharing one machine's cores and memory,
which a profile at P = 1 cannot see. An out-of-band compressor also adds what it receives from the
other ranks into its result: (P-1) payloads for an allgather, 2(P-1)/P of the buffer for a
reduce-scatter + allgather (:func:`.wire.received_values`), charged at the trace's
vector-addition rate (a lower bound of decoding; 0 at P = 1, where the profile ran).
A trace profiled under ``mpirun -np P`` (``trace.workers`` = P) already holds all of that for
P workers: its codec times are used as measured, with no scaling and no addition term.

Overhead = end of the step's communication and codec work - end of backward without
any of it; scaling factor = t_batch / (t_batch + overhead); speed-up over dense = step
time of dense / step time of the compressor. Without overlap (on a CPU, where backward
and Horovod's background thread compete for the cores) the allreduces wait for the end of
backward.

    >>> from horovod_sparse.whatif.trace import load
    >>> p = predict(load("netai:resnet50"), Network.from_gbps(10), workers=16, ratio=1,
    ...             options=Options(rule="netai", latency=False, codec=False))
    >>> round(p.scaling, 3)
    0.572
"""
import os
from dataclasses import dataclass, field

from horovod_sparse.schedule.cost import CostModel, RingAllreduce, TableCost  # noqa: F401 (CostModel: doctest)
from horovod_sparse.schedule.plans import layer_plan, netai_plan, single_plan
from horovod_sparse.schedule.simulate import ready_times, simulate, simulate_cycles
from horovod_sparse.whatif import wire
from horovod_sparse.whatif.trace import CodecCost

RULES = ("netai", "horovod", "wfbp", "single")
DEFAULT_LATENCY_S = 25e-6
_HOROVOD_CYCLE_MS = 1.0
_HOROVOD_FUSION_BYTES = 128 * 1024 * 1024


def horovod_cycle_s():
    """HOROVOD_CYCLE_TIME (milliseconds) in seconds; Horovod 0.28's default is 1 ms."""
    return float(os.environ.get("HOROVOD_CYCLE_TIME", _HOROVOD_CYCLE_MS)) / 1e3


def horovod_fusion_bytes():
    """HOROVOD_FUSION_THRESHOLD in bytes; Horovod 0.28's default is 128 MiB."""
    return int(float(os.environ.get("HOROVOD_FUSION_THRESHOLD", _HOROVOD_FUSION_BYTES)))


@dataclass(frozen=True)
class Network:
    """Each rank's link: ``bandwidth_bps`` bits per second, ``latency_s`` per message round.

    >>> n = Network.from_allreduce(CostModel(a=0.0003, b=8e-9), workers=4)  # fitted a + b*M
    >>> round(n.latency_s * 1e6, 1), round(n.gbps, 3)      # a = 2(P-1) alpha, b = 2(P-1)/P * 8 / bw
    (50.0, 1.5)
    """

    bandwidth_bps: float
    latency_s: float = 0.0

    @classmethod
    def from_gbps(cls, gbps, latency_s=0.0):
        """Gbit/s as in the paper (1 Gbit/s = 1e9 bit/s)."""
        return cls(float(gbps) * 1e9, float(latency_s))

    @classmethod
    def from_allreduce(cls, cost, workers):
        """The link behind a measured ring allreduce cost a + b*M at ``workers`` ranks."""
        p = workers
        if p < 2 or cost.b <= 0:
            raise ValueError("a fitted allreduce needs workers >= 2 and b > 0")
        return cls(2.0 * (p - 1) / p * 8.0 / cost.b, max(0.0, cost.a) / (2 * (p - 1)))

    @property
    def gbps(self):
        return self.bandwidth_bps / 1e9

    def transfer(self, nbytes, rounds):
        """Seconds to send ``nbytes`` in ``rounds`` dependent messages."""
        return rounds * self.latency_s + nbytes * 8.0 / self.bandwidth_bps


@dataclass(frozen=True)
class Options:
    """How to predict. ``rule``: bucket rule (one of :data:`RULES`); ``latency``/``codec``:
    include the latency term / the compressor's own cost (False for both reproduces the
    reference); ``overlap``: allreduces may run during backward (None: yes unless the trace
    is from a CPU); ``reduce``: charge the trace's vector-addition table; ``compute_scale``:
    multiplies the profile's compute and codec times (the contention of several ranks on
    one machine, see :func:`contention`); ``codec_scale``: multiplies codec times on top."""

    rule: str = "horovod"
    latency: bool = True
    codec: bool = True
    overlap: bool = None
    reduce: bool = True
    cycle_s: float = field(default_factory=horovod_cycle_s)
    fusion_bytes: int = field(default_factory=horovod_fusion_bytes)
    channels: int = 1
    compute_scale: float = 1.0
    codec_scale: float = 1.0

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if not self.compute_scale > 0:
            raise ValueError(f"compute_scale must be > 0, got {self.compute_scale!r}")
        if not self.codec_scale >= 0:
            raise ValueError(f"codec_scale must be >= 0, got {self.codec_scale!r}")


@dataclass
class Prediction:
    """One predicted step. Times in seconds; ``wire_bytes``: sent per rank per step."""

    label: str
    workers: int
    gbps: float
    latency_s: float
    batch_s: float
    backward_s: float
    overhead_s: float
    comm_s: float
    codec_s: float
    wire_bytes: float
    buckets: int
    compressor: str = None
    ratio: float = None
    speedup: float = None
    notes: list = field(default_factory=list)

    @property
    def step_s(self):
        return self.batch_s + self.overhead_s

    @property
    def scaling(self):
        return self.batch_s / (self.batch_s + self.overhead_s)

    def row(self):
        """A flat dict (the CLI's ``--json`` rows)."""
        out = {"compressor": self.compressor} if self.compressor is not None else {"ratio": self.ratio}
        out.update(label=self.label, workers=self.workers, gbps=self.gbps, latency_s=self.latency_s,
                   batch_s=self.batch_s, backward_s=self.backward_s, overhead_s=self.overhead_s,
                   step_s=self.step_s, scaling=self.scaling, speedup=self.speedup, comm_s=self.comm_s,
                   codec_s=self.codec_s, wire_bytes=self.wire_bytes, buckets=self.buckets)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def codec_for(trace, spec):
    """The trace's :class:`CodecCost` for ``spec`` (exact key, then canonical spelling, then
    Horovod's fp16 as ours), or None."""
    if spec in trace.compressors:
        return trace.compressors[spec]
    want = wire.canonical(spec)
    for key, cost in trace.compressors.items():
        if wire.canonical(key) == want:
            return cost
    if spec == "hvd-fp16":
        return codec_for(trace, "fp16")
    return None


def contention(trace, fwd_bwd_s, compressor="dense"):
    """The compute slowdown where the steps run, relative to the profile: a measured
    forward + backward (e.g. of the dense training a user already runs, at P ranks) over
    the profiled forward + backward + that compressor's ``compress`` (which runs in the
    hooks). It carries everything that slows compute there and not in the profile: ranks
    sharing cores and memory bandwidth, Horovod's per-tensor work in the hooks and its
    background thread. Use it as ``Options(compute_scale=...)``.

    >>> from horovod_sparse.whatif.trace import Gradient, Trace
    >>> t = Trace("toy", [Gradient("w", 0.06, 4000)], batch_time_s=0.1, forward_s=0.03, update_s=0.01)
    >>> round(contention(t, 0.18), 3)    # 0.18 s measured over 0.03 + 0.06 s profiled
    2.0
    """
    if not fwd_bwd_s > 0:
        raise ValueError(f"fwd_bwd_s must be > 0, got {fwd_bwd_s!r}")
    if trace.forward_s is not None:
        profiled = trace.forward_s + trace.backward_s
    else:
        profiled = trace.batch_time_s - (trace.update_s or 0.0)
    found = codec_for(trace, compressor) if compressor else None
    profiled += found.compress_s if found is not None else 0.0
    if not profiled > 0:
        raise ValueError("the trace has no forward + backward time to compare with")
    return fwd_bwd_s / profiled


def _schedule(trace, ready, sizes, cost, options, waits, bk_end):
    if options.rule == "horovod":
        return simulate_cycles(ready, sizes, cost, options.cycle_s, options.fusion_bytes, backward_end=bk_end)
    if options.rule == "netai":
        plan = netai_plan(waits, sizes)
    elif options.rule == "wfbp":
        plan = layer_plan(len(sizes))
    else:
        plan = single_plan(len(sizes))
    return simulate(ready, sizes, plan, cost, channels=options.channels, backward_end=bk_end)


def predict(trace, network, workers, compressor=None, ratio=None, options=None, wire_bytes=None,
            horovod_network=None):
    """Predict one step (a :class:`Prediction`) for a named ``compressor`` (a spec, or
    ``dense``) or a plain compression ``ratio`` (the NetAI'20 model: the bytes on the wire
    divided by it, nothing else changes). ``wire_bytes`` overrides an out-of-band compressor's
    bytes sent per rank (e.g. the package's own accounting at that P).
    ``horovod_network``, when given, is the link as Horovod's allreduce sees it (e.g.
    calibrated from a measured dense step), ``network`` then serving the fused exchanges."""
    options = options or Options()
    if (compressor is None) == (ratio is None):
        raise ValueError("give either a compressor or a ratio")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if ratio is not None and ratio <= 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    grads = trace.gradients
    sizes = [g.nbytes for g in grads]
    slow = options.compute_scale
    base_waits = [g.wait_s * slow for g in grads]
    overlap = trace.on_gpu if options.overlap is None else options.overlap
    latency = network.latency_s if options.latency else 0.0
    reduce = TableCost(*zip(*trace.reduce)) if options.reduce and trace.reduce else None
    notes = []

    kind, cost_info = "horovod", CodecCost()
    if compressor is not None:
        kind = wire.carrier(compressor)
        found = codec_for(trace, compressor)
        if found is not None:
            cost_info = found
        elif options.codec and compressor not in ("dense", "hvd-none", "none"):
            notes.append("no codec cost in the trace: counted as 0")
    # Codec costs profiled at this P (trace.workers) already hold the contention of P ranks,
    # the out-of-band pipelines' P-rank path, their adding of the others' contributions and the
    # waiting at their collectives; profiled at another P they are scaled and completed.
    at_p = trace.workers == workers > 1
    if trace.workers > 1 and not at_p and compressor is not None:
        notes.append(f"codec costs profiled at P = {trace.workers}, used at P = {workers}")
    scale = (1.0 if at_p else slow) * options.codec_scale if options.codec else 0.0
    compress_s, decompress_s = cost_info.compress_s * scale, cost_info.decompress_s * scale

    # 1. backward, with compress() in the hooks (shared out by bytes)
    total = float(sum(sizes)) or 1.0
    waits = [w + compress_s * s / total for w, s in zip(base_waits, sizes)]
    ready = ready_times(waits)
    bk_end = (ready[-1] if ready else 0.0) + trace.tail_s * slow
    if not overlap:
        ready = [bk_end] * len(ready)

    # 2. Horovod's allreduces: the payloads (or out-of-band compressors' probes) in buckets
    if ratio is not None:
        payload, ring_ratio = sizes, float(ratio)
    else:
        payload, ring_ratio = wire.payload_bytes(compressor, grads), 1.0
    hvd_net = horovod_network or network
    hvd_latency = hvd_net.latency_s if options.latency else 0.0
    ring = RingAllreduce(hvd_net.bandwidth_bps, hvd_latency, workers, ratio=ring_ratio, reduce=reduce)
    sched = _schedule(trace, ready, payload, ring, options, waits, bk_end)
    end = sched.step_end
    sent = wire.dense_ring_bytes(sum(payload), workers) / ring_ratio
    comm = sched.busy

    # 3. the fused exchange, then decompress
    if kind == "out_of_band":
        fused = wire.out_of_band_part(grads)
        n = sum(g.nbytes for g in fused) // 4
        shapes = [g.shape for g in fused] if all(g.shape is not None for g in fused) else None
        formula, rounds = wire.fused_exchange(compressor, n, workers, shapes, cost_info.sent_fraction)
        if wire_bytes is None:
            wire_bytes = formula
            if cost_info.wire_ratio is not None:
                wire_bytes = cost_info.wire_ratio * wire.dense_ring_bytes(4 * n, workers)
        exchange = network.transfer(wire_bytes, rounds if options.latency else 0) if workers > 1 else 0.0
        if reduce is not None and workers > 1 and not at_p:   # adding the others' contributions grows with P
            decompress_s += reduce(4.0 * wire.received_values(compressor, n, wire_bytes)) * scale
        end += exchange
        comm += exchange
        sent += wire_bytes
    end += decompress_s
    label = compressor if compressor is not None else f"x{ratio:g}"
    return Prediction(label=label, compressor=compressor, ratio=ratio, workers=workers, gbps=network.gbps,
                      latency_s=latency, batch_s=trace.batch_time_s * slow, backward_s=trace.backward_s * slow,
                      overhead_s=max(0.0, end - trace.backward_s * slow), comm_s=comm,
                      codec_s=compress_s + decompress_s, wire_bytes=sent, buckets=len(sched.plan), notes=notes)


def with_speedups(predictions):
    """Fill each prediction's ``speedup`` over dense (ratio 1, or ``dense``/``none``) of the
    same workers and bandwidth, when that baseline is among them."""
    base = {}
    for p in predictions:
        if p.ratio == 1 or (p.compressor is not None and wire.canonical(p.compressor) == "none"):
            base.setdefault((p.workers, p.gbps, p.latency_s), p)
    for p in predictions:
        b = base.get((p.workers, p.gbps, p.latency_s))
        p.speedup = b.step_s / p.step_s if b is not None else None
    return predictions


__all__ = ["RULES", "Network", "Options", "Prediction", "predict", "with_speedups", "codec_for", "contention",
           "horovod_cycle_s", "horovod_fusion_bytes", "DEFAULT_LATENCY_S"]
