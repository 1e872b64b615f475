"""What stands between the network and the server's routes: Host names, request ids, faults, the API key.

- DNS rebinding: a page on another site can make a browser send requests to 127.0.0.1 under the
  attacker's own name. `Guard` answers only to the Host names in `allowed` (on a loopback address:
  localhost, 127.0.0.1 and [::1], any port), with a 421 otherwise; `allowed=None` accepts any name.
- Faults: an exception that escapes a route is logged with its traceback under a request id, and the
  client gets a generic 500 that names the id (also in the `X-Request-Id` header of every response),
  never the exception's text, which may show paths or data.
- The API key comes from the environment or a file (`read_api_key`), never from the command line,
  where every user of the machine sees it in `ps`.
CORS stays closed: no response carries Access-Control-Allow-Origin, so other sites cannot read replies,
and `app.read_json` wants `Content-Type: application/json`, which no cross-site form or simple request
can send without a preflight this server never grants.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Collection, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from gptlab.config import SettingError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
API_KEY_VARIABLE = "GPTLAB_API_KEY"

log = logging.getLogger("gptlab.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def host_name(value: str) -> str:
    """A Host header (or an --allowed-hosts entry) without its port, lower-case: "[::1]:8000" -> "[::1]"."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[:value.find("]") + 1]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def default_allowed_hosts(address: str) -> frozenset[str] | None:
    """The Host names a server bound to `address` answers to: loopback names on a loopback address,
    any (None) on a wildcard address, else the address itself."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:  # a name such as "localhost": itself and the loopback names
        return LOOPBACK_NAMES | {host_name(address)}
    if ip.is_loopback:
        return LOOPBACK_NAMES
    if ip.is_unspecified:
        return None
    return frozenset({f"[{ip}]" if ip.version == 6 else str(ip)})


def parse_allowed_hosts(allowed_hosts: str) -> frozenset[str] | None:
    """`a,b:8000,[::1]` (the serve command's --allowed-hosts) as a set of names; "*" accepts any."""
    names = frozenset(host_name(part) for part in allowed_hosts.split(",") if part.strip())
    if not names:
        raise SettingError("{allowed_hosts} is empty: give names separated by commas, or * for any",
                           allowed_hosts="allowed_hosts")
    return None if "*" in names else names


def read_api_key(api_key_file: str | Path | None, environ: Mapping[str, str]) -> str | None:
    """The key from the first line of `api_key_file` if given, else from $GPTLAB_API_KEY; None when neither
    is."""
    if api_key_file is not None:
        try:
            lines = Path(api_key_file).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise SettingError(f"{{file}} {api_key_file}: cannot read it ({err.strerror})",
                               file="api_key_file") from None
        first = lines[0].strip() if lines else ""
        if not first:
            raise SettingError(f"{{file}} {api_key_file} is empty: write the key on its first line",
                               file="api_key_file")
        return first
    key = environ.get(API_KEY_VARIABLE)
    if key is not None and not key.strip():
        raise ValueError(f"{API_KEY_VARIABLE} is set but empty: set it to the key, or unset it to serve "
                         "without one")
    return None if key is None else key.strip()


def error_body(message: str, code: str | None, kind: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class Guard:
    """ASGI middleware: the Host check, a request id on every response, and a generic 500 for faults."""

    def __init__(self, app: ASGIApp, allowed: Collection[str] | None) -> None:
        self.app = app
        self.allowed = None if allowed is None else frozenset(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req-{secrets.token_hex(8)}"
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if self.allowed is not None and host_name(host) not in self.allowed:
            shown = ", ".join(sorted(self.allowed))
            message = (f"Host {host!r} is not a name this server answers to ({shown}): start it with "
                       f"--allowed-hosts to add one")
            await reply(send_with_id, 421, error_body(message, "invalid_host"))
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("internal error (request id %s) in %s %s", request_id, scope.get("method"),
                          scope.get("path"))
            if not started:  # a stream already under way can only stop
                body = error_body(f"internal error (request id {request_id})", None, "server_error")
                await reply(send_with_id, 500, body)


async def reply(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
