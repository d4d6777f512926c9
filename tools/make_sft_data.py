"""Generate the small SFT set and the chat template that ship with loongforge-llm.

Conversations about the world of the bundled corpus (``make_corpus.py``): counting stories with
a question about the final count, arithmetic, colour facts, what lies next to what in a scene,
counting sequences, and multi-turn chats that string several of these together, some with a
system prompt. Each answer follows from its question, so a 2-layer model's loss on the
assistant tokens falls within a few dozen steps. Lengths range from about 20 to 250 tokens,
so packing and DP load balancing have something to do.

Most records are OpenAI-style ``{"messages": [{"role", "content"}, ...]}``; every fourth is
ShareGPT ``{"conversations": [{"from", "value"}, ...]}``, so the shipped file exercises both
readers.

The chat template (``tokenizer/chat_template.jinja``, which ``transformers`` loads with the
tokenizer) writes every message as ``<|role|>`` + newline + content + ``<|endoftext|>``; the
generation prompt is ``<|assistant|>`` + newline.

Run from the repository root (the output is committed; rerunning reproduces it byte for byte):

    uv run python tools/make_sft_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_corpus import (
    ANIMALS, COLOURS, DEFAULT_OUTPUT, FACTS, FRUITS, NAMES, NUMBER_WORDS, OBJECTS, PLACES, PRONOUNS, RELATIONS,
    SIZES, Grammar, cap, plural,
)

SEED = 20240612
NUM_RECORDS = 512
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|endoftext|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer in one sentence.",
    "You answer questions about small stories.",
    "Be brief.",
]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


class Chats:
    """Each method returns one (question, answer) exchange; ``conversation`` strings them together."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.grammar = Grammar(rng)

    def pick(self, items):
        return self.rng.choice(items)

    def counting(self) -> tuple[str, str]:
        name = self.pick(NAMES)
        other = self.pick([n for n in NAMES if n != name])
        she, her, _ = PRONOUNS[name]
        noun = self.pick(FRUITS + OBJECTS)
        count = self.rng.randint(1, 12)
        story = [f"{name} has {NUMBER_WORDS[count]} {plural(noun, count)}."]
        for _ in range(self.rng.randint(1, 3)):
            if count < 20 and (self.rng.random() < 0.55 or count <= 1):
                add = self.rng.randint(1, min(8, 20 - count))
                story.append(f"{self.pick([f'{other} gives {her}', f'{cap(she)} finds'])} {NUMBER_WORDS[add]} more {plural(noun, add)}.")
                count += add
            else:
                sub = self.rng.randint(1, count - 1)
                story.append(f"{self.pick([f'{cap(she)} gives {other}', f'{cap(she)} loses'])} {NUMBER_WORDS[sub]} {plural(noun, sub)}.")
                count -= sub
        question = f"{' '.join(story)} How many {plural(noun)} does {name} have now?"
        return question, f"{name} has {NUMBER_WORDS[count]} {plural(noun, count)}."

    def arithmetic(self) -> tuple[str, str]:
        a, b = self.rng.randint(0, 20), self.rng.randint(0, 20)
        if self.rng.random() < 0.6:
            return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", f"{a} - {b} = {a - b}."

    def colour(self) -> tuple[str, str]:
        subject = self.pick(list(FACTS))
        return f"What colour is {subject}?", f"{cap(subject)} is {FACTS[subject]}."

    def scene(self) -> tuple[str, str]:
        place = self.pick(PLACES)
        first = (self.pick(COLOURS), self.pick(OBJECTS))
        second = (self.pick(SIZES), self.pick([c for c in COLOURS if c != first[0]]), self.pick(OBJECTS))
        relation = self.pick(RELATIONS)
        thing = f"{second[0]} {second[1]} {second[2]}"
        described = (f"In the {place} there is a {first[0]} {first[1]}. "
                     f"A {thing} is {relation} the {first[0]} {first[1]}.")
        if self.rng.random() < 0.5:
            return f"{described} What is {relation} the {first[0]} {first[1]}?", cap(f"a {thing} is {relation} the {first[0]} {first[1]}.")
        return f"{described} Where is the {thing}?", f"The {thing} is {relation} the {first[0]} {first[1]}."

    def sequence(self) -> tuple[str, str]:
        start = self.rng.randint(1, 10)
        stop = min(start + self.rng.randint(3, 8), 20)
        return (f"Count from {NUMBER_WORDS[start]} to {NUMBER_WORDS[stop]}.",
                cap(", ".join(NUMBER_WORDS[i] for i in range(start, stop + 1)) + "."))

    def story(self) -> tuple[str, str]:
        hero, friend = self.rng.sample(NAMES, 2)
        animal = self.pick(ANIMALS)
        colour, obj, place = self.pick(COLOURS), self.pick(OBJECTS), self.pick(PLACES)
        text = (f"There was once a {self.pick(SIZES)} {animal} called {hero}. {hero} lived in the {place}. "
                f"One day, {hero} found a {colour} {obj}. {hero} gave the {obj} to {friend}.")
        if self.rng.random() < 0.5:
            return f"{text} Who found the {colour} {obj}?", f"{hero} found the {colour} {obj}."
        return f"{text} Who has the {obj} now?", f"{friend} has the {colour} {obj} now."

    KINDS = ("counting", "arithmetic", "colour", "scene", "sequence", "story")
    WEIGHTS = (4, 3, 2, 3, 2, 2)

    def conversation(self) -> list[dict]:
        messages = []
        if self.rng.random() < 0.3:
            messages.append({"role": "system", "content": self.pick(SYSTEM_PROMPTS)})
        turns = self.rng.choices((1, 2, 3, 5), weights=(5, 3, 2, 1))[0]
        for kind in self.rng.choices(self.KINDS, weights=self.WEIGHTS, k=turns):
            question, answer = getattr(self, kind)()
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return messages


def record(messages: list[dict], sharegpt: bool) -> dict:
    if sharegpt:
        return {"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in messages]}
    return {"messages": messages}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="bundled data directory")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--records", type=int, default=NUM_RECORDS)
    args = parser.parse_args(argv)

    chats = Chats(random.Random(args.seed))
    path = args.output / "sft.jsonl"
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for i in range(args.records):
            f.write(json.dumps(record(chats.conversation(), sharegpt=i % 4 == 3), ensure_ascii=False) + "\n")
    template = args.output / "tokenizer" / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")
    print(f"{path}: {args.records} conversations, {path.stat().st_size} bytes; chat template {template}")


if __name__ == "__main__":
    main()
