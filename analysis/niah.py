"""Needle-in-a-haystack prompts: a needle sentence hidden at a depth of a haystack, then a question.

The construction follows Kamradt's "needle in a haystack" test as used by Wu et al. 2024,
"Retrieval Head Mechanistically Explains Long-Context Factuality" (arXiv:2404.15574), section 2:

1. the haystack is cut, at a sentence boundary, so that the whole prompt (chat template, haystack,
   needle and question) has at most ``length`` tokens;
2. the needle is inserted at a sentence boundary at ``depth`` percent of the haystack's tokens
   (0 = first sentence, 100 = after the last one), by one of :data:`DEPTH_RULES`: ``nearest`` (the
   default) takes the boundary nearest to that point, ``previous`` the last boundary at or before it
   (the rule of Kamradt's test and of the retrieval-head paper's code, which back up from the
   insertion point to the previous sentence end, so the needle never lands later than asked);
3. the question follows the context, inside the model's chat template when it has one; a model
   without one (a base model) reads the plain message followed by :data:`ANSWER_CUE` ("\nAnswer:"),
   as the retrieval-head paper's prompts for base models end (``... Question: {q}\nAnswer:``), so
   that the greedy continuation is the answer rather than more text;
4. the needle's token span is located exactly in the final token ids. When tokenisation merges the
   needle with its neighbours, so that no contiguous run of tokens spells exactly the needle, the
   build fails with an :class:`~headscope.analysis.capture.InputError` that says so: scores that count
   "attention inside the needle" need that span to be exact.

Haystacks: ``data/niah/haystack_prose.txt`` (original prose written for headscope, CC0, about 8,200
SmolLM2 tokens) and :func:`passkey_filler`, the repetitive filler of the passkey test (Mohtashami &
Jaggi 2023, "Landmark Attention", arXiv:2305.16300). A haystack shorter than the requested length is
repeated from its start.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headscope.analysis.errors import InputError, parse_json, shown
from headscope.analysis.paths import DATA_DIR

if TYPE_CHECKING:  # torch is not imported to check a request's needles, lengths and S + W
    from headscope.analysis.models import LoadedModel

NIAH_DIR = DATA_DIR / "niah"
NEEDLES_FILE = NIAH_DIR / "needles.json"
HAYSTACKS = {"prose": NIAH_DIR / "haystack_prose.txt"}

DEFAULT_TEMPLATE = (
    "Read the following text and answer the question after it.\n\n{context}\n\n"
    "Question: {question} Answer in one short sentence."
)
"""The user message around the context; ``{context}`` and ``{question}`` are filled in."""
ANSWER_CUE = "\nAnswer:"
"""Appended to the message of a model without a chat template (a base model): where a chat model's
generation prompt opens the assistant's turn, this line says that the answer comes next (Wu et al.
2024's base-model prompts end with ``Question: {question}\nAnswer:``)."""

# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket) and the whitespace
# after it; a blank line (a paragraph or a title line) also ends one. The whitespace stays at the
# *start* of the next piece, so that every piece tokenises as it does inside the whole text
# (byte-level BPE attaches a space to the word after it).
DEPTH_RULES = ("nearest", "previous")
"""Where the needle goes: the sentence boundary ``nearest`` to the requested depth, or the
``previous`` one (at or before it). The default, ``nearest``, is the rule of every stored sweep."""
DEFAULT_DEPTH_RULE = "nearest"
DEPTH_RULE_DESCRIPTIONS = {"nearest": "the sentence boundary nearest to the depth",
                           "previous": "the last sentence boundary at or before the depth"}

_BOUNDARY = re.compile(r"(?<=[.!?])(?=\s)|(?<=[.!?][\"')\]])(?=\s)|(?<=\S)(?=\n)")
_SENTENCE_END = (".", "!", "?", '."', ".'", ".)", '!"', '?"')


