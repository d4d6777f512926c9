"""preprocess: text/JSONL -> megatron-core .bin/.idx, read back with megatron's IndexedDataset."""

import json
import re

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from loongforge.llm.data import DataError, bundled_tokenizer_path, load_tokenizer
from loongforge.llm.data.preprocess import preprocess, preprocess_cli

JSONL_DOCS = ["The red ball is on the table.", "Mia has two apples.\nNow she has three.", "naïve café 🦊"]
TXT = "First paragraph, line one.\nLine two.\n\n\nSecond paragraph.\n   \nThird one\nends here"
TXT_PARAGRAPHS = ["First paragraph, line one.\nLine two.", "Second paragraph.", "Third one\nends here"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(bundled_tokenizer_path())


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_docs(prefix):
    ds = IndexedDataset(str(prefix))
    assert len(ds.document_indices) == len(ds) + 1  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))], ds


def test_documents_decode_back_to_inputs(tok, tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(JSONL_DOCS)])
    txt = tmp_path / "b.txt"
    txt.write_text(TXT)
    prefix = preprocess([jsonl, txt], bundled_tokenizer_path(), tmp_path / "out" / "mix", show_progress=False)
    assert prefix == tmp_path / "out" / "mix"
    docs, ds = read_docs(prefix)
    assert ds.index.dtype == numpy.uint16
    expected = JSONL_DOCS + TXT_PARAGRAPHS
    assert len(docs) == len(expected)
    for ids, text in zip(docs, expected):
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert ids[:-1] == tok.encode(text)
        assert tok.decode(ids[:-1]) == text
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mix.bin", "mix.idx"]  # no temp files


def test_line_mode_and_no_eod(tok, tmp_path):
    txt = tmp_path / "lines.txt"
    txt.write_text(TXT)
    prefix = preprocess([txt], tok, tmp_path / "lines", append_eod=False, txt_unit="line", show_progress=False)
    docs, _ = read_docs(prefix)
    lines = [line for line in TXT.split("\n") if line.strip()]
    assert [tok.decode(ids) for ids in docs] == lines
    assert all(tok.eod not in ids for ids in docs)


def test_custom_json_key_and_empty_documents_skipped(tok, tmp_path):
    jsonl = write_jsonl(tmp_path / "c.jsonl", [{"body": "one"}, {"body": ""}, {"body": "three"}])
    with open(jsonl, "a") as f:
        f.write("\n   \n")  # blank lines are ignored
    docs, _ = read_docs(preprocess([jsonl], tok, tmp_path / "c", json_key="body", show_progress=False))
    assert [tok.decode(ids[:-1]) for ids in docs] == ["one", "three"]


def test_rewrite_replaces_old_dataset(tok, tmp_path):
    first = write_jsonl(tmp_path / "1.jsonl", [{"text": "old text"}] * 3)
    second = write_jsonl(tmp_path / "2.jsonl", [{"text": "new"}])
    preprocess([first], tok, tmp_path / "p", show_progress=False)
    preprocess([second], tok, tmp_path / "p", show_progress=False)
    docs, _ = read_docs(tmp_path / "p")
    assert [tok.decode(ids) for ids in docs] == ["new<|endoftext|>"]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"text": "unterminated}', r"invalid JSON: Unterminated string"),
        ('{"txt": "wrong key"}', r"no key 'text' in the JSON object \(keys: 'txt'\)"),
        ('{"text": 42}', r"'text' is int, expected a string"),
        ('["text"]', r"expected a JSON object, got list"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tok, tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + bad_line + "\n" + '{"text": "never read"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: {message}"):
        preprocess([path], tok, tmp_path / "bad", show_progress=False)
    assert list(tmp_path.iterdir()) == [path]  # nothing written, temp files removed


def test_bad_utf8_names_file_and_line(tok, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"fine\ncaf\xe9\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: not valid UTF-8"):
        preprocess([path], tok, tmp_path / "x", show_progress=False)


def test_input_errors(tok, tmp_path):
    with pytest.raises(DataError, match=rf"input file not found: {tmp_path / 'missing.jsonl'}"):
        preprocess([tmp_path / "missing.jsonl"], tok, tmp_path / "x", show_progress=False)
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=rf"{csv}: unsupported input type '.csv'"):
        preprocess([csv], tok, tmp_path / "x", show_progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(DataError, match=rf"no documents found in {empty}"):
        preprocess([empty], tok, tmp_path / "x", show_progress=False)
    with pytest.raises(DataError, match=r"ends with .bin: give the prefix without the extension"):
        preprocess([csv], tok, tmp_path / "x.bin", show_progress=False)


def test_cli(tok, tmp_path, capsys):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in JSONL_DOCS])
    args = ["--input", str(jsonl), "--tokenizer", str(bundled_tokenizer_path()), "--output-prefix", str(tmp_path / "cli")]
    assert preprocess_cli(args) == 0
    docs, _ = read_docs(tmp_path / "cli")
    out = capsys.readouterr().out
    assert f"{len(JSONL_DOCS)} documents, {sum(map(len, docs))} tokens" in out
    assert [tok.decode(ids[:-1]) for ids in docs] == JSONL_DOCS
    # Without --tokenizer: the bundled one, the same ids.
    assert preprocess_cli(["--input", str(jsonl), "--output-prefix", str(tmp_path / "default"), "--json-key", "text"]) == 0
    assert read_docs(tmp_path / "default")[0] == docs

    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert preprocess_cli(["--input", str(bad), "--tokenizer", str(tmp_path / "no-tok"), "--output-prefix", str(tmp_path / "b")]) == 1
    assert f"error: tokenizer not found: {tmp_path / 'no-tok'}" in capsys.readouterr().err
