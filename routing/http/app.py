"""The gateway's routes. Every HTTP request becomes router requests over one shared `AsyncClient`
connection; a client that goes away has its requests cancelled on the workers; every error is
OpenAI's error object with the status the router's code maps to (routing/http/openai.py).

Each model also has a base URL of its own, `/models/<model>/...` (`/v1/completions`,
`/v1/chat/completions`, `/tokenize`, `/detokenize`, `/tokenizer_info`), where `<model>` is what a
request's `model` would be: tools that send no model (lm-evaluation-harness's remote tokenizer)
reach one chosen model of a multi-model deployment that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from routing import openai_objects, openai_requests
from routing.client import AsyncClient, RouterError
from routing.http import openai as O
from routing.http.bodies import BODY_IDLE_SECONDS, ClientGone, read_json, send_json
from routing.http.fanout import all_of
from routing.http.metrics import Metrics
from routing.http.models_admin import model_admin_routes
from routing.http.streaming import stream_response
from wire import protocol as P

# the model a request's work resolved to: its metrics' label when the work fails after that (a
# worker's refusal of a bad parameter counts against the model, not "unknown"); set by target_for,
# read by answer, within one request's context
_RESOLVED: ContextVar[str | None] = ContextVar("resolved_model", default=None)

log = logging.getLogger("mmfusion.http")
OPEN_PATHS = ("/health", "/metrics")  # answered without an API key (probes, scrapers)
TENANT = "mmfusion.tenant"  # the scope key naming the tenant of the request's API key
CLIENT_GONE = 499  # nginx's code for "the client closed the connection": recorded in metrics only
MAX_BODY_BYTES = P.MAX_MESSAGE_BYTES  # a body the router would refuse is refused here first


def unknown_route(served: list[str]):
    """Starlette's answer to a path it has no route for (404) or a method the path does not take
    (405), as OpenAI's error object naming what was asked and what is served: the SDKs show the
    object's message, where Starlette's would be a bare "Not Found"."""
    async def answer(request: Request, exc: HTTPException) -> JSONResponse:
        asked = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            message, code = f"{asked}: this path takes {allow or 'other methods'}", "method_not_allowed"
        else:
            message = (f"{asked}: no such endpoint; the gateway serves {', '.join(served)}, and the model's "
                       "endpoints under /models/<model>/ too")
            code = "not_found"
        err = openai_requests.OpenAIError(exc.status_code, message, code=code, headers=exc.headers)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
    return answer


@dataclass(slots=True)
class GatewaySettings:
    router: str
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    request_timeout: float = 600.0  # a router request with no answer for this long fails (504)
    body_idle_timeout: float = BODY_IDLE_SECONDS  # a body whose next part takes longer is refused (408)
    probe_timeout: float = 5.0  # /health and /metrics ask the router at most this long
    curve_keys: str | None = None
    curve_name: str = "client"
    models_ttl: float = 5.0  # seconds a request reuses the router's model table (GET /v1/models always asks)
    tenant_keys: dict = field(default_factory=dict)  # API key -> its tenant (routing/tenants.py), accepted too

    @property
    def all_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*self.api_keys, *self.tenant_keys]))

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if not self.request_timeout > 0 or not self.probe_timeout > 0 or not self.body_idle_timeout > 0:
            raise ValueError("request_timeout, probe_timeout and body_idle_timeout must be > 0 seconds")


class ApiKeys:
    """ASGI middleware: `Authorization: Bearer <key>` on every path but the open ones. A tenant's key
    puts its tenant in the scope (TENANT), which each request to the router then names."""

    def __init__(self, app, keys: tuple[str, ...], tenants: dict[str, str] | None = None):
        tenants = tenants or {}
        self.app, self.keys = app, [(k.encode(), tenants.get(k)) for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            token = token.strip()
            # every key compared, in constant time each: which key matched takes no less time to find
            found = [tenant for k, tenant in self.keys if hmac.compare_digest(token, k)]
            if scheme.lower() != b"bearer" or not found:
                err = openai_requests.OpenAIError(401, "missing or invalid API key: send Authorization: Bearer <key>",
                                    code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
            if found[0] is not None:
                scope[TENANT] = found[0]
        await self.app(scope, receive, send)


TIMING_HEADERS = {"queued_s": "x-mmfusion-queue-time", "load_s": "x-mmfusion-load-time",
                  "run_s": "x-mmfusion-run-time"}


def timing_headers(answer) -> dict[str, str] | None:
    """The router's timing of a non-streamed answer (its usage's `timing`) as response headers, in
    seconds: how long its requests queued, waited for a model to load, and ran (the longest of each
    over several prompts)."""
    timing = (answer.get("usage") or {}).get("timing") if isinstance(answer, dict) else None
    if not isinstance(timing, dict):
        return None
    return {header: f"{timing[key]:.6f}" for key, header in TIMING_HEADERS.items() if key in timing}


def tenant_of(scope) -> str | None:
    """The tenant of the request's API key (None: it has none)."""
    return scope.get(TENANT)