@dataclass(frozen=True)
class Needle:
    """One needle sentence, the question that asks for it, and the expected answer."""

    needle: str
    question: str
    answer: str
    id: str = ""
    kind: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class NiahPrompt:
    """A built needle-in-a-haystack prompt.

    Attributes
    ----------
    token_ids : the exact ids the model sees (chat template included).
    needle_span : ``(start, end)``, half-open: ``token_ids[start:end]`` are exactly the needle's tokens.
    question_span : ``(start, end)`` of the question's tokens (the queries of the evidence score).
    length : the requested maximum number of tokens; ``n_tokens <= length``.
    depth : the requested depth in percent; ``actual_depth`` is where the needle landed, in percent
        of the haystack's tokens before it.
    haystack_tokens : tokens of haystack text in the prompt (around the needle).
    text : the user message (context and question) before the chat template; for a model without
        one, the whole text after the BOS, :data:`ANSWER_CUE` included.
    depth_rule : how the boundary was chosen (:data:`DEPTH_RULES`).
    """

    token_ids: list[int]
    needle_span: tuple[int, int]
    question_span: tuple[int, int]
    needle: Needle
    length: int
    depth: float
    actual_depth: float
    haystack_tokens: int
    text: str
    depth_rule: str = DEFAULT_DEPTH_RULE

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def settings(self) -> dict[str, Any]:
        """What identifies this prompt in stored trials (besides its token ids)."""
        return {
            "length": self.length,
            "depth": self.depth,
            "actual_depth": round(self.actual_depth, 3),
            "n_tokens": self.n_tokens,
            "needle_span": list(self.needle_span),
            "question_span": list(self.question_span),
            "needle": self.needle.to_dict(),
            # only when not the default, so the settings of earlier trials read the same
            **({"depth_rule": self.depth_rule} if self.depth_rule != DEFAULT_DEPTH_RULE else {}),
        }


# ---------------------------------------------------------------------------------------------
# Inputs


def load_needles(path: Path | str | None = None) -> list[Needle]:
    """The needles shipped in ``data/niah/needles.json`` (or another file of the same shape).

    Returns
    -------
    list of :class:`Needle`, in file order.
    """
    path = Path(path) if path is not None else NEEDLES_FILE
    try:
        raw = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"Cannot read needles from {path}: {e}") from None
    return _needles_from(raw, str(path))


NEEDLE_FIELDS = ("needle", "question", "answer")
"""The fields every needle has; ``id`` and ``kind`` are optional. All are text."""


def _json_kind(value: Any) -> str:
    """What a JSON value is, as a message names it: "a number", "null", "true", "a list", "an object"."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return "a number"
    return {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _needles_from(raw: Any, where: str) -> list[Needle]:
    """Needles from parsed JSON (a list of objects, or ``{"needles": [...]}``). Every field is text: a
    number, ``null`` or a list is refused rather than read as its spelling ("None", "[1, 2]")."""
    items = raw["needles"] if isinstance(raw, dict) and "needles" in raw else raw
    if not isinstance(items, list):
        raise InputError(f"The needles in {where} must be a list of objects with 'needle', 'question' and 'answer'.")
    needles = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not all(k in item for k in NEEDLE_FIELDS):
            raise InputError(f"Needle {i} in {where} needs the fields 'needle', 'question' and 'answer'.")
        for key in (*NEEDLE_FIELDS, "id", "kind"):
            if key in item and not isinstance(item[key], str):
                raise InputError(f"Needle {i} in {where}: field {key!r} must be a string, got {_json_kind(item[key])}.")
        fields = {k: item[k].strip() for k in NEEDLE_FIELDS}
        if not all(fields.values()):
            raise InputError(f"Needle {i} in {where} has an empty needle, question or answer.")
        needles.append(Needle(**fields, id=item.get("id", f"needle-{i}"), kind=item.get("kind", "")))
    return needles


def parse_needles(text: str) -> list[Needle]:
    """Needles a user typed or uploaded: JSON (as ``needles.json``) or one per line as
    ``needle | question | answer``. Blank lines and lines starting with ``#`` are skipped."""
    text = (text or "").strip()
    if not text:
        raise InputError("No needles given: write one per line as 'needle | question | answer'.")
    if text[0] in "[{":
        try:
            raw = parse_json(text)
        except ValueError as e:
            raise InputError(f"The needles look like JSON but do not parse: {e}.") from None
        return _needles_from(raw, "the needles given")
    needles = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 3 or not all(parts):
            raise InputError(f"Needle line {n} must be 'needle | question | answer' (three non-empty parts "
                             f"separated by '|'); got {line[:80]!r}.")
        needles.append(Needle(*parts, id=f"custom-{len(needles) + 1}", kind="custom"))
    if not needles:
        raise InputError("No needles given: write one per line as 'needle | question | answer'.")
    return needles


MAX_LENGTH = 1 << 20
"""The longest context length, in tokens, a sweep may be asked for (also the largest S and W): past
any offered model's context, so a bound on what can be typed, not a setting; the model's own context
is checked where the prompt is built (:func:`build_prompt`)."""


