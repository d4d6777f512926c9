"""Worker of test_llm_qwen3_5.py's TP and CP tests (run under torchrun): one Gated DeltaNet layer under
tensor parallelism (and context parallelism, and sequence parallelism, as asked) against the same
layer whole in the same process.

    torchrun --nproc-per-node=TP*CP gdn_tp_probe.py TP CP SP     # SP: 0 or 1

Every rank builds the whole layer (TP = CP = 1: groups of its own) and the split one from the
same seed, checks that the split one's weights are its shards of the whole one's (weights are
drawn whole, then sharded) and that its sharded state dict, gathered from every rank, is the
whole layer's state dict. It then runs the whole sequences (dense rows, then a packed row) through
the whole layer and its share through the split one: its output rows, its input gradient rows and
its shard of every parameter gradient (summed over CP) must be the whole layer's. Prints ``ok``
on success."""

import sys

import torch
import torch.distributed as dist

HIDDEN = 32
SHAPE = dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)


def own_groups():
    """A ``ProcessGroupCollection`` of one process (every rank takes part in making every group)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    mine = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            mine = group
    return ProcessGroupCollection(tp=mine, cp=mine)


def shard_of(split, whole_tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The split layer's shard of the whole layer's tensor ``name`` (a parameter or its gradient)."""
    sections = {n: sections for n, _, sections in split.split_parameters()}
    if name in sections:
        return split.shards.shard(whole_tensor, sections[name])
    if name == "out_proj.weight":
        return whole_tensor.chunk(split.shards.tp, dim=1)[split.shards.rank]
    return whole_tensor


def main() -> int:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.llm.layers.context_parallel_attention import thd_zigzag_index, zigzag_index
    from loongforge.llm.layers.gated_delta_net import GatedDeltaNet

    tp, cp, sp = int(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3]))
    ctx = init_parallel(tp=tp, cp=cp)
    tp_group, cp_group = ctx.pgs.tp, ctx.pgs.cp
    tp_rank = tp_group.rank()

    def config(tp_size, cp_size, sequence_parallel):
        return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, layernorm_epsilon=1e-6,
                                 tensor_model_parallel_size=tp_size, context_parallel_size=cp_size,
                                 sequence_parallel=sequence_parallel, use_cpu_initialization=True)

    alone = own_groups()
    torch.manual_seed(0)
    whole = GatedDeltaNet(config(1, 1, False), 1, pg_collection=alone, **SHAPE)
    torch.manual_seed(0)
    split = GatedDeltaNet(config(tp, cp, sp), 1, pg_collection=ctx.pgs, **SHAPE)
    whole_params = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p, shard_of(split, whole_params[name], name), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"initial {name}: {m}")
    from llm_grad_probe import whole_state

    state = whole_state(split)
    for name, p in whole_params.items():
        torch.testing.assert_close(state.pop(name), p, rtol=0, atol=0, msg=lambda m, name=name: f"saved {name}: {m}")
    assert not state, f"sharded state dict keys the whole layer does not have: {sorted(state)}"

    def check(out_local, x_local, out, x_whole, index, what):
        torch.testing.assert_close(out_local, out[index].detach(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")
        torch.testing.assert_close(x_local.grad, x_whole.grad[index], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{what} input grad: {m}")
        for name, p in split.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=cp_group)
            want = shard_of(split, whole_params[name].grad, name)
            torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{what} {name}: {m}")
        whole.zero_grad()
        split.zero_grad()

    def share(index: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole sequence: its CP share, its TP part of that under SP."""
        return index.chunk(tp)[tp_rank] if sp else index

    # dense rows: each CP rank holds chunks r and 2cp-1-r of every row
    s, b = 8 * cp * tp, 2
    x = torch.randn(s, b, HIDDEN)
    grad_out = torch.randn(s, b, HIDDEN)
    x_whole = x.clone().requires_grad_()
    out, _ = whole(x_whole)
    out.backward(grad_out)
    index = share(zigzag_index(s, cp, cp_group.rank()))
    x_local = x[index].clone().requires_grad_()
    out_local, _ = split(x_local)
    out_local.backward(grad_out[index])
    check(out_local, x_local, out, x_whole, index, "dense")

    # a packed row: sequences padded to multiples of 2cp (the second shorter than the convolution's reach per chunk)
    cu = torch.tensor([0, 8 * cp, 10 * cp, 24 * cp], dtype=torch.int32) * tp
    t = int(cu[-1])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=t, max_seqlen_kv=t)
    x = torch.randn(t, 1, HIDDEN)
    grad_out = torch.randn(t, 1, HIDDEN)
    x_whole = x.clone().requires_grad_()
    out, _ = whole(x_whole, packed_seq_params=params)
    out.backward(grad_out)
    index = share(thd_zigzag_index(cu, cp, cp_group.rank()))
    x_local = x[index].clone().requires_grad_()
    out_local, _ = split(x_local, packed_seq_params=params)
    out_local.backward(grad_out[index])
    check(out_local, x_local, out, x_whole, index, "packed")
    print("ok", flush=True)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
