"""The Attention and Heads pages in real Chromium on two non-Llama families: tiny random Gemma 3
(sliding windows on layers 0 and 2, QK-norm, head_dim 256, one KV head for four query heads) and
Qwen 3 (QK-norm), each saved as a folder of safetensors + config + the embedded tokenizer and
offered by ``headscope serve --model`` (Gemma 3) and ``HEADSCOPE_MODELS`` (Qwen 3). The grid's
entropy is checked against Hugging Face's own eager attention, normalised by hand."""

from __future__ import annotations

import os
import sys
import urllib.parse

import numpy as np
import pytest
import torch

from tests.app.browsing import select_option, wait_for_run, wait_title
from tests.app.servers import start_server
from tests.tiny_families import tiny_family_model

TEXT = ("The keeper of the lighthouse wrote every evening in a small blue notebook. She counted the ships, "
        "the gulls and the storms.")
FAMILIES = ("gemma3", "qwen3")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, embedded_tokenizer):
    root = tmp_path_factory.mktemp("family-models")
    out = {}
    for family in FAMILIES:
        folder = root / f"tiny-{family}"
        tiny_family_model(family, len(embedded_tokenizer)).save_pretrained(folder, safe_serialization=True)
        embedded_tokenizer.save_pretrained(folder)
        out[family] = str(folder)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders):
    home = tmp_path_factory.mktemp("families-home")
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "HEADSCOPE_MODELS": folders["qwen3"]}
    env.pop("HEADSCOPE_REDIS_URL", None)
    proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve", "--model", folders["gemma3"]], env,
                             home / "server.log")
    yield url, proc, home
    proc.terminate()
    proc.wait(timeout=30)


