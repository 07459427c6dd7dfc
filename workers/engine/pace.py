"""How much a long prompt's chunk may cost beside decoding streams, corrected by what steps take.

The scheduler prices a long prompt's chunk from the model and a calibration at load
(`attention_span`). A price is a model: on this CPU a chunk's attention over thousands of
positions may be bound by memory rather than arithmetic, two copies may share the memory bus,
and a chunk of two tokens reads the whole context as a chunk of sixteen does. So the price is
checked against the clock. The engine reports each step's model call in seconds; a decode-only
step after another gives the streams' own pace per decoding row, and a step that carried a long
chunk gives what the chunk added. A chunk also costs the step after it: it streamed the long
context's keys and values through the caches the streams' weights were in, so a decode-only step
right after a chunk runs slower than the streams' own pace (by a fifth on a 2-core EPYC at 4,000
positions). That step's extra time is owed by the chunk: it counts with the next chunk's, and it
never lowers the streams' own pace. Nor may another copy's chunks: a copy on the same cores slows
this one's decode-only steps while its chunks run, and this copy's clock sees that without its
cause. So the streams' pace follows a faster step at once and a slower one an eighth as fast: it
settles near the steps that ran undisturbed (a low quantile of the recent ones) and still follows
the streams' contexts as they grow. The pace then sets the chunk's tokens a step so that, on
average, a step grows by SLOWDOWN of the streams' own step, never above the configured price
(scale <= 1).

Below the fewest tokens a chunk can usefully have (a pass of the prefill kernel), the chunk runs
on some steps only: each step earns `want` tokens of credit, and a chunk of the floor's size runs
when the credit covers it. The streams then keep about 1 / (1 + SLOWDOWN) of their pace on any
machine, and the long prompt still goes on at a bounded rate (SCALE_LIMITS).
"""

from __future__ import annotations

from dataclasses import dataclass

SLOWDOWN = 0.3  # the extra time a long chunk may add to the streams' step on average, as a fraction of it
ALPHA = 0.2  # weight of the newest decode-only step in the streams' pace, where it is faster
ALPHA_UP = ALPHA / 8  # and where it is slower (see the module)
SCALE_LIMITS = (1 / 256, 1.0)
STEP_LIMITS = (0.5, 1.25)  # the most one step may shrink or grow the scale: timings are noisy


@dataclass(slots=True)
class LongChunkPace:
    """The factor on a long prompt's chunk, from observed step times (see the module)."""

    scale: float = 1.0
    per_row: float | None = None  # seconds per decoding row of a decode-only step (moving average)
    credit: float = 0.0  # tokens earned towards the next chunk while chunks run on some steps only
    owed: float = 0.0  # seconds the steps right after a chunk took beyond the streams' pace (see the module)
    after_chunk: bool = False  # the last step carried a long chunk: the next one is not the streams' own pace

    def tokens(self, share: float, floor: int) -> int:
        """The long chunk's tokens this step for a priced share (`share` tokens at scale 1), at
        least `floor` when it runs; 0: it waits for more credit this step."""
        want = share * self.scale
        if want >= floor or self.scale >= SCALE_LIMITS[1]:
            # at its price the chunk never goes below the floor: fewer tokens would cost as much
            self.credit = 0.0
            return max(floor, int(want))
        self.credit += want
        if self.credit < floor:
            return 0
        self.credit -= floor
        return floor

    def observe(self, decode_rows: int, prefill_tokens: int, long_tokens: int, long_want: float,
                seconds: float) -> None:
        """A step's model call took `seconds` for `decode_rows` decoding sequences and
        `prefill_tokens` prompt tokens, of which `long_tokens` were a long prompt's chunk that the
        pace granted `long_want` tokens a step on average."""
        after_chunk, self.after_chunk = self.after_chunk, long_tokens > 0
        if decode_rows <= 0 or seconds <= 0:
            return
        if prefill_tokens == 0:
            if not after_chunk:
                row = seconds / decode_rows
                if self.per_row is None:
                    self.per_row = row
                else:  # a slower step follows slowly: see ALPHA_UP
                    self.per_row += (ALPHA if row < self.per_row else ALPHA_UP) * (row - self.per_row)
            elif self.per_row is not None:
                self.owed += max(0.0, seconds - self.per_row * decode_rows)
            return
        if long_tokens <= 0 or long_want <= 0 or self.per_row is None:
            return  # a short prompt's prefill, or no pace to compare with yet
        streams = self.per_row * decode_rows
        extra, self.owed = seconds - streams + self.owed, 0.0
        if extra <= 0:
            factor = STEP_LIMITS[1]
        else:
            # this chunk's cost, spread over the steps that earned it, against the allowance
            factor = SLOWDOWN * streams / (extra * long_want / long_tokens)
        factor = min(max(factor, STEP_LIMITS[0]), STEP_LIMITS[1])
        self.scale = min(max(self.scale * factor, SCALE_LIMITS[0]), SCALE_LIMITS[1])
