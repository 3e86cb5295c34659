"""Shared fixtures: a tiny random Llama (unit tests), the embedded model (integration), a fresh store.

The converted embedded model is cached once per machine (``HEADSCOPE_MODEL_CACHE``, shared with
``make serve``); every test gets its own empty store.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import platformdirs
import pytest

os.environ.setdefault("HEADSCOPE_MODEL_CACHE", str(Path(platformdirs.user_data_dir("headscope")) / "models"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _share_cores_between_workers() -> None:
    """Under ``pytest -n N`` (``make test`` runs two workers): each worker, and every server, CLI and
    job process it starts, runs OpenMP on its share of the cores, sleeping while it waits.

    Left to themselves two workers on 2 cores run 4 OpenMP threads that spin while they wait for each
    other: measured on 2026-12-03, an ``ablate`` CLI test took 123 s instead of 7 s and the suite
    1,065 s, against 1,186 s serial; with one thread per worker it took 852 s. Read when torch loads
    OpenMP, so set before anything imports torch; a value the caller set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2:
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:  # a plugin imported it first: its pool is sized already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_cores_between_workers()


# A test that takes one of these fixtures gets the marker, marked or not: ``-m "not integration"`` then
# never loads the embedded model, and ``make test-fast`` never starts Chromium or redis-server.
MARKED_BY_FIXTURE = {"real_model": "integration", "browser": "browser", "page": "browser", "redis_url": "redis"}


def pytest_collection_modifyitems(items):
    for item in items:
        for name in MARKED_BY_FIXTURE.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(MARKED_BY_FIXTURE[name])


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_HOME", str(tmp_path / "home"))


@pytest.fixture
def store(tmp_path):
    from headscope.analysis.store import Store

    return Store(tmp_path / "store")


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct with its real weights (converted once, then ~1 s to load)."""
    from headscope.analysis.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The embedded model's tokenizer and chat template, without its weights (unit tests)."""
    return load_embedded_tokenizer()


def load_embedded_tokenizer():
    """The embedded model's tokenizer alone: from the converted cache folder when there is one
    (0.3 s), else straight from the GGUF (about 5 s; reads the vocabulary, not the weights)."""
    from transformers import AutoTokenizer

    from headscope.analysis.models import embedded_gguf
    from headscope.analysis.paths import model_cache

    gguf = embedded_gguf()
    for source in sorted(model_cache().glob("gguf-*/headscope-source.json")):
        try:
            converted_from = json.loads(source.read_text()).get("gguf")
        except (OSError, ValueError):
            continue
        if converted_from == str(gguf) and (source.parent / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(source.parent))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def tiny_model(embedded_tokenizer):
    """A 2-layer random Llama (4 query heads, 2 key-value heads) with the embedded tokenizer."""
    from headscope.analysis.models import wrap_model

    hf = tiny_hf_model(len(embedded_tokenizer))
    return wrap_model(hf, embedded_tokenizer, name="tiny-llama", digest="tiny-random-llama-seed0")


@pytest.fixture(scope="session")
def make_tiny_model(embedded_tokenizer):
    """Tiny random Llamas (2 layers, 4 query heads, 2 key-value heads) with the embedded tokenizer and
    chat template, for tests that need another seed or longer positions than ``tiny_model``."""
    from headscope.analysis.models import wrap_model

    def make(seed: int = 0, max_positions: int = 512, name: str = "tiny-llama"):
        hf = tiny_hf_model(len(embedded_tokenizer), seed=seed, max_positions=max_positions)
        return wrap_model(hf, embedded_tokenizer, name=name, digest=f"{name}-seed{seed}-pos{max_positions}")

    return make


def tiny_hf_model(vocab_size: int, seed: int = 0, max_positions: int = 512):
    """A fresh tiny random Llama (the bridge rewires a model it wraps, so wrap a fresh one)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
    )
    config.architectures = ["LlamaForCausalLM"]
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def small_retrieval_sweep(real_model):
    """The small needle-in-a-haystack sweep two integration tests share (computed once a session):
    3 shipped needles × depths 25 and 75 % at 256 tokens on the embedded model, 24 new tokens.
    ``tests/analysis/test_retrieval.py`` checks its retrieval-head share, ``test_ablation.py`` masks its
    top heads. bench/ablation_curve.py runs the full-size version (every needle, more k and seeds)."""
    import torch

    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep

    by_id = {n.id: n for n in load_needles()}
    needles = [by_id[k] for k in ("locker-code", "chess-club", "tram-depot")]
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # decoding: see one_thread
    try:
        return sweep(real_model, needles, [256], [25, 75], load_haystack("prose"), max_new_tokens=24)
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """One torch thread: decoding is a long run of tiny matmuls, and on a shared 2-core machine two
    OpenMP threads thrash (measured: this sweep took 314 s with 2 threads under load, 26 s with 1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