def hf_entropy(folder: str, ids: list[int]) -> tuple[np.ndarray, list[int | None]]:
    """``[layer, head]`` normalised entropy from Hugging Face's eager attention of the saved model,
    by hand: row entropy / log(visible keys), ``min(i + 1, W)`` on sliding layers (from the config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    windows = [cfg.sliding_window if t == "sliding_attention" else None for t in types]
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.inference_mode():
        attn = hf(torch.tensor([ids]), output_attentions=True).attentions
    n = len(ids)
    out = []
    for a, w in zip(attn, windows, strict=True):
        p = a[0].double()
        h = -(torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))).sum(-1)  # [head, n]
        visible = torch.arange(1, n + 1, dtype=torch.float64)
        if w:
            visible = visible.clamp(max=w)
        out.append((h[:, 1:] / visible[1:].log()).mean(-1).numpy())
    return np.stack(out), windows


def grid(page) -> dict:
    return page.evaluate("""() => { const el = document.querySelector('#hs-grid .js-plotly-plot');
        return {z: el.data[0].z, custom: el.data[0].customdata, ticks: el.layout.yaxis.ticktext || null}; }""")


@pytest.mark.browser
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_attention_page_runs_a_non_llama_family(server, page, folders, embedded_tokenizer, family):
    url, proc, _ = server
    folder = folders[family]
    page.goto(url + "?model=" + urllib.parse.quote(folder, safe=""))
    page.fill("#attn-hs-text", TEXT, timeout=240_000)
    page.click("#attn-hs-run", timeout=240_000)
    wait_for_run(page, timeout=240_000)
    page.wait_for_selector("#hs-heatmap .heatmaplayer .hm")  # one head's pattern draws too
    assert page.inner_text("#hs-error").strip() == ""
    assert "model=" + urllib.parse.quote(folder, safe="") in page.evaluate("location.search")
    # the run says how its text became tokens (this tokenizer adds no BOS; its chat template is not applied)
    assert "no BOS · text as written, no chat template applied" in page.inner_text("#hs-run-info")

    ids = embedded_tokenizer.encode(TEXT, add_special_tokens=False)  # this tokenizer adds no BOS
    want, windows = hf_entropy(folder, ids)
    shown = grid(page)
    z = np.array([[np.nan if v is None else v for v in row] for row in shown["z"]], dtype=float)
    assert z.shape == want.shape
    np.testing.assert_allclose(z, want, atol=1e-4)  # the grid's default metric is normalised entropy
    if family == "gemma3":  # layers 0 and 2 slide over 6 keys; the grid says so
        assert windows == [6, None, 6]
        assert shown["ticks"] == ["0 w", "1", "2 w"]
        assert shown["custom"][0][0] == "sliding window of 6 keys" and shown["custom"][1][0] == "full attention"
    else:
        assert shown["ticks"] is None and shown["custom"][0][0] == "full attention"
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_heads_page_sweeps_on_qwen3(server, page, folders):
    """A one-trial retrieval sweep on Qwen 3 (QK-norm, statistics mode) runs to the end in the page."""
    url, proc, _ = server
    page.goto(url + "heads?model=" + urllib.parse.quote(folders["qwen3"], safe=""))
    page.wait_for_selector("#hs-heads-run", timeout=240_000)
    page.fill("#hs-heads-custom-needles", "The secret passkey is 7731. | What is the secret passkey? | 7731")
    page.fill("#hs-heads-lengths", "200")
    page.fill("#hs-heads-depths", "50")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=240_000)
    assert page.inner_text("#hs-error").strip() == ""
    page.wait_for_function("(document.querySelector('#hs-heads-info')?.innerText || '').includes('trials')")
    assert "/1 trials" in page.inner_text("#hs-heads-info")
    assert proc.poll() is None


def hf_zero_ablation_loss(folder: str, ids: list[int], heads: list[tuple[int, int]]) -> tuple[float, float]:
    """Mean next-token loss of the saved model, clean and with the heads' outputs zeroed before the
    output projection (``hook_z``), from Hugging Face's model with a pre-hook on ``o_proj``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    d = hf.config.head_dim
    x = torch.tensor([ids])

    def loss() -> float:
        with torch.inference_mode():
            logp = hf(x).logits[0].log_softmax(-1)
        return float(-logp[:-1].gather(1, x[0, 1:, None]).mean())

    clean = loss()
    hooks = []
    for layer in sorted({la for la, _ in heads}):
        cut = [h for la, h in heads if la == layer]

        def zero(module, args, cut=cut):
            z = args[0].clone()
            for h in cut:
                z[..., h * d : (h + 1) * d] = 0
            return (z, *args[1:])

        hooks.append(hf.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero))
    try:
        return clean, loss()
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_ablation_page_zero_ablates_heads_of_gemma3(server, page, folders, embedded_tokenizer):
    """Zero ablation of two Gemma 3 heads (one on a windowed layer, one global) from the Ablation page:
    its mean losses equal Hugging Face's model with those heads' outputs zeroed."""
    import re

    url, proc, _ = server
    page.goto(url + "ablation?model=" + urllib.parse.quote(folders["gemma3"], safe=""))
    page.fill("#abl-hs-text", TEXT, timeout=240_000)
    page.click("#abl-hs-run")
    page.wait_for_function("location.search.includes('run=')", timeout=240_000)
    wait_title(page, "hs-abl-grid", "0 heads chosen")  # the page has drawn the run: the box is live
    page.fill("#hs-abl-heads", "0.1,1.3")
    page.press("#hs-abl-heads", "Enter")
    page.wait_for_function("(document.querySelector('#hs-abl-chosen')?.innerText || '').includes('L1H3')")
    page.click("#hs-abl-apply")
    page.wait_for_function("""() => (document.querySelector('#hs-abl-effects .gtitle')?.textContent || '')
                              .includes('zero ablation of 2 heads: mean loss')""", timeout=240_000)
    title = page.locator("#hs-abl-effects .gtitle").text_content()
    shown = [float(v) for v in re.search(r"mean loss ([\d.]+) → ([\d.]+)", title).groups()]
    ids = embedded_tokenizer.encode(TEXT, add_special_tokens=False)
    want = hf_zero_ablation_loss(folders["gemma3"], ids, [(0, 1), (1, 3)])
    np.testing.assert_allclose(shown, want, atol=1.5e-3)
    assert page.inner_text("#hs-error").strip() == ""
    assert proc.poll() is None
