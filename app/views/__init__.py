"""Named views, one module per page in ``app/pages/``: a run (or stored results) plus parameters →
a figure and the table of numbers behind it.

:mod:`headscope.app.views.registry` holds :data:`VIEWS` and what every view shares; each page's module
(:mod:`~headscope.app.views.attention`, :mod:`~headscope.app.views.flow`, :mod:`~headscope.app.views.heads`,
:mod:`~headscope.app.views.ablation`, :mod:`~headscope.app.views.qk`, :mod:`~headscope.app.views.patching`, :mod:`~headscope.app.views.compress`; :mod:`~headscope.app.views.comparison`
has no page yet: ``headscope compare``) registers its views where they are defined, with
their parameters. Importing this package imports them all, so exports and ``headscope figure`` find
every view; the registry imports none of them, so there is no import circle. Names are constants of
:mod:`headscope.app.views.names`.
"""

from __future__ import annotations

from headscope.app.views import (  # noqa: F401  (each registers its views)
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
from headscope.app.views.registry import VIEWS, Rows, View

__all__ = ["VIEWS", "Rows", "View", "names"]
