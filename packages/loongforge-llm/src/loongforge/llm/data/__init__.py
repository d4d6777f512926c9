"""Text data for LLM training.

- ``tokenizer``: ``load_tokenizer(path)`` -> ``TextTokenizer`` over a local HF ``tokenizer.json``.
- ``preprocess``: text / JSONL files -> megatron-core indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``);
  ``lf-llm preprocess`` mounts ``add_preprocess_arguments`` / ``preprocess_from_args``.
- ``gpt``: ``build_gpt_dataset`` over megatron-core's ``GPTDataset`` / ``BlendedDataset``.
- ``shipped``: the corpus and tokenizer that ship with the package, and ``bundled_dataset``.

Importing this package is cheap; ``preprocess`` and ``gpt`` import megatron-core when used.
"""

from loongforge.llm.data.errors import DataError
from loongforge.llm.data.shipped import bundled_corpus_path, bundled_tokenizer_path
from loongforge.llm.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["DataError", "TextTokenizer", "bundled_corpus_path", "bundled_tokenizer_path", "load_tokenizer"]
