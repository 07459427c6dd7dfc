"""The wire protocol: every message type, its validation, and the limits. msgpack maps, never pickle.

Every message is one ZeroMQ frame holding a msgpack map with at least {"v": VERSION, "type": T}.

Clients (DEALER) <-> router frontend (ROUTER):
  client -> router   complete {id, model, prompt, params, stream, task, tenant}   cancel {id}   models {id}   status {id}
                     load {id, model, copies, pin}   unload {id, model, copies}
  task (default generate): generate (prompt: text or token IDs), chat (prompt: [{role, content}, ...],
  rendered with the model's chat template), tokenize (prompt: text or messages), detokenize (prompt:
  token IDs), tokenizer_info (no prompt). Every task is routed like a completion; its answer is a
  result whose response is the task's output.
  router -> client   chunk {id, outputs}   result {id, response, timing}   reply {id, data}
                     error {id, code, message, param, retry_after}
  tenant (optional) names whose request it is (routing/tenants.py: weights and quotas); a request
  over its tenant's quota is refused at once with rate_limited and retry_after (seconds).
  A result's timing is the router's: {queued_s, load_s, run_s}, the seconds the request waited in
  the router's queue, waited for its model to load, and spent on its worker until the result.
  A generate or chat result's response is neutral, not an OpenAI object (routing/openai_objects.py
  builds those): {model, choices: [{index, text, token_ids, logprobs, finish_reason}], usage}, where
  logprobs is null or {tokens, token_logprobs, top_logprobs, text_offset}. An error's param, when
  present, names the request parameter it refuses. A chunk's outputs are [{index, token_ids, text,
  finish_reason}].
  The router fixes the seed of every request that has none (unless temperature is 0) on arrival: it
  appends a top-level `seed` to the client's frame (no re-encoding; a client's own top-level `seed`
  is dropped), which the worker moves into params (`take_router_seed`).
  A load's or an unload's reply comes when its copies serve (or are gone): {model, copies: [the
  models entries of that model]}. A router without a supervisor answers them not_supported.

Workers (DEALER) <-> router backend (ROUTER):
  worker -> router   ready {capabilities: pid, host, slot (its planned worker, if any), ...}
                     loaded {model_id, weights: {bytes, shared, path}, compile: {compiled, reason, ...}}   load_failed {model_id, message}
                     heartbeat {engine: ENGINE_STATS}
  router -> worker   assign {worker_id, model_id, model}   cancel {id}   heartbeat {}   shutdown {}
  data path, two frames [header, body] so the router never re-encodes a body:
  router -> worker   [pack([request, key]), the client's complete frame as received], or the requests
                     one drain of the clients' socket sends a worker as a bundle of such pairs
  worker -> router   a bundle of a turn's [pack([chunk|result|error, key, tokens]), body for the client, ...]
  where tokens is a result's completion tokens, or for a chunk [[sample index, tokens so far], ...]:
  the router keeps how much of each stream reached the client, so that a request it sends again
  after losing its worker carries `resume` ([[index, tokens already sent], ...]) and the new worker
  streams only what comes after (the request is deterministic: the router fixes a stream's seed).

A bundle is one frame holding several: a msgpack array of binary frames (a message is a map, so
the two never mix up). A worker sends each turn (an engine step) of data messages as one bundle,
the router sends each client its share of a turn as one bundle of bodies, and each worker the
requests it read for it in one pass over its clients' socket as one bundle of [header, frame] pairs. One frame instead of
two a request costs the sockets and the Python around them a wake-up and two calls per request at
every hop.

Request keys are `<router epoch>-<n>`: unique across router lifetimes, so a worker's late output
for an earlier router can never match a request of this one.

Supervisor -> router (inproc control socket, same process): worker_exited {pid, host, slot, restart}
(restart false: the supervisor gave up on that worker, or stopped it when told to).
Router -> supervisor (inproc, same process): start_worker {slot, device, threads, memory,
resources} (a copy loaded at run time: its spec is the router's slot `slot`; the rest is what a
cluster needs to place it: its bytes and custom resources), stop_worker {slot} (unloaded: stop it,
never restart it). A supervisor that cannot start a slot's worker answers worker_exited {slot,
restart: false, why}.
Errors a client raises by itself, without a message: router_lost (the connection dropped with
requests in flight), refused (the router refused the CurveZMQ handshake).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

VERSION = 1
# where a router listens when nothing else is said: clients connect to the frontend, workers to the backend
DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"
DEFAULT_BACKEND = "tcp://127.0.0.1:5556"
# frames above this are refused by `unpack` with TOO_LARGE, an answer the sender can act on; the
# HTTP gateway refuses bodies above it too, before they reach a socket
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# the router's sockets drop a peer that sends a frame above this (ZMQ_MAXMSGSIZE): a hard stop far
# above MAX_MESSAGE_BYTES, so that an oversized request is answered, not disconnected
SOCKET_MESSAGE_LIMIT = 64 * 1024 * 1024
# liveness, both ways: heartbeats every HEARTBEAT_INTERVAL seconds; a peer that misses LIVENESS of
# them in a row is presumed dead (the ZeroMQ guide's Paranoid Pirate)
HEARTBEAT_INTERVAL = 0.5
LIVENESS = 6
# how long a model's queued requests wait for a live worker (a restart, a reload) before no_worker
RESTART_WAIT = 30.0
MAX_PROMPT_ITEMS = 1 << 20
MAX_MAP_ITEMS = 4096  # entries of any map in a message (a request's parameters, its logit_bias)
MAX_SAMPLES = 1024  # per-sample entries in a chunk header
# token IDs a tokenize reply holds at most: msgpack writes an ID in up to 5 bytes, so any vocabulary's reply
# stays within MAX_MESSAGE_BYTES (a longer text's reply was refused by the client as undecodable)
MAX_TOKENIZE_IDS = MAX_MESSAGE_BYTES // 8
# copies of one model a deployment holds at most, started or loaded: each is a worker process (a
# billion asked for was built up entry by entry before any memory check could refuse it)
MAX_COPIES = 1024

# message types
COMPLETE, CANCEL, MODELS, STATUS = "complete", "cancel", "models", "status"
LOAD, UNLOAD = "load", "unload"
CHUNK, RESULT, REPLY, ERROR = "chunk", "result", "reply", "error"
READY, LOADED, HEARTBEAT, ASSIGN, REQUEST, SHUTDOWN = "ready", "loaded", "heartbeat", "assign", "request", "shutdown"
LOAD_FAILED = "load_failed"  # worker -> router: {model_id, worker_id, message}; it stays up, unloaded
WORKER_EXITED = "worker_exited"  # supervisor -> router (inproc control socket): {pid, host}
START_WORKER, STOP_WORKER = "start_worker", "stop_worker"  # router -> supervisor: {slot}
CLIENT_TYPES = {COMPLETE, CANCEL, MODELS, STATUS, LOAD, UNLOAD}
SUPERVISOR_TYPES = {START_WORKER, STOP_WORKER}
WORKER_TYPES = {READY, LOADED, LOAD_FAILED, HEARTBEAT}

# tasks of a complete request
GENERATE, CHAT, TOKENIZE, DETOKENIZE, TOKENIZER_INFO = "generate", "chat", "tokenize", "detokenize", "tokenizer_info"
TASKS = (GENERATE, CHAT, TOKENIZE, DETOKENIZE, TOKENIZER_INFO)

# error codes
BAD_REQUEST = "bad_request"  # undecodable, wrong shape, invalid parameter
UNKNOWN_MODEL = "unknown_model"
BUSY = "busy"  # the model's queue is full: retry later (like HTTP 429)
WORKER_LOST = "worker_lost"
NO_WORKER = "no_worker"  # queued, but no worker served the model within restart_wait (or none will)
TOO_LARGE = "too_large"
INTERNAL = "internal"
NO_MEMORY = "no_memory"  # a load that no device's memory_budget can hold, even by evicting what may go
CONFLICT = "conflict"  # a load and an unload of one model at once
RATE_LIMITED = "rate_limited"  # over the tenant's quota (routing/tenants.py): retry after `retry_after` seconds
UNLOADED = "unloaded"  # the model (copy) was unloaded, or is not loaded and autoload is off
NOT_SUPPORTED = "not_supported"  # load/unload on a router without a supervisor to start and stop workers
ROUTER_LOST = "router_lost"  # raised by the client itself: the connection dropped with requests in flight
# a model ID's state in the models reply; a variant with no copy is listed once as AVAILABLE
STATE_LOADING, STATE_LOADED, STATE_UNLOADING, STATE_AVAILABLE = "loading", "loaded", "unloading", "available"
# what a worker's heartbeat reports of its engine (integers), as the router's status shows it:
# requests, and its KV cache (blocks, preemptions, prefix cache lookups and hits in tokens)
ENGINE_STATS = ("running", "aborted", "dropped", "kv_cache_bytes", "block_size", "blocks_total", "blocks_used",
                "blocks_free", "tokens_capacity", "preemptions", "prefix_cache_queries", "prefix_cache_hits",
                "tokens_generated")
REFUSED = "refused"  # raised by the client itself: the router refused its CurveZMQ handshake


class ProtocolError(ValueError):
    """A message that can't be accepted; `code` is one of the error codes above, `param` the request
    parameter at fault where there is one."""

    def __init__(self, message: str, code: str = BAD_REQUEST, request_id=None, param: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id
        self.param = param
        self.retry_after = retry_after  # rate_limited: seconds after which the request would be admitted


# the integers a message carries (msgpack's int64 and uint64); JSON and YAML have no such limit
INT_MIN, INT_MAX = -2**63, 2**64 - 1


def out_of_range(value: Any) -> list | None:
    """The key path to the first integer outside [INT_MIN, INT_MAX] in a value of maps and lists,
    or None where there is none."""
    if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
        return []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        path = out_of_range(item)
        if path is not None:
            return [key, *path]
    return None


def unencodable(value: Any) -> tuple[list, str] | None:
    """(the key path to the first string, or key, that is not Unicode text UTF-8 can carry: a lone
    UTF-16 surrogate such as JSON's "\\ud800" gives; that string) or None where there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return [], value
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        if isinstance(key, str) and unencodable(key) is not None:
            return [key], key
        found = unencodable(item)
        if found is not None:
            return [key, *found[0]], found[1]
    return None


def printable(key: Any) -> str:
    """A key of a path as text that can be sent back: a lone surrogate in it spelled as an escape."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


def text_error(path: list, text: str) -> str:
    """The message for unencodable's finding: where it is and the code point that is not text."""
    bad = next(c for c in text if 0xD800 <= ord(c) <= 0xDFFF)
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{printable(k)}" for k in path).lstrip(".") or "the value"
    return f"{where} holds a lone UTF-16 surrogate (\\u{ord(bad):04x}), which is not Unicode text"


def range_error(path: list) -> str:
    """The message for out_of_range's path: `params.seed is out of range: ...`, `prompt[0] ...`."""
    where = str(path[0]) + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path[1:])
    return f"{where} is out of range: integers must be within [{INT_MIN}, {INT_MAX}]"


