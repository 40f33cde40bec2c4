"""prepare (jsonl -> Megatron indexed dataset) -> IndexedDocuments round trip, and its errors."""

import json

import numpy as np
import pytest

from megatron_zeppelin.data import IndexedDocuments, check_prefix, document_lengths
from megatron_zeppelin.data.indexed import megatron_indexed_dataset
from megatron_zeppelin.data.prepare import BYTE_TOKENIZER, load_tokenizer, main, prepare
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sampler import ZeppelinBatchSampler

TEXTS = ["hello world", "", "h\u00e9llo \u2603 snow", "x" * 1000, "line\nbreak"]


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def expected_ids(text):
    return list(text.encode("utf-8")) + [256]


def test_round_trip_lengths_and_tokens(tmp_path):
    stats = prepare(write_jsonl(tmp_path / "in.jsonl", TEXTS), tmp_path / "out" / "ds")
    assert stats.documents == len(TEXTS)
    assert stats.tokens == sum(len(expected_ids(t)) for t in TEXTS)
    docs = IndexedDocuments(tmp_path / "out" / "ds")
    assert docs.dtype == np.uint16 and len(docs) == len(TEXTS)
    np.testing.assert_array_equal(docs.lengths, [len(expected_ids(t)) for t in TEXTS])
    np.testing.assert_array_equal(document_lengths(str(tmp_path / "out" / "ds") + ".idx"), docs.lengths)
    for d, text in enumerate(TEXTS):
        assert docs.tokens(d).tolist() == expected_ids(text)
    # pieces from the sampler read back exactly the slices of their documents
    sampler = ZeppelinBatchSampler(docs.lengths, max_seq_len=64, tokens_per_batch=256, num_batches=8)
    for batch in sampler:
        for p in batch.pieces:
            assert docs.tokens(p.doc, p.start, p.end).tolist() == expected_ids(TEXTS[p.doc])[p.start:p.end]


def test_documents_made_of_several_sequences(tmp_path):
    # Megatron's --split-sentences layout: one document = several sequences.
    megatron = megatron_indexed_dataset()
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=np.int32)
    builder.add_document(np.arange(10), [3, 7])
    builder.add_document(np.arange(100, 104), [4])
    builder.add_document(np.arange(200, 206), [1, 2, 3])
    builder.finalize(str(tmp_path / "s.idx"))
    docs = IndexedDocuments(tmp_path / "s")
    np.testing.assert_array_equal(docs.lengths, [10, 4, 6])
    assert docs.tokens(0, 2, 9).tolist() == list(range(2, 9))  # spans both sequences of document 0
    assert docs.tokens(2).tolist() == list(range(200, 206))
    assert docs.tokens(1, 4, 4).size == 0
    with pytest.raises(IndexError, match="outside document 1 of length 4"):
        docs.tokens(1, 0, 5)
    with pytest.raises(IndexError, match="document 3 out of range"):
        docs.tokens(3)


def test_missing_files_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"missing .*nope\.idx; run python -m megatron_zeppelin.data.prepare"):
        check_prefix(tmp_path / "nope")
    prepare(write_jsonl(tmp_path / "in.jsonl", ["ab"]), tmp_path / "ds")
    (tmp_path / "ds.bin").unlink()
    with pytest.raises(ConfigError, match=r"missing .*ds\.bin"):
        IndexedDocuments(tmp_path / "ds")
    (tmp_path / "junk.idx").write_bytes(b"garbage!")
    (tmp_path / "junk.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a Megatron index"):
        IndexedDocuments(tmp_path / "junk")


@pytest.mark.parametrize("lines, match", [
    ('{"text": "ok"}\n{"text": \n', r"in.jsonl:2: not valid JSON"),
    ('{"text": "ok"}\n\n{"body": "x"}\n', r"in.jsonl:3: no key 'text' \(found 'body'\)"),
    ('{"text": 5}\n', r"in.jsonl:1: 'text' is int"),
    ('\n\n', "holds no document"),
])
def test_bad_input_writes_nothing(tmp_path, lines, match):
    (tmp_path / "in.jsonl").write_text(lines)
    with pytest.raises(ConfigError, match=match):
        prepare(tmp_path / "in.jsonl", tmp_path / "ds")
    assert not (tmp_path / "ds.bin").exists() and not (tmp_path / "ds.idx").exists()


def test_cli_json_key_and_errors(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", ["abc", "de"], key="content")
    main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "ds"), "--json-key", "content"])
    assert "wrote 2 documents, 7 tokens" in capsys.readouterr().out
    np.testing.assert_array_equal(document_lengths(tmp_path / "ds"), [4, 3])
    with pytest.raises(SystemExit) as exc:
        main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "x")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_tokenizers():
    assert load_tokenizer("byte") is BYTE_TOKENIZER
    assert BYTE_TOKENIZER.encode("\u00e9").tolist() == [195, 169]
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs the 'transformers' package"):
            load_tokenizer("gpt2")
    else:
        with pytest.raises(ConfigError, match="not available locally"):
            load_tokenizer("/nonexistent/tokenizer/dir")


@pytest.mark.parametrize("input_name, prefix", [("corpus.idx", "corpus"), ("corpus.bin", "corpus")])
def test_an_output_prefix_that_would_overwrite_the_input_is_refused(tmp_path, input_name, prefix):
    """Issue 24: --input corpus.idx --output-prefix corpus wrote the index over the JSON lines."""
    source = tmp_path / input_name
    source.write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError, match=rf"--output-prefix's {source.suffix} '.*{input_name}' is an input of this "
                                          r"run \(--input\)"):
        prepare(source, tmp_path / prefix)
    assert source.read_text() == '{"text": "hello"}\n'
