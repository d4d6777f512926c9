"""A small megatron-core training step on CPU: GPT with an alltoall-dispatched MoE layer,
DDP, Adam with grad clipping, activation recompute, the RoPE slice of a context-parallel rank (``SCENARIO_EP=2`` under torchrun: expert
parallel, so the alltoall dispatcher exchanges tokens over gloo). Exits 0 when the step ran; used by
test_cpu_megatron.py with one adaptation left out at a time."""

import os

import torch
import torch.nn.functional as F

from loongforge.core.parallel import destroy_parallel, init_parallel

EP = int(os.environ.get("SCENARIO_EP", "1"))
ctx = init_parallel(ep=EP, seed=5)
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

cfg = TransformerConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
    gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
    hidden_dropout=0.1, attention_dropout=0.0, num_moe_experts=2, expert_model_parallel_size=EP, moe_router_topk=1, moe_router_pre_softmax=True,
    moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=64, moe_grouped_gemm=False,
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
    calculate_per_token_loss=True, bias_dropout_fusion=False, apply_rope_fusion=False,
)
model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False, normalization="RMSNorm"),
                 vocab_size=64, max_sequence_length=16, position_embedding_type="rope", pg_collection=ctx.pgs)
ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, pg_collection=ctx.pgs)
cfg.finalize_model_grads_func = finalize_model_grads
opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [ddp],
                             use_gloo_process_groups=False, pg_collection=ctx.pgs)
tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))


def step(it, m):
    b = next(it)
    out = m(b[:, :-1], torch.arange(16).expand(2, 16), None, labels=b[:, 1:])
    return out, lambda o: (o.sum(), torch.tensor(o.numel()), {"loss": (o.sum().detach(), o.numel())})


ddp.zero_grad_buffer()
get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=[ddp], num_microbatches=1,
                            seq_length=16, micro_batch_size=2, forward_only=False)
ok, grad_norm, _ = opt.step()
assert ok and grad_norm > 0, (ok, grad_norm)
# RoPE angles of this context-parallel rank, as megatron's MLA and local attention take them under CP
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank  # noqa: E402

assert get_pos_emb_on_this_cp_rank(torch.arange(8.0).view(8, 1, 1, 1), 0, ctx.pgs.cp).shape[0] == 8
destroy_parallel()
print("SCENARIO OK")
