"""Named views, one module per page in ``app/pages/``: a run (or stored results) plus parameters →
a figure and the table of numbers behind it.

:mod:`headscope.app.views.registry` holds :data:`VIEWS` and what every view shares; each module of this
package (:mod:`~headscope.app.views.attention`, :mod:`~headscope.app.views.heads`, …, one per page)
registers its views where they are defined, with their parameters. Importing this package imports
every module in its folder, so exports and ``headscope figure`` find every view, a new page's too,
without a list to extend; the registry imports none of them, so there is no import circle. Names are
constants of :mod:`headscope.app.views.names`.
"""

from __future__ import annotations

import importlib
import pkgutil

from headscope.app.views import names
from headscope.app.views.registry import VIEWS, Rows, View

for _module in pkgutil.iter_modules(__path__):  # each module registers its views as it is imported
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["VIEWS", "Rows", "View", "names"]
