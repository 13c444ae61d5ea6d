"""Writes the generated part of the tokenizer training text (stories, dialogues, facts, code).

The text shipped in engine/data/*.txt is original: prose.txt is hand-written, the rest comes from
this script's word lists and templates. Deterministic: ``python engine/data/make_corpus.py``
rewrites the same files byte for byte.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Ada", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi",
         "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma",
         "Viktor", "Wen", "Ximena", "Yusuf", "Zofia"]
ROLES = ["baker", "engineer", "farmer", "teacher", "pilot", "nurse", "painter", "librarian",
         "carpenter", "chemist", "fisher", "gardener", "musician", "student", "doctor", "sailor",
         "mechanic", "writer", "tailor", "astronomer"]
PLACES = ["the harbor", "the old mill", "a quiet village", "the city library", "the train station",
          "the hills above the town", "a small bakery", "the night market", "the river bank",
          "the workshop", "a crowded kitchen", "the observatory", "the north field",
          "an empty classroom", "the lighthouse", "a mountain hut", "the ferry deck", "the garden"]
TIMES = ["at dawn", "before breakfast", "in the late afternoon", "after the storm", "on Monday",
         "every Sunday", "during the winter", "at midnight", "in early spring", "that evening",
         "the next morning", "once a year", "just before noon", "on the first warm day"]
ADJECTIVES = ["quiet", "bright", "heavy", "careful", "strange", "gentle", "narrow", "ancient",
              "curious", "patient", "sharp", "warm", "broken", "golden", "tired", "hidden",
              "simple", "crowded", "silver", "restless", "clever", "modest", "stubborn", "vivid"]
OBJECTS = ["lantern", "map", "letter", "basket", "engine", "notebook", "bridge", "window",
           "violin", "recipe", "compass", "garden", "clock", "boat", "kettle", "ladder", "coat",
           "telescope", "puzzle", "bicycle", "blanket", "mirror", "key", "drum", "candle", "loaf"]
VERBS = ["repaired", "found", "painted", "carried", "opened", "measured", "studied", "cleaned",
         "borrowed", "built", "sold", "described", "remembered", "forgot", "shared", "traded",
         "wrapped", "tested", "sketched", "polished", "weighed", "counted", "returned", "hid"]
ADVERBS = ["slowly", "quickly", "carefully", "quietly", "happily", "reluctantly", "suddenly",
           "patiently", "proudly", "gently", "eagerly", "calmly", "barely", "finally"]
FEELINGS = ["glad", "surprised", "worried", "relieved", "proud", "puzzled", "hopeful", "calm",
            "annoyed", "delighted", "nervous", "grateful"]
TOPICS = ["the weather", "a new recipe", "the harvest", "an old song", "the price of bread",
          "the next election", "a broken fence", "the stars", "a long journey", "the town council",
          "a missing cat", "the school play", "the river", "a strange noise", "the market"]
QUESTIONS = [
    ("How do I keep bread fresh for longer?",
     "Keep it in a paper bag or a bread box at room temperature. The fridge dries it out faster. "
     "If you will not eat it within two days, slice it and freeze the slices."),
    ("What is a hash function?",
     "A hash function turns input of any length into a fixed-size value. The same input always "
     "gives the same output, and a good hash makes it hard to find two inputs with the same "
     "value."),
    ("Why is the sky blue?",
     "Sunlight scatters off the molecules of the air, and short blue wavelengths scatter much more "
     "than long red ones, so blue light reaches your eyes from every direction of the sky."),
    ("Can you suggest a name for a small cafe?",
     "A few ideas: The Corner Cup, Second Breakfast, Slow Morning, The Kettle and Crumb."),
    ("How many minutes are there in a day?",
     "There are 24 hours in a day and 60 minutes in an hour, so a day has 1440 minutes."),
    ("What should I pack for a day of hiking?",
     "Water, a snack, a map, a light jacket, sun protection, a small first aid kit and a charged "
     "phone. Tell someone where you are going and when you expect to be back."),
    ("Explain what a cache does in one sentence.",
     "A cache keeps copies of recently used data close at hand so that asking for it again is "
     "fast."),
    ("How do I reverse a list in Python?",
     "Use items.reverse() to reverse it in place, or items[::-1] to get a reversed copy."),
    ("What is the difference between weather and climate?",
     "Weather is what the atmosphere does on a given day; climate is the pattern of weather over "
     "many years in a place."),
    ("Give me a tip for learning to cook.",
     "Learn a few basic techniques well, such as cutting an onion, roasting vegetables and making "
     "a simple sauce, then combine them. Taste as you go and write down what worked."),
]


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def sentence(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    templates = [
        lambda: f"{name} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {rng.choice(OBJECTS)} "
                f"{rng.choice(TIMES)}.",
        lambda: f"{_upper_first(rng.choice(TIMES))}, {name} the {rng.choice(ROLES)} walked "
                f"{rng.choice(ADVERBS)} to {rng.choice(PLACES)}.",
        lambda: f"At {rng.choice(PLACES)}, {name} and {other} talked about {rng.choice(TOPICS)}.",
        lambda: f"{name} was {rng.choice(FEELINGS)} to see that the {rng.choice(OBJECTS)} had been "
                f"{rng.choice(VERBS)}.",
        lambda: f"\"Have you seen my {rng.choice(OBJECTS)}?\" asked {name}. \"It was "
                f"{rng.choice(ADJECTIVES)} and I left it near {rng.choice(PLACES)}.\"",
        lambda: f"The {rng.choice(ADJECTIVES)} {rng.choice(ROLES)} {rng.choice(VERBS)} "
                f"{rng.randint(2, 99)} {rng.choice(OBJECTS)}s before {rng.choice(TIMES)}.",
        lambda: f"Nobody knew why {name} {rng.choice(ADVERBS)} {rng.choice(VERBS)} the "
                f"{rng.choice(OBJECTS)}, but {other} had a theory.",
        lambda: f"{other} said that {rng.choice(TOPICS)} was more {rng.choice(ADJECTIVES)} than "
                f"anyone expected.",
    ]
    return rng.choice(templates)()


def stories(rng: random.Random, num_paragraphs: int) -> str:
    paragraphs = []
    for _ in range(num_paragraphs):
        paragraphs.append(" ".join(sentence(rng) for _ in range(rng.randint(3, 7))))
    return "\n\n".join(paragraphs) + "\n"


def dialogues(rng: random.Random, num_dialogues: int) -> str:
    out = []
    for _ in range(num_dialogues):
        question, answer = rng.choice(QUESTIONS)
        name = rng.choice(NAMES)
        turns = [f"User: Hi, I am {name}. {question}", f"Assistant: {answer}"]
        if rng.random() < 0.5:
            turns += [f"User: Thanks! And what about {rng.choice(TOPICS)}?",
                      f"Assistant: That depends on {rng.choice(TOPICS)}. {sentence(rng)}"]
        out.append("\n".join(turns))
    return "\n\n".join(out) + "\n"


def facts(rng: random.Random, num_facts: int) -> str:
    months = ["January", "February", "March", "April", "May", "June", "July", "August",
              "September", "October", "November", "December"]
    lines = []
    for _ in range(num_facts):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        kind = rng.randrange(6)
        if kind == 0:
            lines.append(f"{a} + {b} = {a + b}")
        elif kind == 1:
            lines.append(f"The product of {a} and {b} is {a * b}.")
        elif kind == 2:
            lines.append(f"{a} divided by {b} is {a // b} with remainder {a % b}.")
        elif kind == 3:
            lines.append(f"On {rng.randint(1, 28)} {rng.choice(months)} {rng.randint(1900, 2030)}, "
                         f"{rng.choice(NAMES)} paid ${a}.{b:02d} for a {rng.choice(OBJECTS)}.")
        elif kind == 4:
            lines.append(f"Step {b % 9 + 1}: {rng.choice(VERBS)} the {rng.choice(OBJECTS)} "
                         f"{rng.choice(ADVERBS)}; wait {a % 60 + 1} minutes.")
        else:
            lines.append(f"- {rng.choice(ADJECTIVES)} {rng.choice(OBJECTS)}: {a}g, "
                         f"{b}% ({rng.choice(PLACES)})")
    return "\n".join(lines) + "\n"


def code(rng: random.Random, num_snippets: int) -> str:
    snippets = []
    for _ in range(num_snippets):
        obj, verb = rng.choice(OBJECTS), rng.choice(VERBS)[:-2] or "use"
        n = rng.randint(2, 64)
        kind = rng.randrange(3)
        if kind == 0:
            snippets.append(
                f"def {verb}_{obj}s(items: list[int], limit: int = {n}) -> list[int]:\n"
                f"    \"\"\"Return the {obj}s below the limit, sorted.\"\"\"\n"
                f"    result = [x for x in items if x < limit]\n"
                f"    result.sort()\n"
                f"    return result\n")
        elif kind == 1:
            snippets.append(
                f"class {_upper_first(obj)}Store:\n"
                f"    def __init__(self, capacity={n}):\n"
                f"        self.capacity = capacity\n"
                f"        self.items = {{}}\n\n"
                f"    def get(self, key):\n"
                f"        return self.items.get(key)\n")
        else:
            snippets.append(
                f"for i in range({n}):\n"
                f"    if i % {rng.randint(2, 7)} == 0:\n"
                f"        print(\"{obj}\", i, i * i)\n")
    return "\n".join(snippets)


def main() -> None:
    folder = Path(__file__).parent
    rng = random.Random(20260301)
    (folder / "stories.txt").write_text(stories(rng, 700))
    (folder / "dialogues.txt").write_text(dialogues(rng, 400))
    (folder / "facts.txt").write_text(facts(rng, 2500))
    (folder / "code.txt").write_text(code(rng, 300))


if __name__ == "__main__":
    main()
