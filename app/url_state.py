"""The page state carried in the URL query string, parsed and validated in one place.

``?model=smollm2-135m&run=<run id>&layer=3&head=5&metric=entropy&query=12``. Unknown keys are ignored;
a bad value is dropped and reported, so a mangled link still opens a page that says what was wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qs, urlencode

from headscope.analysis.ablation_choices import METHODS as ABLATION_CHOICES
from headscope.analysis.joint_embedding import METHODS as PROJECTIONS
from headscope.analysis.retrieval import AGGREGATES as RETRIEVAL_AGGREGATES
from headscope.analysis.rollout import FUSIONS
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES
from headscope.app.context import offered_model

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


@dataclass
class AttentionState:
    """The Attention page's own fields: the grid's per-head metric, a zoomed region of a long run."""

    metric: str = "entropy"
    region: str | None = None


@dataclass
class FlowState:
    """The Flow page's own fields: the target token, the rollout's head fusion, dropping sink columns."""

    target: int | None = None
    fusion: str = "mean"
    drop_sink: bool = False


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


@dataclass
class PatchingState:
    """The Patching page's own fields: the stored all-units result and one head's per-position result."""

    patching: str | None = None
    ppos: str | None = None


@dataclass
class CompareState:
    """The Compare page's own fields: the two stored runs (keys or unique prefixes); every change is
    second − first. The first defaults to the shared ``run`` (the run a nav link carries)."""

    first: str | None = None
    second: str | None = None


@dataclass
class CompressState:
    """The Compress page's own fields: the stored compression curve, the tolerance in NIAH points
    (default: :data:`headscope.analysis.kv_compression_choices.DEFAULT_TOLERANCE`) and the policy shown
    (``RANKING:FRACTION[:SEED]``; default: the first score ranking's smallest within the tolerance)."""

    compress: str | None = None
    tol: int | None = None
    pick: str | None = None


PARTS = {"attention": AttentionState, "flow": FlowState, "sweeps": HeadsState, "qk": QKState,
         "ablation": AblationState, "patch": PatchingState, "compare": CompareState, "kv": CompressState}
_OWNER = {f.name: part for part, cls in PARTS.items() for f in fields(cls)}  # page field -> its part
_SHARED = ("model", "run", "layer", "head", "query")  # ``query``: one URL key, read by Attention and QK
# the URL's key order (kept as it was, so links the pages write are unchanged), and a field's URL key
_ORDER = ("model", "run", "layer", "head", "metric", "query", "target", "fusion", "drop_sink", "method", "colour",
          "feature", "sentences", "score", "stat", "sink_size", "window", "heads", "ablate", "by", "k", "seed",
          "curve", "hsweep", "source", "ref", "labels", "texts", "find", "region", "sweep", "trial", "agg",
          "patching", "ppos", "first", "second", "compress", "tol", "pick")
_URL_KEY = {"drop_sink": "sink"}


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
    return state
