"""A schedule's buckets exchanged on channel threads while backward still runs.

A plan (:class:`BucketPlan`) groups the gradients into buckets and pins each to a channel:
one channel for WFBP, MG-WFBP and the exact optimum, two for ASC-WFBP. A channel is a
thread with its own duplicate of the optimizer's communicator (MPI must run
``MPI_THREAD_MULTIPLE``, which mpi4py and Horovod ask for). It runs its buckets in plan
order, each as soon as all of its gradients are in: every rank then issues the same
collectives on each channel in the same order, whatever order its own gradients arrive in.

1. ``arrived(key, ...)`` (from ``compress``, as backward produces gradients): when the
   gradient completes its bucket, the channel's next complete buckets go to its thread;
2. ``finish()`` (the step's first ``decompress``): the buckets still incomplete go with
   what they have (a planned gradient that did not come); gradients outside the plan (a
   layer unfrozen after planning) form one more bucket on channel 0 once the ranks agree
   on them; then it waits for every bucket. An error in a channel is raised here, on every
   rank: each bucket's exchange starts with a layout agreement and fails collectively;
3. ``write(key, scale)``: the gradient's part of its bucket's sum, as
   the frontend's step sum writes it (PyTorch: :class:`~horovod_sparse.torch.buckets.StepSum`).

Each bucket has its own pipeline (residual, thresholds, regions): a sparsifier keeps
``density`` of each bucket rather than of the whole step (docs/results/scheduling.md).
"""
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from horovod_sparse.agreement import agree_on_layout
from horovod_sparse.layout import GradientLayout
from horovod_sparse.layout_pipeline import PIPELINE_KEY
from horovod_sparse.step.bucket import Bucket, key_order


@dataclass(frozen=True)
class BucketPlan:
    """``keys[i]``: the gradient keys of bucket i, in backward order; ``channels[i]``: its channel."""

    keys: tuple
    channels: tuple

    @property
    def channel_count(self):
        return max(self.channels, default=0) + 1

    def encode(self, known):
        """The plan as int64 (bucket count, then per bucket its channel, its size and the
        positions of its keys in ``known``, the sorted keys every rank has): what rank 0
        broadcasts, no pickles on the wire."""
        position = {k: i for i, k in enumerate(known)}
        words = [len(self.keys)]
        for keys, channel in zip(self.keys, self.channels):
            words += [channel, len(keys)] + [position[k] for k in keys]
        return np.array(words, dtype=np.int64)

    @classmethod
    def decode(cls, words, known):
        keys, channels, i = [], [], 1
        for _ in range(int(words[0])):
            channel, size = int(words[i]), int(words[i + 1])
            keys.append(tuple(known[int(p)] for p in words[i + 2:i + 2 + size]))
            channels.append(channel)
            i += 2 + size
        return cls(tuple(keys), tuple(channels))

    @classmethod
    def from_ranges(cls, ranges, order):
        """From a planner's index ranges ``(start, stop[, channel])`` over ``order`` (keys in backward order)."""
        return cls(tuple(tuple(order[b[0]:b[1]]) for b in ranges),
                   tuple(b[2] if len(b) > 2 else 0 for b in ranges))

    @classmethod
    def broadcast(cls, plan, comm, known, root=0):
        """Rank ``root``'s ``plan`` on every rank of ``comm`` (the others pass None; two
        Bcasts of int64)."""
        words = plan.encode(known) if comm.Get_rank() == root else None
        length = np.array([0 if words is None else words.size], dtype=np.int64)
        comm.Bcast(length, root=root)
        if words is None:
            words = np.empty(int(length[0]), dtype=np.int64)
        comm.Bcast(words, root=root)
        return cls.decode(words, known)


