"""The page state carried in the URL query string, parsed and validated in one place.

``?model=smollm2-135m&run=<run id>&layer=3&head=5&metric=entropy&query=12``. Unknown keys are ignored;
a bad value is dropped and reported, so a mangled link still opens a page that says what was wrong.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qs, urlencode

from headscope.analysis.ablation_choices import METHODS as ABLATION_CHOICES
from headscope.analysis.joint_embedding import METHODS as PROJECTIONS
from headscope.analysis.retrieval import AGGREGATES as RETRIEVAL_AGGREGATES
from headscope.analysis.rollout import FUSIONS
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES
from headscope.app.context import offered_model

log = logging.getLogger("headscope.app")

_RUN_ID = re.compile(r"^[0-9a-f]{8,64}$")
_INT_KEYS = ("layer", "head", "query", "target", "trial", "sentences", "sink_size", "window", "k", "seed", "tol")
SCORES = tuple(HEAD_SCORES)  # the Heads page's scores over a sweep's prompts: every score
ABLATION_METHODS = ABLATION_CHOICES
RANK_BY = ("retrieval", "effect", *RUN_SCORES)
_HEADS = re.compile(r"^[\w.:*,; ]{1,2000}$", re.ASCII)  # digits 0-9 only: not "٣" or "３"
_HEX_KEYS = ("curve", "hsweep", "source", "ref", "labels", "texts", "patching", "ppos", "first", "second", "compress")
_PICK = re.compile(r"^[a-z_]{1,20}(:[0-9]{0,3}\.?[0-9]{1,8})?(:[0-9]{1,4})?$")  # RANKING[:FRACTION[:SEED]]
_FIND = re.compile(r"^[^\x00-\x1f<>]{1,40}$")
CHOICES = {"method": PROJECTIONS, "colour": ("position", "kind", "sentence", "norm"),
           "score": SCORES, "stat": ("mean", "std"),
           "ablate": ABLATION_METHODS, "by": RANK_BY}
AGGREGATES = tuple(RETRIEVAL_AGGREGATES)
MAX_INDEX = 1_000_000
MAX_SEARCH = 20_000  # characters of a query string (a head list is at most 2,000)


# The keys every page shares: the model, the text's run, the selected head and query position. Nav
# links carry the first four from page to page (app.server); the rest belong to one page each.
SHARED_KEYS = ("model", "run", "layer", "head")

PARTS: dict[str, type] = {}  # part name -> its dataclass: each page's own fields (:func:`page_part`)
_OWNER: dict[str, str] = {}  # page field -> its part
_READERS: dict[str, Callable[[str], Any]] = {}  # URL key -> its reader, for fields declared with one
_SHARED = ("model", "run", "layer", "head", "query")  # ``query``: one URL key, read by Attention and QK
# The URL's key order: the keys of the links pages wrote before each page declared its own part (kept, so
# those links are written unchanged), then every later part's fields in the order it declares them.
_LINK_ORDER = ("model", "run", "layer", "head", "metric", "query", "target", "fusion", "drop_sink", "method", "colour",
               "feature", "sentences", "score", "stat", "sink_size", "window", "heads", "ablate", "by", "k", "seed",
               "curve", "hsweep", "source", "ref", "labels", "texts", "find", "region", "sweep", "trial", "agg",
               "patching", "ppos", "first", "second", "compress", "tol", "pick")
_ORDER = _LINK_ORDER
_URL_KEY = {"drop_sink": "sink"}
Reader = Callable[[str], Any]


def page_part(name: str, readers: dict[str, Reader] | None = None) -> Callable[[type], type]:
    """Class decorator: the dataclass's fields are a page's own URL fields, ``state.<name>.<field>`` (or
    ``state.<field>``: a field name belongs to one part). A page declares its part in its own module,
    beside its layout::

        @page_part("demo", readers={"zoom": read_whole_number, "shade": read_one_of("light", "dark")})
        @dataclass
        class DemoState:
            zoom: int | None = None
            shade: str = "light"

    Each field is a URL key of the same name, written after those already registered; a field at its
    default is left out of links. ``readers`` turn a link's text into the field's value, or raise
    ``ValueError`` saying what is wrong with it ("is not …"), which the page shows; every field needs
    one, except the keys links had before parts were declared (:data:`_LINK_ORDER`), which
    :func:`parse` reads itself.

    Raises
    ------
    ValueError
        The part or one of its fields is named like a part, a field or a shared key already.
    TypeError
        A field without a reader, or a reader for no field.
    """

    def register(cls: type) -> type:
        names = [f.name for f in fields(cls)]
        taken = set(PARTS) | set(_OWNER) | set(_SHARED) | {"problems"} | set(_URL_KEY.values())
        clashes = sorted(taken & {name, *names})
        if clashes or len(set(names)) < len(names) or name in names:
            raise ValueError(f"URL part {name!r}: {', '.join(clashes) or name!r} is named already")
        given = dict(readers or {})
        unread = [n for n in names if n not in given and n not in _LINK_ORDER]
        if unread or set(given) - set(names):
            raise TypeError(f"URL part {name!r}: no reader for {unread}" if unread
                            else f"URL part {name!r}: readers for no field: {sorted(set(given) - set(names))}")
        global _ORDER
        PARTS[name] = cls
        _OWNER.update({n: name for n in names})
        _READERS.update(given)
        _ORDER = (*_LINK_ORDER, *(n for n in _OWNER if n not in _LINK_ORDER))
        return cls

    return register


def read_whole_number(text: str) -> int:
    """A link's whole number, 0 to :data:`MAX_INDEX` - 1, in ASCII digits (not "٣" or "３")."""
    if re.fullmatch(r"[0-9]{1,7}", text) and int(text) < MAX_INDEX:
        return int(text)
    raise ValueError("is not a non-negative whole number.")