def pack(msg: dict) -> bytes:
    """The frame of a message. An integer msgpack cannot carry (JSON has no limit), or a string that
    is not Unicode text (a lone surrogate), is a ProtocolError that names where it is: `params.seed`,
    `prompt[0]`."""
    msg.setdefault("v", VERSION)
    try:
        return msgpack.packb(msg, use_bin_type=True)
    except UnicodeEncodeError:
        found = unencodable(msg)
        if found is None:
            raise
        path = found[0]
        param = path[1] if path[0] == "params" and len(path) > 1 else path[0]
        raise ProtocolError(text_error(*found), request_id=msg.get("id"), param=printable(param)) from None
    except OverflowError:
        path = out_of_range(msg)
        if path is None:
            raise
        param = path[1] if path[0] == "params" and len(path) > 1 else path[0]
        raise ProtocolError(range_error(path), request_id=msg.get("id"), param=str(param)) from None


def with_field(body: bytes, key: str, value) -> bytes:
    """A message frame with one more field, without decoding the rest: a msgpack map's header
    holds its entry count, and its entries follow it, so the count is raised and the entry
    appended (a worker's result can be megabytes of logprobs; the router adds its timing). The
    key must not be in the map already."""
    return _with_entry(body, msgpack.packb(key) + msgpack.packb(value, use_bin_type=True))