def check_lengths(lengths: Sequence[int]) -> list[int]:
    """Context lengths a request names, each a whole number of tokens from 1 to :data:`MAX_LENGTH`."""
    out = []
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LENGTH:
            if isinstance(n, int) and not isinstance(n, bool):
                given = f"{n:,}" if len(str(n)) <= 12 else f"{str(n)[:12]}… ({len(str(n)):,} digits)"
            else:
                given = shown(n)
            raise InputError(f"Context lengths must be whole numbers of tokens from 1 to {MAX_LENGTH:,}, got {given}.")
        out.append(n)
    if not out:
        raise InputError("Give at least one context length.")
    return out


def check_streaming_window(sink: int, window: int, lengths: Sequence[int]) -> None:
    """Refuse a streaming score's sink size S and window W that leave no query row to score.

    The streaming score (:mod:`headscope.analysis.streaming`) reads the query rows after the first S + W
    positions, so a prompt of at most ``min(lengths)`` tokens has none when S + W reaches it: every
    head's score would be blank. The Heads page and ``headscope scan`` both ask this.
    """
    shortest = min(lengths)
    if sink + window >= shortest:
        raise InputError(f"S + W = {sink + window:,} leaves no query rows to score in a {shortest:,}-token prompt "
                         "(the streaming score reads the rows after the first S + W): lower S or W, or use "
                         "longer context lengths.")


HAYSTACK_NAMES = ("prose", "passkey")


def named_haystack(name: str) -> str:
    """A shipped haystack by name: ``prose`` (the shipped essays) or ``passkey`` (synthetic filler).

    This is what a request may ask for: anything else, paths included, is refused with the names on
    offer (own text reaches a sweep as content, never as a path). Leading lines that start with ``#``
    are a header (the shipped file's provenance and licence) and are dropped.
    """
    if name == "passkey":
        return passkey_filler(2000)
    if not isinstance(name, str) or name not in HAYSTACKS:
        raise InputError(f"Unknown haystack {str(name)[:40]!r}: choose one of {', '.join(HAYSTACK_NAMES)}, "
                         "or paste or upload your own text.")
    return _without_header(HAYSTACKS[name].read_text(encoding="utf-8"))


def load_haystack(name: str = "prose") -> str:
    """A haystack by name (:func:`named_haystack`) or, for the command line only, a UTF-8 text file.

    A server never calls this with a request's value: it would read any file the server can read.
    """
    if name in HAYSTACK_NAMES:
        return named_haystack(name)
    path = Path(name).expanduser()
    if not path.is_file():
        raise InputError(
            f"Unknown haystack {name!r}: use 'prose', 'passkey' or the path of a UTF-8 text file."
        )
    return _without_header(path.read_text(encoding="utf-8"))


def _without_header(text: str) -> str:
    # Leading lines starting with "#" are a header (provenance, licence), not haystack.
    lines = text.splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines).lstrip("\n")


PASSKEY_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


def passkey_filler(n_sentences: int) -> str:
    """The passkey test's filler: "The grass is green. The sky is blue. The sun is yellow. Here we go.
    There and back again." repeated (Mohtashami & Jaggi 2023, arXiv:2305.16300, appendix).

    Parameters
    ----------
    n_sentences : number of sentences (the five sentences cycle); about 5 tokens each.

    Returns
    -------
    The filler text, sentences separated by single spaces, a paragraph break after every cycle.
    """
    if n_sentences < 1:
        raise InputError("The passkey filler needs at least one sentence.")
    parts = []
    for i in range(n_sentences):
        sep = "" if i == 0 else ("\n" if i % len(PASSKEY_SENTENCES) == 0 else " ")
        parts.append(sep + PASSKEY_SENTENCES[i % len(PASSKEY_SENTENCES)])
    return "".join(parts)


def split_sentences(text: str) -> list[str]:
    """Cut ``text`` at sentence boundaries; ``"".join(pieces) == text``.

    Every piece but the first starts with the whitespace that preceded it, so a piece tokenises the
    same alone as inside the whole text (byte-level BPE attaches a leading space to the next word).
    """
    pieces = [p for p in _BOUNDARY.split(text) if p]
    return pieces


# ---------------------------------------------------------------------------------------------
# Building


_piece_lengths: dict[tuple[int, str], list[int]] = {}


