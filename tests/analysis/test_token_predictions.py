"""Per-token loss and top-5 in chunks of positions from the final hidden state, against the same
numbers read off the model's full ``[n, vocab]`` logits (log_softmax, gather, top-k, by hand)."""

import numpy as np
import pytest
import torch

from headscope.analysis.models import wrap_model
from headscope.analysis.token_predictions import TOP_K, final_hidden_state, token_predictions
from tests.tiny_families import tiny_family_model

TEXT = ("The keeper of the lighthouse wrote every evening in a small blue notebook. She counted the ships, "
        "the gulls and the storms, and once a year she sent the notebook to her sister.")


def reference(logits: torch.Tensor, ids: list[int]):
    """Unchunked: one log_softmax over the whole [n, vocab] array; also every probability."""
    lp = torch.log_softmax(logits.double(), -1)
    loss = np.full(len(ids), np.nan)
    loss[1:] = -lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    top = torch.topk(lp, TOP_K, -1)
    return loss, top.values.exp().numpy(), lp.exp().numpy()


def assert_top_k(top_ids, top_probs, want_probs, probs):
    """The top-k probabilities equal the reference's, and each id really has its rank's probability
    (ids may differ only between tokens of equal probability: a soft-capped random model has ties)."""
    np.testing.assert_allclose(top_probs, want_probs, atol=1e-5)
    np.testing.assert_allclose(probs[np.arange(len(probs))[:, None], top_ids], want_probs, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])  # gemma2: final logit soft-capping
def test_chunked_predictions_equal_those_of_the_full_logits(family, embedded_tokenizer):
    model = wrap_model(tiny_family_model(family, len(embedded_tokenizer)), embedded_tokenizer,
                       name=f"tiny-{family}-pred", digest=f"tiny-{family}-pred")
    ids = embedded_tokenizer.encode(TEXT)[:37]
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        full = model.bridge(tokens, return_type="logits")[0]
        with final_hidden_state(model) as kept:
            last = model.bridge(tokens, return_type="logits", logits_to_keep=1)[0, -1]
    assert kept.hidden.shape == (len(ids), model.d_model)
    want_loss, want_probs, probs = reference(full, ids)
    for chunk in (1, 5, 36, 37, 256):  # 5 and 36 do not divide n = 37
        got = token_predictions(model, kept.hidden, ids, chunk=chunk, last_logits=last)
        np.testing.assert_allclose(got.token_loss, want_loss, atol=1e-5, equal_nan=True, err_msg=str(chunk))
        assert_top_k(got.top_ids, got.top_probs, want_probs, probs)
        assert got.token_loss.dtype == np.float32 and got.top_ids.dtype == np.int64


def test_a_model_whose_logits_are_not_its_unembedding_is_refused(embedded_tokenizer):
    """The model's own last-position logits are held against the recomputed ones: an unembedding
    that does something else (here: a soft-capping the recomputation does not know of) is caught."""
    from headscope.analysis.errors import InputError

    model = wrap_model(tiny_family_model("llama", len(embedded_tokenizer)), embedded_tokenizer,
                       name="tiny-llama-pred", digest="tiny-llama-pred")
    ids = embedded_tokenizer.encode(TEXT)[:12]
    with torch.inference_mode(), final_hidden_state(model) as kept:
        last = model.bridge(torch.tensor([ids]), return_type="logits", logits_to_keep=1)[0, -1]
    with pytest.raises(InputError, match="unembedding"):
        token_predictions(model, kept.hidden, ids, last_logits=torch.tanh(last / 3) * 3)


@pytest.mark.parametrize("kind", ["patterns", "statistics"])
def test_both_run_kinds_keep_the_predictions_of_the_full_logits(embedded_tokenizer, kind):
    from headscope.analysis.capture import capture
    from headscope.analysis.statistics_run import capture_statistics

    model = wrap_model(tiny_family_model("gemma2", len(embedded_tokenizer)), embedded_tokenizer,
                       name="tiny-gemma2-run-pred", digest="tiny-gemma2-run-pred")
    ids = embedded_tokenizer.encode(TEXT)[:40]
    with torch.inference_mode():
        full = model.bridge(torch.tensor([ids]), return_type="logits")[0]
    want_loss, want_probs, probs = reference(full, ids)
    run = (capture if kind == "patterns" else capture_statistics)(model, ids)
    np.testing.assert_allclose(run.token_loss, want_loss, atol=1e-4, equal_nan=True)
    assert_top_k(run.top_ids, run.top_probs, want_probs, probs)
