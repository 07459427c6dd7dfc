"""How much a long prompt's chunk may cost beside decoding streams, corrected by what steps take.

The scheduler prices a long prompt's chunk from the model and a calibration at load
(`attention_span`). A price is a model: on this CPU a chunk's attention over thousands of
positions may be bound by memory rather than arithmetic, two copies may share the memory bus,
and a chunk of two tokens reads the whole context as a chunk of sixteen does. So the price is
checked against the clock. The engine reports each step's seconds; a decode-only step gives the
streams' own pace per decoding row, and a step that carried a long chunk gives what the chunk
added. When that exceeds SLOWDOWN of the streams' step, the chunk shrinks (scale < 1); when it
stays below, the chunk grows back, never above the configured price (scale <= 1). The streams
then keep about 1 / (1 + SLOWDOWN) of their pace on any machine, while the long prompt goes on
at least min_long_chunk tokens a step.
"""

from __future__ import annotations

from dataclasses import dataclass

SLOWDOWN = 0.6  # the extra time a long chunk may add to the streams' step, as a fraction of it
ALPHA = 0.2  # weight of the newest decode-only step in the streams' pace
SCALE_LIMITS = (1 / 64, 1.0)
STEP_LIMITS = (0.5, 1.25)  # the most one step may shrink or grow the scale: timings are noisy


@dataclass(slots=True)
class LongChunkPace:
    """The factor on a long prompt's chunk, from observed step times (see the module)."""

    scale: float = 1.0
    per_row: float | None = None  # seconds per decoding row of a decode-only step (moving average)

    def observe(self, decode_rows: int, prefill_tokens: int, long_chunk: bool, seconds: float) -> None:
        """A step's model call took `seconds` for `decode_rows` decoding sequences and
        `prefill_tokens` prompt tokens, a long prompt's chunk among them when `long_chunk`."""
        if decode_rows <= 0 or seconds <= 0:
            return
        if prefill_tokens == 0:
            row = seconds / decode_rows
            self.per_row = row if self.per_row is None else (1 - ALPHA) * self.per_row + ALPHA * row
            return
        if not long_chunk or self.per_row is None:
            return  # a short prompt's prefill, or no pace to compare with yet
        streams = self.per_row * decode_rows
        extra = seconds - streams
        factor = STEP_LIMITS[1] if extra <= 0 else SLOWDOWN * streams / extra
        factor = min(max(factor, STEP_LIMITS[0]), STEP_LIMITS[1])
        self.scale = min(max(self.scale * factor, SCALE_LIMITS[0]), SCALE_LIMITS[1])
