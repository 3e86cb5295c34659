"""Where headscope keeps things on disk.

``HEADSCOPE_HOME`` (default: the user data dir) holds the run store; ``HEADSCOPE_MODEL_CACHE``
(default: ``$HEADSCOPE_HOME/models``) holds converted model weights, so several stores (tests, users)
can share one 0.5 GB conversion.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"


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
