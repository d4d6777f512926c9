"""Chat records for SFT: reading them, and rendering them with a chat template.

Two record layouts are read, one JSON object per line of a JSONL file:

- OpenAI style: ``{"messages": [{"role": "user", "content": "..."}, ...]}`` with roles
  ``system``, ``user``, ``assistant`` and ``tool``;
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}`` with ``from`` one of
  ``system``, ``human``/``user``, ``gpt``/``assistant``, ``tool``/``function``/``observation``.

Both become one form, a list of ``{"role", "content"}`` messages. A record that cannot be used
(not an object, both or neither key, a message without a role or a string content, an unknown
role, no assistant message) is a ``DataError`` naming ``file:line`` and the key.

``ChatRenderer`` renders a conversation with the tokenizer's chat template (``transformers``'
``apply_chat_template``), tokenizes the whole text once (the tokens the model also sees at
inference), and marks the assistant tokens. A template that marks what the assistant generates
with ``{% generation %}`` blocks says so itself, and ``transformers``' assistant mask of those
blocks is used. Otherwise the template decides where an assistant turn starts and ends: turn i
spans from the end of ``render(messages[:i], add_generation_prompt=True)`` to
the end of ``render(messages[:i + 1])``, so it holds the answer and whatever the template closes
a turn with (the end-of-turn token the model must learn to emit), and not the role header. A
token is an assistant token when any of its characters is inside such a span (a token that
merges the header's last space with the answer's first word belongs to the answer, as in
``transformers``' own assistant mask). A template for which these
renders are not prefixes of one another (one that rewrites earlier turns) is refused with an
error, since its assistant turns cannot be located.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from loongforge.llm.data.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool",
}
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
FORMATS = {"messages": ("role", "content", {r: r for r in ROLES}), "conversations": ("from", "value", SHAREGPT_ROLES)}


def parse_record(record, where: str) -> list[dict[str, str]]:
    """The messages of one decoded JSONL record; ``where`` (``file:line``) goes into every error."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with 'messages' or 'conversations', got {type(record).__name__}")
    present = [key for key in FORMATS if key in record]
    if len(present) != 1:
        found = "both" if present else "neither"
        raise DataError(f"{where}: a record needs exactly one of the keys 'messages' (OpenAI) or "
                        f"'conversations' (ShareGPT), found {found} (keys: {sorted(record)})")
    key = present[0]
    role_key, content_key, roles = FORMATS[key]
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: key '{key}' must be a non-empty list of messages, got {turns!r:.80}")
    messages = []
    for i, turn in enumerate(turns):
        at = f"{where}: key '{key}[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{at}': expected an object with '{role_key}' and '{content_key}', got {type(turn).__name__}")
        for field in (role_key, content_key):
            if field not in turn:
                raise DataError(f"{at}.{field}' is missing")
        role, content = turn[role_key], turn[content_key]
        if role not in roles:
            raise DataError(f"{at}.{role_key}': {role!r} is not one of {', '.join(roles)}")
        if not isinstance(content, str):
            raise DataError(f"{at}.{content_key}': expected a string, got {type(content).__name__} (text only)")
        messages.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: key '{key}' has no assistant message, so nothing to learn from")
    return messages


def read_conversations(path: str | Path) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """``(line number, messages)`` for every non-blank line of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"SFT data file not found: {path}")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from err
            yield number, parse_record(record, f"{path}:{number}")


class ChatRenderer:
    """Token ids and assistant-token mask of conversations, through a ``transformers`` tokenizer.

    ``chat_template``: Jinja source to use instead of the tokenizer's own.
    """

    def __init__(self, tokenizer, chat_template: str | None = None, *, name: str = "tokenizer"):
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise DataError(f"{name} has no chat template: give one with sft.chat_template=FILE.jinja")
        if not getattr(tokenizer, "is_fast", True):
            raise DataError(f"{name} is a slow tokenizer; SFT needs a fast one (tokenizer.json) for token offsets")
        self.tagged = GENERATION_TAG.search(self.template) is not None

    def text(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(list(messages), chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def assistant_spans(self, messages: Sequence[dict], where: str = "conversation") -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character span of every assistant turn in it."""
        full = self.text(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.text(messages[:i], add_generation_prompt=True)
            upto = self.text(messages[: i + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise DataError(
                    f"{where}: the chat template does not render message {i} (assistant) as an extension of the "
                    f"messages before it, so the assistant tokens cannot be located; use a template that renders "
                    f"earlier turns unchanged (sft.chat_template=FILE.jinja)"
                )
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return full, spans

    def render(self, messages: Sequence[dict], where: str = "conversation") -> tuple[np.ndarray, np.ndarray]:
        """``(token ids int32, assistant mask bool)`` of one conversation."""
        return self.render_many([messages], [where])[0]

    def render_many(self, conversations: Sequence[Sequence[dict]], wheres: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        if not conversations:  # (a tokenizer called on no texts fails inside transformers)
            return []
        if self.tagged:
            return [self._render_tagged(messages, where) for messages, where in zip(conversations, wheres)]
        texts, all_spans = [], []
        for messages, where in zip(conversations, wheres):
            text, spans = self.assistant_spans(messages, where)
            texts.append(text)
            all_spans.append(spans)
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for ids, offsets, spans, where in zip(encoded["input_ids"], encoded["offset_mapping"], all_spans, wheres):
            ids = np.asarray(ids, dtype=np.int32)
            bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            mask = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans:
                mask |= (bounds[:, 1] > lo) & (bounds[:, 0] < hi)
            out.append((ids, self._checked(mask, where)))
        return out

    def _render_tagged(self, messages: Sequence[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        out = self.tokenizer.apply_chat_template(list(messages), chat_template=self.template, tokenize=True,
                                                 return_dict=True, return_assistant_tokens_mask=True)
        ids = np.asarray(out["input_ids"], dtype=np.int32)
        return ids, self._checked(np.asarray(out["assistant_masks"], dtype=bool), where)

    @staticmethod
    def _checked(mask: np.ndarray, where: str) -> np.ndarray:
        if not mask.any():
            raise DataError(f"{where}: no token of the rendered conversation falls in an assistant turn")
        return mask
