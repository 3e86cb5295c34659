"""Who may use a server: the host names it answers to, the origins it takes POSTs from, and access tokens.

**Host names.** A web page the user visits elsewhere can reach a loopback server by making its own name
resolve to 127.0.0.1 (DNS rebinding): the browser then sends the page's name in ``Host``, and treats the
server's answers as the page's own. As Jupyter does (its ``local_hostnames``), a server bound to a loopback
address answers only to loopback addresses (``127.0.0.1``, ``[::1]``, any of 127.0.0.0/8) and ``localhost``,
plus the names given with ``headscope serve --allowed-hosts`` (or ``HEADSCOPE_ALLOWED_HOSTS``), whatever the
port (an SSH tunnel or a proxy may reach it on another). Bound beyond the loopback it is reached by names it
cannot know, and its token is the guard (Jupyter's ``allow_remote_access``): a rebinding page has no token,
since the browser keeps the token's cookie for the server's own name. Names given there are checked too.
Anything else gets 403 and one line in the log. :func:`guard_hosts`.

**Origins.** A POST (every Dash callback) whose ``Origin`` is not the server's own, or whose
``Sec-Fetch-Site`` says another site sent it when there is no ``Origin``, gets 403: a page elsewhere cannot
start jobs through a form or a fetch. A request without either (curl, a script) is no browser's.

**Tokens.** A server listening beyond the loopback admits only browsers that know its token.

As in Jupyter, ``headscope serve --host 0.0.0.0`` generates a random token (or takes
``--token``/``HEADSCOPE_TOKEN``) and prints a URL carrying it. The first request with
``?token=...`` (or an ``Authorization: Bearer ...`` header) sets an HttpOnly, SameSite=Strict
cookie; later requests carry the cookie. Anything else gets 403 with a short text, never the app.
Tokens are compared in constant time, and never written to a log: :func:`redact_tokens_in_logs`
masks ``token=…`` in every line the web server logs (its access log prints each request's URL).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:  # flask loads with the server, not when the command line checks --allowed-hosts
    from flask import Flask

COOKIE = "headscope_token"
LOOPBACK_NAMES = frozenset({"localhost"})
log = logging.getLogger("headscope.app")

_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$",
                   re.ASCII)
# a Host header: a name or an IPv4 address, or an IPv6 address in brackets; then an optional port
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?$", re.ASCII)


def host_name(text: str) -> str:
    """``text`` (a host name or an IP address, as given to ``--allowed-hosts``) in the one spelling the
    checks compare: lower case, no trailing dot, an IP address as :mod:`ipaddress` writes it. ValueError
    (with what to write instead) for anything else: a port, a scheme, a path, a wildcard."""
    name = text.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    name = name[:-1] if name.endswith(".") else name
    if not _NAME.match(name) or name.replace(".", "").isdigit():
        raise ValueError(f"{text.strip()!r} is not a host name or an IP address (write names alone, without "
                         "a scheme, port, path or wildcard, e.g. lab.example.org)")
    return name


def host_names(text: str) -> tuple[str, ...]:
    """Comma-separated host names (``--allowed-hosts``, ``HEADSCOPE_ALLOWED_HOSTS``), each checked by
    :func:`host_name`; ValueError naming the first that is not one."""
    names = [host_name(item) for item in text.split(",") if item.strip()]
    if not names:
        raise ValueError("give one or more host names separated by commas, e.g. lab.example.org,10.0.0.5")
    return tuple(dict.fromkeys(names))


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (or an origin's host and port) as (name in :func:`host_name`'s spelling, port);
    None when it is not a host and port."""
    m = _HOST.match(value.strip().lower())
    if not m:
        return None
    try:
        name = host_name(m["v6"] or m["name"])
    except ValueError:
        return None
    if m["v6"] and ":" not in name:  # [1.2.3.4] is no IPv6 address
        return None
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 0 < port < 65536:
        return None
    return name, port


@dataclass(frozen=True)
class HostRule:
    """The ``Host`` names a server answers to: loopback addresses and ``localhost`` always, ``names``, and
    any host at all when ``any_host`` (bound beyond the loopback with no names given: the token guards)."""

    names: frozenset[str]
    any_host: bool

    @classmethod
    def for_server(cls, bound: str, allowed: Iterable[str] = ()) -> HostRule:
        """The rule of a server bound to ``bound`` (``--host``) with ``allowed`` names (``--allowed-hosts``)."""
        names = frozenset(host_name(n) for n in allowed)
        try:
            address = ipaddress.ip_address(bound.strip("[]"))
            loopback, wildcard = _is_loopback(address), address.is_unspecified
        except ValueError:
            loopback, wildcard = host_name(bound) in LOOPBACK_NAMES, False
        if not (loopback or wildcard):  # bound to one address or name: it answers to that one too
            names |= {host_name(bound)}
        return cls(names=names, any_host=not loopback and not allowed)

    def accepts(self, host: str) -> bool:
        """Whether a request with this ``Host`` header is for this server."""
        if self.any_host:
            return True
        parts = _split_host(host)
        if parts is None:
            return False
        name = parts[0]
        if name in LOOPBACK_NAMES or name in self.names:
            return True
        try:
            return _is_loopback(ipaddress.ip_address(name))
        except ValueError:
            return False


