"""Build the shipped instruction dataset: shop orders written as sentences -> one fixed JSON schema.

Why this task: a 135M base model answers politely but does not follow an exact schema
(it invents keys, drops fields, wraps JSON in prose), while a few minutes of LoRA
training teaches it the format and the copying. Each field can be scored on its own,
so "better" is a number, not an impression.

Run from the repository root:  python data/make_dataset.py
The output is deterministic (fixed seed): re-running it reproduces the committed files.
"""

import json
import random
from pathlib import Path

SEED = 1234
N_TRAIN = 600
N_EVAL = 60
SCHEMA_KEYS = ["customer", "item", "quantity", "color", "city", "day"]
SYSTEM = "You turn shop orders into JSON."
INSTRUCTION = (
    "Extract the order as JSON with exactly these keys: "
    "customer, item, quantity (a number), color, city, day.\n\nOrder: "
)

NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lucia", "Omar", "Priya", "Lars", "Chen", "Fatima",
         "Diego", "Ingrid", "Kwame", "Sofia", "Ravi", "Elena", "Hugo", "Mei", "Nadia", "Pablo",
         "Yusuf", "Greta", "Tariq", "Ana", "Jonas", "Leila", "Marco", "Zoe", "Ivan", "Amara"]
ITEMS = ["mug", "lamp", "backpack", "notebook", "umbrella", "scarf", "kettle", "chair", "bicycle bell",
         "phone case", "water bottle", "desk fan", "pillow", "jacket", "teapot", "candle", "clock",
         "frying pan", "yoga mat", "keyboard"]
COLORS = ["red", "blue", "green", "black", "white", "yellow", "purple", "orange", "grey", "pink"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Osaka", "Lima", "Dublin", "Cairo", "Seoul", "Porto", "Quito",
          "Vienna", "Accra", "Hanoi", "Denver", "Krakow", "Tunis", "Perth", "Bogota", "Riga", "Austin"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven",
                8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}

# Field order varies across templates so the model must read, not memorise positions.
TEMPLATES = [
    "{customer} ordered {qty} {color} {items} to be delivered in {city} on {day}.",
    "On {day}, {customer} from {city} bought {qty} {color} {items}.",
    "Please ship {qty} {color} {items} to {customer} in {city} by {day}.",
    "{customer} wants {qty} {items} in {color}, delivery to {city} on {day}.",
    "New order: {qty} x {color} {items} for {customer} ({city}), due {day}.",
    "Deliver to {city} on {day}: {qty} {color} {items}, ordered by {customer}.",
    "Hi, this is {customer}. I'd like {qty} {color} {items} sent to {city}, ideally on {day}.",
    "{city} store, {day}: {customer} picked up {qty} {color} {items}.",
]


def plural(item: str, qty: int) -> str:
    return item if qty == 1 else item + ("es" if item.endswith(("sh", "ch", "s")) else "s")


def make_example(rng: random.Random) -> dict:
    qty = rng.randint(1, 12)
    fields = {
        "customer": rng.choice(NAMES),
        "item": rng.choice(ITEMS),
        "quantity": qty,
        "color": rng.choice(COLORS),
        "city": rng.choice(CITIES),
        "day": rng.choice(DAYS),
    }
    qty_text = NUMBER_WORDS[qty] if rng.random() < 0.4 else str(qty)
    sentence = rng.choice(TEMPLATES).format(
        customer=fields["customer"], qty=qty_text, color=fields["color"],
        items=plural(fields["item"], qty), city=fields["city"], day=fields["day"],
    )
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": INSTRUCTION + sentence},
            {"role": "assistant", "content": json.dumps(fields)},
        ]
    }


def main(out_dir: Path = Path(__file__).parent) -> None:
    rng = random.Random(SEED)
    seen, rows = set(), []
    while len(rows) < N_TRAIN + N_EVAL:
        row = make_example(rng)
        key = row["messages"][1]["content"]
        if key not in seen:  # no eval sentence may also appear in train
            seen.add(key)
            rows.append(row)
    for name, part in (("train.jsonl", rows[:N_TRAIN]), ("eval.jsonl", rows[N_TRAIN:])):
        with open(out_dir / name, "w", encoding="utf-8") as f:
            for row in part:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(part)} rows to {out_dir / name}")


if __name__ == "__main__":
    main()
