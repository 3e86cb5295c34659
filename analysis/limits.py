"""Limits on work a request may ask for, each set by an environment variable.

Every limit is read when it is checked, so a server started with another value uses it; a message
that reports a limit names its variable, so the user knows how to change it. A value that is not a
positive whole number written in ASCII digits is ignored (the default holds), so a typo never lifts a
limit or sets it to a number the operator did not write.

=============================  =======  ==========================================================
variable                       default  what it bounds
=============================  =======  ==========================================================
``HEADSCOPE_MAX_TOKENS``         1024   tokens of a page run with full attention patterns
``HEADSCOPE_MAX_STATS_TOKENS`` 32768   tokens of a long page run (statistics mode; also bounded
                                        by the model's context)
``HEADSCOPE_MAX_FLOW_TOKENS``     128   tokens for exact attention flow
``HEADSCOPE_MAX_ABLATION_TOKENS`` 2048 tokens of an ablated text (effects, curves, single-head sweeps,
                                        mean ablation's references; every ablated set runs the text)
``HEADSCOPE_MAX_PATCH_TOKENS``   2048   tokens of each prompt of an activation or path patching (no
                                        patterns are kept, but every patched unit runs the prompt)
``HEADSCOPE_MAX_QK_POINTS``    20000    query + key points of one head's joint embedding
``HEADSCOPE_MAX_SWEEP_TRIALS``   200    trials (needles × lengths × depths) of one NIAH sweep
``HEADSCOPE_MAX_UPLOAD_BYTES`` 4000000  bytes of one uploaded file (haystack, sentences, labels)
``HEADSCOPE_READ_TIMEOUT``         60   seconds the server waits for the next bytes of a request
=============================  =======  ==========================================================
"""

from __future__ import annotations

import os
import re

_WHOLE = re.compile(r"\s*[0-9]{1,18}\s*")

DEFAULTS = {
    "HEADSCOPE_MAX_TOKENS": 1024,
    "HEADSCOPE_MAX_STATS_TOKENS": 32_768,
    "HEADSCOPE_MAX_FLOW_TOKENS": 128,
    "HEADSCOPE_MAX_ABLATION_TOKENS": 2048,
    "HEADSCOPE_MAX_PATCH_TOKENS": 2048,
    "HEADSCOPE_MAX_QK_POINTS": 20_000,
    "HEADSCOPE_MAX_SWEEP_TRIALS": 200,
    "HEADSCOPE_MAX_UPLOAD_BYTES": 4_000_000,
    "HEADSCOPE_READ_TIMEOUT": 60,
}


def limit(name: str) -> int:
    """The current value of limit ``name`` (a key of :data:`DEFAULTS`); a malformed value (not ASCII
    digits, 0, more than 18 digits) falls back to the default rather than failing the request."""
    default = DEFAULTS[name]
    raw = os.environ.get(name)
    if raw is None or not _WHOLE.fullmatch(raw):
        return default
    value = int(raw)
    return value if value > 0 else default


def hint(name: str) -> str:
    return f"(the limit is {limit(name):,}; set {name} to change it)"
