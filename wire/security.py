"""CurveZMQ for connections off loopback: key generation, the router's side, the peers' side.

A keys directory, as `python -m wire.security DIR` writes it:

    DIR/server.key, DIR/server.key_secret      the router's keypair (give server.key to peers)
    DIR/clients/NAME.key, NAME.key_secret      one keypair per client or worker (give each its own)
    DIR/authorized_clients/NAME.key            the public keys the router accepts (zmq.auth)

The router binds loopback by default. Binding any other interface needs a keys directory (both of
its sockets then speak CURVE and accept only the authorized keys), or an explicit `insecure`.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth


class SecurityError(ValueError):
    pass


def is_loopback(address: str) -> bool:
    """True for tcp on 127.0.0.0/8, localhost or ::1, and for ipc/inproc (never leave the machine);
    False for `*`, other addresses, interface and host names."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_problem(address: str, bind: bool = True) -> str | None:
    """Why `address` is not a ZeroMQ endpoint to bind (tcp://HOST:PORT, the port 1-65535, or `*` or
    0 for any free one; ipc://PATH; inproc://NAME), or with bind false to connect to (a port 1-65535),
    or None when it is one."""
    if address.startswith(("ipc://", "inproc://")):
        return None if address.split("://", 1)[1] else "names no path"
    if not address.startswith("tcp://"):
        return "is not tcp://HOST:PORT (nor ipc://PATH)"
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host:
        return "has no HOST:PORT"
    if bind and port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
        return f"has no port 0-65535 (or `*`): {port!r}"
    if not bind and not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"has no port 1-65535 to connect to: {port!r}"
    return None


def check_bind(address: str, curve_keys: str | None, insecure: bool) -> None:
    problem = endpoint_problem(address)
    if problem:
        raise SecurityError(f"address {address!r} {problem}; give e.g. tcp://127.0.0.1:5555")
    if is_loopback(address) or curve_keys or insecure:
        return
    raise SecurityError(f"binding {address} would accept connections from other machines: give a CurveZMQ keys "
                        "directory (--curve_keys DIR, made by `python -m wire.security DIR`) or pass --insecure "
                        "explicitly")


def _keys(dir_: str | Path) -> Path:
    d = Path(dir_)
    if not (d / "server.key_secret").exists():
        raise SecurityError(f"{d}: no server.key_secret; make a keys directory with `python -m wire.security {d}`")
    return d


def serve_curve(ctx: zmq.Context, sockets: list[zmq.Socket], keys_dir: str | Path):
    """Make `sockets` CURVE servers that accept only DIR/authorized_clients. Returns the
    authenticator thread (stop it when done). Call before binding."""
    from zmq.auth.thread import ThreadAuthenticator

    d = _keys(keys_dir)
    public, secret = zmq.auth.load_certificate(str(d / "server.key_secret"))
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(d / "authorized_clients"))
    for s in sockets:
        s.curve_secretkey = secret
        s.curve_publickey = public
        s.curve_server = True
    return auth


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """A CURVE client's keys in memory (z85): the server's public key and the client's pair. A
    process handed these never writes a private key to a file (a Ray actor's worker)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_texts(cls, server_key: str, client_secret_key: str) -> ClientKeys:
        """From the texts of DIR/server.key and DIR/clients/NAME.key_secret (zmq.auth's format)."""
        server = _certificate_fields(server_key)
        client = _certificate_fields(client_secret_key)
        if "public-key" not in server or not {"public-key", "secret-key"} <= client.keys():
            raise SecurityError("a CurveZMQ certificate text lacks its public-key or secret-key line")
        return cls(server["public-key"], client["public-key"], client["secret-key"])


def _certificate_fields(text: str) -> dict[str, bytes]:
    """`public-key = "..."` and `secret-key = "..."` of a zmq.auth certificate."""
    found = re.findall(r'^\s*(public-key|secret-key)\s*=\s*"(.*)"\s*$', text, re.MULTILINE)
    return {k: v.encode() for k, v in found}


def connect_curve(sock: zmq.Socket, keys: str | Path | ClientKeys, name: str) -> None:
    """Make `sock` a CURVE client with DIR/clients/NAME.key_secret, trusting DIR/server.key (or with
    keys held in memory). Call before connecting."""
    if isinstance(keys, ClientKeys):
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.server_public, keys.public, keys.secret
        return
    d = Path(keys)
    server_public, _ = zmq.auth.load_certificate(str(d / "server.key"))
    secret_file = d / "clients" / f"{name}.key_secret"
    if not secret_file.exists():
        raise SecurityError(f"{secret_file} does not exist: make it with `python -m wire.security {d} --client "
                            f"{name}` (and keep its public key in authorized_clients)")
    public, secret = zmq.auth.load_certificate(str(secret_file))
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def generate(keys_dir: str | Path, clients: list[str], authorize: bool = True) -> list[Path]:
    """Create the server keypair (once) and a keypair per client; authorize the clients."""
    d = Path(keys_dir)
    for sub in ("clients", "authorized_clients"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    made = []
    if not (d / "server.key_secret").exists():
        zmq.auth.create_certificates(str(d), "server")
        made.append(d / "server.key")
    for name in clients:
        if not (d / "clients" / f"{name}.key_secret").exists():
            zmq.auth.create_certificates(str(d / "clients"), name)
            made.append(d / "clients" / f"{name}.key_secret")
        if authorize:
            shutil.copy(d / "clients" / f"{name}.key", d / "authorized_clients" / f"{name}.key")
    (d / "server.key_secret").chmod(0o600)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("keys_dir")
    ap.add_argument("--client", action="append", default=None,
                    help="a client or worker keypair to create and authorize (repeatable; default: client, worker)")
    args = ap.parse_args(argv)
    try:
        made = generate(args.keys_dir, args.client or ["client", "worker"])
    except OSError as exc:
        print(f"error: cannot write keys to {args.keys_dir}: {exc}", file=sys.stderr)
        return 2
    for p in made:
        print(f"wrote {p}")
    print(f"router: --curve_keys {args.keys_dir}; peers need {args.keys_dir}/server.key and their own "
          f"clients/NAME.key_secret")
    return 0


if __name__ == "__main__":
    sys.exit(main())
