"""The per-iteration report of the Megatron-LM path: clock, FLOPs, writers."""

from megatron_zeppelin.integration.step_report import (IterationReport, IterationReports, StepClock, format_report,
                                                        step_model_flops, write_report)
from megatron_zeppelin.model_config import load_model


def test_clock_ends_an_iteration_at_the_first_evaluation_batch():
    times = iter([0.0, 4.0, 9.0, 12.0])
    clock = StepClock(lambda: next(times))
    assert clock.training_batch() is None          # t=0: the first batch of the process
    clock.other_batch()                            # t=4: evaluation after iteration 1
    clock.other_batch()                            # still evaluating: reads no clock
    assert clock.training_batch() == 4.0           # t=9: iteration 1 took 0..4
    assert clock.training_batch() == 3.0           # t=12: iteration 2 took 9..12


def test_model_flops_count_real_tokens_and_causal_pairs():
    m = load_model("tiny")
    flops = step_model_flops(m, tokens=100, pairs=1000)
    assert flops == 3 * (100 * m.linear_flops_per_token + 1000 * m.attn_flops_per_pair)


class _Writer:
    def __init__(self):
        self.seen = {}

    def add_scalar(self, name, value, step):
        self.seen[name] = (value, step)

    def log(self, scalars, step):
        self.seen.update({k: (v, step) for k, v in scalars.items()})


def test_report_line_and_writers():
    r = IterationReport(iteration=7, tokens=2000, causal_pairs=50_000, remap_bytes=123456, seconds=0.5,
                        world_size=4, model_flops=2e12)
    assert format_report(r) == "remap_bytes=123456 4000.0 tokens/s, 1 TFLOP/s/GPU"
    tensorboard, wandb = _Writer(), _Writer()
    write_report(r, (tensorboard, wandb))
    assert tensorboard.seen["zeppelin/remap-bytes"] == (123456, 7) == wandb.seen["zeppelin/remap-bytes"]
    assert tensorboard.seen["zeppelin/tflops-per-gpu"] == (1.0, 7)
    first = IterationReport(7, 2000, 50_000, 0, None, 4, 2e12)
    assert format_report(first).startswith("remap_bytes=0 ")
    write_report(first, (None, None))  # a rank without writers


def _micro_batch(index, tokens, remap_bytes):
    """A handed-out micro-batch of global batch ``index`` (one sequence) and its step context."""
    from types import SimpleNamespace

    from megatron_zeppelin.plan import Plan

    plan = SimpleNamespace(seq_lens=[tokens])
    assert not isinstance(plan, Plan)  # report_iteration reads seq_lens only
    prepared = SimpleNamespace(batch=SimpleNamespace(index=index, num_tokens=tokens), plan=plan)
    return prepared, SimpleNamespace(remap_counters=SimpleNamespace(total=remap_bytes))


def _reports(pipelined, sums, emitted, notes=None):
    times = iter(range(0, 100, 2))
    world = 4  # four ranks that counted the same bytes
    reduce = lambda values: (sums.append(list(values)), [v * world for v in values])[1]  # noqa: E731
    return IterationReports(1, load_model("tiny"), StepClock(lambda: float(next(times))), reduce,
                            pipelined=pipelined, emit=lambda parts, r: emitted.append((len(parts), r)),
                            note=(notes if notes is not None else []).append)


def test_an_iteration_of_several_micro_batches_is_reported_once():
    """Two micro-batches per global batch: one report per iteration, with the tokens,
    causal pairs and remap bytes of both (summed over the ranks at the next hand-off)."""
    sums, emitted = [], []
    reports = _reports(False, sums, emitted)
    for index, tokens, remap in ((0, 10, 100), (0, 20, 50), (1, 5, 7), (1, 5, 7), (2, 1, 1)):
        reports.training_batch(*_micro_batch(index, tokens, remap))
    assert sums == [[150, 1], [14, 1]]
    (parts0, r0), (parts1, r1) = emitted
    assert (parts0, r0.iteration, r0.tokens, r0.remap_bytes, r0.world_size, r0.seconds) == (2, 1, 30, 600, 4, 2.0)
    assert r0.causal_pairs == 10 * 11 // 2 + 20 * 21 // 2
    assert (parts1, r1.iteration, r1.tokens, r1.remap_bytes) == (2, 2, 10, 56)


def test_under_pipeline_parallelism_the_sum_is_taken_after_the_schedule():
    """Under PP the hand-offs happen inside 1F1B: no collective there; each iteration's
    bytes are summed in after_schedule (once the schedule is over) and reported at the
    next hand-off.  An iteration whose schedule never ran the hook is named, not
    reported with a made-up sum."""
    sums, emitted, notes = [], [], []
    reports = _reports(True, sums, emitted, notes)
    reports.training_batch(*_micro_batch(0, 10, 100))
    reports.training_batch(*_micro_batch(0, 20, 50))
    assert sums == []
    reports.after_schedule()
    assert sums == [[150, 1]] and emitted == []
    reports.training_batch(*_micro_batch(1, 5, 7))
    assert sums == [[150, 1]] and [(n, r.remap_bytes) for n, r in emitted] == [(2, 600)]
    reports.training_batch(*_micro_batch(2, 5, 7))  # iteration 2's schedule never called after_schedule
    assert len(emitted) == 1 and notes and "no report for iteration 2" in notes[0]
