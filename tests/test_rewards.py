"""Rewards against hand-derived values (SQuAD normalisation, EM, F1, cover-EM, group reward)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from searchlite.rewards import (
    cover_exact_match,
    exact_match,
    f1_score,
    format_reward,
    group_reward,
    normalize_answer,
)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("The Cat", "cat"),  # case + leading article
        ("  Hello,   World!  ", "hello world"),  # punctuation + whitespace
        ("an apple a day", "apple day"),  # all three articles as words
        ("Theater anthem", "theater anthem"),  # articles only as whole words
        ("A.B.C.", "abc"),  # punctuation removed before articles: "abc", not "b c"
        ("t.he end", "end"),  # "t.he" -> "the" -> removed (SQuAD order)
        ("Rock 'n' Roll", "rock n roll"),
        ("\tNew\nYork ", "new york"),
        ("", ""),
        ("the", ""),
        ("Ünïcode Straße", "ünïcode straße"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@given(st.text())
@settings(max_examples=300, deadline=None)
def test_normalize_answer_idempotent_and_total(s):
    once = normalize_answer(s)
    assert isinstance(once, str)
    assert normalize_answer(once) == once
    assert once == " ".join(once.split())  # no leading, trailing or repeated whitespace


@pytest.mark.parametrize(
    "pred, golds, expected",
    [
        ("The Eiffel Tower", ["eiffel tower"], 1.0),
        ("Eiffel", ["Eiffel Tower"], 0.0),
        ("paris!", ["London", "Paris"], 1.0),  # any gold
        ("Paris", "paris", 1.0),  # a bare string is one gold, not a list of letters
        ("p", "paris", 0.0),
        (None, ["paris"], 0.0),
        ("paris", [], 0.0),
        ("Paris -", ["Paris"], 1.0),  # SQuAD drops every punctuation mark, the hyphen too
    ],
)
def test_exact_match(pred, golds, expected):
    assert exact_match(pred, golds) == expected


@pytest.mark.parametrize(
    "pred, golds, expected",
    [
        # pred {eiffel, tower, in, paris}, gold {eiffel, tower}: P = 1/2, R = 1 -> 2/3
        ("Eiffel Tower in Paris", ["the Eiffel Tower"], 2 / 3),
        ("new york city", ["york", "New York City"], 1.0),  # max over golds
        # "cat cat cat" vs "cat": overlap min(3, 1) = 1 -> P = 1/3, R = 1 -> 1/2
        ("the cat cat cat", ["cat"], 0.5),
        # pred {big, red, apple}, gold {red, apple, pie, tin}: overlap 2, P = 2/3, R = 1/2 -> 4/7
        ("big red apple", ["red apple pie tin"], 4 / 7),
        ("paris paris", ["paris paris"], 1.0),  # each repeat counts: overlap 2, not the 1 of a set
        ("noanswer here", ["noanswer"], 0.0),  # FlashRAG's special case: noanswer too, not only yes and no
        ("dog", ["cat"], 0.0),
        # yes/no special case: plain token F1 would give 2/3 and 1/2
        ("no", ["no way"], 0.0),
        ("yes it is", ["yes"], 0.0),
        ("Yes.", ["yes"], 1.0),
        (None, ["cat"], 0.0),
    ],
)
def test_f1_score(pred, golds, expected):
    assert f1_score(pred, golds) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "pred, golds, kwargs, expected",
    [
        ("It is the Eiffel Tower.", ["eiffel tower"], {}, 1.0),
        ("parisian food", ["paris"], {}, 0.0),  # word boundaries, not raw substring
        ("I think Lyon", ["Paris", "lyon"], {}, 1.0),
        ("one two three four five six seven eight nine paris", ["paris"], {}, 1.0),  # 10 words
        ("one two three four five six seven eight nine ten paris", ["paris"], {}, 0.0),  # 11
        ("a b c paris", ["paris"], {"max_words": 3}, 0.0),
        ("the cat", ["the"], {}, 0.0),  # gold normalises to "": never covers
        ("eiffel", ["eiffel tower"], {}, 0.0),  # partial gold is not covered
        (None, ["paris"], {}, 0.0),
        ("Louvre, Paris's", ["Paris"], {}, 1.0),  # a possessive ("pariss" with punctuation deleted)
        ("Paris,France", ["Paris"], {}, 1.0),  # a comma with no space after it
        ("Jean-Paul Sartre", ["Jean Paul Sartre"], {}, 1.0),  # a hyphen against a space
        ("Jean Paul Sartre", ["Jean-Paul Sartre"], {}, 1.0),
        ("Trenton-Mercer Airport", ["Trenton\u2013Mercer Airport"], {}, 1.0),  # an en dash, as realqa has
        ("the answer is \u201cParis\u201d", ["Paris"], {}, 1.0),  # curly quotes
        ("Parisian's", ["Paris"], {}, 0.0),  # still whole words
        ("Rome,Oslo,Bern,Lima,Kyiv,Riga,Baku,Doha,Suva,Apia,Paris", ["Paris"], {}, 0.0),  # 11 names: over the cap
        ("Rome,Oslo,Bern,Lima,Kyiv,Riga,Baku,Doha,Suva,Paris", ["Paris"], {}, 1.0),  # 10
        ("Rome,Oslo,Bern,Lima,Kyiv,Riga,Baku,Doha,Suva,Apia,Paris", ["Paris"], {"max_words": None}, 1.0),
        ("a,b,c,d,e,f,g,h,i,j,Paris", ["Paris"], {}, 0.0),  # 11 items, articles too (1.0 before)
        ("Rome; Oslo / Bern|Lima、Kyiv，Riga,Baku,Doha,Suva,Apia,Paris", ["Paris"], {}, 0.0),  # other separators
        # 10 words as written, one of them with a hyphen, a period, a possessive or a thousands separator:
        # within the cap (each was counted as two words, and the answer scored 0)
        ("Barack Obama, U.S. president from 2009 to 2017, Hawaii native", ["Barack Obama"], {}, 1.0),
        ("Jean-Paul Sartre, French philosopher and writer born in Paris 1905", ["Jean-Paul Sartre"], {}, 1.0),
        ("Obama's wife Michelle Obama, born in Chicago in January 1964", ["Michelle Obama"], {}, 1.0),
        ("population of 1,234 people in Ri Tam town of Kor", ["1,234"], {}, 1.0),
        ("population of 1,234 people in Ri Tam town of Kor Sel", ["1,234"], {}, 0.0),  # 11
        ("the", ["a"], {}, 0.0),  # a gold that normalises to "" is found in no prediction
        ("U.S. Navy", ["US"], {"max_words": None}, 1.0),  # punctuation deleted (SQuAD), not only spaced
        ("The", ["Paris", "An"], {}, 0.0),
    ],
)
def test_cover_exact_match(pred, golds, kwargs, expected):
    assert cover_exact_match(pred, golds, **kwargs) == expected


def test_format_reward():
    assert format_reward(True) == 0.0
    assert format_reward(False) == -2.0


@pytest.mark.parametrize(
    "correct, n, eta, expected",
    [
        # counts 1,2,3,1: mean 1.75, var (0.5625+0.0625+1.5625+0.5625)/4 = 0.6875 -> 1.375;
        # two correct rollouts tie for fewest (1 search): both get it
        ([True, True, False, True], [1, 2, 3, 1], 2.0, [1.375, 0.0, 0.0, 1.375]),
        # counts 0,4,0,4: var 4 -> 2*var = 8, capped at eta = 2; the wrong rollout with
        # 0 searches does not count; fewest among correct is index 2
        ([False, True, True, False], [0, 4, 0, 4], 2.0, [0.0, 0.0, 2.0, 0.0]),
        # counts 0,2,3: mean 5/3, var 14/9 -> 28/9 under eta = 5
        ([False, True, True], [0, 2, 3], 5.0, [0.0, 28 / 9, 0.0]),
        # sigma over the WHOLE group: var of 1,1,4 is 2 -> 4 (over the correct ones it is 0)
        ([True, True, False], [1, 1, 4], 10.0, [4.0, 4.0, 0.0]),
        ([False, False, False], [0, 1, 2], 2.0, [0.0, 0.0, 0.0]),  # no correct rollout
        ([True, True], [2, 2], 2.0, [0.0, 0.0]),  # sigma = 0
        ([True], [3], 2.0, [0.0]),
    ],
)
def test_group_reward(correct, n, eta, expected):
    got = group_reward(correct, n, eta=eta)
    assert got == pytest.approx(expected, abs=1e-12)
    assert all(isinstance(x, float) for x in got)


@pytest.mark.parametrize(
    "correct, n, by_group, by_correct",
    [
        # the only correct rollout searched most: over the group it still earns 2 var(2,0,0,0) = 1.5
        ([True, False, False, False], [2, 0, 0, 0], [1.5, 0, 0, 0], [0, 0, 0, 0]),
        # correct ones searched alike (1, 1); a wrong one searched 4 times
        ([True, True, False], [1, 1, 4], [2.0, 2.0, 0], [0, 0, 0]),
        # correct counts 3 and 1: var 1 -> 2 to the cheaper; over the group, var of 3,1,0,0 is 1.5 -> 3, capped
        ([True, True, False, False], [3, 1, 0, 0], [0, 2.0, 0, 0], [0, 2.0, 0, 0]),
        # correct counts 2, 1, 1: var 2/9 -> 4/9 to both cheapest
        ([True, True, True, False], [2, 1, 1, 0], [0, 1.0, 1.0, 0], [0, 4 / 9, 4 / 9, 0]),
    ],
)
def test_group_reward_sigma_over_the_group_or_the_correct(correct, n, by_group, by_correct):
    assert group_reward(correct, n, eta=2.0) == pytest.approx(by_group, abs=1e-12)
    assert group_reward(correct, n, eta=2.0, over="correct") == pytest.approx(by_correct, abs=1e-12)


def test_group_reward_length_mismatch():
    with pytest.raises(ValueError, match="2 correctness flags but 1 search counts"):
        group_reward([True, False], [1])


@pytest.mark.parametrize("over", ["all", "Group", ""])
@pytest.mark.parametrize("correct", [[True, False], [False, False]])  # also where no rollout is right (all zeros)
def test_group_reward_unknown_over_raises(over, correct):
    with pytest.raises(ValueError, match=f"over must be 'group' or 'correct', got '{over}'"):
        group_reward(correct, [1, 2], over=over)


def test_normalize_answer_replaces_an_article_with_a_space():
    """SQuAD replaces a whole-word article with a space, so an article between two non-ASCII
    punctuation marks (en dashes, not deleted) leaves a space behind."""
    assert normalize_answer("Tom\u2013the\u2013Cat") == "tom\u2013 \u2013cat"
    assert exact_match("Tom\u2013the\u2013Cat", ["tom\u2013 \u2013cat"]) == 1.0
    assert exact_match("Tom\u2013the\u2013Cat", ["tom\u2013\u2013cat"]) == 0.0


def test_cover_cap_splits_at_semicolons_without_spaces():
    """A semicolon separates words for the 10-word cap even with no space after it: 11 names is
    over the cap, 10 names is within it."""
    names = "Rome;Oslo;Bern;Lima;Kyiv;Riga;Baku;Doha;Suva;Apia"
    assert cover_exact_match(names + ";Paris", ["Paris"]) == 0.0
    assert cover_exact_match(names.split(";", 1)[1] + ";Paris", ["Paris"]) == 1.0


def test_cover_cap_comma_after_a_number_separates_when_no_digit_follows():
    """Only a comma between two digits is a thousands separator; after a number and before a letter
    it separates words: "Apollo 11,Apollo 12,..." counts Apollo and 11 as two words each."""
    pred = "Apollo 11,Apollo 12,Apollo 13,Apollo 14,Apollo 15,Paris"  # 11 words
    assert cover_exact_match(pred, ["Paris"]) == 0.0
    assert cover_exact_match(pred, ["Paris"], max_words=None) == 1.0
    assert cover_exact_match("Apollo 11,Apollo 12,Apollo 13,Apollo 14,Paris", ["Paris"]) == 1.0  # 9


def test_group_reward_default_eta_is_two():
    """Without eta, the bonus 2 * sigma^2 is capped at 2: counts 0, 4, 0, 4 have sigma^2 = 4."""
    assert group_reward([False, True, True, False], [0, 4, 0, 4]) == [0.0, 0.0, 2.0, 0.0]
    assert group_reward([True, True, False], [1, 1, 4]) == [2.0, 2.0, 0.0]


def test_no_gold_answer_scores_zero():
    """With an empty list of golds no prediction scores: EM, F1 and cover-EM are all 0."""
    assert exact_match("paris", []) == 0.0
    assert f1_score("paris", []) == 0.0
    assert cover_exact_match("paris", []) == 0.0
