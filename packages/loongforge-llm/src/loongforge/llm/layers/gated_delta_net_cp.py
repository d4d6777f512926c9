"""Context parallelism for ``GatedDeltaNet``: sequential state passing over the CP group.

Each CP rank holds megatron's load-balanced share of every sequence, chunks ``r`` and
``2 cp - 1 - r`` of ``2 cp`` equal chunks. The chunks run in sequence order: chunk ``j``'s owner
runs the convolution and the delta rule on it, starting from the state chunk ``j - 1`` ended
with and reading chunk ``j - 1``'s last ``K - 1`` convolution inputs (its tail), then hands its
final state and its tail on. Every hand-over between ranks is one all-gather over the CP group
(megatron's ``gather_from_sequence_parallel_region``: its backward reduce-scatters, so the
gradients of the state and the tail flow back to the rank that made them). Every rank takes part
in every hand-over, and each rank's part of hand-over ``i + 1`` is computed from what hand-over
``i`` gave it, so the backward runs the collectives in one order on every rank; the last
hand-over's result, which only chunk ``2 cp - 1``'s owner reads, is tied into the other ranks'
output with weight zero for the same reason.

The work is sequential (one chunk at a time across the group), as the recurrence is. Dense rows
only: packed rows under CP are refused.
"""

from __future__ import annotations

import torch

from loongforge.llm.layers.context_parallel_attention import gather_kv


def chunk_owner(chunk: int, cp: int) -> int:
    """The CP rank holding chunk ``chunk`` of ``2 cp`` (load-balanced split)."""
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def context_parallel_delta_net(layer, features: dict, bounds: list[int] | None) -> torch.Tensor:
    """This rank's mixer output ``[b, s_local, Hv, Dv]`` (see the module docstring)."""
    if bounds is not None:
        raise ValueError("GatedDeltaNet: packed (thd) rows under context parallelism are not supported")
    group = layer.cp_group
    cp, rank = group.size(), group.rank()
    qkv = features["qkv"]
    b, local, _ = qkv.shape
    taps = layer.conv_taps
    if local % 2 or local // 2 < taps - 1:
        raise ValueError(f"GatedDeltaNet: this CP rank's {local} tokens must be two chunks of at least "
                         f"{taps - 1} tokens (the convolution's reach)")
    n = local // 2
    halves = {rank: slice(0, n), 2 * cp - 1 - rank: slice(n, local)}  # chunk -> this rank's rows
    state_shape = (b, layer.num_value_heads, layer.key_head_dim, layer.value_head_dim)
    state_size = b * layer.num_value_heads * layer.key_head_dim * layer.value_head_dim
    tail_shape = (b, taps - 1, qkv.shape[-1])

    outputs, state, tail, carried = {}, None, None, None
    for chunk in range(2 * cp):
        owner = chunk_owner(chunk, cp)
        if owner == rank:
            rows = halves[chunk]
            part = {key: features[key][:, rows] for key in ("qkv", "g", "beta")}
            positions = (chunk * n + torch.arange(n, device=qkv.device)).expand(b, n)
            outputs[chunk], state = layer.mix(part, positions, tail if taps > 1 else None, None, state)
            tail = part["qkv"][:, n - taps + 1 :]
        if chunk == 2 * cp - 1 or chunk_owner(chunk + 1, cp) == owner:
            continue  # the end, or the next chunk is the same rank's: nothing to hand over
        # one hand-over: the state and the convolution tail, flat; a rank that did not run this
        # chunk passes on what the previous hand-over gave it (or zeros before the first)
        if owner == rank:
            made = torch.cat([state.reshape(-1), tail.float().reshape(-1)])
        elif carried is not None:
            made = carried
        else:
            # (needing a gradient, so that this rank's hand-over has a backward, as the others' do)
            made = qkv.new_zeros(state_size + tail_shape[0] * tail_shape[1] * tail_shape[2], dtype=torch.float32,
                                 requires_grad=True)
        carried = gather_kv(made[None].contiguous(), group)[owner]
        state = carried[:state_size].view(state_shape)
        tail = carried[state_size:].view(tail_shape).to(qkv.dtype)
    out = torch.cat([outputs[rank], outputs[2 * cp - 1 - rank]], dim=1)
    if rank != 0 and carried is not None:  # the last hand-over's result: read by rank 0 alone (see above)
        out = out + 0.0 * carried.sum().to(out.dtype)
    return out
