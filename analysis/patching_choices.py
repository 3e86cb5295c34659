"""What a user can choose in activation patching, spelled once: the sites, the directions and the
metrics, with what each means (:mod:`headscope.analysis.patching` implements them).

This module imports nothing heavy, so the command line checks its arguments against these names
before torch is loaded.
"""

from __future__ import annotations

SITES = ("z", "q", "k", "v", "resid")
HEAD_SITES = ("z", "q", "k", "v")
KV_SITES = ("k", "v")
JOINT_SITES = ("embed", "z", "q", "k", "v", "attn_out", "mlp_out", "resid")
"""Sites a set of units patched together (:func:`headscope.analysis.path_patching.patch_together`) may name: the head
sites, the residual stream, and the three writers into it (the token embedding ``hook_embed``, a
layer's attention output ``hook_attn_out`` and its MLP output ``hook_mlp_out``)."""
PATH_SITES = ("q", "k", "v")
DIRECTIONS = ("denoise", "noise")
METRICS = ("logit_diff", "loss")
SITE_DESCRIPTIONS = {
    "z": "each query head's output z (hook_z, before W_O)",
    "q": "each query head's queries (hook_q, before rotary)",
    "k": "each key-value head's keys (hook_k, before rotary); with grouped-query attention one key head "
         "serves several query heads, so its effect is theirs together",
    "v": "each key-value head's values (hook_v); with grouped-query attention one value head serves "
         "several query heads, so its effect is theirs together",
    "resid": "the residual stream at one position entering each layer (hook_resid_pre; the last row is "
             "after the last layer)",
}
DIRECTION_DESCRIPTIONS = {
    "denoise": "clean activations copied into the corrupted run (1 = that activation restores the clean answer)",
    "noise": "corrupted activations copied into the clean run (0 = the clean answer needs that activation)",
}
METRIC_LABELS = {"logit_diff": "logit difference", "loss": "loss on the answer"}


def parse_head_pairs(text: object, what: str | None = None) -> list[tuple[int, int]]:
    """Heads typed as ``layer.head``, comma-separated (``0.1,3.4``): the senders and receivers of path
    patching (:func:`headscope.analysis.path_patching.path_patching`, which checks them against the model) as the
    Patching page and ``headscope patch --path-from/--path-to`` take them. Raises ``InputError`` naming
    ``what`` and the item that is not a head."""
    import re

    from headscope.analysis.errors import InputError

    if not isinstance(text, str) or not text.strip():
        raise InputError(f"Give the {what or 'heads'} as layer.head, comma-separated, e.g. 9.1,10.7.")
    if len(text) > 10_000:
        raise InputError(f"The list of {what or 'heads'} is {len(text):,} characters long; a model has far fewer heads.")
    heads = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*([0-9]{1,6})\.([0-9]{1,6})\s*", item)  # ASCII digits: not "٣" or "３"
        if not m:
            where = f" in the {what}" if what else ""
            raise InputError(f"{item.strip()[:40]!r}{where} is not a head: write layer.head, comma-separated, "
                             "e.g. 9.1,10.7.")
        heads.append((int(m[1]), int(m[2])))
    return heads
