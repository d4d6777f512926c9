"""An offline tokenizer for instructions and discretised state.

Bytes of the UTF-8 instruction become tokens ``4..259``; with ``discrete_state`` the normalised
state (in [-1, 1]) is cut into 256 bins (Pi0.5's state discretisation) that become tokens
``260..515``. Layout: ``BOS task-bytes SEP [state-bins SEP]``, right-padded with PAD to ``max_len``.
A real PaliGemma tokenizer can replace it when weights are imported: only token ids matter.
"""

from __future__ import annotations

import torch

PAD, BOS, EOS, SEP = 0, 1, 2, 3
BYTE_OFFSET = 4
STATE_OFFSET = BYTE_OFFSET + 256
STATE_BINS = 256


def clean_instruction(text: str) -> str:
    return text.strip().replace("_", " ").replace("\n", " ")


def discretize_state(state: torch.Tensor, bins: int = STATE_BINS) -> torch.Tensor:
    """Bin index in [0, bins) of each value of a [-1, 1]-normalised state (values outside clamp)."""
    edges = torch.linspace(-1.0, 1.0, bins + 1, dtype=torch.float64)[:-1]
    idx = torch.bucketize(state.double(), edges, right=True) - 1
    return idx.clamp(0, bins - 1)


class ByteTokenizer:
    vocab_size = STATE_OFFSET + STATE_BINS

    def __init__(self, max_len: int, discrete_state: bool):
        self.max_len = max_len
        self.discrete_state = discrete_state

    def encode(self, task: str, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [max_len] int64, mask [max_len] bool)``; the instruction is truncated to fit."""
        tail: list[int] = []
        if self.discrete_state:
            if state is None:
                raise ValueError("this tokenizer discretises the state into the prompt, but no state was given")
            tail = [STATE_OFFSET + int(b) for b in discretize_state(state.reshape(-1))] + [SEP]
        room = self.max_len - 2 - len(tail)
        if room < 0:
            raise ValueError(
                f"policy.max_token_len={self.max_len} is too short for {len(tail) - 1} state tokens plus BOS/SEP"
            )
        text = list(clean_instruction(task).encode("utf-8"))[:room]
        ids = [BOS] + [BYTE_OFFSET + b for b in text] + [SEP] + tail
        mask = [True] * len(ids) + [False] * (self.max_len - len(ids))
        ids = ids + [PAD] * (self.max_len - len(ids))
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)