def _with_entry(body: bytes, entry: bytes) -> bytes:
    first = body[0] if body else 0
    if 0x80 <= first <= 0x8F:
        count, start = first & 0x0F, 1
    elif first == 0xDE:
        count, start = int.from_bytes(body[1:3], "big"), 3
    elif first == 0xDF:
        count, start = int.from_bytes(body[1:5], "big"), 5
    else:
        raise ProtocolError("not a msgpack map")
    count += 1
    head = (bytes([0x80 | count]) if count <= 0x0F else b"\xde" + count.to_bytes(2, "big") if count <= 0xFFFF
            else b"\xdf" + count.to_bytes(4, "big"))
    return b"".join((head, memoryview(body)[start:], entry))  # the body copied once, not twice


# the timing entry's constant bytes around its three float64 values (0xcb: msgpack's float 64)
_TIMING = [msgpack.packb("timing") + b"\x83" + msgpack.packb("queued_s") + b"\xcb",
           msgpack.packb("load_s") + b"\xcb", msgpack.packb("run_s") + b"\xcb"]
_F64 = struct.Struct(">d").pack


def with_timing(body: bytes, queued_s: float, load_s: float, run_s: float) -> bytes:
    """`with_field(body, "timing", {"queued_s": ..., "load_s": ..., "run_s": ...})`, the same bytes,
    without building and encoding the map: the router adds it to every result."""
    q, ld, r = _TIMING
    return _with_entry(body, b"".join((q, _F64(queued_s), ld, _F64(load_s), r, _F64(run_s))))


