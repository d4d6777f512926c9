"""Worker of test_llm_qwen3_5.py's CP test (run under torchrun): one Gated DeltaNet layer under
context parallelism against the same layer on the whole sequence in the same process.

Every rank builds both layers from one seed, runs the whole sequences (dense rows, then a packed
row) through the plain layer and its load-balanced share through the CP layer, and checks its
output rows, its input gradient rows and the CP-summed parameter gradients against the
whole-sequence ones. Prints ``ok`` on success."""

import sys

import torch


def main() -> int:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.llm.layers.context_parallel_attention import thd_zigzag_index, zigzag_index
    from loongforge.llm.layers.gated_delta_net import GatedDeltaNet

    cp = int(sys.argv[1])
    ctx = init_parallel(cp=cp)
    group = ctx.pgs.cp
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=cp,
                               layernorm_epsilon=1e-6)
    shape = dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)
    torch.manual_seed(0)
    whole = GatedDeltaNet(config, 1, **shape)
    split = GatedDeltaNet(config, 1, pg_collection=ctx.pgs, **shape)
    split.load_state_dict(whole.state_dict())

    def check(out_local, x_local, out, x_whole, index, what):
        torch.testing.assert_close(out_local, out[index].detach(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")
        torch.testing.assert_close(x_local.grad, x_whole.grad[index], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{what} input grad: {m}")
        for (name, p), q in zip(split.named_parameters(), whole.parameters()):
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad, group=group)
            torch.testing.assert_close(grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{what} {name}: {m}")
        whole.zero_grad()
        split.zero_grad()

    # dense rows: each rank holds chunks r and 2cp-1-r of every row
    s, b = 16 * cp, 2
    x = torch.randn(s, b, 32)
    grad_out = torch.randn(s, b, 32)
    x_whole = x.clone().requires_grad_()
    out, _ = whole(x_whole)
    out.backward(grad_out)
    index = zigzag_index(s, cp, group.rank())
    x_local = x[index].clone().requires_grad_()
    out_local, _ = split(x_local)
    out_local.backward(grad_out[index])
    check(out_local, x_local, out, x_whole, index, "dense")

    # a packed row: sequences padded to multiples of 2cp, each split into its own 2cp chunks (of a
    # single token in the second: shorter than the convolution's reach)
    cu = torch.tensor([0, 8 * cp, 10 * cp, 22 * cp], dtype=torch.int32)
    t = int(cu[-1])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=t, max_seqlen_kv=t)
    x = torch.randn(t, 1, 32)
    grad_out = torch.randn(t, 1, 32)
    x_whole = x.clone().requires_grad_()
    out, _ = whole(x_whole, packed_seq_params=params)
    out.backward(grad_out)
    index = thd_zigzag_index(cu, cp, group.rank())
    x_local = x[index].clone().requires_grad_()
    out_local, _ = split(x_local, packed_seq_params=params)
    out_local.backward(grad_out[index])
    check(out_local, x_local, out, x_whole, index, "packed")
    print("ok", flush=True)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
