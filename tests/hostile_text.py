"""Texts a user may type or a link may carry, as Hypothesis strategies for the property-based tests of the
analysis boundaries (tests/analysis/test_fuzz_inputs.py) and the command line (tests/app/test_fuzz_cli.py):
zero-width and bidi controls, emoji, control characters, lone surrogates (what undecodable bytes on a
command line become) and markup, among plain Unicode."""

from __future__ import annotations

from hypothesis import strategies as st

ODD = st.sampled_from(["\u200b", "\u200e", "\u202e", "\u2066", "\ufeff", "\U0001F600", "\U0001F469\u200d\U0001F52C",
                       "\x00", "\x07", "\x1b[31m", "\ud800", "\udcff", "é", "ﬁ", "\u0301", "𝔘", "<script>", " "])
TEXT = st.lists(st.one_of(st.text(max_size=20), ODD), max_size=12).map("".join)
