"""The GPT dataset over the corpus and tokenizer that ship inside the package (``data/bundled/``,
located by ``bundled_files``) that ``lf-llm train`` uses when it is given no data."""

from __future__ import annotations

import hashlib
from pathlib import Path

from loongforge.llm.data.bundled_files import bundled_corpus_path, bundled_tokenizer_path


def _content_key(tokenizer: Path) -> str:
    """A hash of the corpus and the tokenizer.json that tokenizes it."""
    file = tokenizer if tokenizer.is_file() else tokenizer / "tokenizer.json"
    digest = hashlib.sha256()
    for part in (bundled_corpus_path(), file):
        digest.update(part.read_bytes())
    return digest.hexdigest()[:16]


def bundled_prefix(cache_dir: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Preprocess the shipped corpus into ``cache_dir`` unless already there, tokenized with
    ``tokenizer`` (a tokenizer.json or a directory holding one; default: the bundled tokenizer);
    return its prefix.

    Idempotent: the prefix is named by a hash of the corpus and tokenizer, and an existing
    ``.bin``/``.idx`` pair is reused. With torch.distributed initialised, every rank must call this:
    local rank 0 builds, the others wait on a barrier.
    """
    import torch.distributed as dist

    from loongforge.core.cache import builds_here
    from loongforge.llm.data.preprocess import preprocess
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = Path(tokenizer) if tokenizer is not None else bundled_tokenizer_path()
    prefix = Path(cache_dir) / f"bundled-corpus-{_content_key(tokenizer)}"
    if builds_here() and not IndexedDataset.exists(str(prefix)):
        preprocess([bundled_corpus_path()], tokenizer, prefix)
    if dist.is_initialized():
        dist.barrier()
    return prefix


def bundled_dataset(cache_dir: str | Path, seq_length: int, num_samples: int, seed: int = 1234,
                    tokenizer: str | Path | None = None):
    """The GPT dataset (``build_gpt_dataset``) over the shipped corpus, preprocessed once into
    ``cache_dir`` with ``tokenizer`` (default: the bundled one); megatron-core's sample indices are
    cached there too."""
    from loongforge.llm.data.gpt import build_gpt_dataset
    from loongforge.llm.data.tokenizer import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else bundled_tokenizer_path()
    prefix = bundled_prefix(cache_dir, tokenizer)
    return build_gpt_dataset(
        prefix,
        seq_length=seq_length,
        num_samples=num_samples,
        seed=seed,
        tokenizer=load_tokenizer(tokenizer),
        cache_dir=cache_dir,
    )
