"""The errors every rank raises together: bad or inconsistent input to an exchange
(:class:`ExchangeError`), and a step skipped for a loss scaler's overflow
(:class:`NonFiniteGradientError`), and a launch whose Horovod ranks are not one MPI job's
processes (:class:`HorovodWorldError`). Here, outside :mod:`horovod_sparse.exchange`, so that a
frontend can catch them without importing mpi4py (importing a frontend starts no MPI)."""


class ExchangeError(ValueError):
    """Raised on EVERY rank when one rank's input is invalid or the ranks disagree.

    The check behind it is collective (see :mod:`.validation`), so every rank
    raises the same error with the same message instead of one rank failing
    alone and the others hanging in the next collective.
    """


class NonFiniteGradientError(ExchangeError):
    """Raised on EVERY rank when some rank's gradient (with its residual) held an inf or a
    NaN this step: a loss scaler's overflow. Nothing was exchanged and no state changed
    (residuals, momenta, thresholds, counters): the next step runs as if this one had not
    been. The frontends turn it into a NaN result by default, so that the scaler sees the
    overflow and skips the step (:mod:`horovod_sparse.nonfinite`).

    ranks : the ranks whose gradient was not finite (empty where the check was made on a
        dense sum, which cannot tell whose it was).
    """

    def __init__(self, message, ranks=()):
        super().__init__(message)
        self.ranks = tuple(int(r) for r in ranks)


class HorovodWorldError(RuntimeError):
    """Horovod's ranks cannot be mapped onto one MPI job's processes, so the exchanges over
    mpi4py cannot run among them, and Horovod's own collectives cannot carry them either
    (``HOROVOD_SPARSE_TRANSPORT=mpi``, or a TF1-style TensorFlow graph without eager execution,
    where Horovod's eager collectives cannot run). Raised on every rank of the Horovod job.

    Example: ``HOROVOD_SPARSE_TRANSPORT=mpi horovodrun --gloo -np 2 python train.py`` raises it at
    the first step, on both ranks (without the variable, PyTorch and TensorFlow train over
    Horovod's collectives).
    """