def _haystack_pieces(model: LoadedModel, haystack: str) -> tuple[list[str], list[int]]:
    """Sentences of ``haystack`` and their token counts (memoised per tokenizer and text)."""
    pieces = split_sentences(haystack.strip())
    key = (id(model.tokenizer), hashlib.sha256(haystack.encode()).hexdigest())
    if key not in _piece_lengths:
        if len(_piece_lengths) > 32:
            _piece_lengths.clear()
        ids = model.tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
        _piece_lengths[key] = [len(x) for x in ids]
    return pieces, _piece_lengths[key]


def _render(template: str, context: str, question: str) -> str:
    return template.replace("{context}", context).replace("{question}", question)


def prompt_text(model: LoadedModel, template: str, context: str, question: str) -> str:
    """The message the model reads: ``template`` filled in, then :data:`ANSWER_CUE` when the model has
    no chat template (its chat template's generation prompt is the cue otherwise)."""
    text = _render(template, context, question)
    return text if model.chat_template else text + ANSWER_CUE


def find_span(ids: Sequence[int], sub: Sequence[int]) -> list[int]:
    """Start positions of every occurrence of ``sub`` as a contiguous run in ``ids``."""
    n, m = len(ids), len(sub)
    if m == 0 or m > n:
        return []
    first = sub[0]
    sub = list(sub)
    return [i for i in range(n - m + 1) if ids[i] == first and list(ids[i : i + m]) == sub]


def locate(model: LoadedModel, token_ids: Sequence[int], text: str, what: str = "needle") -> tuple[int, int]:
    """The exact token span of ``text`` inside ``token_ids``.

    The text may be tokenised with or without the space before it (mid-line or at a line start);
    both spellings are searched. Exactly one occurrence must exist.

    Raises
    ------
    InputError
        When no contiguous run of tokens spells exactly ``text`` (tokenisation merged it with its
        neighbours) or when it occurs more than once.
    """
    text = text.strip()
    spans = set()
    for variant in (text, " " + text):
        sub = model.encode(variant)
        for start in find_span(token_ids, sub):
            spans.add((start, start + len(sub)))
    if not spans:
        raise InputError(
            f"The {what} {text[:60]!r} cannot be located exactly in the prompt's tokens: tokenisation "
            "merges its first or last token with the text around it. End the needle with a full stop "
            "and start it with a word, or move it to another depth."
        )
    if len(spans) > 1:
        raise InputError(
            f"The {what} {text[:60]!r} occurs {len(spans)} times in the prompt (the haystack contains "
            "it); use a needle that the haystack does not contain."
        )
    return spans.pop()


def build_prompt(
    model: LoadedModel,
    needle: Needle,
    haystack: str,
    length: int,
    depth: float,
    *,
    template: str = DEFAULT_TEMPLATE,
    depth_rule: str = DEFAULT_DEPTH_RULE,
) -> NiahPrompt:
    """Hide ``needle`` at ``depth`` percent of a haystack cut to ``length`` tokens, then ask.

    Follows Wu et al. 2024 (arXiv:2404.15574), section 2: the prompt is
    ``chat(template(context = haystack[:d] + needle + haystack[d:], question))`` (for a model without
    a chat template: ``BOS? + template(...) + "\nAnswer:"``, :func:`prompt_text`) with
    ``|prompt| <= length`` tokens and ``d`` the sentence boundary nearest to ``depth``% of the
    haystack's tokens (``depth_rule="nearest"``) or the last one at or before it (``"previous"``).

    Parameters
    ----------
    model : the model whose tokenizer and chat template are used (``model.chat_ids``).
    needle : the sentence to hide and its question.
    haystack : the filler text (see :func:`load_haystack`); repeated when too short.
    length : maximum prompt length in tokens, at most the model's context.
    depth : where the needle goes, in percent of the haystack (0 = start, 100 = end).
    template : user message with ``{context}`` and ``{question}``.
    depth_rule : one of :data:`DEPTH_RULES`.

    Returns
    -------
    :class:`NiahPrompt` with the exact token spans of the needle and the question.

    Raises
    ------
    InputError
        depth outside 0–100, length above the model's context or too short for the needle and the
        question, an empty haystack or needle, or a needle that cannot be located exactly.
    """
    length = _check_prompt_args(model, needle, haystack, length, depth, template, depth_rule)
    needle_text = needle.needle.strip()
    if needle_text in haystack:
        raise InputError(
            f"The haystack already contains the needle {needle_text[:60]!r}; choose another needle."
        )

    overhead = len(model.chat_ids(prompt_text(model, template, needle_text, needle.question.strip())))
    budget = length - overhead
    if budget < 1:
        raise InputError(
            f"length {length} is too short: the template, needle and question alone take {overhead} tokens."
        )
    pieces, lengths = _haystack_pieces(model, haystack)
    if not pieces:
        raise InputError("The haystack has no sentences.")

    chosen, chosen_len = _fill(pieces, lengths, budget)
    # the joined text may tokenise slightly longer than the sum of its pieces: trim a sentence at a time
    while True:
        prompt = _assemble(model, needle, chosen, chosen_len, depth, template, length, depth_rule)
        if prompt.n_tokens <= length or not chosen:
            break
        chosen.pop()
        chosen_len.pop()
    if prompt.n_tokens > length:
        raise InputError(
            f"length {length} is too short: the prompt without any haystack has {prompt.n_tokens} tokens."
        )
    return prompt


