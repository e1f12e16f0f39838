"""Answer rewards: normalisation, EM / F1 / cover-EM, format reward, group reward.

The reward sits on the last policy token of a trajectory; this module only turns strings
and per-rollout counts into floats. `train.py` calls, per trajectory,
`exact_match(pred, golds)` (Search-R1's training reward) or, for R1-Searcher++ (through
`searchlite.r1pp.reward_terms`), `format_reward(ok) + cover_exact_match(pred, golds)` plus
`group_reward(...)` over each question's group of rollouts. `evaluate.py` reports EM, F1
and cover-EM.

`pred` is the text inside the final `<answer>...</answer>` (None when there was none);
`golds` is the list of golden answers (a bare string is taken as a one-item list).

Left out on purpose: answer extraction from the trajectory (that is `protocol.py`), model-
or LLM-judged rewards, and any tensor code (stdlib only, so rewards can run anywhere).

>>> normalize_answer("The  Eiffel Tower!")
'eiffel tower'
>>> exact_match("the eiffel tower", ["Eiffel Tower", "La tour Eiffel"])
1.0
>>> cover_exact_match("It is the Eiffel Tower in Paris", ["eiffel tower"])
1.0
"""

import re
import string
import statistics
import unicodedata
from collections import Counter

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")
# a word of the 10-word cap: a run of text between whitespace and list separators (a comma
# between digits is a thousands separator, part of the number)
_LIST_WORDS = re.compile(r"(?:[^\s,;/|，；、]|(?<=\d),(?=\d))+")


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 normalisation, as Search-R1 and FlashRAG use it.

    Lower-case, drop ASCII punctuation, drop the articles a/an/the as whole words, fold
    whitespace. The order matters and is SQuAD's: "T.he" -> "the" -> "".

    >>> normalize_answer("  An Apple,  a DAY. ")
    'apple day'
    >>> normalize_answer("theatre")  # articles only as whole words
    'theatre'
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _spaced(s: str) -> str:
    """`normalize_answer` with punctuation, ASCII or Unicode (an en dash, curly quotes), turned
    into a space instead of deleted: R1-Searcher's normalisation, for cover-EM's second reading.

    >>> _spaced("Louvre, Paris's"), _spaced("Trenton–Mercer")
    ('louvre paris s', 'trenton mercer')
    """
    s = "".join(" " if ch in _PUNCT or unicodedata.category(ch).startswith("P") else ch for ch in s.lower())
    return " ".join(_ARTICLES.sub(" ", s).split())


def _as_list(golds) -> list:
    # A bare string would otherwise be iterated character by character.
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(pred: str | None, golds: list[str]) -> float:
    """1.0 if the normalised prediction equals some normalised gold, else 0.0.

    >>> exact_match("Paris.", ["paris", "Paris, France"])
    1.0
    >>> exact_match(None, ["paris"])
    0.0
    """
    if pred is None:
        return 0.0
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in _as_list(golds)))


def _f1_one(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred), normalize_answer(gold)
    # SQuAD/HotpotQA/FlashRAG special case: a yes/no/noanswer on either side only
    # scores when both sides agree exactly (no partial credit for "no" vs "no way").
    if (p in _YES_NO or g in _YES_NO) and p != g:
        return 0.0
    p_tok, g_tok = p.split(), g.split()
    n_same = sum((Counter(p_tok) & Counter(g_tok)).values())
    if n_same == 0:
        return 0.0
    precision, recall = n_same / len(p_tok), n_same / len(g_tok)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str | None, golds: list[str]) -> float:
    """Token-level F1 (SQuAD), max over golds; None -> 0.0.

    >>> round(f1_score("Eiffel tower in Paris", ["the Eiffel Tower"]), 4)
    0.6667
    """
    if pred is None:
        return 0.0
    return max((_f1_one(pred, g) for g in _as_list(golds)), default=0.0)


