"""What a compressor learns from the Horovod code calling it, and the settings it refuses.

Horovod passes a compressor neither the reduction op, nor the process set, nor the
gradient's name. Sum and Average need no check: the frontends send a one-element probe
of 1.0 through Horovod's allreduce beside each sparse exchange, and the reduced probe
(1 for Average, the set's size for Sum, the pre/postscale factors included) scales the
exchange's sum. The rest is visible only in the caller's frames, so it is looked up
there: Horovod's optimizers and ``allreduce`` keep the op in ``self.op`` / ``op``, the
process set in ``self.process_set`` / ``process_set``, and the gradient's parameter in
``p`` with its name in ``self._parameter_names`` (``name`` in ``hvd.allreduce``).
"""
import sys
import weakref


def check_caller(name, adasum_op, adasum_code=None, depth=4, process_sets=False):
    """Raise ValueError if the Horovod code calling compressor ``name`` uses Adasum, or a
    process set other than the global one unless the frontend supports them (``process_sets``).

    ``adasum_op`` is the frontend's ``hvd.Adasum`` constant; ``adasum_code`` the code object
    of a function that only Adasum uses (PyTorch's Adasum optimizer is a class made at run
    time, named after the wrapped optimizer, and keeps no ``op``). Looks at up to ``depth``
    frames above the compressor's ``compress``.
    """
    for frame in _frames(sys._getframe(2), depth):
        local = frame.f_locals
        owner = local.get("self")
        op = local.get("op", getattr(owner, "op", None))
        process_set = local.get("process_set", getattr(owner, "process_set", None))
        if frame.f_code is adasum_code or (op is not None and op == adasum_op):
            raise ValueError(f"{name} cannot run under op=hvd.Adasum: use op=hvd.Average or hvd.Sum")
        if not process_sets and getattr(process_set, "process_set_id", None) not in (0, None):
            raise ValueError(f"{name} supports only the global process set, got process set "
                             f"{process_set.process_set_id}")


def caller_gradient(tensor, depth=3, optimizer=False):
    """``(name, parameter)`` of ``tensor`` as the Horovod code compressing it knows them:
    ``hvd.DistributedOptimizer``'s parameter name and the parameter, or the ``name=`` given
    to ``hvd.allreduce`` (parameter None); ``(None, None)`` where no name is visible (a
    direct ``compress`` call, an unnamed ``hvd.allreduce``). Looks at up to ``depth`` frames
    above the compressor's ``compress``. With ``optimizer``, a third item: the
    ``hvd.DistributedOptimizer`` calling (None if none is visible), for :class:`OneOptimizer`.

    Example: inside ``opt.step()``, ``caller_gradient(p.grad)`` is ``("fc.weight", p)``.
    """
    found = (None, None, None)
    for frame in _frames(sys._getframe(2), depth):
        local = frame.f_locals
        parameter = local.get("p")
        if parameter is not None and (parameter is tensor or local.get("tensor") is tensor
                                      or getattr(parameter, "grad", None) is tensor):
            # The grouped path compresses in a comprehension: its optimizer is one frame up.
            for owner_frame in (frame, frame.f_back):
                owner = (owner_frame.f_locals if owner_frame else {}).get("self")
                names = getattr(owner, "_parameter_names", None)
                if isinstance(names, dict):
                    found = (names.get(parameter), parameter, owner)
                    break
            else:
                continue
            break
        if local.get("tensor") is tensor and isinstance(local.get("name"), str):
            found = (local["name"], None, None)
            break
    return found if optimizer else found[:2]


class OneOptimizer:
    """The Horovod optimizer a compressor belongs to: the first that calls it. Its state is keyed
    by parameter name, and two optimizers' parameters share names (two ``nn.Sequential``: both
    ``"0.weight"``), so a second optimizer calling the same instance would mix their residuals
    without an error. ``check(optimizer)`` refuses it on every rank (the same program runs the
    same calls everywhere). An optimizer that has been deleted frees the compressor for a new one.

    Example::

        name, parameter, optimizer = caller_gradient(tensor, optimizer=True)
        self._owner.check(optimizer)      # ValueError from a second optimizer
    """

    def __init__(self, name):
        self.name = name
        self._owner = None  # a weak reference: the compressor must not keep an optimizer alive

    @property
    def optimizer(self):
        """The optimizer the compressor belongs to (None before its first step, or once gone)."""
        return None if self._owner is None else self._owner()

    def abandon_step(self):
        """Before an error escapes ``decompress`` (``nonfinite="raise"``): wait for the allreduces
        PyTorch's Horovod optimizer still has in flight for this step and forget them, as the end
        of its ``synchronize()`` would, so that the caller can skip the step and go on
        (``zero_grad()`` refuses to run while handles are left). Every rank does the same."""
        optimizer = self.optimizer
        handles = getattr(optimizer, "_handles", None)
        if not handles:
            return
        from horovod.torch.mpi_ops import synchronize  # PyTorch's optimizer only: it keeps _handles
        for key, (handle, _) in handles.items():
            if handle is not None and not callable(handle):
                synchronize(handle)  # a no-op for those already waited for
            for p in key if isinstance(key, tuple) else (key,):  # synchronize()'s own bookkeeping
                optimizer._allreduce_delay[p] = optimizer.backward_passes_per_step
        if getattr(optimizer, "_groups", None) is not None:
            optimizer._group_counts = {group: 0 for group in optimizer._group_counts}
        handles.clear()
        optimizer._synchronized = True

    def check(self, optimizer):
        if optimizer is None:
            return
        owner = None if self._owner is None else self._owner()
        if owner is None:
            self._owner = weakref.ref(optimizer)
        elif owner is not optimizer:
            raise ValueError(f"{self.name}: this compressor instance already belongs to another "
                             "hvd.DistributedOptimizer; its state is keyed by parameter name, so two "
                             "optimizers would mix their residuals. Make one compressor per optimizer "
                             "(call Compression.<name>(...) once for each)")


def caller_process_set(depth=24):
    """The Horovod process set of the code calling a compressor (None if it uses the global
    one or none is visible): Horovod keeps it in ``process_set`` or ``self.process_set``.
    ``depth`` leaves room for the frames autograph puts between Horovod and a compressor."""
    for frame in _frames(sys._getframe(1), depth):
        local = frame.f_locals
        process_set = local.get("process_set", getattr(local.get("self"), "process_set", None))
        if getattr(process_set, "process_set_id", None) is not None:
            return process_set if process_set.process_set_id != 0 else None
    return None


def _frames(frame, depth):
    """Up to ``depth`` frames, outwards from ``frame`` (None ends the walk early).

    The caller passes ``sys._getframe(n)`` itself rather than ``n``: under autograph a
    generator runs inside autograph's loop, so a frame counted from here would be another.

    Example: in ``compress``, ``for frame in _frames(sys._getframe(1), 4)`` visits its caller and three more.
    """
    for _ in range(depth):
        if frame is None:
            return
        yield frame
        frame = frame.f_back
