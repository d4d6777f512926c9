"""The model's vocabulary holds every token id the data feeds it (``model.vocab_size``).

An id past the embedding table is not a model error but a data one: a tokenizer larger than the
model (``check_tokenizer_fits``, before any step), or an indexed dataset preprocessed with another
tokenizer (``check_token_ids``, on each step's samples before they reach the model).
"""

from __future__ import annotations

import torch

from loongforge.llm.data.errors import DataError


def check_tokenizer_fits(tokenizer: str, size: int, vocab_size: int) -> None:
    """A tokenizer of ``size`` ids fits a model of ``vocab_size``."""
    if size > vocab_size:
        raise DataError(f"tokenizer {tokenizer} has {size} tokens, more than model.vocab_size={vocab_size}")


def check_token_ids(batch: dict[str, torch.Tensor], sample_ids: list[int], vocab_size: int, data: str) -> None:
    """Every id of a collated ``[b, s]`` batch (``tokens`` and ``labels``) is below ``vocab_size``;
    ``sample_ids`` are the batch rows' dataset indices, ``data`` names the dataset."""
    top = torch.maximum(batch["tokens"].amax(dim=1), batch["labels"].amax(dim=1))
    bad = torch.nonzero(top >= vocab_size).flatten()
    if len(bad):
        row = int(bad[0])
        raise DataError(f"{data}: sample {sample_ids[row]} holds token id {int(top[row])}, not below "
                        f"model.vocab_size={vocab_size} (was the data preprocessed with another tokenizer?)")
