"""The package's environment switches: read where they are used, checked where the ranks agree.

A switch is read at each use, so that a test or a script may change it between steps. A rank
that raised alone in the middle of a step would leave the others waiting in the next collective,
so a value outside the switch's choices reads as its default there, and the ranks find it out
together instead:

- every exchange's agreement header carries :func:`first_invalid`
  (:func:`horovod_sparse.exchange.validation.agree_call`), and every rank raises the same
  ``ExchangeError`` naming the rank and the variable before any data moves;
- compressors that ride Horovod's allreduce, which have no header of their own, check with
  :func:`problem_here` when the ranks first agree on them;
- ``horovod-sparse doctor`` fails on it.

Example::

    from horovod_sparse import switches
    switches.read(switches.KERNELS)      # "numba" unless HOROVOD_SPARSE_KERNELS says otherwise
"""
import os

#: the kernels of the codecs on CPU tensors: "numba" (where installed), "numpy", or "torch"
#: (CPU tensors take the path a CUDA tensor takes)
KERNELS = "HOROVOD_SPARSE_KERNELS"
#: whether device buffers go to MPI as they are: "auto" (CUDA tensors where MPI reports CUDA
#: support), "on" (every torch tensor that would cross to the host), "off"
DEVICE_BUFFERS = "HOROVOD_SPARSE_DEVICE_BUFFERS"
#: each switch's choices, its default first (the header names a switch by its place here)
CHOICES = {KERNELS: ("numba", "numpy", "torch"), DEVICE_BUFFERS: ("auto", "on", "off")}


def _value(variable):
    return os.environ.get(variable, "").strip().lower() or CHOICES[variable][0]


def read(variable):
    """The switch's value in force: the environment's where it is one of the choices, else the
    default (the agreement then fails on every rank: module docstring).

    >>> read(KERNELS) in CHOICES[KERNELS]
    True
    """
    value = _value(variable)
    return value if value in CHOICES[variable] else CHOICES[variable][0]


def problem(variable):
    """What is wrong with the switch's value on this rank, in words; None if nothing."""
    value = _value(variable)
    if value in CHOICES[variable]:
        return None
    return f"{variable} must be one of {list(CHOICES[variable])}, got {value!r}"


def problem_here():
    """Every switch's problem on this rank, joined; None if there is none."""
    problems = [p for p in map(problem, CHOICES) if p is not None]
    return "; ".join(problems) or None


def first_invalid():
    """The place in :data:`CHOICES` of the first switch whose value is not one of its
    choices, or -1 (an int for the agreement header)."""
    return next((i for i, variable in enumerate(CHOICES) if problem(variable)), -1)


def invalid_text(place):
    """The words for :func:`first_invalid`'s ``place``, the same on every rank."""
    variable = list(CHOICES)[place]
    return f"{variable} is set to none of {list(CHOICES[variable])}"
