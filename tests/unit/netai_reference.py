"""Test oracle: the NetAI'20 what-if simulator, transcribed literally, without its clock.

Source: netx-repo/training-bottleneck, ``simulation/sim_with_compression_comm.py`` and
``simulation/sim_with_compression_{resnet50,resnet101,vgg16}.py`` (commit 582a7f0),
Apache License 2.0, (c) Z. Zhang et al., "Is Network the Bottleneck of Distributed
Training?", NetAI'20. This file is an independent transcription of their formulas for
checking :mod:`horovod_sparse.whatif` against; it shares no code with the package.

What the reference does, and what this transcription changes:

* ``BackwardProc`` busy-waits each layer's backward time (scaled by ``slowdown``) and,
  after each layer, adds its time and bytes to a bucket; the bucket is sent to the
  allreduce process when its accumulated time reaches 5 ms or its bytes 64 MiB
  (``64 * 1024 * 1024``); whatever is left is sent at the end of backward.
* ``AllReduceProc`` serves buckets one at a time in arrival order. A bucket of ``size``
  bytes on ``N`` workers at ``bw`` bit/s with compression ``c`` costs
  ``size*8*(N-1)/N/bw/c + (N-1)*vec_add(size/N)`` (reduce-scatter) plus
  ``size*8*(N-1)/N/bw/c`` (allgather); ``vec_add`` is ``np.interp`` over
  ``cuda_vec_add.log`` read as float32 (clamped outside the table). The reduction is not
  compressed.
* The wall time of the two processes, divided by ``slowdown``, minus the sum of the
  backward times is the overhead; scaling factor = t_batch / (t_batch + overhead), with
  the single-GPU batch times hard-coded in the per-model scripts. Bandwidth in bit/s
  (``100e9`` ... ``1e9``, i.e. 1 Gbit/s = 1e9 bit/s).

The transcription replaces wall-clock busy-waiting with exact event times (the reference
also skips waits shorter than 30 us after slowdown, i.e. 3 us at slowdown 10; pass
``skip_below=3e-6`` to mimic that; its process start-up noise is not modelled).
"""
import numpy as np

#: ``sd_batch_time`` of the reference's per-model scripts (seconds, one V100).
BATCH_TIME = {
    "resnet101": 0.19200599479476405,
    "resnet50": 0.12808580219559176,
    "vgg16": 0.19452352295080985,
}
COMPRESSIONS = [1, 2, 5, 10, 50, 100]
WORKERS = [16, 32, 64]
LINKSPEEDS = [100e9, 40e9, 25e9, 10e9, 1e9]


class VecAddCost:
    """``VecAddCost`` of the reference: np.interp over the float32 table."""

    def __init__(self, logfile):
        xp, fp = [], []
        with open(logfile) as ifile:
            for line in ifile:
                x, y = line.strip("\n").split(",")
                xp.append(x)
                fp.append(y)
        self.xp = np.array(xp).astype(np.float32)
        self.fp = np.array(fp).astype(np.float32)

    def est(self, size):
        return np.interp(size, self.xp, self.fp)


def read_backward_log(logfile):
    """The reference's reader: a list of batches, each a list of (wait seconds, bytes)."""
    with open(logfile) as ifile:
        ifile.readline()  # comment
        batch_n = int(ifile.readline().strip("\n"))
        layer_n = int(ifile.readline().strip("\n"))
        data = []
        for _ in range(batch_n):
            bk_events = []
            for _ in range(layer_n):
                wt, s = ifile.readline().strip("\n").split(",")
                bk_events.append((float(wt) / 1e6, int(s)))
            data.append(bk_events)
        return data


def backward_sends(events, skip_below=0.0):
    """BackwardProc.run without the clock: [(send time, bucket bytes)]."""
    timeout = 0.005  # 5ms
    buff_size = 64 * 1024 * 1024  # 64MB
    now, acc_time, acc_buff, sends = 0.0, 0, 0, []
    for wait, size in events:
        if wait > skip_below:
            now += wait
        acc_time += wait
        acc_buff += size
        if acc_time >= timeout or acc_buff >= buff_size:
            sends.append((now, acc_buff))
            acc_time, acc_buff = 0, 0
    if acc_buff > 0:
        sends.append((now, acc_buff))
    return sends, now


def allreduce_cost(size, N, bw, vec_add_est, grad_compression, skip_below=0.0):
    """AllReduceProc.run's cost of one bucket (reduce-scatter stage + allgather stage)."""
    net_cost = (size * 8 * (N - 1) / N) / bw
    net_cost /= grad_compression
    add_cost = (N - 1) * vec_add_est.est(size / N)
    first_stage_cost = net_cost + add_cost
    net_cost = (size * 8 * (N - 1) / N) / bw
    net_cost /= grad_compression
    return (first_stage_cost if first_stage_cost > skip_below else 0.0) + \
        (net_cost if net_cost > skip_below else 0.0)


def get_bk_sim_time(logfile_path, N, linkspeed, add_cost, compression, skip_below=0.0):
    """(mean backward+allreduce time, mean overhead) over the log's batches."""
    coll_bktimes, overheads = [], []
    for es in read_backward_log(logfile_path):
        bk_t = np.sum(np.array(es)[:, 0])
        sends, bk_done = backward_sends(es, skip_below)
        free = 0.0
        for sent_at, size in sends:  # one allreduce process, FIFO pipe
            free = max(free, sent_at) + allreduce_cost(size, N, linkspeed, add_cost, compression, skip_below)
        bk_coll_time = max(bk_done, free)  # both processes joined
        coll_bktimes.append(bk_coll_time)
        overheads.append(bk_coll_time - bk_t)
    return np.mean(coll_bktimes), np.mean(overheads)


def scaling_factor(logfile_path, model_name, N, linkspeed, add_cost, compression, skip_below=0.0):
    """The printed ``batch_t / (batch_t + coll_overhead)``."""
    batch_t = BATCH_TIME[model_name]
    _, coll_overhead = get_bk_sim_time(logfile_path, N, linkspeed, add_cost, compression, skip_below)
    return batch_t / (batch_t + coll_overhead)
