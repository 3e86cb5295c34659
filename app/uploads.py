"""File uploads that say so in the page when a file is too large, and the text of an uploaded file
(uploads are content: nothing here is ever read as a path)."""

from __future__ import annotations

from typing import Any

from dash import (
    Input,
    Output,
    State,
    clientside_callback,
    dcc,
    html,
)

from headscope.app import ids


def upload_file_id(upload_id: str) -> str:
    """The store an upload's file reaches the server through, once its size is checked in the browser."""
    return f"{upload_id}-file"


def upload_field(upload_id: str, label: str) -> list:
    """A file upload that says so in the page when a file is too large.

    ``dcc.Upload``'s own ``max_size`` drops a larger file in the browser without a word, and a file
    over the request cap would be refused by the server (413) with nothing shown. So the browser
    takes any file, a clientside check compares its size with ``HEADSCOPE_MAX_UPLOAD_BYTES`` and
    either shows the limit in the error banner or passes ``{contents, filename}`` on to the store
    :func:`upload_file_id`, which the page's callback reads (with :func:`upload_text`). Register the
    check once per upload with :func:`register_upload`.
    """
    from headscope.analysis.limits import limit

    return [
        dcc.Upload(id=upload_id, children=html.Span(label), className="hs-upload", max_size=-1),
        dcc.Store(id=upload_file_id(upload_id)),
        dcc.Store(id=f"{upload_id}-limit", data=limit("HEADSCOPE_MAX_UPLOAD_BYTES")),
    ]


_CHECK_UPLOAD_SIZE = """
function(contents, filename, limit) {
    const skip = window.dash_clientside.no_update;
    if (!contents) { return [skip, skip]; }
    const b64 = contents.slice(contents.indexOf(",") + 1);
    const bytes = Math.floor(b64.length * 3 / 4) - (b64.endsWith("==") ? 2 : b64.endsWith("=") ? 1 : 0);
    if (bytes > limit) {
        const n = (x) => x.toLocaleString("en-US");
        return [skip, (filename || "The file") + " has " + n(bytes) + " bytes (the limit is " + n(limit) +
                      "; set HEADSCOPE_MAX_UPLOAD_BYTES to change it)."];
    }
    return [{contents: contents, filename: filename}, skip];
}
"""


def register_upload(upload_id: str) -> None:
    """The browser-side size check of :func:`upload_field` ``upload_id``."""
    clientside_callback(
        _CHECK_UPLOAD_SIZE,
        Output(upload_file_id(upload_id), "data"),
        Output(ids.ERROR, "children", allow_duplicate=True),
        Input(upload_id, "contents"),
        State(upload_id, "filename"),
        State(f"{upload_id}-limit", "data"),
        prevent_initial_call=True,
    )


def upload_file(file: Any, what: str) -> tuple[str, str]:
    """(text, name) of an upload's file as :func:`upload_file_id` holds it (``{"contents": base64 data
    URL, "filename": ...}``), or an ``InputError`` (see :func:`upload_text`)."""
    from headscope.analysis.errors import InputError

    contents = file.get("contents") if isinstance(file, dict) else None
    filename = file.get("filename") if isinstance(file, dict) else None
    name = filename[:200] if isinstance(filename, str) and filename else "The file"
    if not isinstance(contents, str):
        raise InputError(f"{name} could not be read: upload {what}.")
    return upload_text(contents, name, what), name


def upload_text(contents: str | None, filename: str | None, what: str) -> str:
    """The text of a dcc.Upload's ``contents`` (a base64 data URL), or an ``InputError`` saying why not:
    over ``HEADSCOPE_MAX_UPLOAD_BYTES``, not base64, not UTF-8, or empty. Uploads are content:
    nothing here is ever read as a path."""
    import base64
    import binascii

    from headscope.analysis.errors import InputError
    from headscope.analysis.limits import hint, limit

    name = filename or "The file"
    try:
        data = base64.b64decode((contents or "").split(",", 1)[1], validate=True)
    except (IndexError, binascii.Error, ValueError):
        raise InputError(f"{name} could not be read: upload {what}.") from None
    if len(data) > limit("HEADSCOPE_MAX_UPLOAD_BYTES"):
        raise InputError(f"{name} has {len(data):,} bytes {hint('HEADSCOPE_MAX_UPLOAD_BYTES')}.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{name} is not UTF-8 text: upload {what}.") from None
    if "\x00" in text or not text.strip():
        raise InputError(f"{name} has no readable text: upload {what}.")
    return text
