"""Which kernel multiplies a weight-only quantized linear at each row count, measured on this machine.

A step of a few rows (decode of a few streams) is bound by the bytes of weights it reads, and the
C++ kernels that read the int4 or int8 blocks as they are win it. A step of many rows (a prompt's
chunk, a large batch) is bound by arithmetic, where ATen's GEMM on the weights widened to the
compute dtype (`qlinear_widened`: oneDNN, with AMX tiles where the CPU has them) may win instead.
Which one wins, and from how many rows, depends on the CPU: on an AVX512-BF16 CPU without AMX the
blocks' own strips held level with oneDNN at 64 rows, while on an AMX CPU oneDNN did the batch 3x
faster. A choice measured on one machine was wrong on another, so each worker measures it at load:
every candidate on each distinct linear shape at the row counts of BUCKETS up to the most rows a
step of the engine can have, from the largest down while the GEMM wins, best of a few calls. A call
of few rows multiplies every layer's linear of the shape in turn, so that their weights stream from
memory as in a step; one of many rows, which is bound by arithmetic (each weight serves every row),
fewer layers (layers_timed): the same comparison for a fraction of the time a worker spends at load. The
result is cached under a key of the machine, torch, the kernels' build, the threads and the shape,
so a later load on the same machine reads it.

The choice is one crossover per shape: the blocks below it, the widened GEMM from it on, taken
only where the GEMM wins at that bucket by MARGIN and the blocks win none of the larger ones measured
by MARGIN (level buckets take the GEMM's way too). So a noisy bucket in the middle does not flip a
linear back and forth, and the same timings always give the same choice.
`deterministic` takes none of this: its strips multiply every row count one way (Linear.make_invariant).

Where the CPU has bfloat16 dot products, a third way joins: PACKED, the blocks' values packed once
in bfloat16 in the tiles' layout (a file every copy maps) and multiplied by ATen's batch-reduce GEMM
on AMX tiles, or without them by the strips' register tiles (vdpbf16ps reads the same layout;
kernels/amx_linear.cpp). Above the crossover, each bucket then takes PACKED unless WIDENED beats it
by MARGIN (batch_way). On an AVX512-BF16 EPYC (Zen 5) it took 0.5-0.6x the blocks' time on
SmolLM2's layer linears at 16 rows and 0.85-0.96x at 64-512, where the blocks widen their values on
every call.

Where the CPU computes in bfloat16 without AMX tiles, a fourth way joins: FLOAT32, the blocks' values
widened once to float32 (a file every copy maps) and multiplied by ATen's float32 GEMM, the
activations widened on the way in and the result rounded back. An Intel core without its tiles issues
bfloat16 dot products at half the rate of its float32 FMAs, so a bfloat16 GEMM of many rows does
no more arithmetic a cycle than a float32 one and pays the conversions: on a Sapphire Rapids capped
to AVX512-BF16, SmolLM2's layer linears at 64 rows took 1.3-1.7x as long in bfloat16 (blocks,
widened or oneDNN's packed) as in float32. A CPU whose bfloat16 dot products run at twice the rate
(AMD's Zen 4) measures the other way, and keeps the 16-bit ways.

Where the kernels have the 8-bit activations' path for the compute dtype (bfloat16 on AVX512-VNNI,
float32 on AVX2: kernels/qlinear_act8.h) and the model's weights are 16-bit, the blocks' kernel may
round a call's activations to 8 bits a block of 32, as llama.cpp does, at up to ACT8_ROWS rows:
ACT8, timed against the blocks at the buckets up to ACT8_ROWS and taken (RowChoice.act8: up to
the largest such bucket) at each from the smallest up that the blocks do not beat by MARGIN. It
reads the same bytes with a third of the instructions (2.2-2.5x the blocks' speed on a Sapphire
Rapids), and a load on a busy machine once timed a bucket level and dropped it for one linear of
five, so level keeps it; on AVX2, whose 16 registers hold half the output rows a pass at 3-4 rows,
it may win one row and not four. The crossover is then measured with the blocks
as chosen.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers import files
from workers.capability import machine_tag
from workers.engine.cpu import calibrate
from workers.kernel_notes import CHOICE_VERSION

BUCKETS = (1, 4, 16, 64, 256, 512)  # the step sizes (rows) measured
# the quantized blocks' own kernels; ATen's GEMM on widened weights; AMX tiles on packed bfloat16
# weights; ATen's float32 GEMM on the values widened once to float32
BLOCKS, WIDENED, PACKED, FLOAT32 = "blocks", "widened", "packed", "float32"
WAYS = (BLOCKS, WIDENED, PACKED, FLOAT32)
BATCH_WAYS = (WIDENED, PACKED, FLOAT32)  # the many-rows ways
# the blocks with the activations rounded to 8 bits, which the kernels take at up to ACT8_ROWS rows
ACT8 = "act8"
ACT8_ROWS = 4
# the widened GEMM replaces the blocks only where it is this much faster: timings on a busy machine
# are noisy, and the blocks hold a quarter of the bytes
MARGIN = 0.10
# timed calls per way and bucket stop once each way has spent this long: a call of many rows over
# every layer of a shape takes a tenth of a second or more, and averages over those layers already
BUDGET_SECONDS = 0.1
# up to this many rows a call reads every layer's weights, as a step does: few rows are bound by the
# bytes of weights read. Above it the layers timed shrink in proportion to the rows, to MIN_LAYERS:
# many rows are bound by arithmetic, and timing every layer at 512 rows took seconds a shape
STREAM_ROWS = 16
MIN_LAYERS = 2


@dataclass(frozen=True, slots=True)
class RowChoice:
    """The blocks below `widened_from` rows, the many-rows way `batch` from there on (None: never),
    and from each `switches` row count (ascending) the way it names. `act8`: the blocks round the
    activations of calls of up to this many rows (at most ACT8_ROWS; 0: none) to 8 bits."""

    widened_from: int | None = None
    batch: str = WIDENED
    switches: tuple[tuple[int, str], ...] = ()
    act8: int = 0

    def __post_init__(self) -> None:
        if self.widened_from is not None and self.widened_from < 1:
            raise ValueError(f"widened_from must be a row count of at least 1 or None, got {self.widened_from}")
        if not 0 <= self.act8 <= ACT8_ROWS:
            raise ValueError(f"act8 must be a row count from 0 to {ACT8_ROWS}, got {self.act8}")
        if any(w not in BATCH_WAYS for w in (self.batch, *(w for _, w in self.switches))):
            raise ValueError(f"the many-rows ways are {', '.join(map(repr, BATCH_WAYS))}, got {self.batch!r}, {self.switches}")

    def way(self, rows: int) -> str:
        if self.widened_from is None or rows < self.widened_from:
            return BLOCKS
        way = self.batch
        for start, other in self.switches:
            if rows >= start:
                way = other
        return way

    def first(self, way: str) -> int | None:
        """The fewest rows that take `way` (None: none do)."""
        if way == BLOCKS:
            return 1 if self.widened_from is None or self.widened_from > 1 else None
        if self.widened_from is None:
            return None
        if self.batch == way:
            return self.widened_from
        return next((start for start, other in self.switches if other == way), None)

    def uses(self, way: str) -> bool:
        """Whether some row count takes `way`."""
        if self.widened_from is None:
            return way == BLOCKS
        return way in (self.batch, *(w for _, w in self.switches)) or (way == BLOCKS and self.widened_from > 1)

    def describe(self) -> str:
        top = None if self.widened_from is None else self.widened_from - 1  # the most rows the blocks take
        parts, low = [], 1
        if self.act8 and (top is None or top >= 1):
            low = min(self.act8, top or self.act8) + 1
            parts.append(f"{ACT8} up to {low - 1} rows")
        if top is None:
            return ", ".join([*parts, f"{BLOCKS} from {low}"]) if parts else BLOCKS
        if top >= low:
            parts.append(f"{BLOCKS} up to {top} rows" if low == 1 else f"{BLOCKS} {low}-{top} rows")
        parts.append(f"{self.batch} from {self.widened_from}" if parts or self.switches else self.batch)
        parts += [f"{way} from {start}" for start, way in self.switches]
        return ", ".join(parts)


def batch_way(timed: dict[str, float]) -> str:
    """The many-rows way of one bucket's timings: the fastest of those besides the blocks, but the
    tiles (PACKED) where they were measured and no other way beats them by MARGIN. The two 16-bit
    ways run level on most shapes, so the faster by a hair was whichever the machine's noise
    favoured, and loads on one machine picked differently; the tiles read their values as packed,
    where the widened GEMM widens them on every call into scratch memory, and keep a decode step
    in the layers' one C++ call (decode_layers)."""
    fastest = min((w for w in timed if w != BLOCKS), key=lambda w: (timed[w], WAYS.index(w)))
    if PACKED in timed and fastest != PACKED and timed[fastest] >= (1 - MARGIN) * timed[PACKED]:
        return PACKED
    return fastest