def open_channels(comm, count):
    """``count`` duplicates of ``comm`` (collective), each with the thread that uses it."""
    from mpi4py import MPI
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("schedules other than 'after_backward' exchange on threads and need MPI initialised "
                           "with MPI_THREAD_MULTIPLE (mpi4py's default; Horovod asks for it too): "
                           f"this process has thread level {MPI.Query_thread()}")
    return [(comm.Dup(), ThreadPoolExecutor(1, thread_name_prefix=f"horovod_sparse-channel-{c}"))
            for c in range(count)]


#: Python's switch interval while channels run (seconds; CPython's default is 0.005). A
#: channel thread whose MPI call returns, or that was just handed a bucket, waits for the GIL
#: until the main thread (running Horovod's hooks and the model's Python) gives it up, at the
#: latest after this interval; at 5 ms that wait came to a good part of a bucket's exchange.
SWITCH_INTERVAL_S = 0.0005


def close_channels(channels):
    for comm, thread in channels:
        thread.shutdown(wait=True)
        comm.Free()


class ChannelExchanges:
    """The buckets of ``plan`` for one optimizer, exchanged on their channels each step.

    ``channels``: [(communicator, thread)] from :func:`open_channels`, at least as many as
    the plan uses (the others are closed); ``arrays``: the frontend's step arrays
    (:mod:`horovod_sparse.step.bucket`). Call ``start_step()`` before a step's first
    ``arrived``. Attributes: ``plan``, ``buckets`` (one :class:`Bucket` per planned bucket,
    then one for the gradients outside the plan), ``channels``.
    """

    def __init__(self, algorithm, plan, comm, name, channels, arrays):
        self.plan, self.comm, self.name, self.arrays = plan, comm, name, arrays
        self.buckets = [Bucket(algorithm, arrays, keys) for keys in plan.keys] + [Bucket(algorithm, arrays)]
        self.bucket_of = {k: i for i, keys in enumerate(plan.keys) for k in keys}
        self.queues = [[i for i, c in enumerate(plan.channels) if c == channel]
                       for channel in range(plan.channel_count)]
        self.channels = channels[:plan.channel_count]
        close_channels(channels[plan.channel_count:])
        self._switch_interval = sys.getswitchinterval()  # restored by close()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self.start_step()

    def start_step(self):
        self.missing = [len(keys) for keys in self.plan.keys]  # gradients each bucket still waits for
        self.started = [0] * len(self.queues)                  # buckets handed to each channel's thread
        self.futures = [None] * len(self.buckets)
        self.results = None
        # when things happened this step (perf_counter seconds): the timeline of one step
        self.clock = {"arrived": [], "buckets": {}, "finish": None}

    # -- a step ---------------------------------------------------------------------------
    def arrived(self, key, recorded, frozen):
        """``key`` was just added to this step's ``recorded`` or ``frozen`` gradients (key ->
        tensor, the compressor's); start its bucket (and the complete ones after it) when complete."""
        self.recorded, self.frozen = recorded, frozen
        self.clock["arrived"].append(time.perf_counter())
        i = self.bucket_of.get(key)
        if i is not None:
            self.missing[i] -= 1
            if self.missing[i] == 0:
                self._start(self.plan.channels[i])

    def _start(self, channel, everything=False):
        queue = self.queues[channel]
        while self.started[channel] < len(queue):
            i = queue[self.started[channel]]
            if self.missing[i] and not everything:
                break
            self._submit(i, channel, self.plan.keys[i])
            self.started[channel] += 1

    def _submit(self, i, channel, keys):
        recorded = {k: self.recorded[k] for k in keys if k in self.recorded}
        frozen = {k: self.frozen[k] for k in keys if k in self.frozen}
        comm, thread = self.channels[channel]
        self.clock["buckets"][i] = {"channel": channel, "gradients": len(recorded), "ready": time.perf_counter()}
        self.futures[i] = thread.submit(self._exchange, i, recorded, frozen, comm)

    def _exchange(self, i, recorded, frozen, comm):
        """Bucket i's exchange, on its channel's thread, timed."""
        times = self.clock["buckets"][i]
        times["start"] = time.perf_counter()
        try:
            return self.buckets[i].exchange(recorded, frozen, comm, self.name)
        finally:
            times["end"] = time.perf_counter()

    def finish(self, recorded, frozen):
        """Start what is left, wait for every bucket; raise the first error (every rank raises)."""
        self.recorded, self.frozen = recorded, frozen
        self.clock["finish"] = time.perf_counter()
        for channel in range(len(self.queues)):
            self._start(channel, everything=True)
        unplanned = sorted((k for k in {**self.recorded, **self.frozen} if k not in self.bucket_of), key=key_order)
        error = None
        try:  # the same extra bucket on every rank, or none: ranks whose layers differ fail here together
            everything = {**self.recorded, **self.frozen}
            items = [(k, shape, dtype + ("/frozen" if k in self.frozen else ""))
                     for k in unplanned for shape, dtype in [self.arrays.describe(everything[k])]]
            agree_on_layout(GradientLayout(items), self.comm, self.name)
        except ValueError as e:
            error = e
        else:
            if unplanned:
                self._submit(len(self.buckets) - 1, 0, unplanned)
        results = []
        for future in self.futures:
            try:
                results.append(None if future is None else future.result())
            except Exception as e:  # noqa: BLE001  (re-raised below, after every channel is idle)
                error = error or e
                results.append(None)
        if error is not None:
            self.results = []
            raise error
        self.results = results
        return self

    def timeline(self):
        """The last finished step, in seconds after its first gradient arrived: ``arrived``
        (each exchanged gradient's arrival at ``compress``), ``finish`` (its first
        ``decompress``) and per bucket its channel, gradients, ``ready`` (handed to the
        channel), ``start`` and ``end`` (of its exchange on the channel's thread)."""
        if self.results is None or not self.clock["arrived"]:
            return None
        zero = self.clock["arrived"][0]
        return {"arrived": [t - zero for t in self.clock["arrived"]], "finish": self.clock["finish"] - zero,
                "buckets": [{"bucket": i, **{k: (v - zero if k in ("ready", "start", "end") else v)
                                             for k, v in times.items()}}
                            for i, times in sorted(self.clock["buckets"].items())]}

    def result_of(self, key):
        """The step sum of ``key``'s bucket (after :meth:`finish`)."""
        return self.results[self.bucket_of.get(key, len(self.buckets) - 1)]

    def write(self, key, scale):  # PyTorch's step sums
        return self.result_of(key).write(key, scale)

    def part(self, key):  # TensorFlow's step parts
        return self.result_of(key).part(key)

    # -- state ----------------------------------------------------------------------------
    def pipelines(self):
        """``{"bucket i": (layout, pipeline)}`` of the buckets exchanged so far (traffic accounting)."""
        return {f"bucket {i}": (b.layout, b.pipeline) for i, b in enumerate(self.buckets) if b.pipeline is not None}

    def state_dict(self):
        """``({gradient key: {field: slice}}, [whole-buffer state of each bucket or None])``."""
        slices, wholes = {}, []
        for bucket in self.buckets:
            state = bucket.pipelines.state_dict()
            wholes.append(state.pop(PIPELINE_KEY, None))
            slices.update(state)
        return slices, wholes

    def load_state_dict(self, slices, wholes=()):
        """Give each bucket its gradients' slices, and the whole-buffer state saved for it
        (``wholes[i]``; a bucket whose layout differs takes only its step counter)."""
        last = len(self.buckets) - 1
        for i, bucket in enumerate(self.buckets):
            keys = set(bucket.keys) if i < last else {k for k in slices if k not in self.bucket_of}
            state = {k: v for k, v in slices.items() if k in keys}
            if i < len(wholes) and wholes[i] is not None:
                state[PIPELINE_KEY] = wholes[i]
            bucket.pipelines.load_state_dict(state)

    def close(self):
        close_channels(self.channels)
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        for bucket in self.buckets:
            bucket.close()
