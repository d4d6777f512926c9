"""The shipped corpus and tokenizer are exactly what tools/make_corpus.py generates."""

import importlib.util
import json
from pathlib import Path

from loongforge.llm.data import bundled_corpus_path, bundled_tokenizer_path

REPO_ROOT = Path(__file__).resolve().parents[3]


def _make_corpus_module():
    spec = importlib.util.spec_from_file_location("make_corpus", REPO_ROOT / "tools" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_files_are_reproduced_by_the_generator(tmp_path):
    _make_corpus_module().main(["--output", str(tmp_path)])
    assert (tmp_path / "corpus.jsonl").read_bytes() == bundled_corpus_path().read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "tokenizer" / name).read_bytes() == (bundled_tokenizer_path() / name).read_bytes(), name


def test_shipped_corpus_shape():
    data = bundled_corpus_path().read_bytes()
    assert 1_000_000 < len(data) < 2_500_000
    docs = [json.loads(line)["text"] for line in data.decode().splitlines()]
    assert len(docs) > 2000 and all(docs)
    assert len(set(docs)) > 0.99 * len(docs)  # varied, not one template repeated
