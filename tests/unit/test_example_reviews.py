"""The offline review set the notebook trains on: deterministic, balanced, disjoint splits."""

import pytest

from ray_train_tpu.examples.reviews import LABELS, NEGATIONS, NEGATIVE, POSITIVE, review_splits


def test_the_same_arguments_give_the_same_reviews_and_another_seed_others():
    assert review_splits(50, 20, seed=1) == review_splits(50, 20, seed=1)
    assert review_splits(50, 20, seed=1) != review_splits(50, 20, seed=2)


def test_splits_are_distinct_disjoint_and_balanced():
    train, test = review_splits()
    assert (len(train), len(test)) == (1200, 400)
    texts = [r.text for r in train + test]
    assert len(set(texts)) == len(texts)
    for split in (train, test):
        share = sum(r.label for r in split) / len(split)
        assert 0.4 < share < 0.6, share
    assert {r.label for r in train} == set(range(len(LABELS)))


def test_a_negation_flips_the_label_of_its_adjective():
    train, _ = review_splits()
    negated = 0
    for r in train:
        words = r.text.lower().replace(".", " ").replace(",", " ").split()
        positive = any(a in words for a in POSITIVE)
        assert positive != any(a in words for a in NEGATIVE), r.text
        is_negated = any(f" {n.strip()} " in f" {' '.join(words)} " for n in NEGATIONS)
        negated += is_negated
        assert r.label == int(positive != is_negated), r
    assert 0.15 < negated / len(train) < 0.35


@pytest.mark.parametrize("kwargs", [{"num_train": 0}, {"num_test": -1}, {"num_train": 2.0}, {"num_test": True}])
def test_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="review_splits"):
        review_splits(**kwargs)
