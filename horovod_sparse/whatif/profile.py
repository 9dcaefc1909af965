"""Measure a PyTorch model's backward trace and every compressor's cost on this device.

The model comes from a factory named ``package.module:function`` (``--model``), called
with no arguments. It returns either

* a ``torch.nn.Module`` with a method ``example_batch(batch)`` returning ``(x, y)`` or
  ``x``; or
* a tuple ``(model, make_batch)`` or ``(model, make_batch, loss_fn)``, where
  ``make_batch(batch)`` returns ``(x, y)`` or ``x``.

The loss is ``loss_fn(model(x), y)`` when given; otherwise mean squared error against a
float ``y``, cross-entropy against an integer ``y``, and ``mean(output**2)`` without ``y``.
``horovod_sparse.whatif.models`` has the step benchmark's models (``mlp5``, ``mlp30``,
``cnn``) in this form.

What is measured (medians over ``steps`` steps after ``warmup``):

* backward: a post-accumulate-grad hook on every parameter stamps the time its gradient
  is ready (after ``torch.cuda.synchronize()`` on CUDA); ``wait_s`` = time since the
  previous stamp (the first: since ``backward()`` was called); ``tail_s`` = backward
  after the last stamp; ``batch_time_s`` = zero_grad + forward + backward + a plain SGD
  update (what one worker pays per step without any communication);
* codec cost per compressor: Horovod's call pattern on the model's real gradients:
  ``compress`` of every gradient in backward order, then ``decompress`` of every payload
  (for the out-of-band compressors that runs the whole pipeline, its own exchange included),
  ``repeats`` times after one warm-up step;
* ``reduce``: adding two float vectors, at sizes up to the model's; ``copy_s``: one copy
  of a buffer as large as the model (memory bound of any pass over the gradient).

Run on one process, the profile is of one worker alone (``workers`` 1 in the trace): the
fused exchanges move no bytes. Run under ``mpirun -np P`` (or ``horovod-sparse profile
--np P``) every rank profiles at once, each step started together: the trace then holds
what P ranks pay where they run (``workers`` P): backward and codec under their
contention for the cores and memory, and the out-of-band compressors' pipelines as they run at
P, their exchange on the local transport and the waiting at its collectives included.
Backward times are averaged over the ranks, codec times are the slowest rank's per step
(a step ends when its slowest rank does); rank 0 returns the trace, the others None.

    >>> load_factory("horovod_sparse.whatif.models:mlp30")       # doctest: +ELLIPSIS
    <function mlp30 at ...>
"""
import importlib
import os
import platform
import statistics
import sys
import time

from horovod_sparse.whatif.trace import CodecCost, Gradient, Trace

#: What ``profile`` measures by default: the step benchmark's list (dense and fp16 are
#: Horovod's own compressors), sparsifiers at density 0.01.
DEFAULT_COMPRESSORS = (
    "dense", "hvd-fp16",
    "topk:density=0.01", "oktopk:density=0.01", "gtopk:density=0.01",
    "gaussiank:density=0.01", "dgc:density=0.01", "randomk:density=0.01", "threshold:value=1.5e-5",
    "bf16", "qsgd", "int4", "terngrad", "signsgd", "signum", "efsignsgd", "onebit", "powersgd", "fft",
)