_ARRAY_FIRST = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}  # msgpack's array types


def bundle(frames: list[bytes]) -> bytes:
    """Several frames as one (see the module's text)."""
    return msgpack.packb(frames, use_bin_type=True)


def unbundle(frame: bytes) -> list[bytes] | None:
    """The frames a bundle holds; None for a frame that is not a well-formed bundle (a message)."""
    if not frame or frame[0] not in _ARRAY_FIRST:
        return None
    try:
        parts = msgpack.unpackb(frame, max_bin_len=len(frame), max_array_len=len(frame), max_str_len=0,
                                max_map_len=0, max_ext_len=0)
    except Exception:  # msgpack raises several unrelated types for garbage
        return None
    return parts if all(type(x) is bytes for x in parts) else None


def salvaged_id(frame: bytes) -> str | None:
    """The `id` of a message refused before it was decoded (too large, an array past
    MAX_PROMPT_ITEMS), read from the map's entries before it, so that the refusal reaches the
    request that was waiting for it. None where there is none to read."""
    try:
        up = msgpack.Unpacker(raw=False, max_buffer_size=max(1, len(frame)), max_array_len=len(frame),
                              max_map_len=len(frame), max_str_len=len(frame), max_bin_len=len(frame))
        up.feed(frame)
        for _ in range(up.read_map_header()):
            if up.unpack() == "id":
                rid = up.unpack()
                return rid if isinstance(rid, str) else None
            up.skip()
    except Exception:  # noqa: BLE001 - garbage: nobody to answer by name
        return None
    return None


def check_request(msg: dict, frame: bytes | None = None) -> None:
    """What the router refuses for its size, refused before it is sent (ProtocolError, TOO_LARGE):
    a prompt of more than MAX_PROMPT_ITEMS token IDs (checked before packing: it would be millions of
    items packed for nothing), a parameter map (logit_bias) of more than MAX_MAP_ITEMS entries, and
    once packed, a `frame` of more than MAX_MESSAGE_BYTES."""
    prompt = msg.get("prompt")
    if isinstance(prompt, (list, tuple)) and len(prompt) > MAX_PROMPT_ITEMS:
        raise ProtocolError(f"prompt of {len(prompt)} token IDs exceeds the limit of {MAX_PROMPT_ITEMS}", TOO_LARGE,
                            msg.get("id"), "prompt")
    params = msg.get("params")
    if isinstance(params, dict):
        if len(params) > MAX_MAP_ITEMS:
            raise ProtocolError(f"{len(params)} parameters exceed the limit of {MAX_MAP_ITEMS}", TOO_LARGE,
                                msg.get("id"))
        for key, value in params.items():
            if isinstance(value, dict) and len(value) > MAX_MAP_ITEMS:
                raise ProtocolError(f"{key} has {len(value)} entries; the limit is {MAX_MAP_ITEMS}", TOO_LARGE,
                                    msg.get("id"), key)
    if frame is not None and len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"request of {len(frame)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}", TOO_LARGE,
                            msg.get("id"), "prompt")


