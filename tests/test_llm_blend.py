"""Continued pre-training on a weighted blend of indexed datasets (``data.prefixes`` +
``data.weights``): the global batches the recipe feeds the trainer hold the datasets in the
blend's proportions, on one DP rank or split over two, and ``lf-llm train`` runs on the blend."""

import json
from types import SimpleNamespace

import pytest
import torch
from cli_runner import run_cli

from loongforge.llm.data import bundled_tokenizer_path, load_tokenizer
from loongforge.llm.data.preprocess import preprocess
from loongforge.llm.recipe import LLMTask, load_llm_config

SEQ, GLOBAL_BATCH, STEPS = 32, 16, 25
WORDS = ("red", "blue", "green")
WEIGHTS = (0.6, 0.3, 0.1)


def docs(word: str, n: int) -> list[str]:
    return [f"{word} {i}: " + " ".join([word] * (4 + i % 5)) + "." for i in range(n)]


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    """Three datasets of disjoint words, each of a different size (so that token counts would
    give other proportions than the weights), and the token ids only each one contains."""
    root = tmp_path_factory.mktemp("blend")
    tok = load_tokenizer(bundled_tokenizer_path())
    prefixes, ids = [], []
    for word, n in zip(WORDS, (40, 80, 120)):
        path = root / f"{word}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(word, n)))
        prefixes.append(str(preprocess([path], tok, root / word, show_progress=False)))
        ids.append({t for text in docs(word, n) for t in tok.encode(text)})
    own = [ids[i] - set().union(*(ids[j] for j in range(len(ids)) if j != i)) for i in range(len(ids))]
    assert all(own)
    return root, prefixes, own


def overrides(root, prefixes) -> list[str]:
    return [f"data.prefixes=[{','.join(prefixes)}]", f"data.weights=[{','.join(map(str, WEIGHTS))}]",
            f"data.cache_dir={root / 'cache'}", f"train.steps={STEPS}", f"train.global_batch_size={GLOBAL_BATCH}",
            "train.micro_batch_size=4", f"train.seq_length={SEQ}", "train.warmup_steps=1"]


def source_of(tokens: torch.Tensor, own: list[set[int]]) -> int:
    present = set(tokens.tolist())
    sources = [i for i, ids in enumerate(own) if present & ids]
    assert len(sources) == 1, f"a sample mixes datasets {sources}"
    return sources[0]


@pytest.mark.parametrize("dp", [1, 2])
def test_training_batches_follow_the_blend_weights(blend, dp):
    root, prefixes, own = blend
    task = LLMTask(load_llm_config("train_qwen3_moe_debug", overrides(root, prefixes)))
    counts = [0] * len(prefixes)
    for rank in range(dp):
        ctx = SimpleNamespace(dp_rank=rank, dp_size=dp, device=torch.device("cpu"), pgs=SimpleNamespace(cp=None))
        batches = task.steps(ctx, 0)  # no context parallelism: pgs.cp None
        for _ in range(STEPS):
            for mb in next(batches).micro_batches:
                for row in mb["tokens"]:
                    counts[source_of(row, own)] += 1
    total = STEPS * GLOBAL_BATCH
    assert sum(counts) == total
    for count, weight in zip(counts, WEIGHTS):
        assert count / total == pytest.approx(weight, abs=0.02)


def test_lf_llm_trains_on_the_blend(blend, tmp_path):
    root, prefixes, _ = blend
    run = tmp_path / "run"
    args = [a for a in overrides(root, prefixes) if not a.startswith("train.steps")]
    proc = run_cli(["lf-llm", "train", "--config", "train_qwen3_moe_debug", *args, "train.steps=2",
                    f"log.run_dir={run}", "log.interval=1", "log.progress=false", "log.tensorboard=false", "checkpoint.save=false"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and 8.0 < losses[0] < 9.0  # about ln(4096) from a random start
    assert losses[1] < losses[0]  # the first update (at lr / warmup_steps) already learns
