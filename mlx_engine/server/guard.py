"""Browser safety: the server answers only the hosts and origins its user allowed, and only JSON bodies.

A server on loopback is still reachable from every web page its user opens. Three checks close the ways in, as
ollama's server makes them (``server/routes.go``: ``allowedHostsMiddleware`` and its CORS configuration;
``envconfig.AllowedOrigins``):

- **Host** (DNS rebinding): a page on ``attacker.example`` whose name is re-pointed at 127.0.0.1 reads our answers
  as same-origin ones; its requests carry ``Host: attacker.example``. Accepted: no Host header (HTTP/1.0), the bound
  address, ``localhost`` and ``*.localhost``, loopback addresses, ``--allowed-hosts``; when bound beyond loopback
  also the machine's own addresses and host name. Any port.
- **Origin** (cross-origin requests): a request with an ``Origin`` header is answered only when the origin is
  allowed (``--allowed-origins`` plus ollama's defaults) or is the server itself; CORS preflights likewise, and
  answers to allowed origins carry ``Access-Control-Allow-Origin``.
- **Content-Type**: ``text/plain``, form and multipart bodies are the ones a page may send cross-origin without a
  preflight (the Fetch standard's CORS-safelisted request headers); a JSON route takes a JSON type or none (415).
  The one form route, ``/v1/images/edits`` (OpenAI's API takes its images as ``multipart/form-data``), takes that
  type too; a browser's cross-origin POST carries an ``Origin``, so the origin check above still guards it.

Refusals come in the route family's error shape: ollama's ``{"error": "..."}`` under ``/api/``, Anthropic's
``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``, OpenAI's
``{"error": {"message", "type", "param", "code"}}`` elsewhere.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Iterable

from starlette.responses import JSONResponse, Response

HOSTS_ENV = "MLX_ENGINE_ALLOWED_HOSTS"
ORIGINS_ENV = "MLX_ENGINE_ORIGINS"

#: ollama's default origins (envconfig.AllowedOrigins): local pages on any port, and desktop apps' schemes.
DEFAULT_ORIGINS = tuple(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
                        for scheme in ("http", "https") for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
#: routes whose body is a ``multipart/form-data`` form (OpenAI's image edits).
FORM_PATHS = ("/v1/images/edits",)
#: What browser clients of the OpenAI, Anthropic and ollama APIs send (ollama's list plus Anthropic's and x-api-key).
ALLOW_HEADERS = ", ".join((
    "Authorization", "Content-Type", "User-Agent", "Accept", "X-Requested-With", "x-api-key", "anthropic-version",
    "anthropic-beta", "anthropic-dangerous-direct-browser-access", "OpenAI-Organization", "OpenAI-Project",
    "x-stainless-lang", "x-stainless-package-version", "x-stainless-os", "x-stainless-arch",
    "x-stainless-retry-count", "x-stainless-runtime", "x-stainless-runtime-version", "x-stainless-async",
    "x-stainless-helper-method", "x-stainless-poll-helper", "x-stainless-custom-poll-interval",
    "x-stainless-timeout"))
PREFLIGHT_MAX_AGE = "43200"  # seconds; gin-contrib/cors's default, which ollama keeps
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def split_list(values: "str | Iterable[str] | None") -> list[str]:
    """Entries of comma-separated values (a string, or several as given to a repeated option), stripped, with the
    quotes ollama strips from ``OLLAMA_ORIGINS`` removed, empty ones dropped."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [e for v in values for e in (p.strip().strip("\"'").strip() for p in v.split(",")) if e]


def check_hosts(hosts: Iterable[str]) -> None:
    """Raises ValueError for an ``--allowed-hosts`` entry that is not a host name (a URL, a path)."""
    for h in hosts:
        if h != "*" and not re.fullmatch(r"(\*\.)?[A-Za-z0-9._\-\[\]:]+", h):
            raise ValueError(f"--allowed-hosts: {h!r} is not a host name; give names such as myhost.lan, "
                             "*.example.com or 192.168.1.20 (without scheme or path), or * for any host")


def check_origins(origins: Iterable[str]) -> None:
    """Raises ValueError for an ``--allowed-origins`` entry that is not an origin pattern."""
    for o in origins:
        if o not in ("*", "null") and "://" not in o:
            raise ValueError(f"--allowed-origins: {o!r} is not an origin; give scheme://host[:port] such as "
                             "https://example.com or http://localhost:*, with * as a wildcard")


#: Anthropic's error types by status (its API reference, "Errors"); 529 is its overloaded_error.
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``, the type from the status."""
    kind = ANTHROPIC_ERRORS.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(path: str, status: int, message: str, kind: str) -> Response:
    """An error in the form of the route family of ``path``: ollama's under ``/api/``, Anthropic's under
    ``/v1/messages``, else OpenAI's."""
    if path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status)
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return JSONResponse(anthropic_error(status, message), status_code=status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


def _pattern(glob: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in glob.lower().split("*")))


