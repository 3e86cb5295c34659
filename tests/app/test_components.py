"""app/components.py: the pieces every page shares (here: the run's info line)."""

from analysis.capture import capture
from app import components


def _texts(div) -> list[str]:
    return [child.children for child in div.children]


def test_run_info_says_the_models_bos_and_template_policy(tiny_model):
    run = capture(tiny_model, "The cat sat on the mat.", pattern_dtype="float32")
    policy = tiny_model.facts.prompt_policy
    texts = _texts(components.run_info(run, 1, 2, policy))
    assert policy in texts and f"run {run.short_id}" in texts and "selected: layer 1, head 2" in texts
    assert f"{run.n_tokens} tokens" in texts
    assert not any("BOS" in t for t in _texts(components.run_info(run, 0, 0, "")))  # unknown: not claimed


def test_prompt_policy_of_a_model_this_server_does_not_offer_is_not_claimed():
    assert components.prompt_policy("/nowhere/not-a-model") == ""
