"""What a user can choose in activation patching, spelled once: the sites, the directions and the
metrics, with what each means (:mod:`analysis.patching` implements them).

This module imports nothing heavy, so the command line checks its arguments against these names
before torch is loaded.
"""

from __future__ import annotations

SITES = ("z", "q", "k", "v", "resid")
HEAD_SITES = ("z", "q", "k", "v")
KV_SITES = ("k", "v")
JOINT_SITES = ("embed", "z", "q", "k", "v", "attn_out", "mlp_out", "resid")
"""Sites a set of units patched together (:func:`analysis.path_patching.patch_together`) may name: the head
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
