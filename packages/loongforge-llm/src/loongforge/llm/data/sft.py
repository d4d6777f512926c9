"""SFT data: conversations tokenized once into a cached index, and the dataset over it.

``build_sft_index`` reads JSONL conversations (``chat``), renders and tokenizes them with the
tokenizer's chat template, and stores the token ids, the assistant-token mask, per-conversation
offsets and the ``(file, line)`` each came from as ``.npy`` arrays under
``CACHE_DIR/sft-<hash>/``. The hash covers the files' bytes, the tokenizer and the template, so a
change to any of them builds a new index and an unchanged one is reused. With torch.distributed
initialised, local rank 0 builds and the others wait.

``SFTDataset`` applies the sequence length: sample i is one conversation of ``L`` tokens trained
as ``L - 1`` positions (``tokens[:-1]`` predicting ``tokens[1:]``), and the loss counts only
positions whose next token is an assistant token. Its ``lengths`` (positions per sample) are
known before any sample is read, which is what the DP balancer plans with.

Truncation policy for a conversation longer than ``seq_length`` positions
(``sft.truncation``):

- ``truncate`` (default): keep its first ``seq_length`` positions; if no assistant token is left
  in them, the conversation is dropped;
- ``drop``: leave the conversation out;
- ``error``: stop with an error naming its ``file:line``.

The dataset reports how many conversations were truncated and dropped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loongforge.core.cache import build_once
from loongforge.llm.data.cache import save_token_arrays
from loongforge.llm.data.chat import ChatRenderer, read_conversations
from loongforge.llm.data.errors import DataError

INDEX_VERSION = 1
TRUNCATION = ("truncate", "drop", "error")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_RENDER_CHUNK = 1024


@dataclass
class SFTDataConfig:
    files: list[str] = field(default_factory=list)  # JSONL conversations; empty: the bundled SFT set
    chat_template: str | None = None  # a Jinja file to use instead of the tokenizer's template
    packing: bool = True  # several conversations per micro-batch row, attention within each (THD)
    truncation: str = "truncate"  # truncate | drop | error (conversations longer than train.seq_length)

    def __post_init__(self):
        if self.truncation not in TRUNCATION:
            raise ValueError(f"sft.truncation={self.truncation!r}: one of {', '.join(TRUNCATION)}")


def bundled_sft_path() -> Path:
    """The shipped SFT set (``tools/make_sft_data.py``): 512 conversations, both record layouts."""
    from loongforge.llm.data.bundled_files import bundled_corpus_path

    return bundled_corpus_path().parent / "sft.jsonl"


def load_chat_tokenizer(path: str | Path):
    """A ``transformers`` tokenizer from a local directory (offline)."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not path.is_dir():
        raise DataError(f"tokenizer directory not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot load the tokenizer with transformers: {err}") from err


def read_template(path: str | Path | None) -> str | None:
    if path is None:
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"sft.chat_template: file not found: {file}")
    return file.read_text(encoding="utf-8")


# -- the index ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SFTIndex:
    """Tokenized conversations: ``tokens[offsets[i]:offsets[i+1]]`` and the same slice of ``assistant``."""

    directory: Path
    files: list[str]
    tokens: np.ndarray  # int32
    assistant: np.ndarray  # bool
    offsets: np.ndarray  # int64, (n + 1,)
    source: np.ndarray  # int64, (n, 2): file number, line number

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def where(self, i: int) -> str:
        f, line = self.source[i]
        return f"{self.files[int(f)]}:{int(line)}"

    @classmethod
    def load(cls, directory: Path) -> SFTIndex:
        meta = json.loads((directory / "meta.json").read_text())
        arrays = {name: np.load(directory / f"{name}.npy", mmap_mode="r") for name in ("tokens", "assistant", "offsets", "source")}
        return cls(directory=directory, files=meta["files"], **arrays)


def _index_key(files: list[Path], tokenizer_dir: Path, template: str | None) -> str:
    digest = hashlib.sha256(f"sft-index-v{INDEX_VERSION}".encode())
    for file in files:
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    for name in _TOKENIZER_FILES:
        file = tokenizer_dir / name
        digest.update(name.encode() + (hashlib.sha256(file.read_bytes()).digest() if file.is_file() else b"-"))
    digest.update((template or "").encode())
    return digest.hexdigest()[:16]


