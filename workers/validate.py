"""Checks of settings and request values, shared by every entry point: a bool is never a number
here (YAML and JSON `true` must not pass as 1), and an error names the parameter and what to give.

Predicates (`is_int`, the wire's, and `is_number`) answer where the caller words its own error; the `check_*`
functions raise `ParamError` (a ValueError) with the parameter's name and return the value.
"""

from __future__ import annotations

import math
from typing import Any

from wire.protocol import is_int  # the wire's one definition, which the workers' checks share


class ParamError(ValueError):
    """A bad value of one parameter, named in `param` as well as in the message (an HTTP error
    names it in its `param` field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def is_number(x: Any) -> bool:
    """An int or a finite float (not a bool, not NaN or an infinity: JSON's parsers and YAML take
    `Infinity`, `1e400` and `.inf`, which no setting or sampling parameter means)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (isinstance(x, float) and not math.isfinite(x))


def check_int(name: str, x: Any, low: int | None = None) -> int:
    if not is_int(x):
        raise ParamError(name, f"{name} must be an integer, got {x!r}")
    if low is not None and x < low:
        raise ParamError(name, f"{name} must be >= {low}, got {x}")
    return x


def check_number(name: str, x: Any, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> float:
    """A number in [low, high] (or (low, high] with `low_open`)."""
    if not is_number(x):
        raise ParamError(name, f"{name} must be a finite number, got {x!r}")
    if low is not None and (x <= low if low_open else x < low):
        raise ParamError(name, f"{name} must be {'>' if low_open else '>='} {low:g}, got {x!r}")
    if high is not None and x > high:
        raise ParamError(name, f"{name} must be <= {high:g}, got {x!r}")
    return x


def check_bool(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise ParamError(name, f"{name} must be true or false, got {x!r}")
    return x
