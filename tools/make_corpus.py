"""Generate the small corpus and tokenizer that ship with loongforge-llm.

The corpus is English-like text from a seeded probabilistic grammar: scene descriptions with
objects and colours, counting stories whose arithmetic is right, arithmetic facts, counting
sequences, question/answer pairs about fixed facts, comparisons and short stories that keep
repeating their characters. The structure is regular enough that a 2-layer model's loss falls
visibly within about a hundred steps, and varied enough that it keeps falling after that.

A byte-level BPE tokenizer (``tokenizers`` library) is then trained on the corpus, with
``<|endoftext|>`` (id 0, the end-of-document token) and ``<|pad|>`` (id 1), and saved so that
both ``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer.from_pretrained`` load it
offline.

Run from the repository root (the output is committed; rerunning reproduces it byte for byte):

    uv run python tools/make_corpus.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "packages/loongforge-llm/src/loongforge/llm/data/bundled"

SEED = 20240611
TARGET_BYTES = 1_500_000
VOCAB_SIZE = 4096
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

SHE_NAMES = ["Mia", "Lily", "Anna", "Nora", "Ella", "Zoe", "Ruby", "Ivy", "Lucy", "Maya", "Iris",
             "Alma", "Rosa", "Vera", "June", "Clara", "Hana", "Lena"]
HE_NAMES = ["Tom", "Ben", "Sam", "Leo", "Max", "Omar", "Finn", "Jack", "Noah", "Eli", "Hugo", "Theo",
            "Owen", "Kai", "Luca", "Adam", "Milo", "Ravi"]
NAMES = SHE_NAMES + HE_NAMES
ANIMALS = [
    "fox", "cat", "dog", "bird", "rabbit", "bear", "owl", "frog", "mouse", "duck", "horse",
    "turtle", "lion", "goat", "squirrel", "hedgehog", "pig", "sheep", "deer", "crow",
]
OBJECTS = [
    "ball", "box", "cup", "hat", "kite", "book", "lamp", "chair", "shoe", "bag", "key", "drum",
    "boat", "car", "block", "shell", "stone", "coin", "ribbon", "spoon", "bell", "flag",
    "bottle", "candle", "basket", "scarf", "pencil", "button", "map", "clock",
]
FRUITS = ["apple", "pear", "plum", "orange", "lemon", "cherry", "peach", "banana", "grape", "melon"]
COLOURS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white", "grey"]
SIZES = ["small", "big", "tiny", "large", "little", "huge"]
MOODS = ["happy", "sad", "tired", "excited", "curious", "sleepy", "proud", "surprised"]
PLACES = [
    "garden", "kitchen", "forest", "park", "river", "school", "market", "beach", "hill",
    "village", "library", "farm", "meadow", "harbour", "attic",
]
SURFACES = ["table", "shelf", "floor", "bed", "bench", "desk", "windowsill", "rug"]
RELATIONS = ["on", "under", "next to", "behind", "in front of", "near"]
FACTS = {
    "the sky": "blue", "grass": "green", "the sun": "yellow", "snow": "white", "coal": "black",
    "a lemon": "yellow", "a strawberry": "red", "a leaf": "green", "a crow": "black",
    "milk": "white", "chocolate": "brown", "the sea": "blue", "a carrot": "orange",
    "a plum": "purple", "a flamingo": "pink", "an elephant": "grey", "a cherry": "red",
    "a pumpkin": "orange", "a banana": "yellow", "the night": "black",
}
PLURAL_OVERRIDES = {"box": "boxes", "peach": "peaches", "cherry": "cherries", "mouse": "mice",
                    "sheep": "sheep", "deer": "deer", "fish": "fish", "goat": "goats"}
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy", "foggy", "snowy"]
ACTIVITIES = ["read a book", "drew a picture", "sang a song", "baked a cake", "flew a kite",
              "built a tower", "planted a tree", "painted a fence", "wrote a letter", "played a game"]
# (subject, object, possessive) pronouns
PRONOUNS = {**{n: ("she", "her", "her") for n in SHE_NAMES}, **{n: ("he", "him", "his") for n in HE_NAMES}}


def plural(noun: str, count: int = 2) -> str:
    if count == 1:
        return noun
    if noun in PLURAL_OVERRIDES:
        return PLURAL_OVERRIDES[noun]
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    return noun + "s"


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def cap(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


class Grammar:
    """Each method returns one document section; ``document`` strings sections together."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, items):
        return self.rng.choice(items)

    def thing(self) -> tuple[str, str, str]:
        """(size or '', colour, object)"""
        size = self.pick(SIZES) if self.rng.random() < 0.4 else ""
        return size, self.pick(COLOURS), self.pick(OBJECTS + FRUITS)

    @staticmethod
    def phrase(size: str, colour: str, noun: str) -> str:
        words = [w for w in (size, colour, noun) if w]
        return f"{article(words[0])} {' '.join(words)}"

    def scene(self) -> str:
        place = self.pick(PLACES)
        first = self.thing()
        out = [f"In the {place} there is {self.phrase(*first)}."]
        previous = first
        for _ in range(self.rng.randint(2, 5)):
            current = self.thing()
            kind = self.rng.random()
            if kind < 0.45:
                rel = self.pick(RELATIONS)
                out.append(cap(f"{self.phrase(*current)} is {rel} the {previous[1]} {previous[2]}."))
            elif kind < 0.6:
                out.append(f"The {previous[2]} is {previous[1]}, not {self.pick([c for c in COLOURS if c != previous[1]])}.")
                continue
            elif kind < 0.85:
                out.append(f"There is also {self.phrase(*current)} {self.pick(RELATIONS)} the {self.pick(SURFACES)}.")
            else:
                out.append(f"{self.phrase(*current)[0].upper()}{self.phrase(*current)[1:]} is on the {self.pick(SURFACES)}.")
            previous = current
        return " ".join(out)

    def counting_story(self) -> str:
        name = self.pick(NAMES)
        other = self.pick([n for n in NAMES if n != name])
        she, her, _ = PRONOUNS[name]
        noun = self.pick(FRUITS + OBJECTS)
        start = self.rng.randint(1, 12)
        out = [f"{name} has {NUMBER_WORDS[start]} {plural(noun, start)}."]
        count = start
        for _ in range(self.rng.randint(1, 3)):
            if self.rng.random() < 0.55 or count <= 1:
                add = self.rng.randint(1, min(8, 20 - count)) if count < 20 else 0
                if add == 0:
                    break
                verb = self.pick([f"{other} gives {her}", f"{cap(she)} finds", f"{cap(she)} buys"])
                out.append(f"{verb} {NUMBER_WORDS[add]} more {plural(noun, add)}.")
                count += add
            else:
                sub = self.rng.randint(1, count - 1)
                verb = self.pick([f"{cap(she)} gives {other}", f"{cap(she)} loses", f"{cap(she)} eats" if noun in FRUITS else f"{cap(she)} drops"])
                out.append(f"{verb} {NUMBER_WORDS[sub]} {plural(noun, sub)}.")
                count -= sub
            out.append(f"Now {name} has {NUMBER_WORDS[count]} {plural(noun, count)}.")
        return " ".join(out)

    def arithmetic_facts(self) -> str:
        lines = []
        for _ in range(self.rng.randint(3, 8)):
            a, b = self.rng.randint(0, 20), self.rng.randint(0, 20)
            op = self.rng.random()
            if op < 0.4:
                lines.append(f"{a} + {b} = {a + b}.")
            elif op < 0.7:
                a, b = max(a, b), min(a, b)
                lines.append(f"{a} - {b} = {a - b}.")
            elif op < 0.85:
                a, b = a % 11, b % 11
                lines.append(f"{a} times {b} is {a * b}.")
            else:
                a, b = a % 11, b % 11
                lines.append(f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}.")
        return " ".join(lines)

    def counting_sequence(self) -> str:
        start = self.rng.randint(1, 10)
        length = self.rng.randint(4, 10)
        if self.rng.random() < 0.5:
            stop = min(start + length, 21)
            seq = ", ".join(NUMBER_WORDS[i] for i in range(start, stop))
            return f"Let us count: {seq}."
        step = self.pick([1, 1, 2, 5, 10])
        seq = ", ".join(str(start * (step if step > 2 else 1) + i * step) for i in range(length))
        animal = self.pick(ANIMALS)
        return f"Count the {plural(animal)}: {seq}."

    def question_answer(self) -> str:
        out = []
        for _ in range(self.rng.randint(2, 4)):
            kind = self.rng.random()
            if kind < 0.45:
                subject = self.pick(list(FACTS))
                out.append(f"Q: What colour is {subject}? A: {cap(subject)} is {FACTS[subject]}.")
            elif kind < 0.8:
                a, b = self.rng.randint(0, 12), self.rng.randint(0, 12)
                out.append(f"Q: What is {a} plus {b}? A: {a} plus {b} is {a + b}.")
            else:
                n = self.rng.randint(1, 9)
                out.append(f"Q: What comes after {NUMBER_WORDS[n]}? A: {cap(NUMBER_WORDS[n + 1])} comes after {NUMBER_WORDS[n]}.")
        return " ".join(out)

    def comparisons(self) -> str:
        out = []
        for _ in range(self.rng.randint(2, 5)):
            a, b = self.rng.sample(range(0, 21), 2)
            word = "more" if a > b else "less"
            if self.rng.random() < 0.5:
                out.append(f"{cap(NUMBER_WORDS[a])} is {word} than {NUMBER_WORDS[b]}.")
            else:
                out.append(f"{a} is {'bigger' if a > b else 'smaller'} than {b}.")
        return " ".join(out)

    def packing_list(self) -> str:
        name = self.pick(NAMES)
        container = self.pick(["bag", "basket", "box"])
        items = []
        while len(items) < self.rng.randint(2, 5):
            item = f"the {self.pick(COLOURS)} {self.pick(OBJECTS)}"
            if item not in items:
                items.append(item)
        listed = ", ".join(items[:-1]) + f" and {items[-1]}"
        return (f"{name} puts {listed} in the {container}. "
                f"The {container} has {NUMBER_WORDS[len(items)]} things in it.")

    def story(self) -> str:
        hero, friend = self.rng.sample(NAMES, 2)
        animal, friend_animal = self.rng.sample(ANIMALS, 2)
        size, colour, obj = self.pick(SIZES), self.pick(COLOURS), self.pick(OBJECTS)
        place = self.pick(PLACES)
        he, _, his = PRONOUNS[hero]
        mood = self.pick(MOODS)
        opening = self.pick([
            f"Once upon a time, there was {article(size)} {size} {animal} named {hero}.",
            f"There was once {article(size)} {size} {animal} called {hero}.",
            f"Long ago, {article(size)} {size} {animal} named {hero} lived in the {place}.",
        ])
        out = [opening]
        if "lived in" not in opening:
            out.append(f"{hero} lived in the {place}.")
        out.append(self.pick([
            f"One day, {hero} found {article(colour)} {colour} {obj}.",
            f"One morning, {hero} saw {article(colour)} {colour} {obj} {self.pick(RELATIONS)} a tree.",
            f"One evening, {hero} found {article(colour)} {colour} {obj} by the {self.pick(PLACES)}.",
        ]))
        out.append(f'"What is that, {hero}?" asked {friend} the {friend_animal}.')
        out.append(f'"It is {article(colour)} {colour} {obj}," said {hero}.')
        for _ in range(self.rng.randint(1, 3)):
            out.append(self.pick([
                f"{hero} and {friend} played with the {obj} all day.",
                f"{friend} wanted the {colour} {obj} too.",
                f"{hero} gave the {obj} to {friend}, and {friend} gave it back.",
                f"{cap(he)} put the {obj} {self.pick(RELATIONS)} the {self.pick(SURFACES)}.",
                f"{friend} the {friend_animal} laughed, and {hero} the {animal} laughed too.",
                f"They took the {colour} {obj} to the {self.pick(PLACES)}.",
            ]))
        out.append(self.pick([
            f"In the end, {hero} took the {colour} {obj} home. {hero} was very {mood}.",
            f"At night, {hero} slept next to {his} {colour} {obj}. {hero} felt {mood}.",
            f"{hero} and {friend} were {mood}. The {obj} stayed in the {place}.",
        ]))
        return " ".join(out)

    def diary(self) -> str:
        name = self.pick(NAMES)
        out = []
        first = self.rng.randrange(len(DAYS))
        for offset in range(self.rng.randint(2, 4)):
            day = DAYS[(first + offset) % len(DAYS)]
            weather = self.pick(WEATHER)
            friend = self.pick([n for n in NAMES if n != name])
            out.append(self.pick([
                f"On {day} it was {weather}. {name} and {friend} {self.pick(ACTIVITIES)}.",
                f"On {day}, {name} went to the {self.pick(PLACES)} with {friend}. It was {weather}.",
                f"{day} was {weather}, so {name} stayed home and {self.pick(ACTIVITIES)}.",
            ]))
            if offset < len(DAYS) - 1 and self.rng.random() < 0.3:
                out.append(f"The day after {day} is {DAYS[(first + offset + 1) % len(DAYS)]}.")
        return " ".join(out)

    SECTIONS = ("scene", "counting_story", "arithmetic_facts", "counting_sequence",
                "question_answer", "comparisons", "packing_list", "story", "diary")
    WEIGHTS = (3, 3, 2, 1, 2, 1, 2, 4, 2)

    def document(self) -> str:
        kinds = self.rng.choices(self.SECTIONS, weights=self.WEIGHTS, k=self.rng.randint(1, 4))
        sections = [getattr(self, kind)() for kind in kinds]
        return "\n".join(sections)


