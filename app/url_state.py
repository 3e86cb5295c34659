"""The page state carried in the URL query string, declared field by field and read in one place.

``?model=smollm2-135m&run=<run id>&layer=3&head=5&metric=entropy&query=12``. Each field declares its URL key,
its kind (a whole number up to a bound, a stored id, one of some choices, a flag, a pattern, an offered
model) and its default with :func:`url_field`, in the spirit of scikit-learn's ``_parameter_constraints``:
:func:`parse`, :meth:`PageState.to_search` and the order of a link's keys are generated from these
declarations. Unknown keys are ignored; a bad value is dropped and reported, so a mangled link still opens a
page that says what was wrong. A page's own fields are a part named after the page (:func:`page_part`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs, urlencode

from headscope.analysis.ablation_choices import METHODS as ABLATION_CHOICES
from headscope.analysis.joint_embedding import METHODS as PROJECTIONS
from headscope.analysis.retrieval import AGGREGATES as RETRIEVAL_AGGREGATES
from headscope.analysis.rollout import FUSIONS
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES
from headscope.app.context import offered_model

log = logging.getLogger("headscope.app")

SCORES = tuple(HEAD_SCORES)  # the Heads page's scores over a sweep's prompts: every score
ABLATION_METHODS = ABLATION_CHOICES
RANK_BY = ("retrieval", "effect", *RUN_SCORES)
AGGREGATES = tuple(RETRIEVAL_AGGREGATES)
MAX_INDEX = 1_000_000
MAX_SEARCH = 20_000  # characters of a query string (a head list is at most 2,000)

# The keys every page shares: the model, the text's run, the selected head. Nav links carry them from page
# to page (app.server); ``query`` is shared too (Attention and QK read it), the rest belong to one page each.
SHARED_KEYS = ("model", "run", "layer", "head")


# --- Kinds: what a field's value may be, how a link's text becomes it, what is said when it cannot ---

class Kind(Protocol):
    """A field's domain. ``read`` turns a link's text into a value of the domain or raises ``ValueError``
    with the problem the page shows; ``holds`` says whether a value is in the domain."""

    def read(self, key: str, text: str) -> Any: ...

    def holds(self, value: Any) -> bool: ...


@dataclass(frozen=True)
class WholeNumber:
    """0 to ``high``, in ASCII digits (not "٣" or "３"); above ``high``, the ``above`` problem."""

    high: int = MAX_INDEX - 1
    above: str = "The link's {key} {number} is more than {high}; using the default."

    def read(self, key: str, text: str) -> int:
        if not re.fullmatch(r"[0-9]{1,7}", text) or int(text) >= MAX_INDEX:
            raise ValueError(f"The link's {key} {text[:20]!r} is not a non-negative whole number.")
        if int(text) > self.high:
            raise ValueError(self.above.format(key=key, number=int(text), high=self.high))
        return int(text)

    def holds(self, value: Any) -> bool:
        return type(value) is int and 0 <= value <= self.high


@dataclass(frozen=True)
class StoredId:
    """The id of a stored run or result: 8–64 hex digits, kept in lower case."""

    def read(self, key: str, text: str) -> str:
        if _ID.fullmatch(text.lower()):
            return text.lower()
        raise ValueError(f"The link's {key} id {text[:40]!r} is not valid (8–64 hex digits).")

    def holds(self, value: Any) -> bool:
        return isinstance(value, str) and _ID.fullmatch(value) is not None


@dataclass(frozen=True)
class OneOf:
    """One of ``choices``; ``problem`` may name ``{key}``, ``{text}`` (the link's value, quoted) and ``{choices}``."""

    choices: Collection[str]
    problem: str = "Unknown {key} {text}; choose one of {choices}."

    def read(self, key: str, text: str) -> str:
        if text in self.choices:
            return text
        raise ValueError(self.problem.format(key=key, text=repr(text[:20]), choices=", ".join(self.choices)))

    def holds(self, value: Any) -> bool:
        return value in self.choices


@dataclass(frozen=True)
class Flag:
    """On when the link says ``1``, ``true`` or ``yes``; anything else is off (never a problem). Written as 1."""

    def read(self, key: str, text: str) -> bool:
        return text in ("1", "true", "yes")

    def holds(self, value: Any) -> bool:
        return isinstance(value, bool)


@dataclass(frozen=True)
class Pattern:
    """Text matching ``regex`` whole; ``problem`` may name ``{key}`` and ``{text}`` (the link's value, quoted)."""

    regex: re.Pattern
    problem: str

    def read(self, key: str, text: str) -> str:
        if self.regex.fullmatch(text):
            return text
        raise ValueError(self.problem.format(key=key, text=repr(text[:40])))

    def holds(self, value: Any) -> bool:
        return isinstance(value, str) and self.regex.fullmatch(value) is not None


@dataclass(frozen=True)
class OfferedModel:
    """A model this server offers (:func:`headscope.app.context.offered_model`): never a path a link names."""

    def read(self, key: str, text: str) -> str:
        try:
            return offered_model(text)
        except ValueError as e:
            raise ValueError(f"{e} Using the default model.") from None

    def holds(self, value: Any) -> bool:
        try:
            return offered_model(value) == value
        except ValueError:
            return False


_ID = re.compile(r"[0-9a-f]{8,64}")
_URL = "headscope.url_state"  # the key of a field's declaration in its dataclass field's metadata


def url_field(kind: Kind, default: Any = None, *, key: str | None = None) -> Any:
    """A page field in a link: its ``kind`` (domain), ``default`` (left out of links) and URL ``key``
    (the field's name unless given). Use as a dataclass field's default: ``agg: str = url_field(OneOf(...), "query")``."""
    return dataclasses.field(default=default, metadata={_URL: (kind, key)})


@dataclass(frozen=True)
class UrlField:
    """One declared field: its name on the page state, its part (``None``: shared), URL key, kind and default."""

    name: str
    part: str | None
    key: str
    kind: Kind
    default: Any


PARTS: dict[str, type] = {}  # part name (its page's) -> its dataclass
_FIELDS: dict[str, UrlField] = {}  # field name -> its declaration, in the order declared
_RESERVED = {"problems", "shared", "to_search", "part", "_parts"}  # PageState's own names


def _declare(part: str | None, cls: type) -> None:
    """Register ``cls``'s fields under ``part``; see :func:`page_part` for what is refused."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"URL part {part!r}: {cls.__name__} is not a dataclass")
    declared = []
    for f in dataclasses.fields(cls):
        if _URL not in f.metadata:
            raise TypeError(f"URL part {part!r}: field {f.name!r} has no URL kind; declare it with url_field(...)")
        kind, key = f.metadata[_URL]
        declared.append(UrlField(f.name, part, key or f.name, kind, f.default))
    shared = {f.name for f in _FIELDS.values() if f.part is None}
    names = [f.name for f in declared] + [f.key for f in declared if f.key != f.name]
    taken = set(_FIELDS) | {f.key for f in _FIELDS.values()} | set(PARTS) | _RESERVED  # a part keeps state.<part>
    clashes = sorted(taken & set(names)) or sorted({n for n in names if names.count(n) > 1})
    if part is not None and (part in PARTS or part in shared or part in _RESERVED or not part.isidentifier()):
        clashes.insert(0, part)
    if clashes:
        raise ValueError(f"URL part {part!r}: {', '.join(map(repr, clashes))} is named already")
    if part is not None:
        PARTS[part] = cls
    _FIELDS.update({f.name: f for f in declared})


def page_part(name: str) -> Callable[[type], type]:
    """Class decorator: the dataclass's fields, each declared with :func:`url_field`, are a page's own URL
    fields, ``state.part(name).<field>``. A page declares its part in its own module, beside its layout, and
    names it after the page::

        @page_part("demo")
        @dataclass
        class DemoState:
            zoom: int | None = url_field(WholeNumber())
            shade: str = url_field(OneOf(("light", "dark")), "light")

    A field's name belongs to one part, so ``state.<field>`` means the same on every page; a part is also
    ``state.<part>`` unless a field has that name (``heads`` is the Ablation page's head list, the Heads
    page's part is ``state.part("heads")``). Fields are written after those already registered.

    Raises
    ------
    ValueError
        The part, one of its fields or URL keys is named like a part, a field, a URL key or a shared key
        already. Only a new part may take a field's name: the field keeps ``state.<name>``, so no
        declaration changes what an existing ``state.<name>`` means.
    TypeError
        ``cls`` is not a dataclass, or a field has no :func:`url_field` declaration.
    """

    def register(cls: type) -> type:
        _declare(name, cls)
        return cls

    return register


@dataclass
class SharedState:
    """The fields every page reads: the model, the text's run, the selected head and query position."""

    model: str | None = url_field(OfferedModel())
    run: str | None = url_field(StoredId())
    layer: int | None = url_field(WholeNumber())
    head: int | None = url_field(WholeNumber())
    query: int | None = url_field(WholeNumber())


_declare(None, SharedState)
_SHARED = tuple(f.name for f in dataclasses.fields(SharedState))

# Links keep the key order they had before each page declared its part, field by field; the fields declared
# since are written after these, in the order they are declared. This tuple never grows.
_LINK_ORDER = ("model", "run", "layer", "head", "metric", "query", "target", "fusion", "drop_sink", "method", "colour",
               "feature", "sentences", "score", "stat", "sink_size", "window", "heads", "ablate", "by", "k", "seed",
               "curve", "hsweep", "source", "ref", "labels", "texts", "find", "region", "sweep", "trial", "agg",
               "patching", "ppos", "first", "second", "compress", "tol", "pick")


def _link_order() -> list[UrlField]:
    """Every declared field in the order a link writes (and :func:`parse` reads) its key."""
    rank = {name: i for i, name in enumerate(_LINK_ORDER)}
    return sorted(_FIELDS.values(), key=lambda f: rank.get(f.name, len(rank)))  # stable: declared order after


_HEAD_LIST = re.compile(r"[\w.:*,; ]{1,2000}", re.ASCII)  # digits 0-9 only: not "٣" or "３"


@page_part("attention")
@dataclass
class AttentionState:
    """The Attention page's own fields: the grid's per-head metric, a zoomed region of a long run, and the
    key position of the heatmap cell (``query``, ``key``) whose "why" panel is open."""

    metric: str = url_field(OneOf(RUN_SCORES, "Unknown metric {text}; showing entropy."), "entropy")
    region: str | None = url_field(Pattern(re.compile(r"[0-9]{1,7}-[0-9]{1,7},[0-9]{1,7}-[0-9]{1,7}"),
                                           "The link's region must be written q0-q1,k0-k1 (token positions)."))
    key: int | None = url_field(WholeNumber())


@page_part("flow")
@dataclass
class FlowState:
    """The Flow page's own fields: the target token, the rollout's head fusion, dropping sink columns."""

    target: int | None = url_field(WholeNumber())
    fusion: str = url_field(OneOf(FUSIONS, "Unknown head fusion {text}; using mean."), "mean")
    drop_sink: bool = url_field(Flag(), False, key="sink")


@page_part("ablation")
@dataclass
class AblationState:
    """The Ablation page's own fields: heads, method, ranking, the curve and the stored results."""

    heads: str | None = url_field(Pattern(_HEAD_LIST, "The link's head list {text} has characters a head list "
                                                      "cannot have."))
    ablate: str = url_field(OneOf(ABLATION_METHODS), "zero")
    by: str = url_field(OneOf(RANK_BY), "retrieval")
    k: int | None = url_field(WholeNumber())
    seed: int | None = url_field(WholeNumber())
    curve: str | None = url_field(StoredId())
    hsweep: str | None = url_field(StoredId())
    source: str | None = url_field(StoredId())
    ref: str | None = url_field(StoredId())


@page_part("heads")
@dataclass
class HeadsState:
    """The Heads page's own fields: the sweep, its trial, the aggregation and the other-score view."""

    sweep: str | None = url_field(StoredId())
    trial: int | None = url_field(WholeNumber())
    agg: str = url_field(OneOf(AGGREGATES, "Unknown aggregation {text}; showing query heads."), "query")
    score: str = url_field(OneOf(SCORES), "streaming")
    stat: str = url_field(OneOf(("mean", "std")), "mean")
    sink_size: int | None = url_field(WholeNumber())
    window: int | None = url_field(WholeNumber())


@page_part("qk")
@dataclass
class QKState:
    """The QK page's own fields: projection, colour, feature, probe set and token search."""

    method: str = url_field(OneOf(PROJECTIONS), "pca")
    colour: str = url_field(OneOf(("position", "kind", "sentence", "norm")), "position")
    feature: str = url_field(Pattern(re.compile(r"[\w .:-]{1,64}"),  # a built-in probe task or an uploaded label
                                     "The link's feature {text} is not a valid feature name."), "previous_token")
    sentences: int | None = url_field(WholeNumber())
    labels: str | None = url_field(StoredId())
    texts: str | None = url_field(StoredId())
    find: str | None = url_field(Pattern(re.compile(r"[^\x00-\x1f<>\ud800-\udfff]{1,40}"),  # writable as UTF-8
                                         "The link's token search must be 1–40 printable characters without < or >."))


@page_part("patching")
@dataclass
class PatchingState:
    """The Patching page's own fields: the stored all-units result and one head's per-position result."""

    patching: str | None = url_field(StoredId())
    ppos: str | None = url_field(StoredId())


@page_part("compare")
@dataclass
class CompareState:
    """The Compare page's own fields: the two stored runs (keys or unique prefixes); every change is
    second − first. The first defaults to the shared ``run`` (the run a nav link carries)."""

    first: str | None = url_field(StoredId())
    second: str | None = url_field(StoredId())


@page_part("compress")
@dataclass
class CompressState:
    """The Compress page's own fields: the stored compression curve, the tolerance in NIAH points
    (default: :data:`headscope.analysis.kv_compression_choices.DEFAULT_TOLERANCE`) and the policy shown
    (``RANKING:FRACTION[:SEED]``; default: the first score ranking's smallest within the tolerance)."""

    compress: str | None = url_field(StoredId())
    tol: int | None = url_field(WholeNumber(100, "The link's tolerance {number} is more than 100 NIAH points; "
                                                 "using the default."))
    pick: str | None = url_field(Pattern(re.compile(r"[a-z_]{1,20}(:[0-9]{0,3}\.?[0-9]{1,8})?(:[0-9]{1,4})?"),
                                         "The link's policy {text} is not RANKING:FRACTION[:SEED]."))


class PageState:
    """The state of a page: the shared fields (model, run, layer, head, query) and each page's own fields in
    its part, named after the page (``state.qk``, ``state.part("heads")``). A page field is also read and set
    by its name (``state.metric``); the name belongs to one part, so it means the same on every page. Where
    a page's name is also a field's (``heads``, ``patching``, ``compress``), ``state.<name>`` is the field."""

    def __init__(self, problems: list[str] | None = None, **values: Any) -> None:
        unknown = set(values) - set(_FIELDS) - set(PARTS)
        if unknown:
            raise TypeError(f"PageState has no field {sorted(unknown)[0]!r}")
        object.__setattr__(self, "problems", list(problems or []))
        for name in _SHARED:
            object.__setattr__(self, name, values.get(name))
        parts = {}
        for part, cls in PARTS.items():
            given = values.get(part) if part not in _FIELDS else None
            parts[part] = given if given is not None else cls(
                **{k: v for k, v in values.items() if k in _FIELDS and _FIELDS[k].part == part})
        object.__setattr__(self, "_parts", parts)

    def part(self, name: str) -> Any:
        """The fields of the page ``name`` (a dataclass of :data:`PARTS`)."""
        return self.__dict__["_parts"][name]

    def __getattr__(self, name: str) -> Any:  # only for names not found on the object: page fields and parts
        parts = self.__dict__.get("_parts", {})
        field = _FIELDS.get(name)
        if field is not None and field.part in parts:
            return getattr(parts[field.part], name)
        if name in parts:
            return parts[name]
        raise AttributeError(f"PageState has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        field = _FIELDS.get(name)
        if field is not None and field.part is not None:
            setattr(self.part(field.part), name, value)
        elif name in _SHARED or name == "problems":
            object.__setattr__(self, name, value)
        elif name in PARTS:
            self.__dict__["_parts"][name] = value
        else:
            raise AttributeError(f"PageState has no field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PageState) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        shared = [f"{k}={getattr(self, k)!r}" for k in (*_SHARED, "problems")]
        return f"PageState({', '.join(shared + [f'{k}={v!r}' for k, v in self.__dict__['_parts'].items()])})"

    def shared(self) -> PageState:
        """Only what every page shares (model, run, layer, head): what a nav link carries."""
        return PageState(**{k: getattr(self, k) for k in SHARED_KEYS})

    def to_search(self) -> str:
        """The link's query string: every field not at its default, in the link order (``""``: none)."""
        params = {}
        for f in _link_order():
            value = getattr(self, f.name)
            if value is not None and value != f.default:
                params[f.key] = int(value) if isinstance(value, bool) else value
        return "?" + urlencode(params) if params else ""


def parse(search: str | None) -> PageState:
    """Parse a query string; never raises. A bad value is left at its default and said in ``problems``."""
    state = PageState()
    if not search:
        return state
    try:
        if not isinstance(search, str) or len(search) > MAX_SEARCH:
            raise ValueError(search)
        raw = parse_qs(search.lstrip("?"), keep_blank_values=True, max_num_fields=50)
    except ValueError:  # too long, too many fields, or not text at all
        state.problems.append("The link's parameters could not be read; starting fresh.")
        return state
    first = {k: v[0] for k, v in raw.items() if v}  # a repeated key: its first value
    for f in _link_order():
        if f.key not in first:
            continue
        text = first[f.key]
        try:
            setattr(state, f.name, f.kind.read(f.key, text))
        except ValueError as e:
            state.problems.append(str(e))
        except Exception:  # noqa: BLE001 - a page-declared kind's bug: the link still opens, without the field
            log.exception("the URL kind of %r failed", f.key)
            state.problems.append(f"The link's {f.key} {text[:40]!r} could not be read; it is left out.")
    return state
