"""Tokenize text files into megatron-core's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Inputs, by file suffix:

- ``.jsonl`` / ``.ndjson``: one JSON object per line; the document is the string under
  ``json_key`` (default ``"text"``). Blank lines are ignored.
- ``.txt`` / ``.text``: with ``txt_unit="paragraph"`` (default) a document is a run of non-blank
  lines, ended by a blank (whitespace-only) line or the end of the file, its lines joined with
  ``"\\n"``; with ``txt_unit="line"`` every non-blank line is a document. Line endings are dropped.

Each document is tokenized (``TextTokenizer.encode``) and, with ``append_eod``, followed by the
tokenizer's end-of-document id. Empty documents are skipped. Token ids are stored as uint16 when the
vocabulary fits, else int32. The files are written under temporary names, flushed to disk and
renamed into place, ``.idx`` last, so a reader never sees a partial dataset.

Command line (``lf-llm preprocess`` mounts the same arguments)::

    python -m loongforge.llm.data.preprocess --input a.jsonl b.txt [--tokenizer TOK_DIR] --output-prefix out/corpus
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Iterator, Literal, Sequence

import numpy

from loongforge.llm.data.errors import DataError
from loongforge.llm.data.tokenizer import TextTokenizer, load_tokenizer

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
TxtUnit = Literal["paragraph", "line"]
_BATCH_DOCS = 512


def _decode_line(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start})") from err


def _jsonl_documents(path: Path, json_key: str) -> Iterator[tuple[str | None, int]]:
    """Yields (document text or None for a skipped line, bytes consumed)."""
    with open(path, "rb") as stream:
        for lineno, raw in enumerate(stream, 1):
            line = _decode_line(raw, path, lineno)
            if not line.strip():
                yield None, len(raw)
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: invalid JSON: {err.msg} (column {err.colno})") from err
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if json_key not in record:
                keys = ", ".join(map(repr, list(record)[:8])) or "none"
                raise DataError(f"{path}:{lineno}: no key {json_key!r} in the JSON object (keys: {keys})")
            text = record[json_key]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: {json_key!r} is {type(text).__name__}, expected a string")
            yield text, len(raw)


def _text_documents(path: Path, unit: TxtUnit) -> Iterator[tuple[str | None, int]]:
    with open(path, "rb") as stream:
        paragraph: list[str] = []
        pending = 0
        for lineno, raw in enumerate(stream, 1):
            line = _decode_line(raw, path, lineno).rstrip("\r\n")
            blank = not line.strip()
            if unit == "line":
                yield (None if blank else line), len(raw)
                continue
            pending += len(raw)
            if blank:
                if paragraph:
                    yield "\n".join(paragraph), pending
                    paragraph, pending = [], 0
            else:
                paragraph.append(line)
        if paragraph or pending:
            yield ("\n".join(paragraph) if paragraph else None), pending


def _check_input(path: Path) -> None:
    if not path.is_file():
        raise DataError(f"input file not found: {path}")
    if path.suffix.lower() not in JSONL_SUFFIXES + TEXT_SUFFIXES:
        raise DataError(
            f"{path}: unsupported input type {path.suffix or '(no suffix)'!r}; "
            f"use one of {', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES)}"
        )


def _documents(path: Path, json_key: str, txt_unit: TxtUnit) -> Iterator[tuple[str | None, int]]:
    if path.suffix.lower() in JSONL_SUFFIXES:
        return _jsonl_documents(path, json_key)
    return _text_documents(path, txt_unit)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preprocess(
    inputs: Sequence[str | Path],
    tokenizer: str | Path | TextTokenizer,
    output_prefix: str | Path,
    json_key: str = "text",
    append_eod: bool = True,
    txt_unit: TxtUnit = "paragraph",
    show_progress: bool = True,
) -> Path:
    """Tokenize ``inputs`` (in order) into ``output_prefix.bin`` / ``output_prefix.idx``; returns the prefix."""
    from loongforge.core.metrics import progress
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    if txt_unit not in ("paragraph", "line"):
        raise DataError(f"txt_unit={txt_unit!r}: expected 'paragraph' or 'line'")
    prefix = Path(output_prefix).expanduser()
    if prefix.suffix in (".bin", ".idx"):
        raise DataError(f"output prefix {prefix} ends with {prefix.suffix}: give the prefix without the extension")
    paths = [Path(p).expanduser() for p in inputs]
    if not paths:
        raise DataError("preprocess: no input files given")
    for path in paths:
        _check_input(path)
    tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)

    prefix.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp_bin = prefix.parent / f".{prefix.name}.{tag}.bin.tmp"
    tmp_idx = prefix.parent / f".{prefix.name}.{tag}.idx.tmp"
    dtype = DType.optimal_dtype(tok.vocab_size)
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    documents = tokens = skipped = 0

    def flush(batch: list[str]) -> None:
        nonlocal documents, tokens
        for ids in tok.encode_batch(batch):
            if append_eod:
                ids.append(tok.eod)
            builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
            documents += 1
            tokens += len(ids)
        batch.clear()

    total_bytes = sum(p.stat().st_size for p in paths)
    bar = progress(total_bytes, desc=f"tokenize -> {prefix.name}", enabled=show_progress)
    bar.unit, bar.unit_scale = "B", True
    bar.refresh()
    try:
        for path in paths:
            batch: list[str] = []
            for text, nbytes in _documents(path, json_key, txt_unit):
                if text == "":
                    skipped += 1
                elif text is not None:
                    batch.append(text)
                    if len(batch) >= _BATCH_DOCS:
                        flush(batch)
                        bar.set_postfix_str(f"docs={documents} tokens={tokens}", refresh=False)
                bar.update(nbytes)
            flush(batch)
        if documents == 0:
            raise DataError(f"no documents found in {', '.join(map(str, paths))}")
        builder.finalize(str(tmp_idx))
        for tmp in (tmp_bin, tmp_idx):
            _fsync(tmp)
        idx_path, bin_path = Path(get_idx_path(str(prefix))), Path(get_bin_path(str(prefix)))
        idx_path.unlink(missing_ok=True)  # never pair an old index with the new data
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
        _fsync(prefix.parent)
    finally:
        bar.set_postfix_str(f"docs={documents} tokens={tokens}")
        bar.close()
        if not builder.data_file.closed:
            builder.data_file.close()
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    if skipped:
        logger.info("skipped %d empty documents", skipped)
    logger.info("wrote %s.{bin,idx}: %d documents, %d tokens", prefix, documents, tokens)
    return prefix


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``lf-llm preprocess`` (for a subcommand parser or a standalone one)."""
    parser.add_argument("--input", nargs="+", required=True, type=Path, metavar="FILE",
                        help="text (.txt) and JSONL (.jsonl) files, tokenized in the order given")
    parser.add_argument("--tokenizer", default=None, metavar="PATH|ID",
                        help="tokenizer.json, a directory holding one, or a Hugging Face Hub id (owner/name) "
                             "(default: the bundled tokenizer, which is also what training uses when "
                             "data.tokenizer is not set)")
    parser.add_argument("--output-prefix", required=True, type=Path, metavar="PREFIX",
                        help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="JSONL field holding the document (default: text)")
    parser.add_argument("--txt-unit", choices=["paragraph", "line"], default="paragraph",
                        help="a .txt document is a blank-line-separated paragraph (default) or a line")
    parser.add_argument("--no-eod", action="store_true", help="do not append the end-of-document token")
    return parser


def preprocess_from_args(args: argparse.Namespace) -> Path:
    """Run ``preprocess`` for parsed ``add_preprocess_arguments`` arguments and print a summary."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from loongforge.llm.data.bundled_files import bundled_tokenizer_path

    from loongforge.core.hub import resolve_local

    tokenizer = resolve_local(args.tokenizer, key="--tokenizer") if args.tokenizer is not None else bundled_tokenizer_path()
    prefix = preprocess(args.input, tokenizer, args.output_prefix, json_key=args.json_key,
                        append_eod=not args.no_eod, txt_unit=args.txt_unit)
    written = IndexedDataset(str(prefix))
    print(f"{prefix}.{{bin,idx}}: {len(written)} documents, {int(written.sequence_lengths.sum())} tokens")
    return prefix


def preprocess_cli(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point; returns the exit status (1 with the error on stderr for bad input)."""
    parser = add_preprocess_arguments(argparse.ArgumentParser(
        prog="lf-llm preprocess", description="Tokenize text/JSONL files into a megatron-core indexed dataset."))
    args = parser.parse_args(argv)
    from loongforge.core.errors import UserError

    try:
        preprocess_from_args(args)
    except UserError as err:  # bad data, a tokenizer that cannot be found
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(preprocess_cli())
