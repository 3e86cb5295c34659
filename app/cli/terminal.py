"""What reaches the terminal: one-line messages, redacted URLs and progress bars drawn only on a terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def one_line(message: str) -> str:
    """``message`` as one printable line: its line breaks become spaces, and any other control character or
    lone surrogate (from bytes that were not UTF-8) that an argument brought into it is shown escaped, as
    ``repr`` writes it, so the user sees what was typed and the terminal receives no escape sequence."""
    text = " ".join(message.split("\n")).strip()
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def redacted(url: str) -> str:
    """A Redis URL without its password, for messages."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


@contextlib.contextmanager
def progress_bar(desc: str, enabled: bool | None = None) -> Iterator:
    """A tqdm bar driven by a ``progress(fraction)`` callback, on a terminal only (``enabled=None``:
    when stderr is a terminal); shown only when the work takes time. Captured output gets no bar,
    so no carriage returns or escape codes run into the result lines."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda fraction: None
        return
    from tqdm import tqdm

    bar = tqdm(total=100, desc=desc, leave=False, file=sys.stderr,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}", delay=1.0)

    def update(fraction: float) -> None:
        bar.n = int(round(100 * min(max(fraction, 0.0), 1.0)))
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()
