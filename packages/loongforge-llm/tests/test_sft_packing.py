"""SFT packing: conversations packed into one THD row give the loss and gradients of the same
conversations unpacked (one padded row each), fp32 on CPU, through the SFT task's forward step."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.config import load_config
from loongforge.llm.data.packing import pack, packed_seq_params, pad_rows
from loongforge.llm.data.sft import bundled_sft_path
from loongforge.llm.recipe import CONFIG_DIR, LLMConfig
from loongforge.llm.sft_recipe import SFTTask

RTOL = 1e-5  # and an absolute tolerance of 1e-4 of each gradient's largest entry (fp32 sums in another order)


def test_pack_boundaries_and_positions():
    samples = [{"tokens": [5, 6, 7], "labels": [6, 7, 8], "loss_mask": [0, 1, 1]},
               {"tokens": [9, 10], "labels": [10, 11], "loss_mask": [1, 1]}]
    row = pack(samples)
    assert row["tokens"].tolist() == [[5, 6, 7, 9, 10]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1]]  # restart per conversation
    assert row["cu_seqlens"].tolist() == [0, 3, 5] and row["cu_seqlens"].dtype == torch.int32
    assert row["max_seqlen"] == 3
    padded = pack(samples, pad_to=8, pad_id=1)
    assert padded["tokens"].tolist() == [[5, 6, 7, 9, 10, 1, 1, 1]]
    assert padded["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0, 0]]
    assert padded["cu_seqlens"].tolist() == [0, 3, 5, 8]  # the pad is a segment of its own
    assert padded["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    rows = pad_rows(samples, pad_id=1)
    assert rows["tokens"].tolist() == [[5, 6, 7], [9, 10, 1]] and rows["loss_mask"].tolist() == [[0, 1, 1], [1, 1, 0]]
    assert packed_seq_params(rows) is None and packed_seq_params(row).qkv_format == "thd"
    with pytest.raises(ValueError, match="do not fit in a row of 4"):
        pack(samples, pad_to=4)


@pytest.fixture(scope="module")
def sft(megatron_world, tmp_path_factory):
    """The debug model of ``sft_debug`` in fp32 and its task over the first shipped conversations."""
    from megatron.core.transformer import TransformerConfig

    root = tmp_path_factory.mktemp("sft")
    head = "".join(bundled_sft_path().read_text().splitlines(keepends=True)[:40])  # 40 conversations: quick to index
    (root / "chats.jsonl").write_text(head)
    cfg = load_config(LLMConfig, "sft_debug", [f"data.cache_dir={root / 'cache'}", f"sft.files=[{root / 'chats.jsonl'}]"],
                      [CONFIG_DIR])
    task = SFTTask(cfg)
    config = TransformerConfig(**task.transformer_config_kwargs(), params_dtype=torch.float32, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = task.build_model(megatron_world, config, True, True)
    return task, model


def _loss_and_grads(task, model, batches):
    """Summed assistant-token loss, its token count and the gradients over several micro-batches."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for batch in batches:
        output, loss_func = task.forward(model, batch)
        loss_sum, num_tokens = loss_func(output)
        loss_sum.backward()
        total += loss_sum.item()
        count += int(num_tokens)
    return total, count, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_batch_matches_unpacked(sft):
    task, model = sft
    data = task.dataset()
    samples = [data[i] for i in (0, 5, 9, 17, 30)]  # conversations of different lengths, some multi-turn
    assert len({len(s["tokens"]) for s in samples}) == 5
    pad = task.pad_id()

    want_loss, want_count, want = _loss_and_grads(task, model, [pad_rows([s], pad) for s in samples])
    assert want_count == sum(int(s["loss_mask"].sum()) for s in samples) > 0
    variants = {
        "one row": [pack(samples)],
        "two rows": [pack(samples[:2]), pack(samples[2:])],
        "padded rows (pipeline)": [pack(samples[:3], pad_to=512, pad_id=pad), pack(samples[3:], pad_to=512, pad_id=pad)],
        "unpacked, one batch": [pad_rows(samples, pad)],
    }
    for name, batches in variants.items():
        loss, count, got = _loss_and_grads(task, model, batches)
        assert count == want_count, name
        assert loss == pytest.approx(want_loss, rel=1e-6), name
        for key in want:
            atol = 1e-4 * want[key].abs().max().item()
            torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=atol, msg=lambda m, k=key, v=name: f"{v}, {k}: {m}")


def test_packing_is_not_a_plain_concatenation(sft):
    """The second conversation of a packed row sees only itself: its per-token losses are those of
    it alone; plainly concatenated (no boundaries, positions running on) they are not."""
    task, model = sft
    data = task.dataset()
    first, second = data[0], data[5]
    row = pack([first, second])
    plain = {k: v for k, v in row.items() if k not in ("cu_seqlens", "max_seqlen")}
    plain["position_ids"] = torch.arange(row["tokens"].shape[1])[None]
    n = len(first["tokens"])
    with torch.no_grad():
        alone = task.forward(model, pad_rows([second]))[0][0]
        packed = task.forward(model, row)[0][0, n:]
        concatenated = task.forward(model, plain)[0][0, n:]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (concatenated - alone).abs().max() > 1e-2
