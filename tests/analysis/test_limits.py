"""Limits come from the environment, fall back to their defaults on bad values, and every message
that reports one names its variable."""

import base64

import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.limits import DEFAULTS, hint, limit


def test_limits_read_the_environment_at_check_time(monkeypatch):
    monkeypatch.setenv("HEADSCOPE_MAX_SWEEP_TRIALS", "7")
    assert limit("HEADSCOPE_MAX_SWEEP_TRIALS") == 7
    assert "HEADSCOPE_MAX_SWEEP_TRIALS" in hint("HEADSCOPE_MAX_SWEEP_TRIALS") and "7" in hint("HEADSCOPE_MAX_SWEEP_TRIALS")
    for bad in ("lots", "-3", "0"):
        monkeypatch.setenv("HEADSCOPE_MAX_SWEEP_TRIALS", bad)
        assert limit("HEADSCOPE_MAX_SWEEP_TRIALS") == DEFAULTS["HEADSCOPE_MAX_SWEEP_TRIALS"]


def test_a_sweep_over_the_trial_limit_is_refused_before_any_work(tiny_model, monkeypatch):
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep

    monkeypatch.setenv("HEADSCOPE_MAX_SWEEP_TRIALS", "5")
    with pytest.raises(InputError, match="6 trials.*HEADSCOPE_MAX_SWEEP_TRIALS"):
        sweep(tiny_model, load_needles()[:2], [128], [10, 50, 90], load_haystack("passkey"))


def test_uploads_over_the_limit_or_not_text_say_why(monkeypatch):
    from headscope.app.uploads import upload_text

    def url(data: bytes) -> str:
        return "data:text/plain;base64," + base64.b64encode(data).decode()

    assert upload_text(url(b"hello\nworld"), "a.txt", "text") == "hello\nworld"
    monkeypatch.setenv("HEADSCOPE_MAX_UPLOAD_BYTES", "10")
    with pytest.raises(InputError, match="11 bytes.*HEADSCOPE_MAX_UPLOAD_BYTES"):
        upload_text(url(b"x" * 11), "big.txt", "text")
    monkeypatch.delenv("HEADSCOPE_MAX_UPLOAD_BYTES")
    for data, why in [(b"\xff\xfe\x00bad", "not UTF-8"), (b"   \n", "no readable text"), (b"a\x00b", "no readable")]:
        with pytest.raises(InputError, match=why):
            upload_text(url(data), "f.bin", "text")
    with pytest.raises(InputError, match="could not be read"):
        upload_text("not a data url", "f", "text")


@pytest.mark.parametrize("raw", ["١٦", "１６", "1_000", "1e3", "16.5", "0x10", "+16", "9" * 19, "9" * 5000, "", " "])
def test_a_limit_written_other_than_in_ascii_digits_is_the_default(monkeypatch, raw):
    """Python's int() reads Arabic-Indic and fullwidth digits, underscores and a sign: a limit does not,
    so what the operator wrote is what bounds the request, or the default does."""
    monkeypatch.setenv("HEADSCOPE_MAX_PATCH_TOKENS", raw)
    assert limit("HEADSCOPE_MAX_PATCH_TOKENS") == DEFAULTS["HEADSCOPE_MAX_PATCH_TOKENS"] == 2048


def test_a_limit_in_ascii_digits_is_read_with_its_spaces_trimmed(monkeypatch):
    monkeypatch.setenv("HEADSCOPE_MAX_PATCH_TOKENS", " 16\n")
    assert limit("HEADSCOPE_MAX_PATCH_TOKENS") == 16
    assert hint("HEADSCOPE_MAX_PATCH_TOKENS") == "(the limit is 16; set HEADSCOPE_MAX_PATCH_TOKENS to change it)"
