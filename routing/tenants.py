"""Tenants: who a request is for, its share of a model and its quotas. Without sockets, like the
dispatch (routing/dispatch.py asks these before it queues or sends a request).

A request names its tenant (the HTTP gateway names the tenant of the request's API key). A request
that names none is the `default` tenant's. Each tenant has:
- a weight. Each model's queue serves its tenants by start-time fair queuing on tokens (Goyal,
  Vin and Cheng, 1996). A request's tag starts where its tenant's last one finished, or at the
  queue's virtual time if the tenant was idle, and lasts its tokens / the weight. The queue
  serves the smallest start tag. Two backlogged tenants of weights 3 and 1 are served tokens
  3:1. A tenant that was idle does not bank credit for later.
- a quota of tokens a minute (optional): completion tokens over a sliding 60-second window.
  A request reserves n * max_tokens when it is admitted. Its result settles the reservation to
  the tokens it was served. A request that would pass the quota is refused at once, with the
  seconds after which it would fit (`retry_after`).
- a quota of requests in flight (optional): queued or running. One more is refused at once.

Requests the router holds back in its queue are the ones the weights can order. With tenants
configured, a worker is given at most its `max_batch_size` requests at once (what its engine runs
together), and the rest wait in the router's queue (routing.dispatch).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from workers.validate import is_int, is_number

DEFAULT_TENANT = "default"
WINDOW_S = 60.0  # the tokens-a-minute quota's window
INFLIGHT_RETRY_S = 1.0  # retry_after of a request refused for the in-flight quota (no window to work from)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    tokens_per_minute: int | None = None
    max_inflight: int | None = None
    api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = f"tenants.{self.name}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a tenant's name must be a non-empty string, got {self.name!r}")
        if not is_number(self.weight) or not self.weight > 0:
            raise ValueError(f"{where}.weight must be a number > 0, got {self.weight!r}")
        for key in ("tokens_per_minute", "max_inflight"):
            value = getattr(self, key)
            if value is not None and not is_int(value, 1):
                raise ValueError(f"{where}.{key} must be a positive integer or null, got {value!r}")
        if not all(isinstance(k, str) and k for k in self.api_keys):
            raise ValueError(f"{where}.api_keys must be a list of non-empty strings")


TENANT_KEYS = ("weight", "tokens_per_minute", "max_inflight", "api_keys")


def parse_tenants(value) -> tuple[Tenant, ...]:
    """The `tenants` setting: a mapping of tenant name -> {weight, tokens_per_minute, max_inflight,
    api_keys}, or null. A ValueError names the key to change."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValueError(f"tenants must be a mapping of tenant name -> settings, got {type(value).__name__}")
    out, owner = [], {}
    for name, settings in value.items():
        settings = {} if settings is None else settings
        if not isinstance(settings, dict):
            raise ValueError(f"tenants.{name} must be a mapping of {', '.join(TENANT_KEYS)}")
        unknown = sorted(set(settings) - set(TENANT_KEYS))
        if unknown:
            raise ValueError(f"tenants.{name}.{unknown[0]} is not a tenant setting; known: {', '.join(TENANT_KEYS)}")
        keys = settings.get("api_keys") or []
        if not isinstance(keys, list):
            raise ValueError(f"tenants.{name}.api_keys must be a list of strings")
        tenant = Tenant(str(name), settings.get("weight", 1.0), settings.get("tokens_per_minute"),
                        settings.get("max_inflight"), tuple(keys))
        for k in tenant.api_keys:
            if k in owner:
                raise ValueError(f"tenants.{name}.api_keys: a key of tenant {owner[k]!r} too; a key names one tenant")
            owner[k] = tenant.name
        out.append(tenant)
    return tuple(out)


def tenant_keys(tenants: tuple[Tenant, ...] | None) -> dict[str, str]:
    """API key -> the name of its tenant (the HTTP gateway names it in each request)."""
    return {k: t.name for t in tenants or () for k in t.api_keys}


def request_tokens(params: dict, default_max_tokens: int) -> int:
    """The completion tokens a request may be served: n (or best_of) * max_tokens, at least 1."""
    max_tokens = params.get("max_tokens")
    max_tokens = max_tokens if is_int(max_tokens, 0) else default_max_tokens
    n, best_of = params.get("n"), params.get("best_of")
    n = max(n if is_int(n, 1) else 1, best_of if is_int(best_of, 1) else 1)
    return max(1, n * max_tokens)


@dataclass(slots=True)
class Usage:
    """One tenant's counters and quota state."""

    tenant: Tenant
    inflight: int = 0
    reserved: int = 0  # tokens reserved by its requests in flight
    window: deque = field(default_factory=deque)  # (time, tokens served) over the last WINDOW_S
    window_tokens: int = 0
    served_tokens: int = 0
    requests: int = 0
    refused: int = 0  # rate_limited answers

    def expire(self, now: float) -> None:
        while self.window and self.window[0][0] <= now - WINDOW_S:
            self.window_tokens -= self.window.popleft()[1]

    def retry_after(self, cost: int, now: float) -> float | None:
        """None when a request of `cost` tokens fits the quotas now, else the seconds after which it
        would (with what is in flight still in flight)."""
        t = self.tenant
        if t.max_inflight is not None and self.inflight >= t.max_inflight:
            return INFLIGHT_RETRY_S
        if t.tokens_per_minute is None:
            return None
        self.expire(now)
        over = self.window_tokens + self.reserved + cost - t.tokens_per_minute
        if over <= 0:
            return None
        for when, tokens in self.window:  # the oldest served tokens leave the window first
            over -= tokens
            if over <= 0:
                return max(0.001, when + WINDOW_S - now)
        return WINDOW_S  # only in-flight reservations stand in the way: a window's wait at most