def load_factory(ref):
    """``"package.module:attribute"`` -> the attribute (ValueError saying what is wrong)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like package.module:factory, got {ref!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())   # like `python -m`: modules of the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for --model {ref!r}: {e}") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"{module_name!r} has no attribute {attr!r} (--model {ref!r})") from None
    if not callable(obj):
        raise ValueError(f"--model {ref!r} is not callable")
    return obj


def build(factory, batch):
    """Call the factory; returns ``(model, x, y, loss_fn)`` (see the module docstring)."""
    import torch
    made = factory()
    loss_fn = None
    if isinstance(made, tuple):
        if not 2 <= len(made) <= 3:
            raise ValueError("a model factory returns a model, (model, make_batch) or (model, make_batch, loss_fn)")
        model, make_batch = made[0], made[1]
        loss_fn = made[2] if len(made) == 3 else None
    else:
        model, make_batch = made, getattr(made, "example_batch", None)
        if make_batch is None and isinstance(model, torch.nn.Module):
            raise ValueError("the factory returned a model without example_batch(batch); return "
                             "(model, make_batch) instead")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"the factory must return a torch.nn.Module, got {type(model).__name__}")
    data = make_batch(batch)
    x, y = data if isinstance(data, tuple) else (data, None)
    return model, x, y, loss_fn or default_loss(y)


def default_loss(y):
    import torch
    if y is None:
        return lambda out, _y: out.float().pow(2).mean()
    if torch.is_floating_point(y):
        return torch.nn.functional.mse_loss
    return torch.nn.functional.cross_entropy


class _Ranks:
    """The profiling processes: one (no MPI), or the ranks of ``mpirun`` (Horovod's world,
    with a private mpi4py communicator to start steps together and combine times)."""

    def __init__(self, use_horovod):
        self.size, self.rank, self.comm = 1, 0, None
        if use_horovod or launched_by_mpirun():
            import horovod.torch as hvd
            hvd.init()
            if hvd.size() > 1:
                from horovod_sparse.agreement import communicator_of  # Horovod's ranks, after hvd.init()
                self.comm = communicator_of(None).Dup()
                self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()

    def barrier(self):
        if self.comm is not None:
            self.comm.Barrier()

    def slowest(self, values):
        """Element-wise maximum over the ranks, as a float64 array."""
        import numpy as np
        from horovod_sparse.agreement import max_over_ranks
        return np.asarray(values, dtype=np.float64) if self.comm is None else max_over_ranks(self.comm, values)

    def mean(self, values):
        """Element-wise mean over the ranks, as a float64 array."""
        import numpy as np
        a = np.asarray(values, dtype=np.float64)
        if self.comm is None:
            return a
        from mpi4py import MPI
        out = np.empty_like(a)
        self.comm.Allreduce(a, out, op=MPI.SUM)
        return out / self.size


def launched_by_mpirun():
    """Whether this process is one of several ranks started by mpirun."""
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1


class _Clock:
    """perf_counter, after a device sync on CUDA."""

    def __init__(self, device):
        import torch
        self.sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def __call__(self):
        self.sync()
        return time.perf_counter()


def _to(obj, device):
    return obj.to(device) if hasattr(obj, "to") else obj


def measure_backward(model, x, y, loss_fn, device, steps=5, warmup=2, ranks=None):
    """Run ``warmup + steps`` plain steps; returns (gradients in backward order with median
    waits, parameter tensors in that order, timings dict). With several ``ranks`` each
    step starts together on all of them and the medians are averaged over the ranks."""
    import torch
    ranks = ranks or _Ranks(use_horovod=False)
    clock = _Clock(device)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    stamps = []
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, name=name: stamps.append((name, clock())))
             for name, p in params.items()]
    opt = torch.optim.SGD(params.values(), lr=1e-6)
    waits, order, fwd, bwd_tail, upd, total = {}, None, [], [], [], []
    try:
        for step in range(warmup + steps):
            ranks.barrier()
            t0 = clock()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            t1 = clock()
            stamps.clear()
            loss.backward()
            t2 = clock()
            opt.step()
            t3 = clock()
            if step < warmup:
                continue
            if not stamps:
                raise ValueError("no parameter received a gradient: nothing to trace")
            names = [n for n, _ in stamps]
            order = order or names
            prev = t1
            for name, t in stamps:
                waits.setdefault(name, []).append(t - prev)
                prev = t
            fwd.append(t1 - t0)
            bwd_tail.append(t2 - prev)
            upd.append(t3 - t2)
            total.append(t3 - t0)
    finally:
        for h in hooks:
            h.remove()
    keys = ("forward_s", "tail_s", "update_s", "batch_time_s")
    medians = ranks.mean([statistics.median(waits[name]) for name in order] +
                         [statistics.median(v) for v in (fwd, bwd_tail, upd, total)])
    grads = []
    for name, wait in zip(order, medians):
        p = params[name]
        grads.append(Gradient(name, float(wait), p.numel() * p.element_size(),
                              list(p.shape), str(p.dtype).replace("torch.", "")))
    timings = {k: float(v) for k, v in zip(keys, medians[len(order):])}
    return grads, [params[n] for n in order], timings


def _horovod_compressor(spec):
    import horovod.torch as hvd
    from horovod_sparse.whatif.wire import HOROVOD_NAMES
    if spec in HOROVOD_NAMES:
        return getattr(hvd.Compression, HOROVOD_NAMES[spec])
    import horovod_sparse.torch as hvds
    from horovod_sparse.registry import steady_spec
    name, params = steady_spec(spec)   # the steady step is what the profile times, not a warm-up's dense ones
    return hvds.Compression.from_spec(name, **params)


def _sent_fraction(compression):
    """Fraction of the fused buffer a sparsifier selected in its last step, if it says."""
    try:
        for _layout, pipeline in getattr(compression, "pipelines", {}).values():
            indices = getattr(getattr(pipeline, "last", None), "local_indices", None)
            n = getattr(pipeline, "n", None)
            if indices is not None and n:
                return float(len(indices)) / n
    except Exception:   # accounting is optional: never fail a profile for it
        return None
    return None


def measure_codec(spec, grads, device, repeats=3, ranks=None):
    """One compressor's :class:`CodecCost` on the gradients ``grads`` (backward order); with
    several ``ranks``, each step's time is its slowest rank's."""
    from horovod_sparse.whatif import wire
    ranks = ranks or _Ranks(use_horovod=False)
    clock = _Clock(device)
    compression = _horovod_compressor(spec)
    comp_t, decomp_t = [], []
    try:
        for step in range(repeats + 1):
            # fresh copies: a step's gradients are new tensors, and some compressors write
            # their result into the tensor they were given
            step_grads = [g.clone() for g in grads]
            ranks.barrier()
            t0 = clock()
            sent = [compression.compress(g) for g in step_grads]
            t1 = clock()
            for payload, ctx in sent:
                compression.decompress(payload, ctx)
            t2 = clock()
            if step:   # the first step builds the pipelines
                comp_t.append(t1 - t0)
                decomp_t.append(t2 - t1)
        fraction = _sent_fraction(compression)
    finally:
        close = getattr(compression, "close", None)
        if callable(close):
            close()
    comp_t, decomp_t = ranks.slowest([comp_t, decomp_t])
    return CodecCost(float(statistics.median(comp_t)), float(statistics.median(decomp_t)), wire.carrier(spec),
                     fraction)


def measure_reduce(max_bytes, device, repeats=5):
    """``[[bytes, seconds], ...]`` of ``a.add_(b)`` on float32 vectors, 4 KiB .. max_bytes."""
    import torch
    clock = _Clock(device)
    sizes, size = [], 4096
    while size < max_bytes:
        sizes.append(size)
        size *= 8
    sizes.append(max(4096, int(max_bytes)))
    a = torch.zeros(sizes[-1] // 4, device=device)
    b = torch.ones(sizes[-1] // 4, device=device)
    table = []
    for nbytes in sizes:
        n = nbytes // 4
        times = []
        for _ in range(repeats + 1):
            t0 = clock()
            a[:n].add_(b[:n])
            times.append(clock() - t0)
        table.append([nbytes, statistics.median(times[1:])])
    return table


def measure_copy(nbytes, device, repeats=5):
    """Median seconds of one copy of ``nbytes`` of float32."""
    import torch
    clock = _Clock(device)
    src = torch.randn(max(1, nbytes // 4), device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = clock()
        dst.copy_(src)
        times.append(clock() - t0)
    return statistics.median(times[1:])


def _progress(enabled):
    """A context manager yielding ``advance(description)``: rich's bar when available."""
    import contextlib

    @contextlib.contextmanager
    def plain(total):
        count = [0]

        def advance(what):
            count[0] += 1
            if enabled:
                print(f"[profile {count[0]}/{total}] {what}", file=sys.stderr, flush=True)
        yield advance

    if not enabled:
        return plain
    try:
        from rich.progress import Progress
    except ImportError:
        return plain

    @contextlib.contextmanager
    def bar(total):
        with Progress(transient=True) as progress:
            task = progress.add_task("profiling", total=total)

            def advance(what):
                progress.update(task, advance=1, description=what)
            yield advance
    return bar


