"""The copy-heavy benchmark's requests (benchmarks/server/copy_heavy.py): (kind, messages), each
asking for a reply that repeats much of what the conversation already holds."""

from __future__ import annotations

INVENTORY = '''def restock(inventory, item, amount):
    """Add amount units of item to the inventory and return the new count."""
    if amount <= 0:
        raise ValueError("amount must be positive")
    current = inventory.get(item, 0)
    inventory[item] = current + amount
    return inventory[item]


def sell(inventory, item, amount):
    """Remove amount units of item from the inventory and return what is left."""
    current = inventory.get(item, 0)
    if amount > current:
        raise ValueError("not enough stock")
    inventory[item] = current - amount
    return inventory[item]
'''

AVERAGE = '''#include <stdio.h>

int average(const int *values, int count) {
    int total = 0;
    for (int i = 0; i < count; i++) {
        total += values[i];
    }
    return count > 0 ? total / count : 0;
}

int main(void) {
    int scores[] = {71, 88, 93, 64, 80};
    printf("average: %d\\n", average(scores, 5));
    return 0;
}
'''

GARDEN = ("Every spring the community garden opens its gates on the first Saturday of April. "
          "Volunteers arrive early to turn the soil, repair the wooden beds and sort the seeds that "
          "were saved from last autumn. By noon the children have planted rows of beans and "
          "sunflowers, and the older members have set up the watering rota for the summer. In the "
          "afternoon everyone shares soup made from the last of the winter vegetables.")

GARDEN_TYPOS = GARDEN.replace("spring", "sprign").replace("Volunteers", "Volunters").replace(
    "repair", "repiar").replace("children", "chidlren").replace("afternoon", "afternon")

RIVER = ("The town of Elmford grew up where two roads crossed the river Wend. In the twelfth century "
         "a stone bridge replaced the old ford, and a market was held beside it every Thursday. The "
         "river carried wool and timber down to the coast, and the mills along its banks ground "
         "grain for the whole valley. A great flood in 1736 swept the bridge away; the one that "
         "stands today was finished in 1741. The market still meets on Thursdays, although it now "
         "sells cheese, bread and pottery to visitors.")

STEPS = ("To make a cup of tea: 1. Fill the kettle with fresh water. 2. Bring the water to the boil. "
         "3. Warm the teapot with a little hot water and pour it away. 4. Put one spoon of tea per "
         "person into the pot.")

FRUIT = ["plum", "apple", "mango", "cherry", "banana", "kiwi", "orange", "grape", "lemon", "apricot", "pear",
         "fig"]

PLANETS = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]

SETTINGS = ('{"name": "office printer", "location": "second floor", "duplex": true, "paper": "A4", '
            '"trays": 2, "colour": false, "queue_limit": 50, "owner": "facilities"}')

SALES = ("region,quarter,units,revenue\nnorth,Q1,120,3600\nnorth,Q2,135,4050\nsouth,Q1,98,2940\n"
         "south,Q2,110,3300\neast,Q1,143,4290\neast,Q2,150,4500")

FIRST_ANSWER = ("A rainbow appears when sunlight passes through raindrops. Each drop bends the light and "
                "splits it into its colours, red on the outside and violet on the inside, so you see a "
                "curved band of colours in the part of the sky opposite the sun.")


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def lines(items: list[str]) -> str:
    return "\n".join(items)


REQUESTS: list[tuple[str, list[dict[str, str]]]] = [
    ("code edit: rename a function", user(
        "Rename the function sell to remove_stock in this code. Change nothing else and reply with the "
        "whole code.\n\n" + INVENTORY)),
    ("code edit: change a check", user(
        "In this code, make restock also accept an amount of zero. Reply with the whole code.\n\n" + INVENTORY)),
    ("code edit: change a type", user(
        "Change the return type of average to double in this C program and print it with %f. Reply with "
        "the whole program.\n\n" + AVERAGE)),
    ("fix the spelling", user("Correct the spelling mistakes in this paragraph and return it:\n\n" + GARDEN_TYPOS)),
    ("repeat and extend", user(
        "Repeat this paragraph exactly, then add one more sentence about the evening.\n\n" + GARDEN)),
    ("repeat and continue a list", user(
        "Copy these steps and continue them until the tea is ready.\n\n" + STEPS)),
    ("sort a list", user("Sort this list alphabetically, one item per line:\n\n" + lines(FRUIT))),
    ("reverse a list", user("Write this list in reverse order, one item per line:\n\n" + lines(PLANETS))),
    ("quote the source", user(
        "Read the text and quote the sentence that says when the present bridge was finished.\n\n" + RIVER)),
    ("quote every match", user(
        "Quote every sentence of this text that mentions the market, word for word.\n\n" + RIVER)),
    ("edit a JSON object", user(
        "Set duplex to false and trays to 3 in this JSON object. Reply with the whole object.\n\n" + SETTINGS)),
    ("table to markdown", user("Turn this CSV into a markdown table:\n\n" + SALES)),
    ("restate the last answer", [
        {"role": "user", "content": "Why do rainbows appear?"},
        {"role": "assistant", "content": FIRST_ANSWER},
        {"role": "user", "content": "Please repeat your answer word for word."}]),
    ("restate as a list", [
        {"role": "user", "content": "Why do rainbows appear?"},
        {"role": "assistant", "content": FIRST_ANSWER},
        {"role": "user", "content": "Say that again, one sentence per bullet point."}]),
]
