"""benchmarks/published_settings.py on its smallest subset: rows, ratios, last line."""

from __future__ import annotations

import re

from tests.benchmarks.scripts import BENCHMARKS, load_script

REPO = BENCHMARKS.parent


def load():
    return load_script("published_settings")


def test_quick_subset_prints_every_row_and_the_summary_line(capsys):
    bench = load()
    outcome = bench.main(["--quick", "--steps", "1", "--time-limit", "0.2",
                       "--zeppelin-lengths", str(REPO / "configs" / "lengths" / "synthetic-longtail.npy")])
    out = capsys.readouterr().out.strip().splitlines()
    rows = outcome.rows
    counted = [r for r in rows if r.ratio is not None]
    assert len(counted) == 8            # 2 FlexSP speedups, 2 all-to-all shares, 4 Zeppelin figures
    for r in counted:
        assert r.ratio == r.modeled / r.published
        assert r.within == (abs(r.ratio - 1) <= 0.25)
        assert r.within or r.term, r     # every row off by more than 25 % names its term
    m = re.fullmatch(r"published: rows=(\d+) within_25pct=(\d+) worst_ratio=([\d.]+)", out[-1])
    assert m and int(m[1]) == 8 and int(m[2]) == sum(r.within for r in counted)
    worst = max(max(r.ratio, 1 / r.ratio) for r in counted)
    assert float(m[3]) == round(worst, 2)
    shares = {r.metric: r.modeled for r in rows if "share" in r.metric}
    assert 0 < shares["FlexSP all-to-all share"] < shares["DeepSpeed SP=64 all-to-all share"] < 1
    # The ring floor is a lower bound of Megatron's replayed step, and the
    # layout is one the TP x CP search reports.
    (setting, layout, mega, floor, flex, what_if), = outcome.megatron_notes
    assert layout.startswith("TP=") and 0 < floor < mega and flex > 0
    assert what_if is None                  # 192K: the search's layout already holds it at TP=8 x CP=4