def unpack(frame: bytes, allowed: set[str]) -> dict:
    """Decode and check the envelope. Raises ProtocolError naming what is wrong."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}", TOO_LARGE,
                            request_id=salvaged_id(frame))
    try:
        # bounded unpacking: nothing inside may claim more items than the frame could hold
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True,
                              max_array_len=MAX_PROMPT_ITEMS, max_map_len=MAX_MAP_ITEMS, max_str_len=len(frame),
                              max_bin_len=len(frame), max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"undecodable message: {type(exc).__name__}: {exc}", request_id=salvaged_id(frame)) from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"message must be a msgpack map, got {type(msg).__name__}")
    rid = msg.get("id")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not supported (expected {VERSION})",
                            request_id=rid)
    mtype = msg.get("type")
    if not isinstance(mtype, str) or mtype not in allowed:
        raise ProtocolError(f"unknown message type {mtype!r}; expected one of {sorted(allowed)}", request_id=rid)
    return msg


@dataclass(slots=True)
class CompleteRequest:
    """A client's completion request, validated (sampling values are checked by the worker's engine)."""

    id: str
    model: str | int
    prompt: str | list[int] | list[dict] | None
    params: dict
    stream: bool
    task: str = GENERATE
    tenant: str | None = None  # whose request (routing/tenants.py); None: the default tenant's

    @classmethod
    def from_msg(cls, msg: dict) -> CompleteRequest:
        rid = msg.get("id")
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            raise ProtocolError("id must be a non-empty string of at most 256 characters", request_id=rid)
        model = msg.get("model")
        if isinstance(model, bool) or not isinstance(model, (str, int)):
            raise ProtocolError("model must be a model name or an integer model ID", request_id=rid)
        task = msg.get("task", GENERATE)
        if task not in TASKS:
            raise ProtocolError(f"task must be one of {', '.join(TASKS)}, got {task!r}", request_id=rid)
        prompt = msg.get("prompt")
        if task == CHAT or (task == TOKENIZE and isinstance(prompt, list)):
            if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
                raise ProtocolError("messages must be a non-empty list of {role, content} objects", request_id=rid)
        elif task == DETOKENIZE:
            if not isinstance(prompt, list) or not all_ints(prompt):
                raise ProtocolError("tokens must be a list of integer token IDs", request_id=rid)
        elif task == TOKENIZE:
            if not isinstance(prompt, str):
                raise ProtocolError("prompt must be text (or messages a list of {role, content} objects)",
                                    request_id=rid)
        elif task == GENERATE:
            if isinstance(prompt, list):
                if not all_ints(prompt):
                    raise ProtocolError("prompt must be text or a list of integer token IDs", request_id=rid)
            elif not isinstance(prompt, str):
                raise ProtocolError("prompt must be text or a list of integer token IDs", request_id=rid)
            if not prompt:
                raise ProtocolError("prompt must not be empty", request_id=rid, param="prompt")
        params = msg.get("params", {})
        if not isinstance(params, dict):
            raise ProtocolError("params must be a map", request_id=rid)
        tenant = msg.get("tenant")
        if tenant is not None and (not isinstance(tenant, str) or not tenant or len(tenant) > 128):
            raise ProtocolError("tenant must be a non-empty string of at most 128 characters", request_id=rid,
                                param="tenant")
        return cls(rid, model, prompt, params, bool(msg.get("stream", False)), task, tenant)


def is_int(x: Any, low: int | None = None) -> bool:
    """An int (not a bool), at least `low` when given: the one definition every side checks with."""
    return isinstance(x, int) and not isinstance(x, bool) and (low is None or x >= low)


def take_router_seed(msg: dict) -> None:
    """A worker's side of the seed the router fixed: into the request's params, where it has none."""
    seed = msg.pop("seed", None)
    params = msg.get("params")
    if seed is not None and isinstance(params, dict) and params.get("seed") is None:
        msg["params"] = {**params, "seed": seed}


_INT_ONLY = {int}


def all_ints(xs: list) -> bool:
    """Every item an int (not a bool): `is_int` over a prompt of thousands, at the speed of C."""
    return set(map(type, xs)) <= _INT_ONLY


def header(mtype: str, key: str, tokens: int | list = 0) -> bytes:
    return msgpack.packb([mtype, key, tokens])


def _is_counts(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                    for v in x) for x in value)


def unpack_header(frame: bytes) -> tuple[str, str, int | list]:
    """[type, key, tokens] of a data-path message."""
    try:
        parts = msgpack.unpackb(frame, raw=False, max_array_len=MAX_SAMPLES, max_str_len=256, max_map_len=0)
    except Exception as exc:
        raise ProtocolError(f"bad header frame: {exc}") from None
    if not isinstance(parts, list) or len(parts) != 3:
        raise ProtocolError("bad header frame: expected [type, key, tokens]")
    mtype, key, tokens = parts
    if not isinstance(key, str) or not (isinstance(tokens, int) or _is_counts(tokens)):
        raise ProtocolError("bad header frame: expected [type, key, tokens]")
    return mtype, key, tokens


def resume_counts(value) -> dict[int, int]:
    """A request's `resume` field as {sample index: tokens already streamed}; anything else is {}."""
    return {i: n for i, n in value} if _is_counts(value) else {}


def error(request_id, code: str, message: str, param: str | None = None, retry_after: float | None = None) -> dict:
    """An ERROR message; `param`: the request parameter refused (bad_request), by name;
    `retry_after`: the seconds after which a rate_limited request would be admitted."""
    msg = {"type": ERROR, "id": request_id, "code": code, "message": message}
    if param is not None:
        msg["param"] = param
    if retry_after is not None:
        msg["retry_after"] = round(retry_after, 3)
    return msg
