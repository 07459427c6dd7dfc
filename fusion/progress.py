"""Progress of a batch run, per model: a tqdm bar each on a terminal, plain periodic lines otherwise,
and a final summary (samples, tokens generated, tokens/s, wall time)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


@dataclass(slots=True)
class ModelStats:
    name: str
    total: int  # samples this run must account for (including ones already written)
    samples: int = 0  # served in this run
    skipped: int = 0  # already written by an earlier run
    errors: int = 0
    tokens: int = 0
    started: float | None = None
    finished: float | None = None

    @property
    def seconds(self) -> float:
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started

    def summary(self) -> str:
        s = self.seconds
        rate = self.tokens / s if s else 0.0
        extra = f", {self.skipped} already written" if self.skipped else ""
        extra += f", {self.errors} errors" if self.errors else ""
        return (f"{self.name}: {self.samples} samples, {self.tokens} tokens generated, {rate:.1f} tokens/s, "
                f"{s:.1f}s wall{extra}")


class Progress:
    def __init__(self, totals: dict[str, int], stream=None, interval: float = 5.0, bars: bool | None = None):
        self.stream = stream or sys.stderr
        self.interval = interval
        self.stats = {name: ModelStats(name, total) for name, total in totals.items()}
        use_bars = self.stream.isatty() if bars is None else bars
        self.bars = {}
        if use_bars:
            from tqdm import tqdm

            self.bars = {name: tqdm(total=total, desc=name, unit="sample", position=i, file=self.stream,
                                    dynamic_ncols=True) for i, (name, total) in enumerate(totals.items())}
        self._last_line = time.monotonic()

    def start(self, name: str) -> None:
        st = self.stats[name]
        if st.started is None:
            st.started = time.perf_counter()

    def advance(self, name: str, samples: int = 0, tokens: int = 0, skipped: int = 0, errors: int = 0) -> None:
        st = self.stats[name]
        st.samples += samples
        st.skipped += skipped
        st.errors += errors
        st.tokens += tokens
        if samples or errors:
            st.finished = time.perf_counter()
        bar = self.bars.get(name)
        if bar is not None:
            bar.update(samples + skipped + errors)
            bar.set_postfix(tokens=st.tokens, refresh=False)
            return
        now = time.monotonic()
        if now - self._last_line >= self.interval or self._all_done():
            self._last_line = now
            for s in self.stats.values():
                done = s.samples + s.skipped + s.errors
                print(f"[{s.name}] {done}/{s.total} samples ({s.tokens} tokens)", file=self.stream, flush=True)

    def _all_done(self) -> bool:
        return all(s.samples + s.skipped + s.errors >= s.total for s in self.stats.values())

    def close(self) -> list[str]:
        for bar in self.bars.values():
            bar.close()
        return [s.summary() for s in self.stats.values()]
