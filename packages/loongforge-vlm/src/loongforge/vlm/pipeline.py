"""Pipeline parallelism (``parallel.pp > 1``) of the VLM's foundation.

The foundation is split into ``pp`` stages of ``foundation.num_layers / pp`` layers each, as
loongforge-llm's GPT model is (megatron's ``GPTModel`` with ``pre_process`` on the first stage and
``post_process`` on the last). The vision tower (encoder, projector and DeepStack's mergers)
lives on the first stage only: it embeds the text tokens, scatters the projected vision features
into the image/video placeholder positions, adds DeepStack's features to the outputs of its first
layers and runs its share of the foundation's layers. Later stages receive the hidden states
through megatron-core's pipeline schedule (1F1B, driven by the core megatron engine); the last
stage computes the per-token loss.

Every rank of a pipeline collates the same micro-batches (the balancer plans per DP rank, which
the stages of one pipeline share), so each stage reads from the batch what it needs: the first
stage the tokens and the media, every stage the (multimodal RoPE) positions and the THD row's
``cu_seqlens``, the last stage the labels and the loss mask.

By default the tower runs inside each micro-batch's forward and backward on the first stage; with
``parallel.encoder.decoupled`` it runs once per step, before and after the schedule
(``loongforge.vlm.encoder_stage``).

The VLM's micro-batches are packed by vision-aware cost and vary in length, so the stages
exchange each micro-batch's hidden-state shape before its tensor (megatron-core's
``variable_seq_lengths``) instead of padding every row to ``train.seq_length``.

With context parallelism (``parallel.cp > 1``, ``loongforge.vlm.context_parallel``) every stage
has its own CP group (megatron's ``ctx.pgs.cp``), and rank ``r`` of one stage's group pipelines
with rank ``r`` of the next: every rank collates the same row and keeps its share (``cp_index``,
with its positions, labels and loss mask; ``cu_seqlens`` stay the whole row's, which the
attention of every stage reads), so the stages exchange this CP rank's rows of each micro-batch.
The first stage's CP group shares out the images (the tower's ``pgs.cp``), every stage's
attention all-gathers keys and values over its own CP group, and the last stage's loss covers
this CP rank's tokens.
"""

from __future__ import annotations


def pipeline_config_kwargs(pp: int, foundation_kwargs: dict) -> dict:
    """``foundation_kwargs`` (the foundation's ``TransformerConfig`` fields) with what pipeline
    parallelism needs: shapes exchanged per micro-batch (the VLM's packed rows vary in length).
    megatron checks that its MoE token dispatcher takes such shapes even for a dense model, whose
    default (allgather) does not; a dense foundation dispatches nothing, so it names alltoall
    (``check_pipeline`` refuses an MoE foundation on allgather)."""
    if pp == 1:
        return foundation_kwargs
    return {"moe_token_dispatcher_type": "alltoall", **foundation_kwargs, "variable_seq_lengths": True}


def check_pipeline(cfg) -> None:
    """Refuse (before any process group) what the VLM's pipeline cannot run, for a ``VLMConfig``
    with ``parallel.pp > 1``: layers that do not split evenly, DeepStack features meant for layers
    past the first stage, and megatron's allgather MoE dispatcher (no variable sequence lengths)."""
    pp, f = cfg.parallel.pp, cfg.foundation
    if f.num_layers % pp:
        raise ValueError(f"parallel.pp={pp}: foundation.num_layers={f.num_layers} does not split into {pp} "
                         f"stages of equal layers")
    deep = list(cfg.encoder.deepstack_indices())
    first_stage = f.num_layers // pp
    if len(deep) > first_stage:
        raise ValueError(f"parallel.pp={pp} with encoder.deepstack_layers={deep}: DeepStack adds its {len(deep)} "
                         f"features to foundation layers 0..{len(deep) - 1}, but the first pipeline stage (which "
                         f"holds the vision tower) has layers 0..{first_stage - 1} of foundation.num_layers="
                         f"{f.num_layers}; lower parallel.pp or use fewer encoder.deepstack_layers")
    if getattr(f, "moe_token_dispatcher", None) == "allgather":
        raise ValueError(f"parallel.pp={pp} with foundation.moe_token_dispatcher=allgather: the VLM's pipeline "
                         f"sends micro-batches of varying length, which megatron's allgather dispatcher does not "
                         f"take; use alltoall")