def cover_exact_match(pred: str | None, golds: list[str], max_words: int | None = 10) -> float:
    """R1-Searcher++ answer reward: a normalised gold occurs in the normalised prediction.

    The gold must appear as a whole-word sequence ("paris" is not covered by "parisian"). That is
    stricter than R1-Searcher's code (R1-Searcher++ released none; the paper does not say which
    variant it used): its `cover_exact_match_score_2` looks for the word sequence and then falls
    back to a plain substring of the normalised text, so "parisian" covers "paris" and "1990s"
    covers "1990" there, as in Search-R1's `subem_check`; its `_1` takes the gold's words in any
    order and place ("tower of eiffel" covers "Eiffel Tower"); and its normalisation turns
    punctuation into spaces where Search-R1's (SQuAD's) deletes it. Here a gold is covered under
    either normalisation (`normalize_answer`, `_spaced`), so neither a hyphen ("jean-paul" covers
    "Jean Paul") nor a possessive or a comma with no space after it ("Paris's", "Paris,France")
    hides the gold, and Unicode punctuation (an en dash) counts as punctuation. A substring reward
    would pay a policy for a longer word that holds the answer. The prediction may have at most
    `max_words` words, counted on the raw prediction as the model wrote it: split at whitespace and
    at list separators (a comma outside a number, ; / | and their full-width forms), not inside a
    word ("Jean-Paul", "U.S.", "Obama's", "1,234" are one) — otherwise 0.0, so the policy cannot
    win by listing candidates, with spaces or commas (R1-Searcher++ §4.2.1, the training reward).
    `max_words=None` is the evaluation metric (ACC_R, §5.1), which has no such cap. Golds that
    normalise to "" never match.

    >>> cover_exact_match("paris, france", ["Paris"])
    1.0
    >>> cover_exact_match("parisian", ["Paris"])
    0.0
    >>> cover_exact_match("one two three four five six seven eight nine ten paris", ["paris"])
    0.0
    >>> cover_exact_match("one two three four five six seven eight nine ten paris", ["paris"], max_words=None)
    1.0
    """
    # "a,b,c,...", one word at whitespace, lists as many candidates as it has names, which the spaced
    # reading below would each find: its separators split words too
    if pred is None or (max_words is not None and len(_LIST_WORDS.findall(pred)) > max_words):
        return 0.0
    for norm in (normalize_answer, _spaced):
        p = f" {norm(pred)} "
        for g in _as_list(golds):
            g = norm(g)
            if g and f" {g} " in p:
                return 1.0
    return 0.0


def format_reward(ok: bool) -> float:
    """R1-Searcher++ R_format (§4.2.1): 0 for a well-formed trajectory, -2 otherwise.

    >>> format_reward(True), format_reward(False)
    (0.0, -2.0)
    """
    return 0.0 if ok else -2.0


def group_reward(correct: list[bool], n_searches: list[int], eta: float = 2.0, over: str = "group") -> list[float]:
    """R1-Searcher++ group reward (§4.2.1) for one question's group of rollouts.

    sigma is the population standard deviation of the retrieval counts over the WHOLE
    group (correct and wrong rollouts alike, as the paper's "std of retrieval counts in
    the group"), or with `over="correct"` over the correct rollouts only: then a lone
    correct rollout, or correct ones that all searched alike, earn nothing, however the
    wrong ones searched. Each correct rollout whose count equals the fewest among the
    correct ones gets min(2 * sigma**2, eta); ties all get it; everything else gets 0. No
    correct rollout, or all counts equal (sigma = 0), gives all zeros. Over the whole group,
    correct rollouts that all searched alike still earn it when a wrong one searched
    otherwise (a bonus for being right, not for being cheaper); `over="correct"` pays only
    for being cheaper than another correct rollout.

    >>> group_reward([True, True, False, True], [1, 2, 3, 1])   # sigma^2 = 0.6875
    [1.375, 0.0, 0.0, 1.375]
    >>> group_reward([True, True, False, True], [1, 2, 3, 1], over="correct")   # sigma^2 of 1, 2, 1 = 2/9
    [0.4444444444444444, 0.0, 0.0, 0.4444444444444444]
    >>> group_reward([False, False], [0, 3])
    [0.0, 0.0]
    >>> group_reward([False, True, True], [0, 2, 2])   # sigma^2 of 0, 2, 2 = 8/9
    [0.0, 1.7777777777777777, 1.7777777777777777]
    >>> group_reward([False, True, True], [0, 2, 2], over="correct")
    [0.0, 0.0, 0.0]
    """
    if len(correct) != len(n_searches):
        raise ValueError(f"{len(correct)} correctness flags but {len(n_searches)} search counts")
    if over not in ("group", "correct"):
        raise ValueError(f"over must be 'group' or 'correct', got {over!r}")
    if not any(correct):
        return [0.0] * len(correct)
    counts = n_searches if over == "group" else [n for n, c in zip(n_searches, correct) if c]
    # 2 * sigma^2 straight from the variance: no sqrt-then-square rounding.
    bonus = float(min(2.0 * statistics.pvariance(counts), eta))
    fewest = min(n for n, c in zip(n_searches, correct) if c)
    return [bonus if c and n == fewest else 0.0 for n, c in zip(n_searches, correct)]
