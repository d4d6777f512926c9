"""Text data for LLM training.

- ``tokenizer``: ``load_tokenizer(path)`` -> ``TextTokenizer`` over a local HF ``tokenizer.json``.
- ``preprocess``: ``preprocess(...)`` turns text / JSONL files into megatron-core's indexed dataset
  (``PREFIX.bin`` + ``PREFIX.idx``); ``lf-llm preprocess`` mounts ``add_preprocess_arguments`` /
  ``preprocess_from_args`` (import them from ``loongforge.llm.data.preprocess``).
- ``gpt``: ``build_gpt_dataset`` over megatron-core's ``GPTDataset`` / ``BlendedDataset``.
- ``bundled_files``: where the corpus and tokenizer that ship with the package lie.
- ``shipped``: ``bundled_dataset`` over them.

Importing this package is cheap: megatron-core is imported when a dataset is written or built.
"""

from loongforge.llm.data.errors import DataError
from loongforge.llm.data.gpt import build_gpt_dataset
from loongforge.llm.data.bundled_files import bundled_corpus_path, bundled_tokenizer_path
from loongforge.llm.data.shipped import bundled_dataset
from loongforge.llm.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = [
    "DataError",
    "TextTokenizer",
    "build_gpt_dataset",
    "bundled_corpus_path",
    "bundled_dataset",
    "bundled_tokenizer_path",
    "load_tokenizer",
]