def _write_index(directory: Path, files: list[Path], tokenizer, template: str | None, tokenizer_dir: Path) -> None:
    renderer = ChatRenderer(tokenizer, template, name=str(tokenizer_dir))
    token_parts, mask_parts, source = [], [], []
    pending: list[list[dict]] = []  # conversations not yet rendered, and their file:line
    wheres: list[str] = []

    def flush():
        for ids, mask in renderer.render_many(pending, wheres):
            token_parts.append(ids)
            mask_parts.append(mask)
        pending.clear()
        wheres.clear()

    for number, file in enumerate(files):
        for line, messages in read_conversations(file):
            pending.append(messages)
            wheres.append(f"{file}:{line}")
            source.append((number, line))
            if len(pending) >= _RENDER_CHUNK:
                flush()
    flush()
    if not token_parts:
        raise DataError(f"sft.files: no conversations in {', '.join(map(str, files))}")
    save_token_arrays(directory, token_parts, mask_parts)
    np.save(directory / "source.npy", np.asarray(source, dtype=np.int64).reshape(-1, 2))
    meta = {"version": INDEX_VERSION, "files": [str(f) for f in files], "tokenizer": str(tokenizer_dir),
            "conversations": len(token_parts), "tokens": sum(len(x) for x in token_parts)}
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def build_sft_index(files: list[str | Path], tokenizer_dir: str | Path, cache_dir: str | Path,
                    chat_template: str | None = None) -> SFTIndex:
    """Tokenize ``files`` into ``cache_dir`` unless an index of the same inputs is there; return it.

    ``chat_template``: Jinja source overriding the tokenizer's template. Every rank must call
    this when torch.distributed is initialised.
    """
    paths = [Path(f).expanduser().resolve() for f in files]
    for path in paths:
        if not path.is_file():
            raise DataError(f"sft.files: file not found: {path}")
    tokenizer_dir = Path(tokenizer_dir).expanduser().resolve()
    tokenizer = load_chat_tokenizer(tokenizer_dir)
    directory = Path(cache_dir) / f"sft-{_index_key(paths, tokenizer_dir, chat_template)}"
    build_once(directory, lambda tmp: _write_index(tmp, paths, tokenizer, chat_template, tokenizer_dir), "SFT index")
    return SFTIndex.load(directory)


# -- the dataset -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TruncationReport:
    conversations: int
    truncated: int
    dropped: int

    def __str__(self) -> str:
        return f"{self.conversations} conversations, {self.truncated} truncated, {self.dropped} dropped"


class SFTDataset:
    """Map-style dataset of training samples; ``dataset[i]`` is a dict of int64 arrays.

    ``tokens``, ``labels`` (the next token) and ``loss_mask`` (1 where the label is an
    assistant token), each of ``lengths[i]`` positions, and ``index`` (i).
    """

    def __init__(self, index: SFTIndex, seq_length: int, truncation: str = "truncate"):
        if truncation not in TRUNCATION:
            raise ValueError(f"sft.truncation={truncation!r}: one of {', '.join(TRUNCATION)}")
        self.index, self.seq_length = index, seq_length
        offsets = np.asarray(index.offsets)
        sizes = np.diff(offsets)
        positions = np.minimum(sizes - 1, seq_length)
        long = sizes - 1 > seq_length
        if truncation == "error" and long.any():
            i = int(np.flatnonzero(long)[0])
            raise DataError(
                f"{index.where(i)}: conversation of {int(sizes[i])} tokens ({int(sizes[i]) - 1} positions) is longer "
                f"than train.seq_length={seq_length}; {int(long.sum())} conversation(s) are: set "
                f"sft.truncation=truncate or drop, or raise train.seq_length"
            )
        # a position trains when its label (the next token) is an assistant token
        mask = np.asarray(index.assistant)
        cum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        trainable = cum[offsets[:-1] + 1 + positions] - cum[offsets[:-1] + 1]
        keep = (positions >= 1) & (trainable > 0)
        if truncation == "drop":
            keep &= ~long
        self.conversation = np.flatnonzero(keep)  # sample i -> conversation number in the index
        if self.conversation.size == 0:
            raise DataError(f"{', '.join(index.files)}: no conversation has an assistant token within "
                            f"train.seq_length={seq_length} positions")
        self.lengths = positions[self.conversation].astype(np.int64)
        self.report = TruncationReport(conversations=len(index), truncated=int((long & keep).sum()),
                                       dropped=int((~keep).sum()))

    def __len__(self) -> int:
        return int(self.conversation.size)

    def where(self, i: int) -> str:
        """``file:line`` of sample i."""
        return self.index.where(int(self.conversation[i]))

    def __getitem__(self, i: int) -> dict[str, np.ndarray | np.int64]:
        c = int(self.conversation[i])
        start = int(self.index.offsets[c])
        n = int(self.lengths[i])
        ids = np.asarray(self.index.tokens[start : start + n + 1], dtype=np.int64)
        mask = np.asarray(self.index.assistant[start + 1 : start + n + 1], dtype=np.int64)
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": mask, "index": np.int64(i)}