class FastPath:
    """ASGI: POST /v1/completions straight to its handler, past Starlette's router and middleware
    layers (the short-request hot spot); everything else, lifespan included, to Starlette."""

    def __init__(self, gateway, app: Starlette):
        self.gateway, self.app = gateway, app
        keys = gateway.settings.all_keys
        self.completions = (ApiKeys(gateway.completions, keys, gateway.settings.tenant_keys) if keys
                            else gateway.completions)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/completions" and scope["method"] == "POST":
            await self.completions(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class Asgi:
    """A bound method taking (scope, receive, send), as a Starlette route endpoint: Starlette calls
    an endpoint that is not a function or method as an ASGI app (path parameters in the scope)."""

    def __init__(self, fn):
        self.fn = fn

    async def __call__(self, scope, receive, send):
        await self.fn(scope, receive, send)


async def until_cancelled_by_client(receive, coro):
    """Await `coro`; if the client disconnects first, cancel it (which cancels on the workers).
    One watcher task per request, which cancels this one: cheaper than racing two tasks."""
    me = asyncio.current_task()
    gone = False

    async def watch():
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        me.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await coro
    except asyncio.CancelledError:
        if gone:
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


@dataclass(slots=True)
class Gateway:
    settings: GatewaySettings
    metrics: Metrics = field(default_factory=Metrics)
    client: AsyncClient | None = None
    _models: list[dict] = field(default_factory=list)
    _models_at: float = -1e9
    _targets: dict = field(default_factory=dict)  # (model value, tokenizer path) -> Target, for _models

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        kw = {"curve_keys": s.curve_keys, "curve_name": s.curve_name} if s.curve_keys else {}
        self.client = AsyncClient(s.router, timeout=s.request_timeout, **kw)

    async def stop(self) -> None:
        if self.client is not None:
            self.client.close()

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    def app(self) -> FastPath:
        routes = []
        for prefix in ("", "/models/{model:path}"):
            routes += [Route(prefix + "/v1/completions", Asgi(self.completions), methods=["POST"]),
                       Route(prefix + "/v1/chat/completions", self.chat, methods=["POST"]),
                       Route(prefix + "/tokenize", self.tokenize, methods=["POST"]),
                       Route(prefix + "/detokenize", self.detokenize, methods=["POST"]),
                       Route(prefix + "/tokenizer_info", self.tokenizer_info, methods=["GET"])]
        routes += [*model_admin_routes(self),
                   Route("/v1/models", self.list_models, methods=["GET"]),
                   Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
                   Route("/health", self.health, methods=["GET"]),
                   Route("/metrics", self.prometheus, methods=["GET"])]
        served = sorted({r.path.replace("{model:path}", "<model>") for r in routes if not r.path.startswith("/models/")})
        no_route = unknown_route(served)
        app = Starlette(routes=routes, lifespan=self.lifespan, exception_handlers={404: no_route, 405: no_route})
        if self.settings.all_keys:  # outermost: the fast path is inside
            app.add_middleware(ApiKeys, keys=self.settings.all_keys, tenants=self.settings.tenant_keys)
        return FastPath(self, app)

    # --- helpers ---------------------------------------------------------------------------------
    async def models(self, refresh: bool = False) -> list[dict]:
        if refresh or time.monotonic() - self._models_at > self.settings.models_ttl:
            self._models = await asyncio.wait_for(self.client.models(), self.settings.probe_timeout)
            self._models_at = time.monotonic()
            self._targets = {}  # resolved against the table just replaced
        return self._models

    async def target(self, request: Request, body: dict | None) -> O.Target:
        """The model a request names: in its path (`/models/<model>/...`), else in its body (or
        query), else the only variant when there is just one."""
        value = request.path_params.get("model") or (body or {}).get("model") or request.query_params.get("model")
        return await self.target_for(value, request.scope["path"])

    async def target_for(self, value, path: str) -> O.Target:
        models = await self.models()
        tokenizer_path = path.rsplit("/", 1)[-1] in ("tokenize", "detokenize", "tokenizer_info")
        key = (value, tokenizer_path) if isinstance(value, str) or value is None else None
        if key in self._targets:
            _RESOLVED.set(self._targets[key].name)
            return self._targets[key]  # resolved against the current model table
        names = list(dict.fromkeys(m["name"] for m in models))
        default = names[0] if len(names) == 1 and tokenizer_path else None
        try:
            target = O.resolve_model(value, models, default)
        except openai_requests.OpenAIError as exc:
            if exc.status != 404:
                raise
            models = await self.models(refresh=True)  # a model table gone stale
            target = O.resolve_model(value, models, default)
        if key is not None:
            self._targets[key] = target  # bounded: only names that resolved (the deployment's)
        _RESOLVED.set(target.name)
        return target

    def error_response(self, exc: Exception) -> JSONResponse:
        err = O.error_for(exc, self.settings.request_timeout)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def answer(self, endpoint: str, work) -> Response | dict:
        """Run an endpoint's work; count it, time it, turn its failure into an OpenAI error. The work
        returns (a Response or a JSON body, the model label)."""
        t0 = time.perf_counter()
        label = "unknown"
        _RESOLVED.set(None)
        try:
            resp, label = await work(t0)
        except ClientGone:
            resp = Response(status_code=CLIENT_GONE)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error object, never a crash
            resp = self.error_response(exc)
            label = _RESOLVED.get() or label
        streamed = isinstance(resp, StreamingResponse)
        self.metrics.request_done(label, endpoint, resp.status_code if isinstance(resp, Response) else 200,
                                  None if streamed else time.perf_counter() - t0)
        return resp

    async def handle(self, endpoint: str, work) -> Response:
        """answer(), as a Response for a Starlette endpoint."""
        resp = await self.answer(endpoint, work)
        return JSONResponse(resp, headers=timing_headers(resp)) if isinstance(resp, dict) else resp

    # --- OpenAI endpoints --------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        async def work(t0):  # the router's table as it is now (models load and unload at run time)
            return JSONResponse(openai_objects.model_list(await self.models(refresh=True), int(time.time()))), "-"
        return await self.handle("models", work)

    async def get_model(self, request: Request) -> Response:
        async def work(t0):
            models = await self.models(refresh=True)
            target = O.resolve_model(request.path_params["model"], models)
            entry = next(m for m in openai_objects.model_list(models, int(time.time()))["data"] if m["id"] == target.name)
            return JSONResponse(entry), target.name
        return await self.handle("models", work)

    async def completions(self, scope, receive, send) -> None:
        """POST /v1/completions, as plain ASGI: the hot path of short requests, so no Request or
        Response object on its way unless it streams or fails."""
        async def work(t0):
            body = await read_json(scope, receive, self.settings.max_body_bytes, self.settings.body_idle_timeout)
            path_model = scope.get("path_params", {}).get("model")
            target = await self.target_for(path_model or body.get("model"), scope["path"])
            job = openai_requests.completion_job(body)
            tenant = tenant_of(scope)
            if job.stream.stream:
                return await stream_response(self.client, self.metrics, self.error_response, target, job.prompts,
                                             job.params, job.n, job.stream.include_usage, P.GENERATE, t0,
                                             tenant), target.name
            results = await until_cancelled_by_client(receive, all_of(
                lambda p: self.client.result(target.router_model, p, tenant=tenant, **job.params), job.prompts))
            out = openai_objects.merge_completions(results, target.name, job.n)
            self.metrics.observe_usage(target.name, out["usage"])
            return out, target.name

        resp = await self.answer("completions", work)
        if isinstance(resp, dict):
            await send_json(send, resp, timing_headers(resp))
        else:
            await resp(scope, receive, send)

    async def chat(self, request: Request) -> Response:
        async def work(t0):
            body = await read_json(request.scope, request.receive, self.settings.max_body_bytes,
                                   self.settings.body_idle_timeout)
            target = await self.target(request, body)
            job = openai_requests.chat_job(body)
            tenant = tenant_of(request.scope)
            try:
                if job.stream.stream:
                    return await stream_response(self.client, self.metrics, self.error_response, target,
                                                 [job.messages], job.params, job.n, job.stream.include_usage, P.CHAT,
                                                 t0, tenant), target.name
                result = await until_cancelled_by_client(request.receive, self.client.result(
                    target.router_model, job.messages, task=P.CHAT, tenant=tenant, **job.params))
            except RouterError as exc:
                raise job.error(O.error_for(exc)) from None
            self.metrics.observe_usage(target.name, result["usage"])
            return openai_objects.chat_completion(result, target.name), target.name
        return await self.handle("chat", work)

    # --- tokenizer endpoints -------------------------------------------------------------------------
    async def _task(self, request: Request, endpoint: str, task: str, body_needed: bool, build) -> Response:
        async def work(t0):
            body = await read_json(request.scope, request.receive, self.settings.max_body_bytes,
                                   self.settings.body_idle_timeout) if body_needed else {}
            target = await self.target(request, body)
            prompt, task_params = build(body)
            answer = await until_cancelled_by_client(request.receive, self.client.result(
                target.router_model, prompt, task=task, tenant=tenant_of(request.scope), **task_params))
            return answer, target.name
        return await self.handle(endpoint, work)

    async def tokenize(self, request: Request) -> Response:
        def build(body):
            if "messages" in body:
                return body["messages"], {}
            if not isinstance(body.get("prompt"), str):
                raise openai_requests.bad("prompt", "prompt must be a string (or give messages)")
            add = body.get("add_special_tokens", True)
            return body["prompt"], {"add_special_tokens": add}
        return await self._task(request, "tokenize", P.TOKENIZE, True, build)

    async def detokenize(self, request: Request) -> Response:
        def build(body):
            return body.get("tokens"), {}
        return await self._task(request, "detokenize", P.DETOKENIZE, True, build)

    async def tokenizer_info(self, request: Request) -> Response:
        return await self._task(request, "tokenizer_info", P.TOKENIZER_INFO, False, lambda body: (None, {}))

    # --- operations ----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        try:
            models = await self.models()
            status = await asyncio.wait_for(self.client.status(), self.settings.probe_timeout)
        except Exception as exc:  # noqa: BLE001 - unhealthy, whatever the reason
            return JSONResponse({"status": "unavailable", "error": f"the router did not answer: {exc!r}"}, 503)
        serving = [m for m in models if m["id"] is not None and m.get("state", "loaded") == "loaded"]
        missing = [f"{m['name']}:{m['id']}" for m in serving
                   if not any(w["alive"] and w["loaded"] and w["model_id"] == m["id"] for w in status["workers"])]
        if missing:
            return JSONResponse({"status": "unavailable", "models_without_worker": missing}, 503)
        return JSONResponse({"status": "ok", "models": [f"{m['name']}:{m['id']}" for m in serving]})

    async def prometheus(self, request: Request) -> Response:
        try:
            models = await self.models()
            self.metrics.router_state(models, await asyncio.wait_for(self.client.status(),
                                                                     self.settings.probe_timeout))
        except Exception as exc:  # noqa: BLE001 - the gateway's own metrics are still worth serving
            log.warning("gateway: router state for /metrics unavailable: %r", exc)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