def read_stored_id(text: str) -> str:
    """A link's id of a stored run or result: 8–64 hex digits, in lower case."""
    if _RUN_ID.match(text.lower()):
        return text.lower()
    raise ValueError("is not a valid id (8–64 hex digits).")


def read_one_of(*choices: str) -> Reader:
    """A reader that accepts one of ``choices``."""

    def read(text: str) -> str:
        if text in choices:
            return text
        raise ValueError(f"is not one of: {', '.join(choices)}.")

    return read


@page_part("attention")
@dataclass
class AttentionState:
    """The Attention page's own fields: the grid's per-head metric, a zoomed region of a long run."""

    metric: str = "entropy"
    region: str | None = None


@page_part("flow")
@dataclass
class FlowState:
    """The Flow page's own fields: the target token, the rollout's head fusion, dropping sink columns."""

    target: int | None = None
    fusion: str = "mean"
    drop_sink: bool = False


@page_part("sweeps")
@dataclass
class HeadsState:
    """The Heads page's own fields: the sweep, its trial, the aggregation and the other-score view."""

    sweep: str | None = None
    trial: int | None = None
    agg: str = "query"
    score: str = "streaming"
    stat: str = "mean"
    sink_size: int | None = None
    window: int | None = None


@page_part("qk")
@dataclass
class QKState:
    """The QK page's own fields: projection, colour, feature, probe set and token search."""

    method: str = "pca"
    colour: str = "position"
    feature: str = "previous_token"
    sentences: int | None = None
    labels: str | None = None
    texts: str | None = None
    find: str | None = None


@page_part("ablation")
@dataclass
class AblationState:
    """The Ablation page's own fields: heads, method, ranking, the curve and the stored results."""

    heads: str | None = None
    ablate: str = "zero"
    by: str = "retrieval"
    k: int | None = None
    seed: int | None = None
    curve: str | None = None
    hsweep: str | None = None
    source: str | None = None
    ref: str | None = None


@page_part("patch")
@dataclass
class PatchingState:
    """The Patching page's own fields: the stored all-units result and one head's per-position result."""

    patching: str | None = None
    ppos: str | None = None