def profile(factory, batch, device="cpu", steps=5, warmup=2, compressors=DEFAULT_COMPRESSORS, repeats=3,
            threads=None, model_name=None, show_progress=True):
    """Profile a model (a factory callable or ``"package.module:factory"``); returns a
    :class:`~horovod_sparse.whatif.trace.Trace` (on rank 0 only under ``mpirun``: None on the
    others). Compressors that fail to run are recorded in ``meta["errors"]`` and left out."""
    import torch
    if threads:
        torch.set_num_threads(int(threads))
    ref = factory if isinstance(factory, str) else getattr(factory, "__qualname__", "model")
    if isinstance(factory, str):
        factory = load_factory(factory)
    compressors = list(compressors or ())
    errors = {}
    try:
        ranks = _Ranks(use_horovod=bool(compressors))
    except Exception as e:   # no Horovod: a trace without codec costs is still useful
        if launched_by_mpirun():
            raise
        errors["horovod"] = f"{type(e).__name__}: {e}"
        compressors, ranks = [], _Ranks(use_horovod=False)
    model, x, y, loss_fn = build(factory, batch)
    model, x, y = _to(model, device), _to(x, device), _to(y, device)
    meta = dict(factory=ref, steps=steps, warmup=warmup, repeats=repeats, threads=torch.get_num_threads(),
                workers=ranks.size, torch=torch.__version__, python=platform.python_version(),
                host=platform.node(), cpus=os.cpu_count(), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                errors=errors)
    with _progress(show_progress and ranks.rank == 0)(3 + len(compressors)) as advance:
        grads, params, timings = measure_backward(model, x, y, loss_fn, device, steps, warmup, ranks)
        advance("backward trace")
        gradients = [p.grad.detach().clone() for p in params]
        nbytes = sum(g.nbytes for g in grads)
        reduce = measure_reduce(nbytes, device)
        advance("vector additions")
        copy_s = measure_copy(nbytes, device)
        advance("copy")
        costs = {}
        for spec in compressors:
            cost, error = None, None
            try:
                cost = measure_codec(spec, gradients, device, repeats, ranks)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"[:300]
            # every rank keeps a compressor only if it ran everywhere (the next one starts
            # with a barrier: no rank may skip ahead)
            if ranks.slowest([error is not None])[0]:
                errors[spec] = error or "failed on another rank"
            else:
                costs[spec] = cost
            advance(spec)
    if ranks.rank != 0:
        return None
    if device != "cpu" and str(device).startswith("cuda"):
        meta["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return Trace(model=model_name or ref.split(":")[-1], gradients=grads, device=str(device), batch=batch,
                 compressors=costs, reduce=reduce, copy_s=copy_s, workers=ranks.size, meta=meta, **timings)
