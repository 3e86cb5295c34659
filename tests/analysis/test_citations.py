"""Each formula credits the work it comes from, where a reader looks for it (the analysis docstring,
the page, the README), and what headscope adds of its own says so (#38 item 23):

- norm-based attention ``‖Σ_h α f(x)‖`` is Kobayashi et al. 2020 (EMNLP 2020, arXiv:2004.10102);
  running rollout on it combines that with Abnar & Zuidema 2020, which neither paper defines;
- the position correction of rollout and flow (÷ uniform causal attention) is headscope's own;
- "all streaming" keeps StreamingLLM's sinks and window but not its positions: StreamingLLM
  renumbers positions within its cache, headscope keeps the positions the model saw."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _docstring(path: str) -> str:
    return ast.get_docstring(ast.parse((ROOT / path).read_text())) or ""


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_value_weighted_rollout_credits_the_norms_to_2020_and_the_combination_to_headscope():
    doc = _flat(_docstring("analysis/value_norms.py"))
    assert "Attention is Not Only a Weight: Analyzing Transformers with Vector Norms" in doc and "EMNLP 2020" in doc
    assert "2021" not in doc and "2109.07152" not in doc
    assert "headscope's own" in doc and "Abnar & Zuidema" in doc
    readme = _flat((ROOT / "README.md").read_text())
    assert "Kobayashi et al. 2021" not in readme and "2109.07152" not in readme
    assert "value-weighted rollout (rollout on the norms: headscope's own combination)" in readme


def test_the_position_correction_is_said_to_be_headscopes_own():
    assert "headscope's own" in _flat(_docstring("analysis/position_bias.py"))
    flow_page = _flat((ROOT / "app/pages/flow.py").read_text())
    assert "This correction is headscope's own" in flow_page
    assert "position-corrected** (headscope's own correction, not from Abnar & Zuidema)" in _flat(
        (ROOT / "README.md").read_text())


def test_all_streaming_says_positions_are_kept_not_renumbered():
    from headscope.analysis.kv_compression_choices import RANKING_LABELS

    label = RANKING_LABELS["all_streaming"]
    assert "StreamingLLM" in label and "positions kept" in label, label
    doc = _flat(_docstring("analysis/kv_compression.py"))
    assert "renumbers" in doc and "positions the model saw" in doc
    readme = _flat((ROOT / "README.md").read_text())
    assert "all streaming = StreamingLLM" not in readme
    assert "StreamingLLM renumbers them within its cache" in readme
