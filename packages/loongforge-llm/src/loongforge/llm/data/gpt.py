"""GPT training samples over preprocessed indexed datasets, built by megatron-core.

``build_gpt_dataset`` takes one prefix, a list of prefixes (mixed in proportion to their token
counts) or a blend ``[(weight, prefix), ...]`` (a continued-pre-training mix; weights need not sum
to one), and returns megatron-core's ``GPTDataset`` (one prefix) or ``BlendedDataset`` (several),
with the single split "train". An item is a dict of ``seq_length`` tensors::

    tokens       int64   input ids
    labels       int64   tokens shifted left by one (the next token at each position)
    loss_mask    float32 1.0, 0.0 where the label is padding (and after EOD with eod_mask_loss)
    position_ids int64   0 .. seq_length-1

plus ``dataset_id`` (which prefix it came from) for blends. Samples are windows over the shuffled
concatenation of documents (EOD-separated), ``seq_length + 1`` tokens each; documents are reused
for as many epochs as ``num_samples`` needs, and the dataset holds at least ``num_samples`` items.

The sample indices are cached in ``cache_dir`` (keyed by data, tokenizer, seed, lengths). Without
torch.distributed every call builds or loads them itself; with it, every rank must call
``build_gpt_dataset``: rank 0 builds the indices first, the others wait on a barrier and load them,
as megatron-core does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence, Union

from loongforge.llm.data.errors import DataError
from loongforge.llm.data.tokenizer import TextTokenizer, load_tokenizer

PathLike = Union[str, Path]
DataSpec = Union[PathLike, Sequence[PathLike], Sequence[tuple[float, PathLike]]]


def _is_pair(item) -> bool:
    return (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[0], (int, float))
        and not isinstance(item[0], bool)
        and isinstance(item[1], (str, Path))
    )


def _check_prefix(prefix: str) -> None:
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not Path(p).is_file()]
    if missing:
        raise DataError(
            f"dataset prefix {prefix}: {' and '.join(missing)} not found "
            f"(write them with `lf-llm preprocess --output-prefix {prefix} ...`)"
        )


def _token_count(prefix: str) -> int:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # Keep the dataset alive while reading: its __del__ unmaps the index the lengths point into.
    dataset = IndexedDataset(prefix)
    count = int(dataset.sequence_lengths.sum(dtype="int64"))
    del dataset
    return count


def resolve_blend(data: DataSpec) -> tuple[list[str], list[float] | None]:
    """``data`` as megatron-core's blend: (prefixes, weights or None for a single prefix)."""
    if isinstance(data, (str, Path)):
        items: list = [data]
    elif isinstance(data, Sequence) and len(data) > 0:
        items = list(data)
    else:
        raise DataError(f"data={data!r}: expected a dataset prefix, a list of prefixes or [(weight, prefix), ...]")

    pairs = [_is_pair(item) for item in items]
    if all(pairs):
        weights = [float(w) for w, _ in items]
        prefixes = [str(Path(p).expanduser()) for _, p in items]
        for weight, prefix in zip(weights, prefixes):
            if not math.isfinite(weight) or weight <= 0:
                raise DataError(f"blend weight {weight} for {prefix}: must be a positive number")
    elif not any(pairs) and all(isinstance(item, (str, Path)) for item in items):
        prefixes = [str(Path(p).expanduser()) for p in items]
        weights = None
    else:
        raise DataError(
            f"data={data!r}: mixes plain prefixes and (weight, prefix) pairs, or holds something else; "
            "give all prefixes or all (weight, prefix) pairs"
        )
    for prefix in prefixes:
        _check_prefix(prefix)
    if len(prefixes) == 1:
        return prefixes, None
    if weights is None:
        weights = [float(_token_count(prefix)) for prefix in prefixes]
    return prefixes, weights


def build_gpt_dataset(
    data: DataSpec,
    *,
    seq_length: int,
    num_samples: int,
    seed: int,
    tokenizer: TextTokenizer | PathLike,
    cache_dir: PathLike,
    eod_mask_loss: bool = False,
    is_built_on_rank: Callable[[], bool] | None = None,
):
    """The "train" GPT dataset over ``data`` (see the module docstring for items and semantics).

    ``is_built_on_rank`` (default: every rank) lets model-parallel ranks that never read data
    skip building; they get ``None`` back.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if not isinstance(seq_length, int) or seq_length < 1:
        raise DataError(f"seq_length={seq_length!r}: must be a positive integer")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise DataError(f"num_samples={num_samples!r}: must be a positive integer")
    tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)
    prefixes, weights = resolve_blend(data)
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)

    config = GPTDatasetConfig(
        random_seed=int(seed),
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split="1,0,0",
        path_to_cache=str(cache),
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, 0, 0], is_built_on_rank or (lambda: True), config
    )
    train, _, _ = builder.build()
    return train
