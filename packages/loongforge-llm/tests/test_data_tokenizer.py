"""TextTokenizer over a local tokenizer.json: special ids, round trips, transformers parity, errors."""

import json
import shutil

import pytest

from loongforge.llm.data import DataError, TextTokenizer, bundled_corpus_path, bundled_tokenizer_path, load_tokenizer

TEXTS = [
    "The red ball is on the table.",
    "  two  spaces,\ttabs and\nnew lines\n\n",
    "12 + 30 = 42. Q: What colour is the sky? A: The sky is blue.",
    "naïve café — 東京 🦊",
    "",
]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return load_tokenizer(bundled_tokenizer_path())


def test_bundled_special_tokens(tok):
    assert tok.eod == 0 and tok.eod_token == "<|endoftext|>"
    assert tok.pad == 1 and tok.pad_token == "<|pad|>"
    assert tok.encode("<|endoftext|>") == [tok.eod]
    assert tok.encode("a<|pad|>b")[1] == tok.pad
    vocab = json.loads((bundled_tokenizer_path() / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok.vocab_size == len(vocab) > 1000
    assert max(tok.encode(bundled_corpus_path().read_text()[:20000])) < tok.vocab_size


def test_round_trip(tok):
    docs = [json.loads(line)["text"] for line in bundled_corpus_path().read_text().splitlines()[:50]]
    for text in TEXTS + docs:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode(tok.encode(TEXTS[0]) + [tok.eod]) == TEXTS[0] + "<|endoftext|>"
    assert tok.decode(tok.encode(TEXTS[0]) + [tok.eod], skip_special_tokens=True) == TEXTS[0]


def test_bundled_corpus_compresses(tok):
    text = bundled_corpus_path().read_text()[:50000]
    assert len(text) / len(tok.encode(text)) > 3.0  # whole words, not bytes


def test_same_ids_as_transformers(tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bundled_tokenizer_path()), local_files_only=True)
    assert hf.eos_token_id == tok.eod
    assert hf.pad_token_id == tok.pad
    assert len(hf) == tok.vocab_size
    for text in TEXTS:
        assert hf(text, add_special_tokens=True)["input_ids"] == tok.encode(text)
        assert hf.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_loads_a_tokenizer_json_file_directly(tok):
    direct = load_tokenizer(bundled_tokenizer_path() / "tokenizer.json")
    assert (direct.eod, direct.pad, direct.vocab_size) == (tok.eod, tok.pad, tok.vocab_size)
    assert direct.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_unique_identifiers_follow_content_not_path(tok, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundled_tokenizer_path(), copy)
    assert json.dumps(load_tokenizer(copy).unique_identifiers) == json.dumps(tok.unique_identifiers)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["pad_token"] = "<|endoftext|>"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    other = load_tokenizer(copy)
    assert other.pad == other.eod == 0
    assert other.unique_identifiers != tok.unique_identifiers


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=f"tokenizer not found: {missing}"):
        load_tokenizer(missing)


def test_directory_without_tokenizer_json(tmp_path):
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match=rf"{tmp_path} is not a tokenizer directory: it has no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(DataError, match=rf"{tmp_path / 'tokenizer.json'} is not a tokenizers/transformers tokenizer.json"):
        load_tokenizer(tmp_path)


def test_eos_token_not_in_vocab(tmp_path):
    shutil.copytree(bundled_tokenizer_path(), tmp_path / "t")
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "t" / "special_tokens_map.json").unlink()
    with pytest.raises(DataError, match=r"end-of-document token '</s>' is not in the vocabulary"):
        load_tokenizer(tmp_path / "t")


def test_tokenizer_without_pad(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "hello": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.eod == 0 and tok.encode("hello world") == [1, 2]
    with pytest.raises(AttributeError, match="defines no pad token"):
        tok.pad
