"""build_gpt_dataset / bundled_dataset over megatron-core's GPTDataset and BlendedDataset."""

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch

from loongforge.llm.data import DataError, bundled_tokenizer_path, load_tokenizer
from loongforge.llm.data.gpt import build_gpt_dataset
from loongforge.llm.data.preprocess import preprocess
from loongforge.llm.data.shipped import bundled_dataset

SEQ = 32


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(bundled_tokenizer_path())


def make_prefix(tmp_path, name, texts, tok):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return preprocess([path], tok, tmp_path / name, show_progress=False)


def numbered_docs(word, n):
    return [f"{word} {i}: " + " ".join([word] * (3 + i % 7)) + "." for i in range(n)]


def contains(haystack: list[int], needle: list[int]) -> bool:
    h, n = ",".join(map(str, haystack)), ",".join(map(str, needle))
    return f",{n}," in f",{h},"


def test_items_are_shifted_windows_of_the_documents(tok, tmp_path):
    texts = numbered_docs("apple", 40)
    prefix = make_prefix(tmp_path, "a", texts, tok)
    ds = build_gpt_dataset(prefix, seq_length=SEQ, num_samples=100, seed=7, tokenizer=tok, cache_dir=tmp_path / "cache")
    assert len(ds) >= 100
    docs = [tok.encode(t) for t in texts]
    for i in range(0, 100, 7):
        item = ds[i]
        assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
        for key, dtype in [("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32), ("position_ids", torch.int64)]:
            assert item[key].shape == (SEQ,) and item[key].dtype == dtype, key
        assert torch.equal(item["labels"][:-1], item["tokens"][1:])
        assert torch.equal(item["position_ids"], torch.arange(SEQ))
        assert torch.equal(item["loss_mask"], torch.ones(SEQ))
        # The SEQ + 1 tokens are documents joined by EOD: every piece between EODs is part of one document.
        window = item["tokens"].tolist() + [int(item["labels"][-1])]
        pieces, piece = [], []
        for t in window:
            if t == tok.eod:
                pieces.append(piece)
                piece = []
            else:
                piece.append(t)
        pieces.append(piece)
        assert len(pieces) > 1  # documents are shorter than SEQ
        for piece in filter(None, pieces):
            assert any(contains(doc, piece) for doc in docs), tok.decode(piece)
        for piece in pieces[1:-1]:  # interior pieces are whole documents
            assert piece in docs


def test_same_seed_same_samples_other_seed_other_order(tok, tmp_path):
    prefix = make_prefix(tmp_path, "a", numbered_docs("pear", 30), tok)
    kwargs = dict(seq_length=SEQ, num_samples=50, tokenizer=tok, cache_dir=tmp_path / "cache")
    first = build_gpt_dataset(prefix, seed=1, **kwargs)
    again = build_gpt_dataset(str(prefix), seed=1, **kwargs)
    other = build_gpt_dataset(prefix, seed=2, **kwargs)
    assert all(torch.equal(first[i]["tokens"], again[i]["tokens"]) for i in range(50))
    assert not all(torch.equal(first[i]["tokens"], other[i]["tokens"]) for i in range(50))


def test_eod_mask_loss(tok, tmp_path):
    prefix = make_prefix(tmp_path, "a", numbered_docs("plum", 30), tok)
    ds = build_gpt_dataset(prefix, seq_length=SEQ, num_samples=20, seed=3, tokenizer=tok,
                           cache_dir=tmp_path / "cache", eod_mask_loss=True)
    for i in range(20):
        item = ds[i]
        assert torch.equal(item["loss_mask"], (item["tokens"] != tok.eod).float())


def test_blend_weights_are_respected(tok, tmp_path):
    a = make_prefix(tmp_path, "a", numbered_docs("red", 60), tok)
    b = make_prefix(tmp_path, "b", numbered_docs("blue", 20), tok)
    a_ids = {t for text in numbered_docs("red", 60) for t in tok.encode(text)} | {tok.eod}
    b_ids = {t for text in numbered_docs("blue", 20) for t in tok.encode(text)} | {tok.eod}
    n = 400
    ds = build_gpt_dataset([(0.2, a), (0.8, b)], seq_length=SEQ, num_samples=n, seed=5, tokenizer=tok,
                           cache_dir=tmp_path / "cache")
    assert len(ds) == n
    counts = Counter()
    for i in range(n):
        item = ds[i]
        source = int(item["dataset_id"])
        counts[source] += 1
        assert set(item["tokens"].tolist()) <= (a_ids, b_ids)[source]
    assert abs(counts[0] / n - 0.2) < 0.02 and abs(counts[1] / n - 0.8) < 0.02


def test_plain_prefix_list_mixes_by_token_count(tok, tmp_path):
    a = make_prefix(tmp_path, "a", numbered_docs("green", 90), tok)
    b = make_prefix(tmp_path, "b", numbered_docs("green", 30), tok)
    ds = build_gpt_dataset([a, b], seq_length=SEQ, num_samples=300, seed=5, tokenizer=tok, cache_dir=tmp_path / "cache")
    share = sum(int(ds[i]["dataset_id"]) == 0 for i in range(300)) / 300
    assert abs(share - 0.75) < 0.03


def test_data_errors(tok, tmp_path):
    kwargs = dict(seq_length=SEQ, num_samples=10, seed=0, tokenizer=tok, cache_dir=tmp_path / "cache")
    missing = tmp_path / "missing"
    with pytest.raises(DataError, match=rf"dataset prefix {missing}: {missing}.bin and {missing}.idx not found"):
        build_gpt_dataset(missing, **kwargs)
    a = make_prefix(tmp_path, "a", ["some text"], tok)
    with pytest.raises(DataError, match=rf"blend weight -1.0 for {a}: must be a positive number"):
        build_gpt_dataset([(1.0, a), (-1, a)], **kwargs)
    with pytest.raises(DataError, match=r"mixes plain prefixes and \(weight, prefix\) pairs"):
        build_gpt_dataset([a, (1.0, a)], **kwargs)
    with pytest.raises(DataError, match=r"seq_length=0: must be a positive integer"):
        build_gpt_dataset(a, **{**kwargs, "seq_length": 0})


def test_bundled_dataset_is_idempotent(tok, tmp_path):
    cache = tmp_path / "cache"
    first = bundled_dataset(cache, seq_length=64, num_samples=200, seed=11)
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert sum(name.endswith(".bin") for name in files) == 1 and sum(name.endswith(".idx") for name in files) == 1
    second = bundled_dataset(cache, seq_length=64, num_samples=200, seed=11)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == files  # nothing rebuilt or rewritten
    for i in (0, 57, 199):
        assert torch.equal(first[i]["tokens"], second[i]["tokens"])
    text = tok.decode(first[0]["tokens"].tolist())
    assert any(word in text for word in ("red", "blue", "green", "has", "the")), text


DIST_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from loongforge.llm.data.shipped import bundled_dataset

    rank, store, cache, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ds = bundled_dataset(cache, seq_length=48, num_samples=64, seed=3)
    with open(f"{out}.{rank}", "w") as f:
        json.dump([ds[i]["tokens"].tolist() for i in range(0, 64, 9)], f)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_bundled_dataset_two_gloo_ranks(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(DIST_SCRIPT)
    cache, out = tmp_path / "cache", tmp_path / "items"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOONGFORGE_ACCELERATOR": "cpu"}
    env.pop("LOCAL_RANK", None)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), str(cache), str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    rank0, rank1 = (json.loads((tmp_path / f"items.{r}").read_text()) for r in range(2))
    assert rank0 == rank1
    assert sorted(p.suffix for p in cache.iterdir() if p.suffix in (".bin", ".idx", ".tmp")) == [".bin", ".idx"]
    alone = bundled_dataset(tmp_path / "alone", seq_length=48, num_samples=64, seed=3)
    assert rank0 == [alone[i]["tokens"].tolist() for i in range(0, 64, 9)]
