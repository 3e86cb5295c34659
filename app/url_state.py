"""The page state carried in the URL query string, parsed and validated in one place.

``?model=smollm2-135m&run=<run id>&layer=3&head=5&metric=entropy&query=12``. Unknown keys are ignored;
a bad value is dropped and reported, so a mangled link still opens a page that says what was wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlencode

from analysis.head_summary import HEAD_METRICS
from analysis.rollout import FUSIONS
from app.context import offered_model

_RUN_ID = re.compile(r"^[0-9a-f]{8,64}$")
_INT_KEYS = ("layer", "head", "query", "target", "trial", "sentences", "sink_size", "window", "k", "seed")
SCORES = (*HEAD_METRICS, "evidence")
ABLATION_METHODS = ("zero", "mean", "resample", "uniform", "first_token")
RANK_BY = ("retrieval", "effect", *HEAD_METRICS)
_HEADS = re.compile(r"^[\w.:*,; ]{1,2000}$")
_HEX_KEYS = ("curve", "hsweep", "source", "ref", "labels", "texts")
_FIND = re.compile(r"^[^\x00-\x1f<>]{1,40}$")
CHOICES = {"method": ("pca", "umap", "tsne"), "colour": ("position", "kind", "sentence", "norm"),
           "score": SCORES, "stat": ("mean", "std"),
           "ablate": ABLATION_METHODS, "by": RANK_BY}
AGGREGATES = ("query", "group_max", "group_mean")
MAX_INDEX = 1_000_000
MAX_SEARCH = 20_000  # characters of a query string (a head list is at most 2,000)


@dataclass
class PageState:
    model: str | None = None
    run: str | None = None
    layer: int | None = None
    head: int | None = None
    metric: str = "entropy"
    query: int | None = None
    target: int | None = None
    fusion: str = "mean"
    drop_sink: bool = False
    sweep: str | None = None
    trial: int | None = None
    agg: str = "query"
    method: str = "pca"
    colour: str = "position"
    feature: str = "previous_token"
    sentences: int | None = None
    score: str = "streaming"
    stat: str = "mean"
    sink_size: int | None = None
    window: int | None = None
    heads: str | None = None
    ablate: str = "zero"
    by: str = "retrieval"
    k: int | None = None
    seed: int | None = None
    curve: str | None = None
    hsweep: str | None = None
    source: str | None = None
    ref: str | None = None
    labels: str | None = None
    texts: str | None = None
    find: str | None = None
    region: str | None = None
    problems: list[str] = field(default_factory=list)

    def to_search(self) -> str:
        params = {
            k: v
            for k, v in (
                ("model", self.model), ("run", self.run), ("layer", self.layer), ("head", self.head),
                ("metric", None if self.metric == "entropy" else self.metric), ("query", self.query), ("target", self.target),
                ("fusion", None if self.fusion == "mean" else self.fusion),
                ("sink", 1 if self.drop_sink else None),
                ("method", None if self.method == "pca" else self.method),
                ("colour", None if self.colour == "position" else self.colour),
                ("feature", None if self.feature == "previous_token" else self.feature),
                ("sentences", self.sentences),
                ("score", None if self.score == "streaming" else self.score),
                ("stat", None if self.stat == "mean" else self.stat),
                ("sink_size", self.sink_size), ("window", self.window),
                ("heads", self.heads), ("ablate", None if self.ablate == "zero" else self.ablate),
                ("by", None if self.by == "retrieval" else self.by), ("k", self.k), ("seed", self.seed),
                ("curve", self.curve), ("hsweep", self.hsweep), ("source", self.source), ("ref", self.ref),
                ("labels", self.labels), ("texts", self.texts), ("find", self.find), ("region", self.region),
                ("sweep", self.sweep), ("trial", self.trial), ("agg", None if self.agg == "query" else self.agg),
            )
            if v is not None
        }
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
            if re.fullmatch(r"\d{1,7}", value) and int(value) < MAX_INDEX:
                setattr(state, key, int(value))
            else:
                state.problems.append(f"The link's {key} {value[:20]!r} is not a non-negative whole number.")
    if "metric" in first:
        if first["metric"] in HEAD_METRICS:
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
        if re.fullmatch(r"\d{1,7}-\d{1,7},\d{1,7}-\d{1,7}", first["region"]):
            state.region = first["region"]
        else:
            state.problems.append("The link's region must be written q0-q1,k0-k1 (token positions).")
    if "agg" in first:
        if first["agg"] in AGGREGATES:
            state.agg = first["agg"]
        else:
            state.problems.append(f"Unknown aggregation {first['agg'][:20]!r}; showing query heads.")
    return state