class TenantBook:
    """The tenants' quotas and counters: admit, then settle each admitted request once."""

    def __init__(self, tenants: tuple[Tenant, ...] = ()):
        self.tenants = {t.name: t for t in tenants}
        self.tenants.setdefault(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
        self.configured = bool(tenants)
        self.usage = {name: Usage(t) for name, t in self.tenants.items()}

    def weight(self, name: str) -> float:
        return self.tenants[name].weight

    def admit(self, name: str, cost: int, now: float) -> float | None:
        """Reserve `cost` tokens for tenant `name`'s request: None when admitted, else the
        retry_after it is refused with (nothing is reserved then)."""
        u = self.usage[name]
        t = u.tenant
        if t.tokens_per_minute is not None and cost > t.tokens_per_minute:
            raise ValueError(f"the request may be served {cost} tokens (n * max_tokens), more than tenant "
                             f"{name!r} may be served in a minute (its quota: {t.tokens_per_minute}); ask for fewer")
        wait = u.retry_after(cost, now)
        if wait is not None:
            u.refused += 1
            return wait
        u.inflight += 1
        u.reserved += cost
        u.requests += 1
        return None

    def quota_hit(self, name: str) -> str:
        """The quota a refusal of tenant `name` just now was for, in words."""
        u = self.usage[name]
        t = u.tenant
        if t.max_inflight is not None and u.inflight >= t.max_inflight:
            return f"{t.max_inflight} requests in flight"
        return f"{t.tokens_per_minute} tokens a minute"

    def settle(self, name: str, cost: int, served: int, now: float) -> None:
        """An admitted request is done (answered, failed or cancelled) after `served` tokens."""
        u = self.usage[name]
        u.inflight -= 1
        u.reserved -= cost
        if served > 0:
            u.window.append((now, served))
            u.window_tokens += served
            u.served_tokens += served

    def status(self, queued: dict[str, int], now: float) -> dict:
        out = {}
        for name, u in self.usage.items():
            u.expire(now)
            t = u.tenant
            out[name] = {"weight": t.weight, "tokens_per_minute": t.tokens_per_minute, "max_inflight": t.max_inflight,
                         "inflight": u.inflight, "queued": queued.get(name, 0), "tokens_last_minute": u.window_tokens,
                         "reserved_tokens": u.reserved, "served_tokens": u.served_tokens, "requests": u.requests,
                         "rate_limited": u.refused}
        return out


class FairQueue:
    """A model's waiting requests, served by start-time fair queuing across tenants (the module's
    docstring). The deque operations the dispatch uses; one tenant alone is served in order.
    Items need `tenant` (a name), `cost` (tokens) and `weight` (their tenant's) attributes."""

    def __init__(self):
        self._items: dict[int, tuple] = {}  # id(item) -> (start tag, order, item)
        self._heap: list[tuple] = []  # (start tag, order, id) of live and removed items (lazily dropped)
        self._finish: dict[str, float] = {}  # a tenant's last finish tag
        self._count = itertools.count()
        self.virtual = 0.0  # the start tag of the request served last

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, item) -> bool:
        return id(item) in self._items

    def __iter__(self):
        return iter([entry[2] for entry in sorted(self._items.values(), key=lambda e: e[:2])])

    def _push(self, start: float, item) -> None:
        entry = (start, next(self._count), item)
        self._items[id(item)] = entry
        heapq.heappush(self._heap, (entry[0], entry[1], id(item)))

    def append(self, item) -> None:
        start = max(self.virtual, self._finish.get(item.tenant, -math.inf))
        self._finish[item.tenant] = start + item.cost / item.weight
        self._push(start, item)

    def appendleft(self, item) -> None:
        """Ahead of everything queued (a request sent again after its worker was lost: admitted
        earlier); it does not move its tenant's tags."""
        self._push(-math.inf, item)

    def popleft(self):
        while self._heap:
            start, order, key = heapq.heappop(self._heap)
            entry = self._items.get(key)
            if entry is not None and entry[1] == order:
                del self._items[key]
                if start > self.virtual:
                    self.virtual = start
                return entry[2]
        raise IndexError("pop from an empty FairQueue")

    def remove(self, item) -> None:
        if self._items.pop(id(item), None) is None:
            raise ValueError("FairQueue.remove(x): x not in queue")
        if not self._items:
            self._heap.clear()

    def by_tenant(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, _, item in self._items.values():
            out[item.tenant] = out.get(item.tenant, 0) + 1
        return out
