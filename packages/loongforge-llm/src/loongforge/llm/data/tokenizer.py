"""A text tokenizer loaded from a local Hugging Face ``tokenizer.json`` (offline, no hub).

``load_tokenizer`` accepts a ``tokenizer.json`` file or a directory holding one (as written by
``transformers``' ``save_pretrained``). The end-of-document token is the ``eos_token`` of
``tokenizer_config.json`` / ``special_tokens_map.json`` next to it, else ``<|endoftext|>`` when the
vocabulary has it; the pad token is their ``pad_token``, else ``<|pad|>`` when present.

``TextTokenizer`` also carries what megatron-core's ``GPTDatasetConfig.tokenizer`` is read for:
``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers`` (part of the dataset cache key, so
it holds a hash of the tokenizer's content rather than its path).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer

from loongforge.llm.data.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_DEFAULT_EOD = "<|endoftext|>"
_DEFAULT_PAD = "<|pad|>"


class TextTokenizer:
    """Encode/decode text with a ``tokenizers.Tokenizer``; knows its EOD and pad ids."""

    def __init__(self, backend: Tokenizer, *, path: Path, eod_token: str, pad_token: str | None):
        self.backend = backend
        self.path = Path(path)
        self.eod_token = eod_token
        self.pad_token = pad_token
        eod = backend.token_to_id(eod_token)
        if eod is None:
            raise DataError(f"{self.path}: end-of-document token {eod_token!r} is not in the vocabulary")
        self._eod = eod
        self._pad = None
        if pad_token is not None:
            self._pad = backend.token_to_id(pad_token)
            if self._pad is None:
                raise DataError(f"{self.path}: pad token {pad_token!r} is not in the vocabulary")
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._sha256 = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included (the model's vocabulary must be at least this)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """Id of the end-of-document token appended after every document."""
        return self._eod

    @property
    def pad(self) -> int:
        """Id of the pad token. Raises ``AttributeError`` when the tokenizer has none (megatron-core's
        GPT dataset then pads with an id that never occurs in the data)."""
        if self._pad is None:
            raise AttributeError(f"tokenizer {self.path} defines no pad token")
        return self._pad

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with whatever the tokenizer's post-processor adds (e.g. a BOS id for
        Llama tokenizers; the bundled tokenizer adds nothing). No EOD: preprocessing appends it."""
        return self.backend.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` over many texts at once (runs on the Rust thread pool)."""
        return [enc.ids for enc in self.backend.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What makes datasets tokenized by this tokenizer distinct (megatron-core's cache key)."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("tokenizer_sha256", self._sha256),
                ("eod", self._eod),
                ("pad", self._pad),
            ]
        )

    def __repr__(self) -> str:
        return (
            f"TextTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"eod={self.eod_token!r}:{self._eod}, pad={self.pad_token!r}:{self._pad})"
        )


def _token_name(value) -> str | None:
    """A special-token entry of tokenizer_config.json is a string or a serialised AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(directory: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in _CONFIG_FILES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{file}: not valid JSON ({err})") from err
        if not isinstance(config, dict):
            raise DataError(f"{file}: expected a JSON object, got {type(config).__name__}")
        for key in ("eos_token", "pad_token"):
            token = _token_name(config.get(key))
            if token is not None and key not in found:
                found[key] = token
    return found


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """Load a tokenizer from a ``tokenizer.json`` file or a directory holding one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"tokenizer not found: {path} (expected a {TOKENIZER_FILE} file or a directory holding one)")
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise DataError(
                f"{path} is not a tokenizer directory: it has no {TOKENIZER_FILE} (a directory with only "
                f"slow-tokenizer files can be converted once with transformers: "
                f"AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
            )
    else:
        file = path
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception for unparsable files
        raise DataError(f"{file} is not a tokenizers/transformers tokenizer.json: {err}") from err

    special = _special_tokens(file.parent)
    vocab = backend.get_vocab(with_added_tokens=True)
    eod_token = special.get("eos_token") or (_DEFAULT_EOD if _DEFAULT_EOD in vocab else None)
    if eod_token is None:
        raise DataError(
            f"{file}: no end-of-document token: set eos_token in {file.parent / _CONFIG_FILES[0]} "
            f"or add {_DEFAULT_EOD!r} to the vocabulary"
        )
    pad_token = special.get("pad_token") or (_DEFAULT_PAD if _DEFAULT_PAD in vocab else None)
    return TextTokenizer(backend, path=file, eod_token=eod_token, pad_token=pad_token)