def host_name(value: str) -> "str | None":
    """The host of a ``Host`` header value, lower case, without port, brackets or a final dot; None when it is
    malformed (a port that is not a number, an unclosed bracket)."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        rest = v[end + 1:]
        if end < 2 or rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return v[1:end]
    if v.count(":") == 1:
        v, port = v.split(":")
        if not port.isdigit():
            return None
    return v.rstrip(".")


def _ip(host: str) -> "ipaddress.IPv4Address | ipaddress.IPv6Address | None":
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


@functools.lru_cache(maxsize=256)
def own_address(host: str) -> bool:
    """Whether ``host`` (an IP address) is one of this machine's: the system lets a socket bind it."""
    ip = _ip(host)
    if ip is None:
        return False
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


class BrowserGuard:
    """Pure ASGI middleware making the three checks of this module before anything else runs (the API key check
    included: a CORS preflight carries no credentials).

    Args:
        app: the ASGI app behind it.
        bound: the address the server binds (``--host``).
        allowed_hosts: more Host names to answer (exact, ``*.domain`` for its subdomains, or ``*`` for any).
        allowed_origins: more origins (``*`` matches any run of characters), on top of :data:`DEFAULT_ORIGINS`.
    """

    def __init__(self, app, *, bound: str, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()):
        self.app = app
        self.bound = host_name(bound) or ""
        bound_ip = _ip(self.bound)
        self.beyond_loopback = self.bound != "localhost" and (bound_ip is None or not bound_ip.is_loopback)
        hosts = split_list(allowed_hosts)
        self.any_host = "*" in hosts
        self.hosts = {host_name(h) or h for h in hosts if not h.startswith("*")}
        self.host_suffixes = tuple(h[1:].lower() for h in hosts if h.startswith("*."))
        self.origins = [_pattern(o) for o in (*split_list(allowed_origins), *DEFAULT_ORIGINS)]

    # ---- the checks ----------------------------------------------------------------------------------------------
    def host_allowed(self, value: "str | None") -> bool:
        """Whether a request whose ``Host`` header is ``value`` (None: no header) is answered."""
        if value is None or self.any_host:
            return True
        host = host_name(value)
        if host is None:
            return False
        ip = _ip(host)
        if host in ("", "localhost", self.bound) or host.endswith(".localhost") or (ip is not None and ip.is_loopback):
            return True
        if host in self.hosts or any(host.endswith(s) for s in self.host_suffixes):
            return True
        if self.beyond_loopback:  # reached over the network: the machine's own names and addresses
            name = socket.gethostname().lower()
            return host in (name, name + ".local") or (ip is not None and own_address(str(ip)))
        return False

    def origin_allowed(self, origin: str, host: "str | None") -> bool:
        """Whether a request from the page ``origin`` to ``host`` (its Host header) is answered."""
        origin = origin.strip().lower()
        if host is not None and origin in (f"http://{host.lower()}", f"https://{host.lower()}"):
            return True  # the server's own pages: not a cross-origin request (gin-contrib/cors's rule)
        return any(p.fullmatch(origin) for p in self.origins)

    @staticmethod
    def json_or_none(content_type: "str | None") -> bool:
        """Whether a body of ``content_type`` (None: no header) is read: a JSON type, or none."""
        if content_type is None:
            return True
        media = content_type.split(";")[0].strip().lower()
        return media in ("", "application/json") or (media.startswith("application/") and media.endswith("+json"))

    # ---- ASGI ----------------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        path, method = scope.get("path", ""), scope.get("method", "GET")
        host, origin = headers.get("host"), headers.get("origin")

        async def refuse(status: int, message: str, kind: str, extra: "dict[str, str] | None" = None):
            response = error_response(path, status, message, kind)
            response.headers.update(extra or {})
            await response(scope, receive, send)

        if not self.host_allowed(host):
            return await refuse(403, f"Host {host!r} is not allowed: this server answers requests for localhost, "
                                     "its own address and the hosts named with --allowed-hosts (or "
                                     f"${HOSTS_ENV})", "permission_error")
        if origin is None:
            cors: dict[str, str] = {}
        elif self.origin_allowed(origin, host):
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        else:
            return await refuse(403, f"Origin {origin!r} is not allowed: web pages may use this server only from the "
                                     "origins named with --allowed-origins (or $" + ORIGINS_ENV + ") and local ones",
                                "permission_error")
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            return await Response(status_code=204, headers={
                **cors, "Access-Control-Allow-Methods": ALLOW_METHODS, "Access-Control-Allow-Headers": ALLOW_HEADERS,
                "Access-Control-Max-Age": PREFLIGHT_MAX_AGE})(scope, receive, send)
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        ctype = headers.get("content-type")
        if method in _BODY_METHODS and has_body and not self.json_or_none(ctype) and not (
                path in FORM_PATHS and ctype.split(";")[0].strip().lower() == "multipart/form-data"):
            return await refuse(415, f"unsupported Content-Type {headers['content-type']!r}: send the body as JSON "
                                     "with 'Content-Type: application/json' (curl: -H 'Content-Type: "
                                     "application/json')", "invalid_request_error", cors)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                extra = [(k.lower().encode(), v.encode("latin-1")) for k, v in cors.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
