"""Regenerate `demo_chat.jsonl`: the small chat dataset bundled for `eagle-fast demo` and tests.

Run `python eagle_fast/data/make_demo_chat.py` to rewrite the file next to this script. The
output is a pure function of SEED and this source: the same bytes on every machine and
Python >= 3.10 (only `random.Random` with a fixed seed, sorted containers, no hashing of
sets). Each line is `{"messages": [...]}` with an optional system turn and one to three
user/assistant exchanges drawn from a dozen templated tasks (arithmetic, unit conversion,
geography, spelling, short code, lists, definitions, dates, recipes, small talk...), so the
tokenizer trained on it sees varied words, digits, punctuation and code.

Limits: templated text, not natural conversation; it exists to exercise chat templates,
assistant-only loss masks, length variety and the draft vocabulary, not to teach anything.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240607
NUM_CONVERSATIONS = 400

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a friendly tutor who explains each step.",
    "You are a careful assistant; say when you are unsure.",
    "Answer in plain English without jargon.",
]

COUNTRIES = [
    ("France", "Paris", "euro"), ("Japan", "Tokyo", "yen"), ("Kenya", "Nairobi", "shilling"),
    ("Brazil", "Brasilia", "real"), ("Canada", "Ottawa", "Canadian dollar"),
    ("Egypt", "Cairo", "Egyptian pound"), ("India", "New Delhi", "rupee"),
    ("Norway", "Oslo", "krone"), ("Peru", "Lima", "sol"), ("Vietnam", "Hanoi", "dong"),
    ("Australia", "Canberra", "Australian dollar"), ("Mexico", "Mexico City", "peso"),
    ("Poland", "Warsaw", "zloty"), ("Chile", "Santiago", "peso"),
    ("Morocco", "Rabat", "dirham"), ("Thailand", "Bangkok", "baht"),
]

WORDS = [
    "necessary", "rhythm", "separate", "definitely", "accommodate", "embarrass", "occurrence",
    "privilege", "maintenance", "conscience", "guarantee", "harass", "millennium", "queue",
    "recommend", "threshold", "vacuum", "weird", "bureaucracy", "liaison",
]

DEFINITIONS = {
    "photosynthesis": "the process plants use to turn light, water and carbon dioxide into "
    "sugar and oxygen",
    "inflation": "a general rise in prices that lowers what a unit of money can buy",
    "latency": "the delay between a request and the start of its response",
    "entropy": "a measure of uncertainty or disorder in a system",
    "recursion": "a way of solving a problem where a function calls itself on smaller inputs",
    "osmosis": "the movement of water through a membrane toward the side with more dissolved "
    "particles",
    "gradient": "the direction and rate of the fastest increase of a function",
    "tokenizer": "a tool that splits text into the units a language model reads",
    "cache": "a small fast store that keeps recently used data close at hand",
    "bandwidth": "how much data a link can carry per second",
    "speculative decoding": "a method where a cheap draft model proposes tokens and the large "
    "model checks them in one pass",
    "hidden state": "the vector a neural network layer produces for each position",
}

UNITS = [
    ("kilometres", "miles", 0.621371), ("miles", "kilometres", 1.609344),
    ("kilograms", "pounds", 2.204623), ("litres", "gallons", 0.264172),
    ("metres", "feet", 3.280840), ("inches", "centimetres", 2.54),
]

RECIPES = {
    "pancakes": ["1 cup flour", "1 egg", "1 cup milk", "1 tablespoon sugar", "a pinch of salt"],
    "guacamole": ["2 avocados", "1 lime", "half an onion", "1 tomato", "salt and pepper"],
    "tomato soup": ["6 tomatoes", "1 onion", "2 cloves garlic", "2 cups stock", "olive oil"],
    "fried rice": ["2 cups cooked rice", "2 eggs", "1 carrot", "peas", "soy sauce"],
    "lemonade": ["4 lemons", "half a cup of sugar", "4 cups water", "ice"],
}

ANIMALS = ["cat", "dog", "owl", "horse", "dolphin", "penguin", "fox", "bee", "whale", "tiger"]
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
LANGS = ["Python", "JavaScript", "Rust", "Go", "C"]
NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jules"]
SMALL_TALK = [
    ("How are you today?", "I am doing well, thanks for asking. What can I help you with?"),
    ("Tell me a fun fact.", "Octopuses have three hearts and blue blood."),
    ("What is your favourite colour?", "I do not have preferences, but many people like blue."),
    ("Can you keep a secret?", "I do not remember past conversations, so your secret is safe."),
    ("Thanks for the help!", "You are welcome. Good luck with your work!"),
    ("I feel tired.", "A short walk, some water and a proper night of sleep often help."),
]


def _arith(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    q = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {word} {b}.", f"{a} {op} {b} = ?"])
    if op == "*" and rng.random() < 0.5:
        ans = f"{a} times {b} is {value}. Check: {a} x {b // 2} x 2 + {a} x {b % 2} = {value}."
    else:
        ans = f"{a} {op} {b} = {value}."
    return q, ans


def _units(rng: random.Random) -> tuple[str, str]:
    src, dst, factor = rng.choice(UNITS)
    x = rng.choice([1, 2, 3, 5, 10, 12, 20, 42, 100, 250])
    return (
        f"How many {dst} are in {x} {src}?",
        f"{x} {src} is about {x * factor:.2f} {dst}, since 1 {src[:-1]} is {factor} {dst}.",
    )


def _geo(rng: random.Random) -> tuple[str, str]:
    country, capital, currency = rng.choice(COUNTRIES)
    if rng.random() < 0.5:
        return f"What is the capital of {country}?", f"The capital of {country} is {capital}."
    return f"Which currency is used in {country}?", f"{country} uses the {currency}."


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    kind = rng.randint(0, 2)
    if kind == 0:
        return f"How do you spell '{word}'?", f"It is spelled {'-'.join(word.upper())}."
    if kind == 1:
        return f"Reverse the word {word}.", f"{word} reversed is {word[::-1]}."
    n = sum(ch in "aeiou" for ch in word)
    return f"How many vowels are in '{word}'?", f"'{word}' has {n} vowels."


def _code(rng: random.Random) -> tuple[str, str]:
    lang = rng.choice(LANGS)
    task = rng.choice(["add two numbers", "square a number", "check if a number is even"])
    body = {
        ("Python", "add two numbers"): "def add(a, b):\n    return a + b",
        ("Python", "square a number"): "def square(x):\n    return x * x",
        ("Python", "check if a number is even"): "def is_even(n):\n    return n % 2 == 0",
        ("JavaScript", "add two numbers"): "function add(a, b) {\n  return a + b;\n}",
        ("JavaScript", "square a number"): "const square = (x) => x * x;",
        ("JavaScript", "check if a number is even"): "const isEven = (n) => n % 2 === 0;",
        ("Rust", "add two numbers"): "fn add(a: i64, b: i64) -> i64 {\n    a + b\n}",
        ("Rust", "square a number"): "fn square(x: f64) -> f64 {\n    x * x\n}",
        ("Rust", "check if a number is even"): "fn is_even(n: u32) -> bool {\n    n % 2 == 0\n}",
        ("Go", "add two numbers"): "func add(a, b int) int {\n\treturn a + b\n}",
        ("Go", "square a number"): "func square(x float64) float64 {\n\treturn x * x\n}",
        ("Go", "check if a number is even"): "func isEven(n int) bool {\n\treturn n%2 == 0\n}",
        ("C", "add two numbers"): "int add(int a, int b) {\n    return a + b;\n}",
        ("C", "square a number"): "double square(double x) {\n    return x * x;\n}",
        ("C", "check if a number is even"): "int is_even(int n) {\n    return n % 2 == 0;\n}",
    }[(lang, task)]
    return (
        f"Write a {lang} function to {task}.",
        f"Here is one way in {lang}:\n```\n{body}\n```\nIt runs in constant time.",
    )


def _list(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(3, 5)
    pool = rng.choice([ANIMALS, COLOURS, [c for c, _, _ in COUNTRIES]])
    items = rng.sample(pool, n)
    style = rng.randint(0, 2)
    if style == 0:
        return f"Sort these alphabetically: {', '.join(items)}.", ", ".join(sorted(items)) + "."
    if style == 1:
        return (
            f"Number this list: {', '.join(items)}.",
            "\n".join(f"{i + 1}. {x}" for i, x in enumerate(items)),
        )
    return f"Which of these is longest: {', '.join(items)}?", (
        f"The longest is {max(items, key=len)} with {len(max(items, key=len))} letters."
    )


def _define(rng: random.Random) -> tuple[str, str]:
    term = rng.choice(sorted(DEFINITIONS))
    q = rng.choice([f"What is {term}?", f"Define {term}.", f"Explain {term} in one sentence."])
    return q, f"{term[0].upper() + term[1:]} is {DEFINITIONS[term]}."


def _date(rng: random.Random) -> tuple[str, str]:
    d = rng.randrange(7)
    k = rng.randint(1, 30)
    return (
        f"If today is {DAYS[d]}, what day is it in {k} days?",
        f"{k} days is {k // 7} weeks and {k % 7} days, so it will be {DAYS[(d + k) % 7]}.",
    )


def _recipe(rng: random.Random) -> tuple[str, str]:
    dish = rng.choice(sorted(RECIPES))
    items = RECIPES[dish]
    return f"What do I need to make {dish}?", (
        f"For {dish} you need: " + "; ".join(items) + ". Mix, cook gently and taste as you go."
    )


def _word_problem(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    a, b, price = rng.randint(2, 12), rng.randint(1, 9), rng.randint(1, 7)
    thing = rng.choice(["apples", "pens", "tickets", "books", "cups"])
    return (
        f"{name} buys {a} {thing} and then {b} more. Each costs ${price}. How much in total?",
        (f"{name} buys {a} + {b} = {a + b} {thing}. At ${price} each that is "
         f"{a + b} x {price} = ${(a + b) * price}."),
    )


def _small_talk(rng: random.Random) -> tuple[str, str]:
    return rng.choice(SMALL_TALK)


TASKS = [_arith, _units, _geo, _spell, _code, _list, _define, _date, _recipe, _word_problem,
         _small_talk]
FOLLOW_UPS = [
    ("Can you double check that?", "Yes, I checked it again and the answer stands."),
    ("Thanks!", "Happy to help."),
    ("Explain it more simply.", "Sure: take it one step at a time, as shown above."),
    ("Why?", "Because each step follows directly from the previous one."),
]


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for turn in range(rng.choice([1, 1, 2, 2, 3])):
        if turn > 0 and rng.random() < 0.3:
            q, a = rng.choice(FOLLOW_UPS)
        else:
            q, a = rng.choice(TASKS)(rng)
        messages.append({"role": "user", "content": q})
        messages.append({"role": "assistant", "content": a})
    return {"messages": messages}


def generate(n: int = NUM_CONVERSATIONS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def main() -> None:
    out = Path(__file__).with_name("demo_chat.jsonl")
    lines = [json.dumps(rec, ensure_ascii=True, sort_keys=True) for rec in generate()]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out} ({len(lines)} conversations, {out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
