"""ChunkPipe for the GPT families (``train.seq_chunks=N``): each micro-batch's sequences go through
the model in ``N`` chunks (``loongforge.core.training.chunk_pipe``: the forward keeps only every
attention layer's keys and values; the backward runs the chunks again, last to first).

What a chunk carries to the chunks after it: every ``FusedSelfAttention`` layer's keys (after RoPE)
and values. While chunk ``i`` runs, each layer gets a ``ChunkAttentionState``: the rows of the
whole sequence's RoPE angles at the chunk's positions, and the keys and values of chunks
``0 .. i-1``, which it puts before its own (the attention is causal, its queries aligned with the
last keys). The model's own forward runs unchanged on the chunk's tokens and labels and returns the
chunk's per-token losses.

Under pipeline parallelism each stage runs its own layers' chunks: a stage after the first takes
the chunk's hidden states from the stage before (the model's ``set_input_tensor``) and a stage
before the last hands its hidden states on; the chunks of a micro-batch fill the pipeline over
the model's pipeline group (``loongforge.core.training.chunk_pipe.Stage``).

Where it runs: the dense fast layer spec (llama, qwen2, qwen3, mistral), unpacked sequences, no
context parallelism, no dropout, no other recomputation (each chunk is recomputed already);
``check_chunk_pipe`` refuses the rest before any process group is made.
"""

from __future__ import annotations

import torch

from loongforge.core.config import ConfigError
from loongforge.core.training.chunk_pipe import Stage, chunked_loss
from loongforge.llm.layers.chunk_attention_state import ChunkAttentionState

DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


class GPTChunks:
    """One micro-batch of a GPT model (this rank's pipeline stage of it) as ``ChunkedModel`` chunks
    (``chunks`` equal pieces of the sequence); ``model`` is the engine's wrapped model, called as the
    task calls it."""

    def __init__(self, model, batch: dict[str, torch.Tensor], chunks: int):
        from megatron.core.utils import unwrap_model

        from loongforge.llm.layers.self_attention import FusedSelfAttention

        self.model, self.batch, self.chunks = model, batch, chunks
        inner = self.inner = unwrap_model(model)
        self.layers = [m for m in inner.modules() if isinstance(m, FusedSelfAttention)]
        seq = batch["tokens"].shape[1]
        if seq % chunks:
            raise ValueError(f"ChunkPipe: a sequence of {seq} tokens does not split into {chunks} equal chunks")
        if not self.layers or getattr(inner, "rotary_pos_emb", None) is None:
            raise ValueError("ChunkPipe: the model has no FusedSelfAttention layer with rotary embeddings")
        self.size = seq // chunks
        self.loss_shape = tuple(batch["tokens"].shape)
        with torch.no_grad():
            self.angles = inner.rotary_pos_emb(seq)  # [seq, 1, 1, rot_dim], fp32

    def input_buffer(self, index: int) -> torch.Tensor:
        config = self.inner.config
        dtype = config.pipeline_dtype or config.params_dtype
        shape = (self.size, self.batch["tokens"].shape[0], config.hidden_size)  # [chunk, b, h]
        return torch.empty(shape, dtype=dtype, device=self.batch["tokens"].device)

    def run_chunk(self, index: int, carried: list[list[torch.Tensor]], stage_input: torch.Tensor | None):
        rows = slice(index * self.size, (index + 1) * self.size)
        prefix = {id(layer): [(chunk[2 * n], chunk[2 * n + 1]) for chunk in carried]
                  for n, layer in enumerate(self.layers)}
        state = ChunkAttentionState(self.angles[rows], prefix)
        for layer in self.layers:
            layer.chunk_state = state
        if stage_input is not None:
            self.inner.set_input_tensor(stage_input)
        try:
            b = self.batch
            out = self.model(b["tokens"][:, rows], b["position_ids"][:, rows], None, labels=b["labels"][:, rows],
                             loss_mask=b["loss_mask"][:, rows])
        finally:
            for layer in self.layers:
                layer.chunk_state = None
            if stage_input is not None:
                self.inner.set_input_tensor(None)
        own = [t for layer in self.layers for t in state.produced[id(layer)]]
        return out, own


def chunked_forward(model, batch: dict[str, torch.Tensor], chunks: int) -> torch.Tensor:
    """The micro-batch's ``[b, s]`` per-token losses, computed chunk by chunk (ChunkPipe) on this
    pipeline stage and passed through the model's pipeline group (zeros before the last stage)."""
    chunked = GPTChunks(model, batch, chunks)
    return chunked_loss(chunked, list(model.parameters()), Stage(chunked.inner.pg_collection.pp))


def check_chunk_pipe(chunks: int, *, family: str, seq_length: int, parallel, recompute: str,
                     packed: bool = False) -> None:
    """Refuse, naming the key, what ChunkPipe does not run with (see the module docstring)."""
    if chunks == 1:
        return
    key = f"train.seq_chunks={chunks}"
    if family not in DENSE_FAMILIES:
        raise ConfigError(f"{key}: ChunkPipe runs the dense families ({', '.join(DENSE_FAMILIES)}), "
                          f"not model.family={family}")
    if seq_length % chunks:
        raise ConfigError(f"{key}: train.seq_length={seq_length} is not a multiple of the chunk count")
    if parallel.cp > 1:
        raise ConfigError(f"{key} with parallel.cp={parallel.cp}: ChunkPipe runs without context parallelism")
    if recompute != "none":
        raise ConfigError(f"{key} with train.recompute={recompute}: ChunkPipe recomputes every chunk already; "
                          "use train.recompute=none")
    if packed:
        raise ConfigError(f"{key}: ChunkPipe runs unpacked sequences (pre-training), not packed SFT rows")