@page_part("compare")
@dataclass
class CompareState:
    """The Compare page's own fields: the two stored runs (keys or unique prefixes); every change is
    second − first. The first defaults to the shared ``run`` (the run a nav link carries)."""

    first: str | None = None
    second: str | None = None


@page_part("kv")
@dataclass
class CompressState:
    """The Compress page's own fields: the stored compression curve, the tolerance in NIAH points
    (default: :data:`headscope.analysis.kv_compression_choices.DEFAULT_TOLERANCE`) and the policy shown
    (``RANKING:FRACTION[:SEED]``; default: the first score ranking's smallest within the tolerance)."""

    compress: str | None = None
    tol: int | None = None
    pick: str | None = None




class PageState:
    """The state of a page: the shared fields (model, run, layer, head, query) and each page's own
    fields in its part (``state.attention``, ``state.flow``, ``state.sweeps`` (the Heads page), ``state.qk``,
    ``state.ablation``, ``state.patch``, ``state.compare``, ``state.kv`` (the Compress page)). A page field may also be read and set by its name (``state.metric``);
    the name belongs to one part, so it means the same on every page."""

    def __init__(self, model: str | None = None, run: str | None = None, layer: int | None = None,
                 head: int | None = None, query: int | None = None, problems: list[str] | None = None,
                 **page_fields: Any) -> None:
        unknown = set(page_fields) - set(_OWNER) - set(PARTS)
        if unknown:
            raise TypeError(f"PageState has no field {sorted(unknown)[0]!r}")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "query", query)
        object.__setattr__(self, "problems", list(problems or []))
        for part, cls in PARTS.items():
            given = page_fields.get(part)
            object.__setattr__(self, part, given if given is not None else cls(
                **{k: v for k, v in page_fields.items() if _OWNER.get(k) == part}))

    def __getattr__(self, name: str) -> Any:  # only for names not found on the object: page fields
        part = _OWNER.get(name)
        if part is None:
            raise AttributeError(f"PageState has no field {name!r}")
        return getattr(self.__dict__[part], name)

    def __setattr__(self, name: str, value: Any) -> None:
        part = _OWNER.get(name)
        if part is not None:
            setattr(self.__dict__[part], name, value)
        elif name in _SHARED or name in PARTS or name == "problems":
            object.__setattr__(self, name, value)
        else:
            raise AttributeError(f"PageState has no field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PageState) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"PageState({inner})"

    def shared(self) -> PageState:
        """Only what every page shares (model, run, layer, head): what a nav link carries."""
        return PageState(**{k: getattr(self, k) for k in SHARED_KEYS})

    def to_search(self) -> str:
        defaults = {f.name: f.default for cls in PARTS.values() for f in fields(cls)}
        params = {}
        for name in _ORDER:
            value = getattr(self, name)
            if value is None or (name in defaults and value == defaults[name]):
                continue  # a page field at its default is left out of the link
            params[_URL_KEY.get(name, name)] = 1 if value is True else value
        return "?" + urlencode(params) if params else ""


def parse(search: str | None) -> PageState:
    """Parse a query string; never raises."""
    state = PageState()
    if not search:
        return state
    if not isinstance(search, str) or len(search) > MAX_SEARCH:
        state.problems.append("The link's parameters could not be read; starting fresh.")
        return state
    try:
        raw = parse_qs(search.lstrip("?"), keep_blank_values=True, max_num_fields=50)
    except ValueError:
        state.problems.append("The link's parameters could not be read; starting fresh.")
        return state
    first = {k: v[0] for k, v in raw.items() if v}
    if "model" in first:
        try:  # models come from the server's allowlist, never from a path in a link
            state.model = offered_model(first["model"])
        except ValueError as e:
            state.problems.append(f"{e} Using the default model.")
    if "run" in first:
        if _RUN_ID.match(first["run"].lower()):
            state.run = first["run"].lower()
        else:
            state.problems.append(f"The link's run id {first['run'][:40]!r} is not valid (8–64 hex digits).")
    for key in _INT_KEYS:
        if key in first:
            value = first[key]
            if re.fullmatch(r"[0-9]{1,7}", value) and int(value) < MAX_INDEX:  # ASCII digits: not "٣" or "３"
                setattr(state, key, int(value))
            else:
                state.problems.append(f"The link's {key} {value[:20]!r} is not a non-negative whole number.")
    if "metric" in first:
        if first["metric"] in RUN_SCORES:
            state.metric = first["metric"]
        else:
            state.problems.append(f"Unknown metric {first['metric'][:40]!r}; showing entropy.")
    if "fusion" in first:
        if first["fusion"] in FUSIONS:
            state.fusion = first["fusion"]
        else:
            state.problems.append(f"Unknown head fusion {first['fusion'][:20]!r}; using mean.")
    if "sink" in first:
        state.drop_sink = first["sink"] in ("1", "true", "yes")
    for key, allowed in CHOICES.items():
        if key in first:
            if first[key] in allowed:
                setattr(state, key, first[key])
            else:
                state.problems.append(f"Unknown {key} {first[key][:20]!r}; choose one of {', '.join(allowed)}.")
    if "sweep" in first:
        if _RUN_ID.match(first["sweep"].lower()):
            state.sweep = first["sweep"].lower()
        else:
            state.problems.append(f"The link's sweep id {first['sweep'][:40]!r} is not valid (8–64 hex digits).")
    if "heads" in first:
        if _HEADS.match(first["heads"]):
            state.heads = first["heads"]
        else:
            state.problems.append(f"The link's head list {first['heads'][:40]!r} has characters a head list cannot have.")
    if "find" in first:
        if _FIND.match(first["find"]):
            state.find = first["find"]
        else:
            state.problems.append("The link's token search must be 1–40 printable characters without < or >.")
    for key in _HEX_KEYS:
        if key in first:
            if _RUN_ID.match(first[key].lower()):
                setattr(state, key, first[key].lower())
            else:
                state.problems.append(f"The link's {key} id {first[key][:40]!r} is not valid (8–64 hex digits).")
    if "feature" in first:  # a built-in probe task or a feature of an uploaded label file
        if re.fullmatch(r"[\w .:-]{1,64}", first["feature"]):
            state.feature = first["feature"]
        else:
            state.problems.append(f"The link's feature {first['feature'][:40]!r} is not a valid feature name.")
    if "region" in first:  # a zoomed region of a long run: q0-q1,k0-k1
        if re.fullmatch(r"[0-9]{1,7}-[0-9]{1,7},[0-9]{1,7}-[0-9]{1,7}", first["region"]):
            state.region = first["region"]
        else:
            state.problems.append("The link's region must be written q0-q1,k0-k1 (token positions).")
    if state.tol is not None and state.tol > 100:
        state.problems.append(f"The link's tolerance {state.tol} is more than 100 NIAH points; using the default.")
        state.tol = None
    if "pick" in first:
        if _PICK.match(first["pick"]):
            state.pick = first["pick"]
        else:
            state.problems.append(f"The link's policy {first['pick'][:40]!r} is not RANKING:FRACTION[:SEED].")
    if "agg" in first:
        if first["agg"] in AGGREGATES:
            state.agg = first["agg"]
        else:
            state.problems.append(f"Unknown aggregation {first['agg'][:20]!r}; showing query heads.")
    _read_declared(first, state)
    return state


def _read_declared(first: dict[str, str], state: PageState) -> None:
    """The fields of parts declared with readers (:func:`page_part`): a bad value is dropped and reported."""
    for key, read in _READERS.items():
        if key not in first:
            continue
        try:
            setattr(state, key, read(first[key]))
        except ValueError as e:
            state.problems.append(f"The link's {key} {first[key][:40]!r} {e}")
        except Exception:  # noqa: BLE001 - a reader's bug: the link still opens, without the field
            log.exception("the URL reader of %r failed", key)
            state.problems.append(f"The link's {key} {first[key][:40]!r} could not be read; it is left out.")
