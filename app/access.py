"""Access tokens: a server listening beyond the loopback admits only browsers that know its token.

As in Jupyter, ``headscope serve --host 0.0.0.0`` generates a random token (or takes
``--token``/``HEADSCOPE_TOKEN``) and prints a URL carrying it. The first request with
``?token=...`` (or an ``Authorization: Bearer ...`` header) sets an HttpOnly, SameSite=Strict
cookie; later requests carry the cookie. Anything else gets 403 with a short text, never the app.
Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import secrets

from flask import Flask, Response, request

COOKIE = "headscope_token"


def new_token() -> str:
    return secrets.token_urlsafe(24)


def protect(server: Flask, token: str) -> None:
    """Require ``token`` on every request to ``server`` (a Dash app's Flask server)."""
    if len(token) < 16:
        raise ValueError("An access token must have at least 16 characters.")

    def matches(value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(value.encode(), token.encode())

    @server.before_request
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

    @server.after_request
    def remember(response: Response) -> Response:
        if request.environ.get("headscope.set_cookie"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", max_age=30 * 24 * 3600)
        return response
