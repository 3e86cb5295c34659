"""Named views, one module per page in ``app/pages/``: a run (or stored results) plus parameters →
a figure and the table of numbers behind it.

:mod:`app.views.registry` holds :data:`VIEWS` and what every view shares; each page's module
(:mod:`~app.views.attention`, :mod:`~app.views.flow`, :mod:`~app.views.heads`,
:mod:`~app.views.ablation`, :mod:`~app.views.qk`, :mod:`~app.views.patching`, :mod:`~app.views.compress`; :mod:`~app.views.comparison`
has no page yet: ``headscope compare``) registers its views where they are defined, with
their parameters. Importing this package imports them all, so exports and ``headscope figure`` find
every view; the registry imports none of them, so there is no import circle. Names are constants of
:mod:`app.views.names`.
"""

from __future__ import annotations

from app.views import (  # noqa: F401  (each registers its views)
    ablation,
    attention,
    comparison,
    compress,
    flow,
    heads,
    names,
    patching,
    qk,
)
from app.views.registry import VIEWS, Rows, View

__all__ = ["VIEWS", "Rows", "View", "names"]
