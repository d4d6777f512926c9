"""SFT data: record layouts and their errors, the assistant-only mask, the index, truncation."""

import json

import numpy as np
import pytest

from loongforge.llm.data.chat import ChatRenderer, parse_record, read_conversations
from loongforge.llm.data.errors import DataError
from loongforge.llm.data.sft import SFTDataset, build_sft_index, bundled_sft_path, load_chat_tokenizer
from loongforge.llm.data.shipped import bundled_tokenizer_path

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "4 + 4 = 8."},
]
# Templates that mark the answers with {% generation %}, so transformers computes its own
# assistant mask. The header ends in a space that BPE merges into the answer's first word.
SEPARATOR_FIRST = (
    "{%- for m in messages %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if m['role'] == 'assistant' %}{{- '### Assistant: ' }}{% generation %}{{- m['content'] + '<|endoftext|>' }}"
    "{% endgeneration %}{%- else %}{{- '### ' + m['role'] + ': ' + m['content'] }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '\\n### Assistant: ' }}{%- endif %}"
)
SEPARATOR_AFTER = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}{{- '### Assistant: ' }}"
    "{% generation %}{{- m['content'] + '<|endoftext|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '### ' + m['role'] + ': ' + m['content'] + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '### Assistant: ' }}{%- endif %}"
)


def untagged(template):
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.fixture(scope="module")
def tokenizer():
    return load_chat_tokenizer(bundled_tokenizer_path())


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_openai_and_sharegpt_records_read_the_same():
    share = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2 + 3?"},
                               {"from": "gpt", "value": "2 + 3 = 5."}, {"from": "user", "value": "And 4 + 4?"},
                               {"from": "assistant", "value": "4 + 4 = 8."}]}
    assert parse_record(share, "f:1") == parse_record({"messages": CHAT}, "f:2") == CHAT


@pytest.mark.parametrize("line, message", [
    ("not json", "bad.jsonl:2: not valid JSON"),
    ("[1, 2]", "bad.jsonl:2: expected a JSON object"),
    ({"messages": CHAT, "conversations": []}, "bad.jsonl:2: a record needs exactly one of the keys 'messages'"),
    ({"text": "hi"}, "found neither"),
    ({"messages": []}, "key 'messages' must be a non-empty list"),
    ({"messages": [{"content": "hi"}]}, "bad.jsonl:2: key 'messages[0].role' is missing"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
     "key 'messages[1].role': 'bot' is not one of system, user, assistant, tool"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},
     "bad.jsonl:2: key 'conversations[1].value': expected a string, got NoneType"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]},
     "key 'conversations[1].from': 'robot' is not one of system, human"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "bad.jsonl:2: key 'messages' has no assistant message"),
])
def test_bad_records_name_file_line_and_key(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHAT}, line])
    with pytest.raises(DataError) as err:
        list(read_conversations(path))
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_assistant_mask_of_the_bundled_template(tokenizer):
    renderer = ChatRenderer(tokenizer)
    ids, mask = renderer.render(CHAT)
    text = renderer.text(CHAT)
    assert ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]  # the inference tokens
    eos = tokenizer.eos_token
    assert tokenizer.decode(ids[mask]) == f"2 + 3 = 5.{eos}4 + 4 = 8.{eos}"  # answers and their end of turn
    rest = tokenizer.decode(ids[~mask])
    for m in CHAT:
        assert (m["content"] in rest) == (m["role"] != "assistant")
    assert "<|assistant|>" in rest  # the header is context, not a target