_DEFAULT_PORTS = {"http": 80, "https": 443}


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (an ``Origin`` header) names the host and port of ``host`` (the ``Host`` header
    of the same request): the page that sent it is the server's own. The scheme is not compared (a TLS
    proxy in front of the server sees ``https`` pages over ``http``); a default port may be left out."""
    try:
        parts = urlsplit(origin.strip())
        netloc_ok = parts.scheme in _DEFAULT_PORTS and parts.netloc and not (parts.path or parts.query
                                                                             or parts.fragment or "@" in parts.netloc)
    except ValueError:
        return False
    given, asked = _split_host(parts.netloc) if netloc_ok else None, _split_host(host)
    if given is None or asked is None:
        return False
    default = _DEFAULT_PORTS[parts.scheme]
    return given[0] == asked[0] and (given[1] or default) == (asked[1] or default)


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def guard_hosts(server: Flask, rule: HostRule) -> None:
    """Answer 403 (and log one line) to a request whose ``Host`` ``rule`` does not accept, and to a POST
    (any method but GET, HEAD, OPTIONS) sent by another site's page. Runs before every other check,
    the token's included."""
    from flask import Response, request

    def refuse(text: str, why: str) -> Response:
        log.warning("refused %s %r from %s: %s", request.method, request.path[:200],
                    request.remote_addr, why)
        return Response(f"headscope: {text}\n", status=403, mimetype="text/plain")

    def check_host_and_origin():
        environ = request.environ
        host = environ.get("HTTP_HOST")
        if host is None:  # HTTP/1.0 allows it; no browser sends a request without one
            if environ.get("SERVER_PROTOCOL") == "HTTP/1.0":
                return None
            return refuse("this server answers only to requests that name it (no Host header).", "no Host header")
        if not rule.accepts(host):
            return refuse("this server answers only to the host names it was started for. If you reached it by "
                          "this name on purpose, start it with --allowed-hosts NAME.",
                          f"Host {host[:200]!r} is not a name it answers to (add names with --allowed-hosts "
                          "or HEADSCOPE_ALLOWED_HOSTS)")
        if request.method in _SAFE_METHODS:
            return None
        origin = request.headers.get("Origin")
        site = request.headers.get("Sec-Fetch-Site", "").strip().lower()
        if origin is None and site not in ("cross-site", "same-site"):
            return None
        if origin is not None and same_origin(origin, host):
            return None
        return refuse("this request comes from another site's page; only this server's own pages may send it.",
                      f"Origin {origin[:200]!r} is not this server's own" if origin is not None
                      else f"Sec-Fetch-Site {site!r} (a page of another site sent it)")

    server.before_request_funcs.setdefault(None, []).insert(0, check_host_and_origin)


def new_token() -> str:
    return secrets.token_urlsafe(24)


def protect(server: Flask, token: str) -> None:
    """Require ``token`` on every request to ``server`` (a Dash app's Flask server)."""
    from flask import Response, request

    if len(token) < 16:
        raise ValueError("An access token must have at least 16 characters.")
    _SECRETS.add(token)

    def matches(value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(value.encode(), token.encode())

    def check_token():
        given = request.args.get("token")
        auth = request.headers.get("Authorization", "")
        bearer = auth[7:] if auth.startswith("Bearer ") else None
        if matches(request.cookies.get(COOKIE)) or matches(bearer):
            return None
        if matches(given):
            request.environ["headscope.set_cookie"] = True
            return None
        return Response("headscope: this server needs its access token. Open the URL it printed at start "
                        "(…/?token=…).\n", status=403, mimetype="text/plain")

    # first of all request checks: nothing else answers (or explains itself to) a request without the token
    server.before_request_funcs.setdefault(None, []).insert(0, check_token)

    @server.after_request
    def remember(response: Response) -> Response:
        if request.environ.get("headscope.set_cookie"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", max_age=30 * 24 * 3600)
        return response


_TOKEN_IN_URL = re.compile(r"(?i)(token=)[^&\s\"']*")
_SECRETS: set[str] = set()  # the tokens this process checks (protect() adds its own)


class RedactTokens(logging.Filter):
    """Masks access tokens in a log record's text: any ``token=…`` of a URL, and the tokens this process
    checks wherever they appear. Both are looked for after undoing percent escapes, since the server
    decodes ``%74oken=`` or an escaped value into the token it accepts while the access log prints the
    request line as sent."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report
            return True
        plain = unquote(text)
        if "token=" in plain.lower() or any(secret in plain for secret in _SECRETS):
            for secret in _SECRETS:
                plain = plain.replace(secret, "***")
            record.msg, record.args = _TOKEN_IN_URL.sub(r"\1***", plain), ()
        return True


def redact_tokens_in_logs() -> None:
    """Keep access tokens out of the logs of this process: werkzeug's access log (one line per request,
    with its URL) and headscope's own."""
    for name in ("werkzeug", "headscope", "headscope.app", "headscope.app.server", "dash"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
