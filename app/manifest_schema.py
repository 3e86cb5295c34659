"""The shape of an export's ``manifest.json``, checked field by field before anything is rebuilt.

``headscope figure`` reads manifests from disk: an edited or damaged one must end in a message that
names the field and says what it should hold, never in a traceback from deep inside a rebuild.
This module imports nothing heavy, so a bad manifest is refused in well under a second.
The manifest itself is written by :func:`headscope.app.export.manifest`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from headscope.analysis.errors import parse_json


class ManifestError(ValueError):
    """A manifest that is not what ``headscope figure`` can rebuild; the message names the field."""


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any, field: str, minimum: int = 0) -> None:
    if not isinstance(value, list):
        raise ManifestError(f"field {field!r} must be a list of whole numbers, got {_kind(value)}.")
    for i, x in enumerate(value):
        if not _is_int(x) or x < minimum:
            raise ManifestError(f"field {field!r} must hold whole numbers ≥ {minimum}; item {i} is {x!r}.")


# settings fields: optional, but typed when present
_SETTINGS_INTS = ("block_size", "sink", "window")
_SETTINGS_LISTS = ("qk_layers",)


def check_manifest(man: Any) -> dict[str, Any]:
    """Check a parsed manifest's fields and types; return it unchanged.

    Required: ``view`` (non-empty string), ``params`` (object), ``model`` (object with a non-empty
    string ``name`` and a string ``digest``), ``token_ids`` (list of whole numbers ≥ 0),
    ``settings`` (object). Optional and typed when present: ``manifest_version`` (whole number),
    ``tokens`` (list of strings, as long as ``token_ids``), ``run_key`` (string), and in ``settings``
    ``block_size``/``sink``/``window`` (whole numbers), ``qk_layers`` (list of whole numbers),
    ``pattern_dtype`` (string), ``spans`` (list of [start, end] pairs); the stored records a view
    read (:func:`headscope.app.export.carried`): ``runs`` (objects with ``key``, ``kind`` ``run`` or
    ``stats_run``, ``token_ids``, ``settings`` and ``text``), ``results`` (objects with ``key``,
    ``kind``, ``meta`` and ``arrays``, each array an object with a ``sha256`` and its ``npy`` bytes
    in base64) and ``results_left_out`` (a list of keys).

    Raises
    ------
    ManifestError
        The first field that is missing or of the wrong type, by name.
    """
    if not isinstance(man, dict):
        raise ManifestError(f"a manifest is a JSON object, got {_kind(man)}; pass the manifest.json from an export.")
    missing = [k for k in ("view", "params", "model", "token_ids", "settings") if k not in man]
    if missing:
        raise ManifestError(f"not a headscope manifest: missing field(s) {', '.join(missing)}.")
    if not isinstance(man["view"], str) or not man["view"]:
        raise ManifestError(f"field 'view' must be the name of a view (a string), got {_kind(man['view'])}.")
    if not isinstance(man["params"], dict):
        raise ManifestError(f"field 'params' must be an object, got {_kind(man['params'])}.")
    model = man["model"]
    if not isinstance(model, dict):
        raise ManifestError(f"field 'model' must be an object with 'name' and 'digest', got {_kind(model)}.")
    if not isinstance(model.get("name"), str) or not model["name"].strip():
        raise ManifestError(f"field 'model.name' must be a model spec (a string), got {_kind(model.get('name'))}.")
    if not isinstance(model.get("digest"), str):
        raise ManifestError(f"field 'model.digest' must be a string, got {_kind(model.get('digest'))}.")
    _int_list(man["token_ids"], "token_ids")
    settings = man["settings"]
    if not isinstance(settings, dict):
        raise ManifestError(f"field 'settings' must be an object, got {_kind(settings)}.")
    if "manifest_version" in man and not _is_int(man["manifest_version"]):
        raise ManifestError(f"field 'manifest_version' must be a whole number, got {_kind(man['manifest_version'])}.")
    if "run_key" in man and not isinstance(man["run_key"], str):
        raise ManifestError(f"field 'run_key' must be a string, got {_kind(man['run_key'])}.")
    if "tokens" in man:
        tokens = man["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ManifestError("field 'tokens' must be a list of strings.")
        if len(tokens) != len(man["token_ids"]):
            raise ManifestError(f"field 'tokens' has {len(tokens)} items but 'token_ids' has {len(man['token_ids'])}.")
    for name in _SETTINGS_INTS:
        if name in settings and (not _is_int(settings[name]) or settings[name] < 0):
            raise ManifestError(f"field 'settings.{name}' must be a whole number ≥ 0, got {settings[name]!r}.")
    if "block_size" in settings and not all(k in settings for k in ("sink", "window")):
        raise ManifestError("field 'settings' of a statistics-mode run needs 'sink' and 'window' beside 'block_size'.")
    for name in _SETTINGS_LISTS:
        if name in settings:
            _int_list(settings[name], f"settings.{name}")
    if "pattern_dtype" in settings and not isinstance(settings["pattern_dtype"], str):
        raise ManifestError(f"field 'settings.pattern_dtype' must be a string, got {_kind(settings['pattern_dtype'])}.")
    if "spans" in settings:
        spans = settings["spans"]
        ok = isinstance(spans, list) and all(
            isinstance(s, list) and len(s) == 2 and all(_is_int(x) and x >= 0 for x in s) for s in spans)
        if not ok:
            raise ManifestError("field 'settings.spans' must be a list of [start, end] pairs of whole numbers.")
    _check_carried(man)
    return man


_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _check_carried(man: dict[str, Any]) -> None:
    """The stored records a manifest carries (``runs``, ``results``, ``results_left_out``): their
    types here; their contents when a rebuild uses them (checksums, keys: :func:`headscope.app.export.rebuilding`)."""
    runs = man.get("runs", [])
    if not isinstance(runs, list):
        raise ManifestError(f"field 'runs' must be a list, got {_kind(runs)}.")
    for i, run in enumerate(runs):
        where = f"runs[{i}]"
        if not isinstance(run, dict):
            raise ManifestError(f"field {where!r} must be an object, got {_kind(run)}.")
        if not isinstance(run.get("key"), str) or not _KEY.fullmatch(run["key"]):
            raise ManifestError(f"field '{where}.key' must be a run's id (letters and digits).")
        if run.get("kind") not in ("run", "stats_run"):
            raise ManifestError(f"field '{where}.kind' must be 'run' or 'stats_run', got {str(run.get('kind'))[:40]!r}.")
        _int_list(run.get("token_ids"), f"{where}.token_ids")
        if not run["token_ids"]:
            raise ManifestError(f"field '{where}.token_ids' is empty: a run has at least one token.")
        settings = run.get("settings")
        if not isinstance(settings, dict):
            raise ManifestError(f"field '{where}.settings' must be an object, got {_kind(settings)}.")
        for name in _SETTINGS_INTS:
            if name in settings and (not _is_int(settings[name]) or settings[name] < 0):
                raise ManifestError(f"field '{where}.settings.{name}' must be a whole number ≥ 0.")
        for name in _SETTINGS_LISTS:
            if name in settings:
                _int_list(settings[name], f"{where}.settings.{name}")
        if "pattern_dtype" in settings and not isinstance(settings["pattern_dtype"], str):
            raise ManifestError(f"field '{where}.settings.pattern_dtype' must be a string.")
        if "spans" in settings and not (isinstance(settings["spans"], list) and all(
                isinstance(sp, list) and len(sp) == 2 and all(_is_int(x) and x >= 0 for x in sp)
                for sp in settings["spans"])):
            raise ManifestError(f"field '{where}.settings.spans' must be a list of [start, end] pairs of whole numbers.")
        if run.get("text") is not None and not isinstance(run["text"], str):
            raise ManifestError(f"field '{where}.text' must be a string or null, got {_kind(run['text'])}.")
    results = man.get("results", [])
    if not isinstance(results, list):
        raise ManifestError(f"field 'results' must be a list, got {_kind(results)}.")
    for i, result in enumerate(results):
        where = f"results[{i}]"
        if not isinstance(result, dict):
            raise ManifestError(f"field {where!r} must be an object, got {_kind(result)}.")
        if not isinstance(result.get("key"), str) or not _KEY.fullmatch(result["key"]):
            raise ManifestError(f"field '{where}.key' must be a stored result's id (letters and digits).")
        if not isinstance(result.get("kind"), str) or not _KEY.fullmatch(result["kind"]):
            raise ManifestError(f"field '{where}.kind' must be a record kind (a short name).")
        if not isinstance(result.get("meta"), dict):
            raise ManifestError(f"field '{where}.meta' must be an object, got {_kind(result.get('meta'))}.")
        arrays = result.get("arrays")
        if not isinstance(arrays, dict):
            raise ManifestError(f"field '{where}.arrays' must be an object, got {_kind(arrays)}.")
        for name, arr in arrays.items():
            if not _KEY.fullmatch(name) or not isinstance(arr, dict) or not isinstance(arr.get("npy"), str) \
                    or not isinstance(arr.get("sha256"), str) or not _SHA256.fullmatch(arr["sha256"]):
                raise ManifestError(f"field '{where}.arrays.{name[:40]}' must be an object with a sha256 (64 hex "
                                    "digits) and the array's .npy bytes in base64 (npy).")
    left = man.get("results_left_out", [])
    if not isinstance(left, list) or not all(isinstance(k, str) for k in left):
        raise ManifestError("field 'results_left_out' must be a list of ids.")


def read_manifest_file(path: Path | str) -> dict[str, Any]:
    """Read ``path`` as JSON and :func:`check_manifest` it; errors name the file and the field."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir() and not path.is_file():  # a pipe never ends or waits for a writer
            raise ManifestError(f"{path} is not a regular file (a pipe or a device?); pass the manifest.json from "
                                "an export.")
        raw = path.read_bytes()
    except IsADirectoryError:
        raise ManifestError(f"{path} is a folder; pass the manifest.json file inside an export.") from None
    except OSError as e:
        raise ManifestError(f"Cannot read manifest {path}: {e.strerror}.") from None
    try:
        man = parse_json(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ManifestError(f"{path} is not UTF-8 text (a binary file?); pass the manifest.json from an export.") from None
    except ValueError as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); pass the manifest.json from an export.") from None
    try:
        return check_manifest(man)
    except ManifestError as e:
        raise ManifestError(f"{path}: {e}") from None