def blocks_win(timed: dict[str, float]) -> bool:
    """Whether the blocks beat the bucket's many-rows way by MARGIN: no smaller bucket can then start
    the crossover (`pick`)."""
    return timed[BLOCKS] < (1 - MARGIN) * timed[batch_way(timed)]


def bucket_rows(max_rows: int) -> tuple[int, ...]:
    """The buckets a step of at most `max_rows` rows can fall in: those up to the first that holds it."""
    i = bisect_left(BUCKETS, max(1, max_rows))
    return BUCKETS[: i + 1] if i < len(BUCKETS) else BUCKETS


def pick(seconds: dict[int, dict[str, float]]) -> RowChoice:
    """The choice from the timings of buckets of BUCKETS ({rows: {way: seconds}}): from the smallest
    bucket that the fastest of the other ways beats the blocks at by MARGIN, and above which the blocks
    beat it by MARGIN at no bucket timed, each bucket's fastest other way. A step of rows between two buckets takes the
    larger one's way; buckets below the largest timed one that are missing were not worth timing
    (a larger one kept the blocks)."""
    rows = sorted(seconds)
    start = None
    for i in range(len(rows) - 1, -1, -1):
        t = seconds[rows[i]]
        if t[batch_way(t)] < (1 - MARGIN) * t[BLOCKS]:
            start = i
        elif blocks_win(t):
            break
        # level within the margin: a smaller bucket that the other way wins starts it there, and this
        # one takes it too (on an AVX512-BF16 EPYC the packed values won 16 to 64 rows by 1.2-2x and
        # drew at 256-512, where both are bound by the same dot products)
    if start is None:
        return RowChoice()

    def first_row(i: int) -> int:  # the fewest rows that take bucket rows[i]'s way
        below = [b for b in BUCKETS if b < rows[i]]
        return below[-1] + 1 if below else 1

    batch, switches = batch_way(seconds[rows[start]]), []
    for i in range(start + 1, len(rows)):
        way = batch_way(seconds[rows[i]])
        if way != (switches[-1][1] if switches else batch):
            switches.append((rows[i - 1] + 1, way))
    return RowChoice(first_row(start), batch, tuple(switches))


