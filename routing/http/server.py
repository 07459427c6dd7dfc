"""Running the gateway: uvicorn in the foreground (the CLI, which run_mm serve --http starts as a
process of its own: routing/http/process.py) or in a thread (tests).

    python -m routing.http --router tcp://127.0.0.1:5555 --http 127.0.0.1:8000 [--api-key KEY ...]

It binds 127.0.0.1 by default. Any other address needs API keys (`--api-key`, `--api-keys-file`
with one key per line, or MMFUSION_API_KEYS, comma-separated) or an explicit `--insecure`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from routing.http.app import MAX_BODY_BYTES, Gateway, GatewaySettings
from routing.open_files import raise_open_files
from wire import protocol as P
from wire.security import endpoint_problem, is_loopback

KEYS_ENV = "MMFUSION_API_KEYS"
TENANT_KEYS_ENV = "MMFUSION_TENANT_KEYS"  # JSON {API key: tenant name}: keys accepted, each naming its tenant
READY_LINE = "gateway: listening"  # printed once uvicorn listens: what a supervising process waits for


class GatewayError(ValueError):
    """A gateway that must not start as asked (bad address, off loopback without keys)."""


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise GatewayError(f"--http must be HOST:PORT (e.g. 127.0.0.1:8000), got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def api_keys(keys: list[str] | None = None, keys_file: str | None = None, env: dict | None = None) -> tuple[str, ...]:
    """Keys from the flags, a file (one per line, # comments) and the environment, in that order."""
    out = [k for k in (keys or []) if k]
    if keys_file:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except OSError as exc:
            raise GatewayError(f"api keys file {keys_file}: {exc.strerror}") from None
        out += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    out += [k.strip() for k in (env if env is not None else os.environ).get(KEYS_ENV, "").split(",") if k.strip()]
    return tuple(dict.fromkeys(out))


def tenant_keys(env: dict | None = None) -> dict[str, str]:
    """{API key: tenant} from the environment (run_mm.py's `tenants`)."""
    text = (env if env is not None else os.environ).get(TENANT_KEYS_ENV, "")
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise GatewayError(f"{TENANT_KEYS_ENV} must be a JSON object of API key -> tenant name: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                              for k, v in value.items()):
        raise GatewayError(f"{TENANT_KEYS_ENV} must be a JSON object of API key -> tenant name")
    return value


def check_listen(host: str, keys: tuple[str, ...], insecure: bool) -> None:
    if not is_loopback(f"tcp://[{host}]:0") and not keys and not insecure:
        raise GatewayError(f"the HTTP gateway would listen on {host}, off loopback, with no API key: give "
                           f"--api-key (or --api-keys-file, or {KEYS_ENV}), or --insecure to allow it")


def check_free(host: str, port: int) -> None:
    """Refuse at once an address another server listens on: run_mm serve checks before its models
    load, which would otherwise take their minutes only to stop when the gateway cannot bind."""
    if port == 0:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except OSError as exc:
        raise GatewayError(f"--http {host}:{port}: {exc}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(addr)
        except OSError as exc:
            raise GatewayError(f"the HTTP gateway cannot listen on {host}:{port}: {exc.strerror} (another server "
                               "there? give --http another port)") from None


def bound_port(server: uvicorn.Server) -> int:
    """The port a started server listens on: the one asked for, or the one the OS chose for port 0."""
    return server.servers[0].sockets[0].getsockname()[1]


def make_server(settings: GatewaySettings, host: str, port: int, log_level: str = "warning") -> uvicorn.Server:
    app = Gateway(settings).app()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="auto", http="auto",
                            lifespan="on", access_log=False, timeout_keep_alive=30,
                            # no X-Forwarded-* rewriting: a proxy in front is not assumed (and costs every request)
                            proxy_headers=False)
    return uvicorn.Server(config)


class GatewayThread:
    """The gateway on a thread of this process (run_mm serve): start() returns once it listens."""

    def __init__(self, settings: GatewaySettings, host: str, port: int):
        self.server = make_server(settings, host, port)
        self.thread = threading.Thread(target=self.server.run, name="http-gateway", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 30.0) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise GatewayError(f"the HTTP gateway could not start on {self.host}:{self.port} (see above)")
            if time.monotonic() > deadline:
                raise GatewayError(f"the HTTP gateway did not start on {self.host}:{self.port} within {timeout}s")
            time.sleep(0.02)
        self.port = bound_port(self.server)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def add_arguments(ap: argparse.ArgumentParser, router: bool = True) -> None:
    if router:
        ap.add_argument("--router", default=P.DEFAULT_FRONTEND, help="the router's client endpoint")
        ap.add_argument("--http", default="127.0.0.1:8000", help="HOST:PORT to listen on")
        ap.add_argument("--insecure", action="store_true", help="listen off loopback without API keys")
        ap.add_argument("--curve-keys", help="CurveZMQ keys directory, when the router requires it")
    ap.add_argument("--api-key", action="append", dest="api_key", help="an accepted API key (repeatable)")
    ap.add_argument("--api-keys-file", help="a file of accepted API keys, one per line")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (no orphans)")
    args = ap.parse_args(argv)
    try:
        host, port = parse_listen(args.http)
        keys = api_keys(args.api_key, args.api_keys_file)
        tenants = tenant_keys()
        check_listen(host, keys + tuple(tenants), args.insecure)
        check_router_address(args.router)
        settings = GatewaySettings(router=args.router, api_keys=keys, max_body_bytes=args.max_body_bytes,
                                   curve_keys=args.curve_keys, tenant_keys=tenants)
    except (GatewayError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"gateway: http://{host}:{port} -> router {args.router}", flush=True)
    raise_open_files()  # a connection a file: a thousand idle clients must not shut the others out
    server = make_server(settings, host, port, args.log_level)
    threading.Thread(target=_watch, args=(server, args.parent_pid), name="gateway-watch", daemon=True).start()
    server.run()
    return 0 if server.started else 1  # uvicorn has said why (e.g. the port is taken)


def _watch(server: uvicorn.Server, parent_pid: int | None, interval: float = 0.5) -> None:
    """Say when the gateway listens; stop it when the parent that started it is gone."""
    while not server.started and not server.should_exit:
        time.sleep(0.02)
    if server.started:
        print(f"{READY_LINE} on http://{server.config.host}:{bound_port(server)}", flush=True)
    while parent_pid is not None and not server.should_exit:
        if os.getppid() != parent_pid:
            server.should_exit = True
            os.kill(os.getpid(), signal.SIGTERM)  # wakes uvicorn's loop at once
        time.sleep(interval)


def check_router_address(address: str) -> None:
    """A router endpoint to connect to (tcp://host:port, ipc://...), checked before serving."""
    if problem := endpoint_problem(address, bind=False):
        raise GatewayError(f"--router {address!r} {problem}; give e.g. {P.DEFAULT_FRONTEND}")
