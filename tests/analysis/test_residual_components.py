"""analysis/residual_components.py: a capture unembeds only the last position where the model can, and
keeps exactly what a forward pass with every position's logits keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headscope.analysis import residual_components as rc
from headscope.analysis.models import wrap_model
from tests.tiny_families import FAMILIES, tiny_family_model

IDS = [5, 17, 42, 8, 99, 23, 61, 7, 13, 77, 31, 50]


def _tensors(capture) -> dict[str, torch.Tensor]:
    out = {"embed": capture.embed, "z": capture.z, "mlps": capture.mlps, "resid": capture.resid,
           "final_sigma": capture.final_sigma, "final_out": capture.final_out}
    for layer, a in capture.attention.items():
        out.update({f"{name}{layer}": getattr(a, name) for name in ("q_proj", "k_proj", "q", "k", "cos", "sin", "sigma")
                    if getattr(a, name) is not None})
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_capture_without_every_positions_logits_keeps_the_same_tensors(family, embedded_tokenizer, monkeypatch):
    model = wrap_model(tiny_family_model(family, len(embedded_tokenizer), seed=1), embedded_tokenizer,
                       name=f"tiny-{family}", digest=f"tiny-{family}-seed1")
    try:
        rc.check_structure(model)
    except rc.InputError:
        pytest.skip(f"{family}: attributions refuse this family")
    if family in ("llama", "qwen2", "gemma2", "gpt2"):  # the Hugging Face classes that take logits_to_keep here
        assert rc._last_logits_only(model) == {"logits_to_keep": 1}
    fast = _tensors(rc.capture_components(model, IDS, range(len(IDS)), attention_layers=range(model.n_layers)))
    monkeypatch.setattr(rc, "_last_logits_only", lambda model: {})
    every = _tensors(rc.capture_components(model, IDS, range(len(IDS)), attention_layers=range(model.n_layers)))
    assert fast.keys() == every.keys()
    for name, tensor in every.items():
        np.testing.assert_array_equal(fast[name].numpy(), tensor.numpy(), err_msg=f"{family}: {name}")
