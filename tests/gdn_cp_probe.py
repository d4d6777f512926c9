"""Worker of test_llm_qwen3_5_cli's CP test (run under torchrun): one Gated DeltaNet layer under
context parallelism against the same layer on the whole sequence in the same process.

Every rank builds both layers from one seed, runs the whole sequence through the plain layer and
its load-balanced share through the CP layer, and checks its output rows, its input gradient rows
and the CP-summed parameter gradients against the whole-sequence ones. Prints ``ok`` on success."""

import sys

import torch


def main() -> int:
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.llm.layers.context_parallel_attention import zigzag_index
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
    torch.testing.assert_close(out_local, out[index].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_local.grad, x_whole.grad[index], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    print("ok", flush=True)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
