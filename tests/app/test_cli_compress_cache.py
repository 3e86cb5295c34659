"""``headscope compress --backend cache``: the policies run on caches as small as they say, with the
numbers of the masking backends (#42 item 1)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.mark.timeout(900)  # a sweep and two policy sets at 256 tokens; minutes under load
def test_compress_on_the_cache_backend_gives_the_masks_numbers(tmp_path, real_model, capsys, monkeypatch):
    from headscope.app.cli import main

    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    common = ["compress", "--lengths", "256", "--depths", "50", "--needles", "locker-code", "--sink", "16",
              "--recent", "64", "--fractions", "0.5", "--rankings", "retrieval,all_streaming"]
    home = ["--home", str(tmp_path / "home")]
    assert main([*home, *common, "--backend", "eager", "--out", str(tmp_path / "eager")]) == 0
    assert main([*home, *common, "--backend", "cache", "--out", str(tmp_path / "cache")]) == 0
    capsys.readouterr()
    eager = json.loads((tmp_path / "eager" / "summary.json").read_text())
    cache = json.loads((tmp_path / "cache" / "summary.json").read_text())
    assert (eager["backend"], cache["backend"]) == ("eager", "cache")
    for a, b in zip([eager["baseline"], *eager["rows"]], [cache["baseline"], *cache["rows"]], strict=True):
        assert (a["ranking"], a["kv_bytes"], a["agreement"], a["niah_accuracy"]) == \
            (b["ranking"], b["kv_bytes"], b["agreement"], b["niah_accuracy"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)


def test_an_unknown_backend_is_a_usage_error(tmp_path, capsys):
    from headscope.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--home", str(tmp_path / "home"), "compress", "--backend", "kvpress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'kvpress'" in err and "cache" in err and "Traceback" not in err
