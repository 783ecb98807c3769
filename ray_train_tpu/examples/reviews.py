"""A labelled product-review sentiment set, generated offline and deterministically.

Short English reviews, each about one aspect of one product, labelled
``0`` (negative) or ``1`` (positive). A quarter of them negate their opinion
("the zipper was not sturdy", "the price is anything but disappointing"), which
flips the label: a bag of positive or negative words does not solve the task,
and an untrained classifier head on a sentence encoder is at chance.

Example:
    >>> train, test = review_splits(num_train=8, num_test=4, seed=0)
    >>> len(train), len(test), sorted(set(r.label for r in train + test))
    (8, 4, [0, 1])
    >>> LABELS
    ('negative', 'positive')
"""

from __future__ import annotations

import dataclasses
import random

LABELS = ("negative", "positive")

PRODUCTS = (
    "headphones", "laptop", "blender", "backpack", "phone", "camera", "kettle", "keyboard",
    "monitor", "vacuum", "office chair", "tent", "coffee maker", "smartwatch", "speaker", "drill",
)
ASPECTS = (
    "battery", "sound", "build quality", "screen", "price", "design", "customer service",
    "packaging", "performance", "handle", "motor", "zipper", "setup", "manual", "display", "fit",
)
POSITIVE = (
    "great", "excellent", "reliable", "impressive", "comfortable", "sturdy", "superb",
    "wonderful", "solid", "fantastic", "pleasant", "outstanding",
)
NEGATIVE = (
    "terrible", "flimsy", "disappointing", "awful", "unreliable", "poor", "frustrating",
    "mediocre", "dreadful", "cheap", "annoying", "useless",
)
INTENSIFIERS = ("", "really ", "very ", "quite ", "truly ", "rather ")
NEGATIONS = ("not ", "never ", "far from ", "anything but ")
CLOSERS = ("", " Bought it last month.", " Used it every day.", " Arrived on Tuesday.",
           " Got it as a gift.", " Second one I own.")
# {p}: product, {a}: aspect, {o}: opinion (intensifier or negation + adjective)
TEMPLATES = (
    "The {a} of this {p} is {o}.",
    "I found the {a} of the {p} {o}.",
    "{P}: the {a} was {o}.",
    "Honestly, the {a} on my new {p} is {o}.",
    "My {p} arrived and the {a} is {o}.",
    "For a {p}, the {a} feels {o}.",
    "After a week with this {p}, I'd say the {a} is {o}.",
    "The {p} looks nice, and its {a} is {o}.",
)


@dataclasses.dataclass(frozen=True)
class Review:
    text: str
    label: int  # index into LABELS


def _review(rng: random.Random) -> Review:
    positive = rng.random() < 0.5
    adjective = rng.choice(POSITIVE if positive else NEGATIVE)
    negated = rng.random() < 0.25
    opinion = (rng.choice(NEGATIONS) if negated else rng.choice(INTENSIFIERS)) + adjective
    product = rng.choice(PRODUCTS)
    text = rng.choice(TEMPLATES).format(p=product, P=product.capitalize(), a=rng.choice(ASPECTS), o=opinion)
    return Review(text + rng.choice(CLOSERS), int(positive != negated))


def review_splits(num_train: int = 1200, num_test: int = 400, seed: int = 0) -> tuple[list[Review], list[Review]]:
    """``num_train`` and ``num_test`` distinct reviews (no text in both splits),
    the same for the same arguments on every machine and Python version.

    Example:
        >>> review_splits(num_train=2, num_test=1, seed=3)[1][0].text  # doctest: +SKIP
        'The price of this kettle is quite superb.'
    """
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"review_splits({name}={value!r}) must be an integer >= 1")
    rng = random.Random(seed)
    seen: dict[str, Review] = {}
    # About 3 million distinct texts: a few thousand draws rarely repeat one.
    limit = 20 * (num_train + num_test)
    for _ in range(limit):
        review = _review(rng)
        seen.setdefault(review.text, review)
        if len(seen) == num_train + num_test:
            reviews = list(seen.values())
            return reviews[:num_train], reviews[num_train:]
    raise ValueError(f"review_splits: only {len(seen)} distinct reviews in {limit} draws; ask for fewer")