def make_corpus(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> list[str]:
    grammar = Grammar(random.Random(seed))
    docs, total = [], 0
    while total < target_bytes:
        doc = grammar.document()
        docs.append(doc)
        total += len(doc.encode()) + 1
    return docs


def train_tokenizer(docs: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tokenizer


def write_tokenizer(tokenizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOD_TOKEN,
        "eos_token": EOD_TOKEN,
        "unk_token": EOD_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN, "pad_token": PAD_TOKEN}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="bundled data directory")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--target-bytes", type=int, default=TARGET_BYTES)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--corpus-only", type=Path, metavar="JSONL",
                        help="write only the documents, to this file, and train no tokenizer: a larger corpus "
                             "from another seed for runs longer than an epoch of the bundled one (tokenize it "
                             "with `lf-llm preprocess`, whose default is the bundled tokenizer)")
    args = parser.parse_args(argv)

    docs = make_corpus(args.seed, args.target_bytes)
    corpus = args.corpus_only or args.output / "corpus.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    with open(corpus, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    if args.corpus_only:
        print(f"{corpus}: {len(docs)} documents, {corpus.stat().st_size} bytes")
        return
    tokenizer = train_tokenizer(docs, args.vocab_size)
    write_tokenizer(tokenizer, args.output / "tokenizer")
    print(f"{corpus}: {len(docs)} documents, {corpus.stat().st_size} bytes; "
          f"tokenizer vocab {tokenizer.get_vocab_size()} in {args.output / 'tokenizer'}")


if __name__ == "__main__":
    main()
