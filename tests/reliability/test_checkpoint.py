"""Checkpoints survive a writer killed at any byte; a damaged one is one clear line."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal

import pytest
import torch

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.train import checkpoint
from megatron_zeppelin.train.checkpoint import LATEST, latest_path, load_state, save_state


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"step": step, "shards": {"tp0-ep0": {"model": {"w": torch.randn(64, 64, generator=g)},
                                                 "optimizer": {"lr": 0.1 * step}}},
            "layout": {"tp": 1, "ep": 1}, "sampler": {"epoch": 0, "offset": step, "carried": []}, "strategy": "zeppelin",
            "model_preset": "tiny", "shape": {"--strategy": "zeppelin"}}


def same(a: dict, b: dict) -> bool:
    weights = [s["shards"]["tp0-ep0"]["model"]["w"] for s in (a, b)]
    return a["step"] == b["step"] and torch.equal(*weights) and a["sampler"] == b["sampler"]


def _killed_save(directory, step: int, offset: int | None) -> None:
    """Save ``state(step)``, SIGKILLed after ``offset`` bytes of the checkpoint
    (None: after the checkpoint's rename, while ``latest`` is rewritten)."""
    real_save, real_replace = torch.save, os.replace

    def partial_save(obj, f):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[:offset])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def replace_then_die(src, dst):
        real_replace(src, dst)
        if str(dst).endswith(".pt"):
            os.kill(os.getpid(), signal.SIGKILL)

    if offset is None:
        checkpoint.os.replace = replace_then_die
    else:
        checkpoint.torch.save = partial_save
    save_state(directory, state(step))


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.5, 0.999, 1.0, None])
def test_a_save_killed_at_any_point_leaves_the_previous_checkpoint(tmp_path, fraction):
    """Killed after 0 bytes ... the whole file (before its rename), or after the
    rename while ``latest`` is rewritten (None)."""
    save_state(tmp_path, state(2))
    size = (tmp_path / checkpoint.checkpoint_name(2)).stat().st_size
    offset = None if fraction is None else int(fraction * size)
    child = mp.get_context("fork").Process(target=_killed_save, args=(tmp_path, 3, offset))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    # The old checkpoint is complete and still the one to load.
    path, loaded = load_state(tmp_path, torch.device("cpu"))
    assert path.name == checkpoint.checkpoint_name(2) and same(loaded, state(2))
    # The next save into the same folder completes and cleans up what the kill left.
    save_state(tmp_path, state(4), replaces=checkpoint.checkpoint_name(2))
    # (A step-3 file renamed into place before the kill is no checkpoint of this run: it stays.)
    left = [LATEST, "step_000004.pt", "step_000004.pt.sha256"] + (["step_000003.pt"] if offset is None else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(left)
    assert same(load_state(tmp_path, torch.device("cpu"))[1], state(4))


def test_saving_replaces_only_the_checkpoint_the_run_wrote(tmp_path):
    save_state(tmp_path, state(1))                               # another run's (or the --load one)
    first = save_state(tmp_path, state(2))
    save_state(tmp_path, state(3), replaces=first.name)
    assert (tmp_path / LATEST).read_text() == "step_000003.pt\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001.pt", "step_000001.pt.sha256",
                                                          "step_000003.pt", "step_000003.pt.sha256"]


def overwrite_tensor_data(path, size=1024):
    """1 KiB of the weights overwritten, the zip structure intact (the file still loads)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"/data/0") + 64 + 512      # inside the first tensor's stored bytes
    data[at:at + size] = os.urandom(size)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:1000]), r"contents do not match the SHA-256 in step_000005.pt.sha256"),
    (overwrite_tensor_data, r"contents do not match the SHA-256 in step_000005.pt.sha256; the file is damaged"),
    (lambda p: p.with_name(p.name + ".sha256").unlink(), "checksum file step_000005.pt.sha256 is missing"),
    (lambda p: p.write_bytes(b""), r"not a checkpoint written by torch.save \(0 bytes"),
    (lambda p: p.write_bytes(b"\0" + os.urandom(4999)), r"not a checkpoint written by torch.save \(5000 bytes"),
    (lambda p: torch.save({"weights": torch.zeros(3)}, p), "contents do not match"),
    (lambda p: p.unlink(), "which is missing"),
    (lambda p: (p.parent / LATEST).write_text("../../etc/passwd\n"), "not a checkpoint file"),
    (lambda p: (p.parent / LATEST).unlink(), "no complete checkpoint"),
])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, damage, message):
    save_state(tmp_path, state(5))
    damage(tmp_path / "step_000005.pt")
    with pytest.raises(ConfigError, match=message) as exc:
        load_state(tmp_path, torch.device("cpu"))
    assert "\n" not in str(exc.value)
    assert str(tmp_path) in str(exc.value)


def test_latest_names_the_complete_file(tmp_path):
    save_state(tmp_path, state(7))
    assert latest_path(tmp_path) == tmp_path / "step_000007.pt"


def test_1kib_overwritten_inside_the_weights_still_unzips_but_is_refused(tmp_path):
    """The issue's case: the damage leaves a loadable zip, so only the checksum sees it."""
    path = save_state(tmp_path, state(5))
    overwrite_tensor_data(path)
    damaged = torch.load(path, weights_only=True)             # torch itself notices nothing
    assert not torch.equal(damaged["shards"]["tp0-ep0"]["model"]["w"], state(5)["shards"]["tp0-ep0"]["model"]["w"])
    with pytest.raises(ConfigError) as exc:
        load_state(tmp_path, torch.device("cpu"))
    assert str(exc.value).startswith(f"{path}: contents do not match the SHA-256")
