"""Where headscope keeps things on disk, and where it finds what it ships.

``ASSETS_DIR`` and ``DATA_DIR`` are the browser assets and the shipped inputs (needles, haystack,
probes, patching pairs): beside the ``analysis`` package both in a checkout (the repository's
``assets/`` and ``data/``) and in an installed wheel (``site-packages/headscope/assets``, ``…/data``),
so they are found from the package itself, never from the current directory.
``HEADSCOPE_HOME`` (default: the user data dir) holds the run store; ``HEADSCOPE_MODEL_CACHE``
(default: ``$HEADSCOPE_HOME/models``) holds converted model weights, so several stores (tests, users)
can share one 0.5 GB conversion.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the checkout, or site-packages/headscope
ASSETS_DIR = PACKAGE_ROOT / "assets"
DATA_DIR = PACKAGE_ROOT / "data"


def home() -> Path:
    """The store root: ``$HEADSCOPE_HOME`` or the platform's user data dir."""
    path = Path(os.environ.get("HEADSCOPE_HOME") or platformdirs.user_data_dir("headscope"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_cache() -> Path:
    """Converted model weights: ``$HEADSCOPE_MODEL_CACHE`` or ``home()/models``."""
    env = os.environ.get("HEADSCOPE_MODEL_CACHE")
    path = Path(env) if env else home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
