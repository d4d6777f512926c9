"""The prompt tokenizers: a released model's own (PaliGemma's) or an offline byte tokenizer.

``make_tokenizer(policy config, data.tokenizer)`` picks one. A tokenizer directory (``tokenizer.json``,
``tokenizer.model`` or ``tokenizer_config.json``: PaliGemma's, as LeRobot's and openpi's released
policies use) is loaded with transformers' ``AutoTokenizer`` and builds LeRobot's prompts
(``HFPromptTokenizer``): Pi0's is the instruction ending in a newline, Pi0.5's (``discrete_state``)
``Task: <instruction>, State: <256-bin indices>;\nAction: ``, tokenised as LeRobot's
``TokenizerProcessorStep`` does (truncated and right-padded to ``max_len``). The directory is
``data.tokenizer`` when set, else the directory of ``model.pretrained`` when it holds tokenizer
files; a tokenizer that is configured but does not load is a ``ConfigError`` naming the path.

Without one, ``ByteTokenizer``: bytes of the UTF-8 instruction become tokens ``4..259``; with
``discrete_state`` the normalised state (in [-1, 1]) is cut into 256 bins (Pi0.5's state
discretisation) that become tokens ``260..515``. Layout: ``BOS task-bytes SEP [state-bins SEP]``,
right-padded with PAD to ``max_len``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge.core.config import ConfigError

PAD, BOS, EOS, SEP = 0, 1, 2, 3
BYTE_OFFSET = 4
STATE_OFFSET = BYTE_OFFSET + 256
STATE_BINS = 256


def clean_instruction(text: str) -> str:
    return text.strip().replace("_", " ").replace("\n", " ")


def discretize_state(state: torch.Tensor, bins: int = STATE_BINS, clamp: bool = True) -> torch.Tensor:
    """Bin index in [0, bins) of each value of a [-1, 1]-normalised state (values above 1 fall in
    the last bin; values below -1 clamp to 0, or are -1 with ``clamp=False``, as in LeRobot's
    Pi0.5 prompt)."""
    edges = torch.linspace(-1.0, 1.0, bins + 1, dtype=torch.float64)[:-1]
    idx = torch.bucketize(state.double(), edges, right=True) - 1
    return idx.clamp(0, bins - 1) if clamp else idx


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class HFPromptTokenizer:
    """A transformers tokenizer building LeRobot's Pi0 / Pi0.5 prompts (see the module doc)."""

    def __init__(self, tokenizer, max_len: int, discrete_state: bool):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_len = max_len
        self.discrete_state = discrete_state

    def prompt(self, task: str, state: torch.Tensor | None = None) -> str:
        if not self.discrete_state:
            return task if task.endswith("\n") else task + "\n"
        if state is None:
            raise ValueError("this tokenizer puts the discretised state into the prompt, but no state was given")
        bins = " ".join(str(int(b)) for b in discretize_state(state.reshape(-1), clamp=False))
        return f"Task: {clean_instruction(task)}, State: {bins};\nAction: "

    def encode(self, task: str, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [max_len] int64, mask [max_len] bool)``; the prompt is truncated to fit."""
        out = self.tokenizer(self.prompt(task, state), max_length=self.max_len, truncation=True, padding="max_length",
                             padding_side="right", return_tensors="pt")
        return out["input_ids"][0].long(), out["attention_mask"][0].bool()


def tokenizer_source(policy_cfg, tokenizer: str | None = None) -> tuple[str, Path] | None:
    """``(config key naming it, directory)`` of the policy's tokenizer (``data.tokenizer``, else the
    directory of ``model.pretrained``), or None for the byte tokenizer."""
    if tokenizer is not None:
        path = Path(tokenizer)
        if not path.is_dir():
            raise ConfigError(f"data.tokenizer={tokenizer!r}: no such directory (a tokenizer directory: "
                              f"{', '.join(TOKENIZER_FILES)})")
        return f"data.tokenizer={tokenizer!r}", path
    if policy_cfg.pretrained is not None:
        path = Path(policy_cfg.pretrained).parent
        if any((path / name).is_file() for name in TOKENIZER_FILES):
            return f"model.pretrained={policy_cfg.pretrained!r}: its directory's tokenizer {str(path)!r}", path
    return None


def make_tokenizer(policy_cfg, tokenizer: str | None = None) -> ByteTokenizer | HFPromptTokenizer:
    """The prompt tokenizer of a policy config and ``data.tokenizer`` (see the module doc)."""
    source = tokenizer_source(policy_cfg, tokenizer)
    if source is None:
        return ByteTokenizer(policy_cfg.max_token_len, policy_cfg.discrete_state)
    what, path = source
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # any reason a directory does not load: one error line naming it
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"{what}: cannot be loaded with transformers' AutoTokenizer ({type(exc).__name__}: {detail})") from exc
    return HFPromptTokenizer(tokenizer, policy_cfg.max_token_len, policy_cfg.discrete_state)
