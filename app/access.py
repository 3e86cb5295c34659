"""Access tokens: a server listening beyond the loopback admits only browsers that know its token.

As in Jupyter, ``headscope serve --host 0.0.0.0`` generates a random token (or takes
``--token``/``HEADSCOPE_TOKEN``) and prints a URL carrying it. The first request with
``?token=...`` (or an ``Authorization: Bearer ...`` header) sets an HttpOnly, SameSite=Strict
cookie; later requests carry the cookie. Anything else gets 403 with a short text, never the app.
Tokens are compared in constant time, and never written to a log: :func:`redact_tokens_in_logs`
masks ``token=…`` in every line the web server logs (its access log prints each request's URL).
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
from urllib.parse import unquote

from flask import Flask, Response, request

COOKIE = "headscope_token"


def new_token() -> str:
    return secrets.token_urlsafe(24)


def protect(server: Flask, token: str) -> None:
    """Require ``token`` on every request to ``server`` (a Dash app's Flask server)."""
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
    for name in ("werkzeug", "headscope", "headscope.app", "app.server", "dash"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
