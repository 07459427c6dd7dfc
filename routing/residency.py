"""Which model copies hold memory on which device, and which of them a load evicts. Without sockets
or clocks: routing/lifecycle.py asks it and applies the answer.

A copy's size is fixed before it loads (`CopySize`): what it alone holds (its process, its packed
linears, its KV pool, and its weights unless they are shared) plus the weights it shares with the
other copies of the same source and dtype on its device, which count once there. A device's
budget (`memory_budget`) bounds the sum. A load goes where it fits as things are; else to the
device where evicting the fewest unpinned copies makes room: copies already leaving first, then
idle ones before busy ones, and among those the copy worth least to keep first. A copy's worth is
how often it is asked for (its requests, decayed with a half-life of REUSE_HALF_LIFE_S) times what
loading it again costs (its model's measured load seconds), over the bytes evicting it frees:
a big copy that is rarely used and quick to reload goes before a small, busy one that is slow to
reload. Ties go least recently used first. A copy that began serving less than `protect_s` ago
is not evicted (hysteresis: a load does not undo the one before it); a load that needs it waits
instead (`wait`). A load that cannot fit even alone, or only by evicting pinned or loading
copies, is refused before anything is evicted.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

REUSE_HALF_LIFE_S = 60.0  # how fast a copy's request count fades
MIN_RELOAD_S = 0.5  # the reload cost of a copy whose model has not been timed yet


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@dataclass(slots=True, frozen=True)
class CopySize:
    """What one copy holds on `device`: `own` bytes no other copy shares, and `shared` bytes of
    weights that every copy with the same `shared_key` on that device holds once."""

    device: str
    own: int
    shared_key: str | None = None
    shared: int = 0

    @property
    def alone(self) -> int:
        """On a device where nothing shares its weights."""
        return self.own + self.shared

    def as_dict(self) -> dict:
        return {"device": self.device, "own_bytes": self.own, "shared_bytes": self.shared, "bytes": self.alone}


@dataclass(slots=True)
class Resident:
    model_id: int
    size: CopySize
    pinned: bool = False
    last_use: float = 0.0
    leaving: bool = False  # being unloaded: its bytes are promised back
    evictable: bool = True  # False while it loads: a load in progress is never evicted
    loaded_at: float = float("-inf")  # when it began serving (younger than protect_s: kept)
    uses: float = 0.0  # its requests, decayed to used_at
    used_at: float = 0.0
    reload_s: float = 0.0  # what loading its model again took, measured (0: not yet)

    def use(self, now: float) -> None:
        self.uses = self.rate(now) + 1.0
        self.used_at = self.last_use = now

    def rate(self, now: float) -> float:
        return self.uses * 0.5 ** (max(0.0, now - self.used_at) / REUSE_HALF_LIFE_S)


class NoMemory(Exception):
    """No device has room for the load; the message names the bytes."""


@dataclass(slots=True, frozen=True)
class Placement:
    size: CopySize
    evict: tuple[int, ...]  # model IDs to unload first, in order

    @property
    def device(self) -> str:
        return self.size.device


class Residency:
    def __init__(self, budgets: dict[str, int | None], ceilings: dict[str, int] | None = None):
        self.budgets = budgets  # device -> bytes (None: no budget there)
        # device -> bytes the device had available when the deployment started, for a device with no
        # budget: nothing is evicted there, but a load past what the device has is refused, not
        # started (ten thousand copies of a small model took the machine's memory)
        self.ceilings = {d: c for d, c in (ceilings or {}).items() if budgets.get(d) is None}
        self.copies: dict[int, Resident] = {}

    def add(self, r: Resident) -> None:
        self.copies[r.model_id] = r

    def remove(self, model_id: int) -> None:
        self.copies.pop(model_id, None)

    def used(self, device: str, without: frozenset[int] = frozenset(), plus: CopySize | None = None) -> int:
        """Bytes held on `device` by its copies (those leaving too, until they are gone) but those in
        `without`, and `plus`."""
        sizes = [r.size for r in self.copies.values() if r.size.device == device and r.model_id not in without]
        if plus is not None:
            sizes.append(plus)
        shared = {s.shared_key: s.shared for s in sizes if s.shared_key is not None}
        return sum(s.own + (0 if s.shared_key is not None else s.shared) for s in sizes) + sum(shared.values())

    def resident_bytes(self, model_id: int) -> int:
        """What the copy holds: its own bytes, and its shared weights split among their holders."""
        r = self.copies.get(model_id)
        if r is None:
            return 0
        s = r.size
        if s.shared_key is None:
            return s.alone
        holders = sum(1 for o in self.copies.values() if o.size.device == s.device and o.size.shared_key == s.shared_key)
        return s.own + s.shared // max(1, holders)

    def by_device(self) -> dict[str, int]:
        return {d: self.used(d) for d in sorted({r.size.device for r in self.copies.values()} | set(self.budgets))}

    def freed(self, r: Resident) -> int:
        """The bytes evicting `r` gives back: its own, and its shared weights if no other copy holds them."""
        s = r.size
        alone = s.shared_key is None or not any(o is not r and o.size.device == s.device and o.size.shared_key == s.shared_key
                                                for o in self.copies.values())
        return s.own + (s.shared if alone else 0)

    def worth(self, r: Resident, now: float) -> float:
        """What keeping `r` is worth a byte: its request rate times its reload seconds, over what it frees."""
        return r.rate(now) * max(r.reload_s, MIN_RELOAD_S) / max(1, self.freed(r))

    def _victims(self, device: str, busy: Callable[[int], bool], wait: bool, now: float,
                 protect_s: float) -> list[Resident]:
        rs = [r for r in self.copies.values()
              if r.size.device == device and (r.evictable or wait) and (r.leaving or not r.pinned)
              and (wait or r.leaving or now - r.loaded_at >= protect_s)]
        return sorted(rs, key=lambda r: (not r.evictable, not r.leaving, busy(r.model_id), self.worth(r, now),
                                         r.last_use, r.model_id))

    def _place_on(self, size: CopySize, busy: Callable[[int], bool], wait: bool = False, now: float = 0.0,
                  protect_s: float = 0.0) -> Placement | None:
        budget = self.budgets.get(size.device)
        if budget is None:
            ceiling = self.ceilings.get(size.device)
            return Placement(size, ()) if ceiling is None or self.used(size.device, plus=size) <= ceiling else None
        if self.used(size.device, plus=size) <= budget:
            return Placement(size, ())
        evict: list[int] = []
        for r in self._victims(size.device, busy, wait, now, protect_s):
            evict.append(r.model_id)
            if self.used(size.device, frozenset(evict), size) <= budget:
                return Placement(size, tuple(evict))  # those leaving already: the load waits for them too
        return None

    def choose(self, name: str, sizes: list[CopySize], busy: Callable[[int], bool], wait: bool = False,
               now: float = 0.0, protect_s: float = 0.0) -> Placement:
        """Where one more copy of `name` goes (one size per device it may run on), and what it evicts.
        `wait`: as if the copies loading now, and those younger than `protect_s`, could go too
        (would it fit once they may?)."""
        options = [p for p in (self._place_on(s, busy, wait, now, protect_s) for s in sizes) if p is not None]
        if options:
            return min(options, key=lambda p: sum(not self.copies[i].leaving for i in p.evict))
        raise NoMemory(self._why(name, sizes))

    def choose_many(self, name: str, sizes: list[CopySize], n: int, busy: Callable[[int], bool],
                    wait: bool = False, now: float = 0.0, protect_s: float = 0.0) -> list[Placement]:
        """`n` copies, each placed beside the ones before; all or none (NoMemory, nothing changed)."""
        trial = copy.deepcopy(self)
        out = []
        for k in range(n):
            try:
                p = trial.choose(name, sizes, busy, wait, now, protect_s)
            except NoMemory as exc:
                if k == 0:
                    raise
                raise NoMemory(f"no memory for {n} copies of {name!r}, only for {k}: "
                               + str(exc).removeprefix("no memory for the load: ")) from None
            trial.apply(p, -1 - k, True, 0.0)  # pinned in the trial: one load never evicts its own copies
            out.append(p)
        return out

    def apply(self, p: Placement, model_id: int, pinned: bool, now: float) -> None:
        """Reserve the placed copy's bytes (it loads: not evictable) and mark its evictions leaving."""
        for i in p.evict:
            self.copies[i].leaving = True
        self.add(Resident(model_id, p.size, pinned, now, evictable=False))

    def _why(self, name: str, sizes: list[CopySize]) -> str:
        parts = []
        for s in sizes:
            budget = self.budgets[s.device]
            if budget is None:  # a ceiling's refusal
                parts.append(f"on {s.device} a copy of {name!r} needs {mib(s.alone)} (with its shared weights), and the "
                             f"copies there would then hold {mib(self.used(s.device, plus=s))}, more than the "
                             f"{mib(self.ceilings[s.device])} the device had available when the deployment started "
                             "(memory_budget is null: nothing is evicted; set one to evict, or load fewer)")
                continue
            if s.alone > budget:
                parts.append(f"on {s.device} a copy of {name!r} needs {mib(s.alone)} even alone, more than the "
                             f"memory_budget of {mib(budget)}")
                continue
            kept = [r for r in self.copies.values() if r.size.device == s.device and not r.leaving
                    and (r.pinned or not r.evictable)]
            held = self.used(s.device, frozenset(r.model_id for r in self.copies.values() if r not in kept))
            parts.append(f"on {s.device} a copy of {name!r} needs {mib(s.alone)} (with its shared weights) and the "
                         f"memory_budget is {mib(budget)}, of which pinned or loading copies hold {mib(held)}"
                         f" (model IDs {sorted(r.model_id for r in kept if r.model_id >= 0)}"
                         f"{', and the copies of this load before it' if any(r.model_id < 0 for r in kept) else ''})")
        return "no memory for the load: " + "; ".join(parts)
