"""Context parallelism for ``GatedDeltaNet``: sequential state passing over the CP group.

Each CP rank holds megatron's load-balanced share of every sequence: of its ``2 cp`` equal chunks,
chunks ``r`` and ``2 cp - 1 - r``, side by side (a packed row: per packed sequence, in row order,
each padded to a multiple of ``2 cp``; dense rows are handled as one packed row of whole rows). The
chunks run in sequence order, chunk ``j`` of every sequence at once on its owner: the convolution
reads the last ``K - 1`` convolution inputs before the chunk (the tail, however many chunks back
they lie) and the delta rule starts from the state chunk ``j - 1`` ended with; the owner then hands
the states and tails on. Every hand-over between ranks is one all-gather over the CP group
(megatron's ``gather_from_sequence_parallel_region``: its backward reduce-scatters, so the
gradients of the states and the tails flow back to the rank that made them). Every rank takes part
in every hand-over, and each rank's part of hand-over ``i + 1`` is computed from what hand-over
``i`` gave it (a rank that ran nothing in between passes that on), so the backward runs the
collectives in one order on every rank; the last hand-over's result, which only chunk
``2 cp - 1``'s owner reads, is tied into the other ranks' output with weight zero for the same
reason. The work is sequential across the group, as the recurrence is.
"""

from __future__ import annotations

import torch

from loongforge.llm.layers.context_parallel_attention import gather_kv


def chunk_owner(chunk: int, cp: int) -> int:
    """The CP rank holding chunk ``chunk`` of ``2 cp`` (load-balanced split)."""
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def _chunk_lengths(bounds: list[int], cp: int) -> list[int]:
    lengths = [e - s for s, e in zip(bounds, bounds[1:])]
    uneven = [n for n in lengths if n % (2 * cp)]
    if uneven:
        raise ValueError(f"GatedDeltaNet: sequences of {uneven} tokens do not split into 2*cp = {2 * cp} equal chunks "
                         "(pad each packed sequence to a multiple of 2*cp: cu_seqlens_q_padded)")
    return [n // (2 * cp) for n in lengths]


def context_parallel_delta_net(layer, features: dict, bounds: list[int] | None) -> torch.Tensor:
    """This rank's mixer output ``[b, s_local, Hv, Dv]`` (see the module docstring); ``bounds``: a
    packed row's whole-row (padded) sequence bounds, ``None`` for dense rows."""
    group = layer.cp_group
    cp, rank = group.size(), group.rank()
    b, local = features["qkv"].shape[:2]
    if bounds is None:  # dense rows: one packed row of b sequences
        bounds = [i * local * cp for i in range(b + 1)]
        features = {key: value.reshape(1, b * local, *value.shape[2:]) for key, value in features.items()}
    out = _packed(layer, features, _chunk_lengths(bounds, cp), cp, rank)
    return out.reshape(b, local, *out.shape[2:])


def _packed(layer, features: dict, n: list[int], cp: int, rank: int) -> torch.Tensor:
    """The packed row's output: ``n[i]`` tokens per chunk of sequence ``i``."""
    qkv = features["qkv"]
    device = qkv.device
    taps, channels, count = layer.conv_taps, qkv.shape[-1], len(n)
    sizes = torch.tensor(n, device=device)
    starts = torch.cumsum(torch.tensor([0] + [2 * k for k in n[:-1]], device=device), 0)  # each sequence's local rows
    longest = max(n)
    rows_of_seq = torch.repeat_interleave(torch.arange(count, device=device), sizes)
    within = torch.cat([torch.arange(k, device=device) for k in n])

    def rows(chunk: int) -> torch.Tensor:  # this rank's rows of chunk ``chunk`` of every sequence
        return starts[rows_of_seq] + (0 if chunk == rank else sizes[rows_of_seq]) + within

    cu = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])
    state_shape = (count, layer.num_value_heads, layer.key_head_dim, layer.value_head_dim)
    state_size = count * layer.num_value_heads * layer.key_head_dim * layer.value_head_dim
    tail_shape = (count, taps - 1, channels)
    state, tail, carried = None, qkv.new_zeros(tail_shape), None
    pieces, order = [], []
    for chunk in range(2 * cp):
        owner = chunk_owner(chunk, cp)
        if owner == rank:
            index = rows(chunk)
            padded = qkv.new_zeros(count, longest, channels).index_put((rows_of_seq, within), qkv[0, index])
            positions = chunk * sizes[:, None] + torch.arange(longest, device=device)[None]
            mixed = layer.conv(padded, positions, tail)[rows_of_seq, within][None]
            out, state = layer.rule(mixed, features["g"][:, index], features["beta"][:, index], cu, state)
            pieces.append(out[0])
            order.append(index)
            # the last K - 1 inputs up to this chunk's end, per sequence (earlier chunks' where it is short)
            history = torch.cat([tail, padded], dim=1)
            last = sizes[:, None] + torch.arange(taps - 1, device=device)[None]
            tail = history.gather(1, last[..., None].expand(-1, -1, channels))
        if chunk == 2 * cp - 1 or chunk_owner(chunk + 1, cp) == owner:
            continue  # the end, or the next chunk is the same rank's: nothing to hand over
        if owner == rank:
            assert state is not None  # this rank ran chunk ``chunk`` just above
            made = torch.cat([state.reshape(-1), tail.float().reshape(-1)])
        elif carried is not None:
            made = carried
        else:  # before any hand-over reached this rank (needing a gradient: its hand-over has a backward)
            made = qkv.new_zeros(state_size + tail.numel(), dtype=torch.float32, requires_grad=True)
        carried = gather_kv(made[None].contiguous(), layer.cp_group)[owner]
        state = carried[:state_size].view(state_shape)
        tail = carried[state_size:].view(tail_shape).to(qkv.dtype)
    out = torch.cat(pieces)[torch.argsort(torch.cat(order))][None]
    if rank != 0 and carried is not None:  # the last hand-over's result: read by rank 0 alone (see above)
        out = out + 0.0 * carried.sum().to(out.dtype)
    return out
