"""A corrupt indexed dataset is found by its sizes and offsets: one line, never wrong numbers."""

from __future__ import annotations

import struct

import pytest

from megatron_zeppelin.data import IndexedDocuments
from megatron_zeppelin.data.prepare import prepare
from megatron_zeppelin.errors import ConfigError
from tests.data.test_indexed_prepare import write_jsonl

HEADER = 34


def _poke(fmt: str, offset: int, value):
    def damage(idx: bytearray, _bin: bytearray) -> None:
        struct.pack_into(fmt, idx, offset, value)
    return damage


@pytest.mark.parametrize("damage, message", [
    (lambda idx, b: idx.__delitem__(slice(100, None)), r"\.idx: 100 bytes, but its header declares 5 sequences"),
    (lambda idx, b: idx.__setitem__(slice(0, 9), b"garbage!!"), r"\.idx: not a Megatron index"),
    (lambda idx, b: idx.clear(), r"\.idx: not a Megatron index \(0 bytes"),
    (lambda idx, b: b.__delitem__(slice(10, None)), r"\.bin: 10 bytes, but .*\.idx describes"),
    (lambda idx, b: b.extend(b"\0" * 8), r"\.bin: .* bytes, but .*\.idx describes"),
    (_poke("<i", HEADER + 4 * 2, -7), r"sequence 2 has a negative length"),
    (_poke("<i", HEADER + 4 * 1, 10**6), r"offsets do not follow its sequence lengths"),
    (_poke("<q", HEADER + 12 * 5 + 8 * 2, 99), r"document indices are not 0 \.\. sequence count"),
    (_poke("<B", 17, 42), r"unknown token dtype code 42"),
])
def test_corrupt_dataset_is_one_line(tmp_path, damage, message):
    prefix = tmp_path / "ds"
    prepare(write_jsonl(tmp_path / "in.jsonl", ["alpha", "bb", "a longer document", "x", "yy"]), prefix)
    idx, bin_ = bytearray((tmp_path / "ds.idx").read_bytes()), bytearray((tmp_path / "ds.bin").read_bytes())
    assert len(IndexedDocuments(prefix)) == 5
    damage(idx, bin_)
    (tmp_path / "ds.idx").write_bytes(bytes(idx))
    (tmp_path / "ds.bin").write_bytes(bytes(bin_))
    with pytest.raises(ConfigError, match=message) as exc:
        IndexedDocuments(prefix)
    assert "\n" not in str(exc.value) and "rebuild it" in str(exc.value)


def test_prepare_refuses_a_folder_prefix_and_binary_input(tmp_path):
    good = write_jsonl(tmp_path / "in.jsonl", ["ab"])
    with pytest.raises(ConfigError, match="names a folder; add a file name"):
        prepare(good, str(tmp_path) + "/")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ConfigError, match=r"bin.jsonl:1: not UTF-8 text"):
        prepare(binary, tmp_path / "out")
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".bin"))
