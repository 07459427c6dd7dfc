"""The compiled engine's settings, checked without torch: the `compile` mode and the token buckets.

The planner and the params loader check them in processes that never load a model.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def default_buckets(max_tokens: int, step: int = 64) -> tuple[int, ...]:
    """Powers of two up to `step`, then multiples of `step`, up to max_tokens (itself included).

    A step of at most `step` tokens is bound by reading the weights, so padding it costs almost
    nothing; past that matmuls are bound by compute, and padding there is kept under `step` rows."""
    out, b = [], 1
    while b < min(step, max_tokens):
        out.append(b)
        b *= 2
    b = min(step, max_tokens)
    while b < max_tokens:
        out.append(b)
        b += step
    out.append(max_tokens)
    return tuple(out)


@dataclass(slots=True, frozen=True)
class Buckets:
    """Token counts a compiled forward is built for; a step pads up to the next one."""

    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        t = self.tokens
        if not t or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in t):
            raise ValueError(f"compile buckets must be positive token counts, got {t!r}")
        if list(t) != sorted(set(t)):
            raise ValueError(f"compile buckets must be strictly increasing, got {t!r}")

    def pad(self, n: int) -> int | None:
        """The bucket a step of n tokens runs in; None when it is past the largest (run eagerly)."""
        i = bisect.bisect_left(self.tokens, n)
        return self.tokens[i] if i < len(self.tokens) else None

    def key(self) -> str:
        return "-".join(map(str, self.tokens))


COMPILE_MODES = ("auto", "true", "false")


def compile_mode(value) -> str:
    """The `compile` setting as one of COMPILE_MODES (YAML gives booleans for true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)} (or a boolean), got {value!r}")
    return value
