"""Built-in clean/corrupted prompt pairs for activation patching, shipped in ``data/patching/pairs.json``.

Three kinds, each a classic patching experiment:

- ``ioi``: indirect object identification with the second clause's subject swapped (Wang et al. 2022,
  "Interpretability in the Wild", arXiv:2211.00593): "When Mary and John …, John gave a drink to" →
  " Mary"; with "Mary gave", → " John".
- ``fact``: factual recall with the subject swapped (Meng et al. 2022, "Locating and Editing Factual
  Associations in GPT", arXiv:2202.05262): "The capital of France is" → " Paris" vs Italy → " Rome".
- ``induction``: an earlier copy of the answer replaced, so that copying it (Olsson et al. 2022,
  "In-context Learning and Induction Heads", arXiv:2209.11895) gives the other answer.

The file is ``{"version": 1, "pairs": [{"id", "kind", "clean", "corrupted", "answers": [A, B], "note"}]}``
with A the clean answer and B the corrupted one, single tokens written with their leading space. This
module imports nothing heavy, so the command line checks ``--pair`` before torch loads; the token-level
checks (equal lengths, single-token answers) are :func:`headscope.analysis.patching.prompt_pair`'s, and the test
on the embedded model checks that it answers every shipped pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headscope.analysis.errors import InputError, parse_json
from headscope.analysis.paths import DATA_DIR

PAIRS_FILE = DATA_DIR / "patching" / "pairs.json"
PAIR_KINDS = ("ioi", "fact", "induction")
PAIRS_VERSION = 1


@dataclass(frozen=True)
class PairSpec:
    """One built-in pair as written in the file (texts, not yet tokenised)."""

    id: str
    kind: str
    clean: str
    corrupted: str
    answers: tuple[str, str]
    note: str = ""


def load_pairs(path: Path | str | None = None) -> list[PairSpec]:
    """The pairs of ``data/patching/pairs.json`` (or another file of the same shape), in file order.

    Raises
    ------
    InputError
        The file cannot be read or is not JSON, or does not have the shape of the module docstring
        (the message names the pair and the field to fix).
    """
    path = Path(path) if path is not None else PAIRS_FILE
    try:
        raw = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"Cannot read prompt pairs from {path}: {e}") from None
    return pairs_from(raw, str(path))


def pairs_from(raw: Any, where: str) -> list[PairSpec]:
    """Check the parsed JSON ``raw`` against the schema of the module docstring."""
    if not isinstance(raw, dict) or not isinstance(raw.get("pairs"), list):
        raise InputError(f"The prompt pairs in {where} must be an object with a list 'pairs' "
                         f"(and 'version': {PAIRS_VERSION}).")
    if raw.get("version") != PAIRS_VERSION:
        raise InputError(f"The prompt pairs in {where} have version {raw.get('version')!r}; this headscope reads "
                         f"version {PAIRS_VERSION}.")
    pairs: list[PairSpec] = []
    seen: set[str] = set()
    for i, item in enumerate(raw["pairs"]):
        if not isinstance(item, dict):
            raise InputError(f"Pair {i} in {where} must be an object with 'id', 'kind', 'clean', 'corrupted' "
                             f"and 'answers'.")
        name = item.get("id")
        label = f"Pair {i} ({name!r})" if isinstance(name, str) else f"Pair {i}"
        for field in ("id", "kind", "clean", "corrupted"):
            value = item.get(field)
            if not isinstance(value, str) or not value.strip():
                raise InputError(f"{label} in {where} needs a non-empty text '{field}'.")
        if item["kind"] not in PAIR_KINDS:
            raise InputError(f"{label} in {where} has kind {item['kind']!r}: use one of {', '.join(PAIR_KINDS)}.")
        answers = item.get("answers")
        if (not isinstance(answers, list) or len(answers) != 2
                or not all(isinstance(a, str) and a.strip() for a in answers)):
            raise InputError(f"{label} in {where} needs 'answers': the clean answer and the corrupted one, two "
                             f"non-empty texts (e.g. [\" Mary\", \" John\"]).")
        if item["id"] in seen:
            raise InputError(f"{label} in {where} repeats the id {item['id']!r}: ids must be unique.")
        note = item.get("note", "")
        if not isinstance(note, str):
            raise InputError(f"{label} in {where} has a 'note' that is not a text.")
        seen.add(item["id"])
        pairs.append(PairSpec(item["id"], item["kind"], item["clean"], item["corrupted"],
                              (answers[0], answers[1]), note))
    if not pairs:
        raise InputError(f"The prompt pairs in {where} are an empty list.")
    return pairs


def pair_by_id(pair_id: str, pairs: list[PairSpec] | None = None) -> PairSpec:
    """The built-in pair ``pair_id``; an :class:`InputError` listing the ids otherwise."""
    pairs = load_pairs() if pairs is None else pairs
    for p in pairs:
        if p.id == pair_id:
            return p
    raise InputError(f"No built-in prompt pair {pair_id!r}: choose one of {', '.join(p.id for p in pairs)}.")
