"""bench/compress_curve.py's --from-results: the curve in the README is drawn from the tables the runs
printed, so the parser must give back exactly what was printed, refuse runs that are not the same curve,
and decide "smallest fraction" by the Compress page's own rule."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from headscope.analysis.intervals import wilson
from headscope.analysis.kv_compression import CompressionCurve, KVMemory, Policy, PolicyEvaluation

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "bench" / "results" / "compress_curve_cpu_2026-12-05c.txt"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_compress_curve", ROOT / "bench" / "compress_curve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_compress_curve"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _evaluation(ranking, fraction, k, n, seed=None, kv=None):
    full = np.zeros((2, 2), dtype=bool)
    full.reshape(-1)[:round(fraction * 4)] = True
    kv = fraction if kv is None else kv
    return PolicyEvaluation(Policy(full, 4, 8, ranking, fraction, seed), KVMemory(100, int(1000 * kv), 1000),
                            2.5, 0.9, k / n, 0.0, n)


def _curve(base_k, n, points):
    return CompressionCurve([_evaluation(*p[:3], n, *p[3:]) for p in points], _evaluation("all_full", 1.0, base_k, n),
                            4, 8, 1, n, meta={"backend": "statistics"})


def test_the_shipped_results_parse_to_the_numbers_the_readme_gives(bench):
    panels = bench.parse_results(SHIPPED.read_text(), SHIPPED.name)
    assert set(panels) == {2048, 4096}
    short, long = panels[2048], panels[4096]
    assert (short.baseline.successes, short.baseline.n, short.backend) == (97, 100, "statistics")
    assert (long.baseline.successes, long.baseline.n) == (93, 100)
    got = {(p.ranking, p.fraction, p.seed): (p.niah.successes, p.kv_fraction) for p in long.points}
    assert got == {("retrieval", 0.25, None): (25, 0.325), ("random", 0.25, 0): (2, 0.325),
                   ("random", 0.25, 1): (30, 0.325), ("random", 0.25, 2): (2, 0.325)}
    assert len(short.points) == 7 and short.memory[1.0] == (90.0, 90.0) and long.memory[0.25] == (58.6, 58.6)
    # every interval is recomputed from the count, and it is the one printed
    assert short.points[0].niah == wilson(short.points[0].niah.successes, 100)


def test_a_printed_panel_parses_back_to_itself_even_past_two_decimals(bench, capsys):
    # 39/200 prints as 0.20 (or 0.19): only the printed count gives the prompts back
    curve = _curve(190, 200, [("retrieval", 0.25, 39), ("random", 0.25, 120, 0), ("random", 0.25, 121, 1)])
    panel = bench._panel(curve, 2048)
    bench._print_panel(panel, 200)
    back = bench.parse_results(capsys.readouterr().out)[2048]
    assert back.baseline == panel.baseline and back.backend == "statistics"
    assert [(p.ranking, p.seed, p.fraction, p.niah) for p in back.points] == \
        [(p.ranking, p.seed, p.fraction, p.niah) for p in sorted(panel.points, key=lambda p: (p.ranking, p.fraction, p.seed or 0))]


@pytest.mark.parametrize("points", [
    # uncompressed 97/100 = [0.915, 0.990]: 90/100 reaches it (high 0.945), 60/100 does not (high 0.691)
    [("retrieval", 0.25, 60), ("retrieval", 0.5, 90), ("retrieval", 0.75, 97)],
    [("retrieval", 0.1, 95, None, 0.2), ("retrieval", 0.5, 40)],  # the smallest passes, a larger one falls below
    [("random", 0.25, 96, 0), ("random", 0.25, 50, 1), ("random", 0.5, 95, 0), ("random", 0.5, 97, 1)],  # every seed
    [("streaming", 0.25, 10), ("evidence", 0.5, 20)],  # none passes
])
def test_smallest_reaching_is_the_compress_pages_rule_at_tolerance_zero(bench, points):
    curve = _curve(97, 100, points)
    panel = bench._panel(curve, 2048)
    for ranking in {p[0] for p in points}:
        page = curve.smallest_within(ranking, 0.0)
        mine = bench.smallest_reaching(panel, ranking)
        assert (None if page is None else (page.policy.fraction, page.policy.seed)) == \
            (None if mine is None else (mine.fraction, mine.seed))


def test_runs_merge_only_when_they_are_the_same_curve(bench, capsys):
    def printed(base_k, points):
        bench._print_panel(bench._panel(_curve(base_k, 100, points), 2048), 100)
        return bench.parse_results(capsys.readouterr().out)

    a = printed(97, [("retrieval", 0.25, 64)])
    b = printed(97, [("streaming", 0.25, 30), ("retrieval", 0.25, 64)])
    merged = bench.merge([a, b], ["a", "b"])[2048]
    assert sorted((p.ranking, p.niah.successes) for p in merged.points) == [("retrieval", 64), ("streaming", 30)]
    assert len(a[2048].points) == 1  # merging copies, the first run's panel is left as parsed
    with pytest.raises(ValueError, match="uncompressed baseline is 0.96"):
        bench.merge([a, printed(96, [])], ["a", "c"])
    with pytest.raises(ValueError, match="retrieval 0.25 seed None at 2048 tokens answered 63/100"):
        bench.merge([a, printed(97, [("retrieval", 0.25, 63)])], ["a", "d"])


def test_a_tampered_or_missing_results_file_is_refused_with_a_message(bench, tmp_path, capsys):
    text = SHIPPED.read_text().replace("0.64 [0.54, 0.73] n=100", "0.64 [0.60, 0.73] n=100")
    with pytest.raises(ValueError, match=r"64/100 gives \[0.54, 0.73\], not the printed \[0.60, 0.73\]"):
        bench.parse_results(text, "tampered")
    for given in [str(tmp_path / "absent.txt"), str(tmp_path / "empty.txt")]:
        (tmp_path / "empty.txt").write_text("no table here\n")
        with pytest.raises(SystemExit) as stop:
            bench.main(["--from-results", given])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "--from-results" in err or "absent.txt" in err
        assert "Traceback" not in err