def _check_prompt_args(model: LoadedModel, needle: Needle, haystack: str, length: int, depth: float,
                       template: str, depth_rule: str) -> int:
    """The checks of :func:`build_prompt` (see its Raises); ``length`` as an int."""
    if not 0.0 <= float(depth) <= 100.0:
        raise InputError(f"depth must be between 0 and 100 (percent of the haystack), got {depth}.")
    if depth_rule not in DEPTH_RULES:
        raise InputError(f"Unknown depth rule {depth_rule!r}: choose one of {', '.join(DEPTH_RULES)}.")
    length = int(length)
    if length > model.n_ctx:
        raise InputError(
            f"length {length:,} is above the model's context of {model.n_ctx:,} tokens; choose a shorter length."
        )
    if not haystack or not haystack.strip():
        raise InputError("The haystack is empty: give some filler text (or use 'prose' or 'passkey').")
    for field_name in ("needle", "question", "answer"):
        if not getattr(needle, field_name).strip():
            raise InputError(f"The needle's {field_name} is empty.")
    if "{context}" not in template or "{question}" not in template:
        raise InputError("The template must contain {context} and {question}.")
    return length


def _fill(pieces: list[str], lengths: list[int], budget: int) -> tuple[list[str], list[int]]:
    """Whole haystack sentences, cycling through ``pieces`` (of ``lengths`` tokens), until ``budget``
    tokens are used; a blank line before each new cycle. Returns the sentences and their lengths."""
    chosen: list[str] = []
    chosen_len: list[int] = []
    total = 0
    i = 0
    while True:
        k = i % len(pieces)
        piece, n = pieces[k], lengths[k]
        if k == 0 and i > 0:
            piece = "\n\n" + piece.lstrip()
            n += 1
        if total + n > budget:
            break
        chosen.append(piece)
        chosen_len.append(n)
        total += n
        i += 1
        if i > 10 * (budget + 1):  # zero-length pieces cannot occur, but never loop forever
            break
    return chosen, chosen_len


def _assemble(
    model: LoadedModel,
    needle: Needle,
    chosen: list[str],
    chosen_len: list[int],
    depth: float,
    template: str,
    length: int,
    depth_rule: str = DEFAULT_DEPTH_RULE,
) -> NiahPrompt:
    total = sum(chosen_len)
    # The boundary whose cumulative token count is nearest to depth% of the haystack (or the last
    # one at or before it).
    target = float(depth) / 100.0 * total
    cum = [0]
    for n in chosen_len:
        cum.append(cum[-1] + n)
    # Only boundaries after a full sentence (not after a title line) are candidates.
    candidates = [0] + [j for j in range(1, len(cum)) if chosen[j - 1].rstrip().endswith(_SENTENCE_END)]
    if depth_rule == "previous":
        b = max(j for j in candidates if cum[j] <= target)  # 0 is always a candidate
    else:
        b = min(candidates, key=lambda j: (abs(cum[j] - target), j))
    before = "".join(chosen[:b]).strip()
    after = "".join(chosen[b:])
    needle_text = needle.needle.strip()
    context = (before + " " if before else "") + needle_text
    if after.strip():
        context += after if after[0].isspace() else " " + after
    context = context.strip()
    question = needle.question.strip()
    text = prompt_text(model, template, context, question)
    ids = model.chat_ids(text)
    needle_span = locate(model, ids, needle_text, "needle")
    question_span = locate(model, ids, question, "question")
    return NiahPrompt(
        token_ids=ids,
        needle_span=needle_span,
        question_span=question_span,
        needle=needle,
        length=length,
        depth=float(depth),
        actual_depth=100.0 * cum[b] / total if total else 0.0,
        haystack_tokens=total,
        text=text,
        depth_rule=depth_rule,
    )
