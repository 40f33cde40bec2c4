"""benchmarks/published_kernels.py: the published points hold the cost model's curve, every
preset it names carries its fit, and --check names a preset that does not."""

from __future__ import annotations

import pytest

from tests.benchmarks.scripts import load_script

pk = load_script("published_kernels")
from attn_calibration import FIT_TOLERANCE  # noqa: E402  (beside it, on the path load_script set)


@pytest.mark.parametrize("series", pk.SERIES, ids=[s.name for s in pk.SERIES])
def test_every_published_series_holds_the_curve(series):
    curve = series.fit()
    assert 0 < curve.efficiency <= 1 and curve.half_block > 0
    assert len(series.tflops) == len(pk.LENGTHS) and series.worst_error() <= FIT_TOLERANCE


def test_every_preset_carries_its_fit():
    assert pk.preset_mismatches() == []
    assert {p.series for p in pk.PRESETS} <= set(pk.BY_NAME)
    assert all(pk.BY_NAME[p.series].causal for p in pk.PRESETS)   # a local sequence is causal


def test_forward_and_backward_figures_add_as_times():
    # 1 FLOP forward at 100/s and 2.5 FLOPs backward at 50/s take 0.01 + 0.05 s: 3.5 / 0.06.
    (combined,) = pk.forward_backward((100.0,), (50.0,))
    assert combined == pytest.approx(3.5 / 0.06)
    assert pk.forward_backward((300.0,), (300.0,)) == pytest.approx((300.0,))


def test_check_names_a_preset_that_differs(monkeypatch, capsys):
    wrong = pk.PresetFit("h100-8x400g", "fa2-a100-causal-d128", "a deliberately wrong series")
    monkeypatch.setattr(pk, "PRESETS", (wrong,))
    assert pk.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "h100-8x400g: attn_efficiency 0.337, attn_half_block 532; the fit to fa2-a100-causal-d128 gives 0.62, 484" in out
    assert out.strip().splitlines()[-1] == "published_kernels: series=8 presets=1 differing=1"
