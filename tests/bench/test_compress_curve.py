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


SETTINGS = {"tasks": "single_needle,passkey", "per_task": 50, "min_rate": 0.5, "sink": 128, "recent": 256,
            "sweep_length": 1024, "backend": "statistics"}


def test_runs_merge_only_when_they_are_the_same_curve(bench, capsys):
    def printed(base_k, points, **settings):
        bench._print_panel(bench._panel(_curve(base_k, 100, points), 2048), 100)
        return {**SETTINGS, **settings}, bench.parse_results(capsys.readouterr().out)

    a = printed(97, [("retrieval", 0.25, 64)])
    b = printed(97, [("streaming", 0.25, 30), ("retrieval", 0.25, 64)])
    merged = bench.merge([a, b], ["a", "b"])[2048]
    assert sorted((p.ranking, p.niah.successes) for p in merged.points) == [("retrieval", 64), ("streaming", 30)]
    assert len(a[1][2048].points) == 1  # merging copies, the first run's panel is left as parsed
    with pytest.raises(ValueError, match="uncompressed baseline is 0.96"):
        bench.merge([a, printed(96, [])], ["a", "c"])
    with pytest.raises(ValueError, match="retrieval 0.25 seed None at 2048 tokens answered 63/100"):
        bench.merge([a, printed(97, [("retrieval", 0.25, 63)])], ["a", "d"])
    with pytest.raises(ValueError, match="answered 64/100 at KV 0.3"):  # the same answers at another KV fraction
        bench.merge([a, printed(97, [("retrieval", 0.25, 64, None, 0.3)])], ["a", "e"])
    # the same baseline is not enough: other windows or another ranking sweep are another curve
    with pytest.raises(ValueError, match="f was run with other settings than a: recent 512 against 256"):
        bench.merge([a, printed(97, [("streaming", 0.25, 30)], recent=512)], ["a", "f"])


def test_the_settings_are_read_from_the_runs_command_line_with_its_defaults(bench):
    text = SHIPPED.read_text()
    assert bench.run_settings(text) == SETTINGS
    with pytest.raises(ValueError, match="no '# bench/compress_curve.py"):
        bench.run_settings(text.replace("# bench/compress_curve.py", "# something else"))
    with pytest.raises(ValueError, match="a merged table"):
        bench.run_settings("# bench/compress_curve.py --from-results a.txt,b.txt\n")


@pytest.mark.parametrize("edit, said", [
    # a baseline this script cannot read must not let the next rows land in the previous length's table
    (("4096 tokens: uncompressed NIAH 0.93 [0.86, 0.97] n=100, loss 3.5458",
      "4096 tokens: uncompressed NIAH 0.93 [0.86, 0.97] n=100, loss ?"), "an uncompressed line this script cannot read"),
    (("retrieval            0.25   0.325    0.25 [0.18, 0.34] n=100  3.5602",
      "retrieval            0.25   0.325    0.25 [0.18, 0.34] n=100  3.56x"), "a policy row this script cannot read"),
    (("0.64 [0.54, 0.73] n=100", "0.64 [0.60, 0.73] n=100"), r"64/100 gives \[0.54, 0.73\], not the printed \[0.60, 0.73\]"),
    (("0.64 [0.54, 0.73] n=100  3.5602", "0.64 [0.54, 0.73] n=100   64/99  3.5602"), "64/99 answered, but n=100"),
    (("0.64 [0.54, 0.73] n=100  3.5602", "0.64 [0.54, 0.73] n=100   66/100  3.5602"), "66/100 is 0.6600, not the printed 0.64"),
    (("4096 tokens:", "2048 tokens:"), "a second table at 2048 tokens"),
])
def test_a_table_that_does_not_read_back_is_refused_not_skipped(bench, edit, said):
    text = SHIPPED.read_text()
    assert edit[0] in text
    with pytest.raises(ValueError, match=said):
        bench.parse_results(text.replace(edit[0], edit[1], 1), "edited")


def test_memory_for_a_length_without_a_table_is_refused(bench):
    with pytest.raises(ValueError, match="memory at 4096 tokens, which has no table above it"):
        bench.parse_results("  cache backend at 4096 tokens, 1.00 of groups full: 180.0 MiB kept (191.2 allocated), "
                            "180.0 MiB counted\n")


def test_from_results_prints_the_merged_curve_and_refuses_bad_files_with_a_message(bench, tmp_path, capsys):
    older = SHIPPED.parent / "compress_curve_cpu_2026-12-05b.txt"  # the 2k policies, the same run settings
    bench.main(["--from-results", f"{SHIPPED},{older}"])
    out = capsys.readouterr().out
    assert "2048 tokens: uncompressed NIAH 0.97 [0.92, 0.99] n=100 (97/100)" in out
    assert out.count("smallest fraction whose interval reaches the uncompressed one, retrieval: none") == 2
    (tmp_path / "empty.txt").write_text("# bench/compress_curve.py --lengths 2048\nno table here\n")
    for given in [str(tmp_path / "absent.txt"), f"{SHIPPED},{tmp_path / 'empty.txt'}"]:
        with pytest.raises(SystemExit) as stop:
            bench.main(["--from-results", given])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert ("absent.txt" in err or "no curve table in it" in err) and "Traceback" not in err
