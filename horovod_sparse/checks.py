"""Parameter checks: each returns the value, or raises ValueError naming the parameter
and the accepted range. Used by the compressors and by the pipelines they build."""
import math
import numbers


def check_fraction(name, value):
    """A float in (0, 1]; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(name, value, low, high=2**63 - 1):
    """An integer (Python or numpy, not bool) in [low, high]; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def check_nonnegative_int(name, value, upper=2**63 - 1):
    return check_int(name, value, 0, upper)


def check_choice(name, value, choices):
    """``value`` if it is one of ``choices``; ValueError naming ``name`` and the choices otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_positive_int(name, value, upper=2**31 - 1):
    return check_int(name, value, 1, upper)


def check_positive_number(name, value):
    """A finite float > 0; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not value > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_unit_interval(name, value):
    """A float in [0, 1); ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)