def act8_rows(seconds: dict[int, dict[str, float]]) -> int:
    """Up to how many rows the 8-bit activations (ACT8) stay: the largest bucket timed up to which
    the blocks beat them by MARGIN at none (0: at the smallest)."""
    rows = 0
    for r in sorted(seconds):
        if seconds[r][BLOCKS] < (1 - MARGIN) * seconds[r][ACT8]:
            break
        rows = r
    return rows


def layers_timed(rows: int, layers: int) -> int:
    """How many of a shape's `layers` linears a call of `rows` rows multiplies while measuring."""
    if rows <= STREAM_ROWS:
        return layers
    return min(layers, max(MIN_LAYERS, -(-layers * STREAM_ROWS // rows)))


def measure(ways: dict[str, Callable[[torch.Tensor, int], object]], width: int, dtype: torch.dtype,
            rows: tuple[int, ...], layers: int = 1,
            repeats: int = calibrate.REPEATS, every: bool = False) -> dict[int, dict[str, float]]:
    """Seconds of each way's call `fn(x, n)` on random rows x [r, width] of `dtype` over the first n
    of the shape's `layers` linears (layers_timed), the best of `repeats` after a
    warm-up (fewer where the calls took BUDGET_SECONDS already), from the largest r of `rows` down,
    until a bucket where the blocks beat the other ways (no smaller bucket can then start the
    crossover: `pick`), so a CPU where the blocks win times one bucket. The ways take turns call by
    call: a machine whose load changes while it measures (another model loading beside this one)
    slows both alike, not whichever ran then. `every`: every bucket of `rows`, without that stop."""
    gen = torch.Generator().manual_seed(0)
    out: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for r in sorted(rows, reverse=True):
            x = torch.randn(r, width, generator=gen).to(dtype)
            n = layers_timed(r, layers)
            for fn in ways.values():
                fn(x, n)  # warm-up: first touch of the scratch memory, one-off set-up in the kernels
            best, spent = dict.fromkeys(ways, float("inf")), dict.fromkeys(ways, 0.0)
            for _ in range(repeats):
                for name, fn in ways.items():
                    t = time.perf_counter()
                    fn(x, n)
                    took = time.perf_counter() - t
                    best[name], spent[name] = min(best[name], took), spent[name] + took
                if min(spent.values()) >= BUDGET_SECONDS:
                    break
            out[r] = best
            if not every and blocks_win(out[r]):
                break
    return out


def machine_key() -> str:
    """What a measurement depends on besides the shape: the CPU (its model and flags, as the
    kernels were built for them), torch and the threads a step runs on."""
    return f"{machine_tag()}|{torch.get_num_threads()} threads"


def choose(kind: str, shape: tuple[int, int], dtype: torch.dtype,
           ways: dict[str, Callable[[torch.Tensor, int], object]], max_rows: int, build: str,
           layers: int = 1) -> RowChoice:
    """The choice for a quantized linear of `kind` ("int4", "int8") and `shape` (out, in) computing in
    `dtype`, held by `layers` layers, read from the cache or measured now over `ways` (BLOCKS and one
    or both of the many-rows ways, `fn(x, n)` multiplies rows x by the first n layers' linears) for the buckets a step of at
    most `max_rows` rows falls in. `build`: the kernels' build (its tag)."""
    rows = bucket_rows(max_rows)
    key = _key(kind, shape, dtype, ways, max_rows, build, layers)

    def measured() -> RowChoice:
        act8 = act8_rows(measure_act8(ways, shape[1], dtype, rows, layers)) if ACT8 in ways else 0
        rest = {name: fn for name, fn in ways.items() if name != ACT8}
        if act8:  # the crossover against the blocks as they will run
            rest[BLOCKS] = lambda x, n: (ways[ACT8] if x.shape[0] <= act8 else ways[BLOCKS])(x, n)
        choice = pick(measure(rest, shape[1], dtype, rows, layers))
        return RowChoice(choice.widened_from, choice.batch, choice.switches, act8)

    return _from_list(files.remembered(key, lambda: _as_list(measured())))


def measure_act8(ways: dict[str, Callable[[torch.Tensor, int], object]], width: int, dtype: torch.dtype,
                 rows: tuple[int, ...], layers: int = 1, repeats: int = calibrate.REPEATS) -> dict[int, dict[str, float]]:
    """Seconds of the blocks and of ACT8 (`ways`' entries) at each bucket of `rows` up to ACT8_ROWS,
    as `measure` times them."""
    few = tuple(r for r in rows if r <= ACT8_ROWS)
    return measure({BLOCKS: ways[BLOCKS], ACT8: ways[ACT8]}, width, dtype, few, layers, repeats, every=True)


def recalled(kind: str, shape: tuple[int, int], dtype: torch.dtype, ways, max_rows: int, build: str,
             layers: int = 1) -> RowChoice | None:
    """The choice `choose` keeps for the same arguments (`ways`: their names), or None where it has
    not measured it on this machine yet: a load can skip preparing a way its choice does not take."""
    kept = files.recalled(_key(kind, shape, dtype, ways, max_rows, build, layers))
    return None if kept is None else _from_list(kept)


def _key(kind: str, shape: tuple[int, int], dtype: torch.dtype, ways, max_rows: int, build: str, layers: int) -> str:
    return "|".join(map(str, (f"row kernels {CHOICE_VERSION}", kind, shape, dtype, bucket_rows(max_rows), build, f"{layers} layers",
                              sorted(ways), machine_key())))


def _from_list(kept: list) -> RowChoice:
    return RowChoice(kept[0], kept[1], tuple((start, way) for start, way in kept[2]), kept[3])


def _as_list(choice: RowChoice) -> list:
    """A choice as the cache keeps it (JSON)."""
    return [choice.widened_from, choice.batch, [list(x) for x in choice.switches], choice.act8]
