"""The parser and the argument types the commands share: each type checks one value, importing nothing heavy."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from headscope.analysis.errors import shown
from headscope.app.cli.errors import EXIT_USER_ERROR, UsageError
from headscope.app.cli.terminal import one_line
from headscope.app.export_formats import FIGURE_FORMATS


class Parser(argparse.ArgumentParser):
    """argparse, with an error as one line naming the argument (not a usage block) and status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: {one_line(message)} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)


# Argument types: each checks one value and raises ArgumentTypeError, which argparse reports as
# "argument --name: message".

_WHOLE = re.compile(r"[+-]?[0-9]+")
_MOST_DIGITS = 18  # no count or index has more; int() refuses numerals past 4,300 digits


def ascii_number(text: str, kind: type = int) -> int | float:
    """``text`` as an int (ASCII digits, an optional sign) or a float (as ``float()`` reads it), written in
    ASCII: ``٣`` or ``３`` are digits to Python, not numbers a user meant to type. ValueError with what to
    write otherwise."""
    t = text.strip()
    if not t.isascii():
        raise ValueError(f"{shown(text)} is not a number: write numbers with the digits 0-9")
    if kind is float:
        try:
            return float(t)
        except ValueError:
            raise ValueError(f"{shown(text)} is not a number") from None
    if not _WHOLE.fullmatch(t):
        raise ValueError(f"{shown(text)} is not a whole number")
    if len(t.lstrip("+-").lstrip("0")) > _MOST_DIGITS:
        raise ValueError(f"{shown(t)} is out of range")
    return int(t)


def _whole(text: str) -> int:
    try:
        return ascii_number(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        n = _whole(text)
        if n < minimum or (maximum is not None and n > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {n}")
        return n

    return parse


def number_list(kind: type, minimum: float, maximum: float | None = None, what: str = "numbers"
                ) -> Callable[[str], list]:
    """Comma-separated numbers, at least one, each in ``[minimum, maximum]``."""

    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"give one or more {what} separated by commas, e.g. "
                                             f"{int(minimum) if kind is int else minimum},{int(minimum) + 1}")
        try:
            values = [ascii_number(x, kind) for x in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e}; give {what} separated by commas") from None
        for v in values:
            if v != v or v < minimum or (maximum is not None and v > maximum):
                bound = f"between {minimum:g} and {maximum:g}" if maximum is not None else f"at least {minimum:g}"
                raise argparse.ArgumentTypeError(f"each value must be {bound}, got {v:g}")
        return values

    return parse


def _shown_path(path: str) -> str:
    """A path as a message shows it: a very long one cut short."""
    return path if len(path) <= 160 else path[:150] + "…"


def _user_path(path: str) -> Path:
    """``path`` with ``~`` or ``~user`` expanded; ArgumentTypeError for a user this machine does not have."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ~someone, and no such user
        raise argparse.ArgumentTypeError(f"cannot use {_shown_path(path)}: no user {path[1:].split('/')[0]!r} "
                                         "here to expand ~ for") from None


def read_text_file(path: str) -> str:
    """The contents of a UTF-8 text file, or ArgumentTypeError saying why it cannot be used."""
    p = _user_path(path)
    try:
        exists, is_dir, is_file = p.exists(), p.is_dir(), p.is_file()
    except OSError as e:  # a name too long for the file system, a loop of links...
        raise argparse.ArgumentTypeError(f"cannot read {_shown_path(path)}: {e.strerror or e}") from None
    path = _shown_path(path)
    if not exists:
        raise argparse.ArgumentTypeError(f"cannot read {path}: no such file")
    if is_dir:
        raise argparse.ArgumentTypeError(f"cannot read {path}: it is a folder, not a text file")
    if not is_file:  # a pipe waits for a writer, /dev/zero never ends: only a file has an end
        raise argparse.ArgumentTypeError(f"cannot read {path}: it is not a regular file (a pipe or a device?)")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from None
    if b"\0" in raw:
        raise argparse.ArgumentTypeError(f"cannot read {path}: it is a binary file, not UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return text


def text_file(path: str) -> str:
    """A path that :func:`read_text_file` accepts (returned as given)."""
    read_text_file(path)
    return path


def haystack(value: str) -> str:
    """A haystack name (:data:`headscope.analysis.niah.HAYSTACK_NAMES`) or a UTF-8 text file."""
    from headscope.analysis.niah import HAYSTACK_NAMES  # light: no model code

    if value in HAYSTACK_NAMES:
        return value
    if value.isidentifier() and not os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"unknown haystack {value!r}: use {', '.join(HAYSTACK_NAMES)} or the path "
                                         "of a UTF-8 text file")
    return text_file(value)


def folder(path: str) -> str:
    """A folder that exists or can be created (an output or store folder)."""
    if not path.strip():  # "" would silently mean the default folder (or the current one)
        raise argparse.ArgumentTypeError("the folder is empty: give a folder's path")
    p = _user_path(path)
    try:
        if p.exists() and not p.is_dir():
            raise argparse.ArgumentTypeError(f"{_shown_path(path)} is a file, not a folder")
        parent = p
        while not parent.exists():
            parent = parent.parent
    except OSError as e:  # a name too long for the file system, a loop of links...
        raise argparse.ArgumentTypeError(f"cannot use {_shown_path(path)} as a folder: {e.strerror or e}") from None
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {_shown_path(str(parent))}")
    return path


def non_empty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} is empty")
        return text

    return parse


def text_arg(text: str) -> str:
    """Text given on the command line: not empty, and valid Unicode (bytes that are not UTF-8 come
    through as lone surrogates)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the text is empty: give some text to analyse")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"the text is not valid UTF-8 at character {e.start}") from None
    return text


def bind_host(text: str) -> str:
    """``--host``: an IP address or a host name (:func:`headscope.app.access.host_name`)."""
    from headscope.app.access import host_name

    try:
        return host_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def allowed_hosts(text: str) -> tuple[str, ...]:
    """``--allowed-hosts``: host names or IP addresses, comma-separated (:func:`headscope.app.access.host_names`)."""
    from headscope.app.access import host_names

    try:
        return host_names(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?|mps)$")


def device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device: use cpu, cuda, cuda:N or mps")
    return text


_LAYER_HEAD = re.compile(r"^\s*([0-9]{1,9})\.([0-9]{1,9})\s*$")  # ASCII digits: not "٣" or "３"


def layer_head(text: str) -> tuple[int, int]:
    m = _LAYER_HEAD.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a head: write layer.head with the digits 0-9, "
                                         "e.g. 23.3")
    return int(m[1]), int(m[2])


def check_formats(value: str, allowed: tuple[str, ...] = FIGURE_FORMATS, flag: str = "--formats") -> tuple[str, ...]:
    formats = tuple(f.strip() for f in value.split(",") if f.strip())
    unknown = [f for f in formats if f not in allowed]
    if unknown:
        raise UsageError(f"argument {flag}: unknown format(s) {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return formats


MODEL_HELP = "model spec: an embedded model (smollm2-135m; gemma3-270m after `make gemma3`), a .gguf file, " \
             "a folder of safetensors (default: the embedded model; `headscope models` lists them)"
