"""The per-iteration report of the Megatron-LM path: clock, FLOPs, writers."""

from megatron_zeppelin.integration.step_report import (IterationReport, StepClock, format_report,
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
