"""``python -m megatron_zeppelin.data.prepare``: JSON lines -> Megatron indexed dataset.

Each input line is one document (``{"text": "..."}``); each becomes one sequence
and one document in ``PREFIX.bin``/``PREFIX.idx`` with an end-of-document token
appended, exactly what Megatron's ``preprocess_data.py --append-eod`` writes, so
the files feed both Megatron-LM (``--data-path PREFIX``) and the Zeppelin sampler.

Tokenizers: ``byte`` (default; UTF-8 bytes 0..255 plus EOD = 256, works offline
with no files) or a Hugging Face tokenizer name/path (``gpt2``), which needs
``transformers`` and the tokenizer files already on disk -- nothing is downloaded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from megatron_zeppelin.data.indexed import megatron_indexed_dataset
from megatron_zeppelin.errors import ConfigError, exit_on_user_error
from megatron_zeppelin.validation import OneLineParser, check_not_an_input, check_output_dir


@dataclass(frozen=True)
class Tokenizer:
    """What the writer needs from a tokenizer."""

    name: str
    """How the user named it (``byte``, ``gpt2``, a local path)."""
    vocab_size: int
    """Number of token ids, EOD included (picks the on-disk dtype)."""
    eod: int
    """End-of-document id appended to every document."""
    encode: Callable[[str], np.ndarray]
    """Text -> token ids (without EOD)."""


def _encode_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


BYTE_TOKENIZER = Tokenizer(name="byte", vocab_size=257, eod=256, encode=_encode_bytes)


def load_tokenizer(name: str) -> Tokenizer:
    """``byte``, or a Hugging Face tokenizer available locally (never downloaded)."""
    if name == "byte":
        return BYTE_TOKENIZER
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"tokenizer {name!r} needs the 'transformers' package, which is not installed; "
                          "install it, or use --tokenizer byte") from None
    try:
        hf = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer {name!r} is not available locally ({exc}); pass a local tokenizer "
                          "directory, or use --tokenizer byte") from None
    if hf.eos_token_id is None:
        raise ConfigError(f"tokenizer {name!r} has no end-of-document (eos) token; use another tokenizer")

    def encode(text: str) -> np.ndarray:
        return np.asarray(hf.encode(text, add_special_tokens=False), dtype=np.int64)

    return Tokenizer(name=name, vocab_size=len(hf), eod=int(hf.eos_token_id), encode=encode)


def read_documents(path: str | os.PathLike, json_key: str) -> Iterator[str]:
    """Texts of a JSON-lines file (blank lines skipped); errors name the line."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"input file {str(path)!r} is a directory; pass a JSON-lines file with one "
                          f'{{"{json_key}": "..."}} object per line')
    if not path.is_file():
        raise ConfigError(f"input file {str(path)!r} does not exist; pass a JSON-lines file with one "
                          f'{{"{json_key}": "..."}} object per line')
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if any("\udc80" <= ch <= "\udcff" for ch in line):   # undecodable bytes
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text (a binary file?); pass a JSON-lines "
                                  "file with one JSON object per line")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc.msg}); each line must be one "
                                  "JSON object") from None
            if not isinstance(record, dict) or json_key not in record:
                keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{path}:{lineno}: no key {json_key!r} (found {keys}); choose the text "
                                  "field with --json-key")
            if not isinstance(record[json_key], str):
                raise ConfigError(f"{path}:{lineno}: {json_key!r} is {type(record[json_key]).__name__}, "
                                  "expected a string")
            yield record[json_key]


def check_output_prefix(output_prefix: str | os.PathLike, input_path: str | os.PathLike) -> str:
    """``PREFIX`` whose ``.bin`` and ``.idx`` can be written (its folder is
    created) and are not ``input_path``; a prefix naming a folder would write
    hidden ``.bin``/``.idx`` files."""
    prefix = os.fspath(output_prefix)
    if not Path(prefix).name or prefix.endswith(os.sep) or Path(prefix).is_dir():
        raise ConfigError(f"--output-prefix {prefix!r} names a folder; add a file name, e.g. "
                          f"{os.path.join(prefix, 'corpus')!r} (writes corpus.bin and corpus.idx)")
    for ext in (".bin", ".idx"):
        check_not_an_input(prefix + ext, f"--output-prefix's {ext}", {"--input": input_path})
    check_output_dir(Path(prefix).parent, "--output-prefix's folder")   # probes, writes nothing else
    return prefix


@dataclass(frozen=True)
class PrepareStats:
    """What :func:`prepare` wrote."""

    documents: int
    """Documents written."""
    tokens: int
    """Tokens written, EOD tokens included."""


def prepare(input_path: str | os.PathLike, output_prefix: str | os.PathLike, *, json_key: str = "text",
            tokenizer: Tokenizer = BYTE_TOKENIZER) -> PrepareStats:
    """Tokenize every document of ``input_path`` into ``output_prefix.{bin,idx}``."""
    megatron = megatron_indexed_dataset()
    prefix = check_output_prefix(output_prefix, input_path)
    documents = read_documents(input_path, json_key)  # opened first: a bad input writes nothing
    first = next(documents, None)
    if first is None:
        raise ConfigError(f"{input_path}: holds no document; write one JSON object per line")
    dtype = megatron.DType.optimal_dtype(tokenizer.vocab_size)
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    count = tokens = 0
    try:
        for text in itertools.chain([first], documents):
            ids = np.append(tokenizer.encode(text), tokenizer.eod)
            builder.add_document(ids, [ids.size])
            count, tokens = count + 1, tokens + ids.size
        builder.finalize(prefix + ".idx")
    except BaseException:
        # A half-written dataset would later read as valid but short: remove it.
        builder.data_file.close()
        for ext in (".bin", ".idx"):
            Path(prefix + ext).unlink(missing_ok=True)
        raise
    return PrepareStats(documents=count, tokens=tokens)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m megatron_zeppelin.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="field holding the text (default: text)")
    parser.add_argument("--tokenizer", default="byte",
                        help="byte (offline, vocab 257) or a local Hugging Face tokenizer name/path")

    def run() -> None:
        args = parser.parse_args(argv)
        tok = load_tokenizer(args.tokenizer)
        stats = prepare(args.input, args.output_prefix, json_key=args.json_key, tokenizer=tok)
        print(f"wrote {stats.documents} documents, {stats.tokens} tokens ({tok.name} tokenizer, vocab "
              f"{tok.vocab_size}, eod {tok.eod}) to {args.output_prefix}.bin/.idx")

    exit_on_user_error(run)


if __name__ == "__main__":
    main()
