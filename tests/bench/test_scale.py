"""bench/scale.py's dry run: the GPU script's whole path (model built and wrapped, SDPA and statistics-mode
passes, one layer's attention timings, a retrieval trial) on tiny shapes on the CPU, so it is known to run
before a GPU is lent."""

import importlib.util
import re
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "scale.py"


def test_the_dry_run_prints_every_table_with_parity(capsys):
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    scale = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = scale  # its dataclasses look their module up there
    spec.loader.exec_module(scale)
    scale.main(["--dry-run"])
    out = capsys.readouterr().out
    rows = {(m[1], int(m[2])): m[3].split() for m in re.finditer(r"^(sdpa|stats)\s+(\d+)\s+(.*)$", out, re.M)}
    assert set(rows) == {(case, n) for case in ("sdpa", "stats") for n in (128, 256)}
    for n in (128, 256):
        seconds, _, tokens_per_s, ratio, diff = map(float, rows["stats", n])
        assert seconds > 0 and tokens_per_s > 0 and ratio > 0
        assert diff < 1e-4  # the statistics-mode pass gives the SDPA pass's logits (float32 on the CPU)
    attention_rows = re.findall(r"^\s+(128|256)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+n/a$", out, re.M)
    assert attention_rows == ["128", "256"]
    assert re.search(r"retrieval trial at 128 tokens: .* 3 steps .* same tokens True; argmax rows \(3, 2, 4\)", out)
