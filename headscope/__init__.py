"""headscope: a workbench for attention heads, in the browser (``headscope serve``) and in Python.

The notebook API, for what a notebook does most; every name is also reachable by its long path::

    import headscope as hs

    model = hs.load_model("smollm2-135m")           # headscope.analysis.models.load_model
    run = hs.capture(model, "When Mary and John went to the store, John gave a drink to Mary.")
    scores = hs.HEAD_METRICS["induction"].compute(run.patterns, run.token_ids)   # [layers, heads]
    hs.figures.head_grid(scores, "induction")        # headscope.app.figures: plotly figures
    figure, rows = hs.VIEWS["sink_map"].build(run, {})  # what an export of that view holds

Names load on first use, so ``import headscope`` (and ``headscope --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("headscope")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

#: name -> (module, attribute or None for the module itself)
_API = {
    "load_model": ("headscope.analysis.models", "load_model"),
    "capture": ("headscope.analysis.capture", "capture"),
    "Store": ("headscope.analysis.store", "Store"),
    "HEAD_METRICS": ("headscope.analysis.score_registry", "HEAD_METRICS"),
    "HEAD_SCORES": ("headscope.analysis.score_registry", "HEAD_SCORES"),
    "VIEWS": ("headscope.app.views", "VIEWS"),
    "figures": ("headscope.app.figures", None),
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'headscope' has no attribute {name!r}")
    module, attribute = _API[name]
    value = importlib.import_module(module)
    value = value if attribute is None else getattr(value, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