def _generation_mask(tokenizer, template):
    ref = tokenizer.apply_chat_template(CHAT, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return ref["input_ids"], ref["assistant_masks"]


def test_turn_spans_give_transformers_generation_mask(tokenizer):
    """Without generation tags the mask comes from the rendered turn spans; on a template whose
    turns end where its generation blocks end it equals transformers' mask of those blocks."""
    ids, mask = ChatRenderer(tokenizer, untagged(SEPARATOR_FIRST)).render(CHAT)
    ref_ids, ref_mask = _generation_mask(tokenizer, SEPARATOR_FIRST)
    assert ids.tolist() == ref_ids
    assert mask.astype(int).tolist() == ref_mask
    assert tokenizer.decode(ids[mask]) == " 2 + 3 = 5.<|endoftext|> 4 + 4 = 8.<|endoftext|>"


def test_generation_tags_decide_when_present(tokenizer):
    """A template that closes a turn with a separator after its generation block: the tags
    leave the separator out, the turn spans (no tags) include it."""
    ids, mask = ChatRenderer(tokenizer, SEPARATOR_AFTER).render(CHAT)
    assert (ids.tolist(), mask.astype(int).tolist()) == _generation_mask(tokenizer, SEPARATOR_AFTER)
    _, spans_mask = ChatRenderer(tokenizer, untagged(SEPARATOR_AFTER)).render(CHAT)
    assert tokenizer.decode(ids[spans_mask & ~mask]) == "\n\n"


def test_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    # renders only the last message: an assistant turn is not an extension of what came before
    template = "{{- messages[-1]['content'] }}{%- if add_generation_prompt %}>{%- endif %}"
    with pytest.raises(DataError, match="conv:7: the chat template does not render message 2"):
        ChatRenderer(tokenizer, template).render(CHAT, where="conv:7")


def test_no_template_is_an_error(tokenizer, tmp_path):
    tokenizer = load_chat_tokenizer(bundled_tokenizer_path())
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="has no chat template: give one with sft.chat_template"):
        ChatRenderer(tokenizer)


def _long_chat(n_words):
    return {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(["one"] * n_words)}]}


def test_index_samples_and_truncation_policies(tmp_path, tokenizer):
    short = {"messages": CHAT}
    only_prompt_fits = {"messages": [{"role": "user", "content": " ".join(["four"] * 200)},
                                     {"role": "assistant", "content": "Yes."}]}
    data = write_jsonl(tmp_path / "chats.jsonl", [short, _long_chat(150), only_prompt_fits])
    index = build_sft_index([data], bundled_tokenizer_path(), tmp_path / "cache")
    assert len(index) == 3 and index.where(1) == f"{data}:2"

    renderer = ChatRenderer(tokenizer)
    ids, mask = renderer.render(CHAT)
    ds = SFTDataset(index, seq_length=100)
    assert len(ids) - 1 < 100
    sample = ds[0]
    assert sample["tokens"].tolist() == ids[:-1].tolist()
    assert sample["labels"].tolist() == ids[1:].tolist()
    assert sample["loss_mask"].tolist() == mask[1:].astype(int).tolist()  # a position trains on its next token
    assert ds.lengths[0] == len(ids) - 1

    # truncate: the long answer keeps its first 100 positions; the third has no answer token left
    assert len(ds) == 2 and ds.lengths[1] == 100 and ds.where(1) == f"{data}:2"
    assert (ds.report.truncated, ds.report.dropped) == (1, 1)
    assert ds[1]["loss_mask"].sum() > 0
    dropped = SFTDataset(index, seq_length=100, truncation="drop")
    assert len(dropped) == 1 and dropped.report.dropped == 2
    with pytest.raises(DataError, match=rf"{data}:2: conversation of \d+ tokens \(\d+ positions\) is longer than "
                                        r"train.seq_length=100; 2 conversation\(s\)"):
        SFTDataset(index, seq_length=100, truncation="error")


def test_index_is_cached_by_content(tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    first = build_sft_index([data], bundled_tokenizer_path(), tmp_path / "cache")
    stamp = (first.directory / "tokens.npy").stat().st_mtime_ns
    again = build_sft_index([data], bundled_tokenizer_path(), tmp_path / "cache")
    assert again.directory == first.directory and (again.directory / "tokens.npy").stat().st_mtime_ns == stamp
    write_jsonl(data, [{"messages": CHAT}, _long_chat(3)])
    changed = build_sft_index([data], bundled_tokenizer_path(), tmp_path / "cache")
    assert changed.directory != first.directory and len(changed) == 2
    other_template = build_sft_index([data], bundled_tokenizer_path(), tmp_path / "cache", chat_template=SEPARATOR_FIRST)
    assert other_template.directory != changed.directory
    assert not np.array_equal(np.asarray(other_template.tokens), np.asarray(changed.tokens))


def test_shipped_set_reads_both_layouts(tmp_path):
    records = [json.loads(line) for line in bundled_sft_path().read_text().splitlines()]
    assert len(records) == 512
    assert {next(iter(r)) for r in records} == {"messages", "conversations"}
    index = build_sft_index([bundled_sft_path()], bundled_tokenizer_path(), tmp_path / "cache")
    lengths = np.diff(index.offsets)
    assert len(index) == 512 and lengths.min() < 40 and lengths.max() > 200  # a spread for packing and balancing
