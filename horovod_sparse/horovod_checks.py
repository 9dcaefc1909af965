"""Refuse Horovod settings the sparse exchanges cannot honour, instead of being silently wrong.

Horovod passes a compressor neither the reduction op nor the process set. Sum and
Average need no check: the frontends send a one-element probe of 1.0 through
Horovod's allreduce beside each sparse exchange, and the reduced probe (1 for
Average, P for Sum, the pre/postscale factors included) scales the exchange's sum.
Adasum and process sets other than the global one are visible only in the caller's
frame, so they are looked up there (Horovod's optimizers and ``allreduce`` keep
them in ``self.op`` / ``op`` and ``self.process_set`` / ``process_set``).
"""
import sys


def check_caller(name, adasum_op, adasum_code=None, depth=4):
    """Raise ValueError if the Horovod code calling compressor ``name`` uses Adasum or a process set.

    ``adasum_op`` is the frontend's ``hvd.Adasum`` constant; ``adasum_code`` the code object
    of a function that only Adasum uses (PyTorch's Adasum optimizer is a class made at run
    time, named after the wrapped optimizer, and keeps no ``op``). Looks at up to ``depth``
    frames above the compressor's ``compress``.
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return
        local = frame.f_locals
        owner = local.get("self")
        op = local.get("op", getattr(owner, "op", None))
        process_set = local.get("process_set", getattr(owner, "process_set", None))
        if frame.f_code is adasum_code or (op is not None and op == adasum_op):
            raise ValueError(f"{name} cannot run under op=hvd.Adasum: use op=hvd.Average or hvd.Sum")
        if getattr(process_set, "process_set_id", None) not in (0, None):
            raise ValueError(f"{name} supports only the global process set, got process set "
                             f"{process_set.process_set_id}")
        frame = frame.f_back
