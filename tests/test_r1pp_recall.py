"""bench/r1pp_recall.py: which training questions a run drew, the control set, and the tally."""

import pytest
from conftest import load_bench

from searchlite.data import QA
from train import batch_questions


@pytest.fixture(scope="module")
def recall():
    return load_bench("r1pp_recall")


def make_train(n, famous_every=4):
    return [QA(f"q{i}", f"question {i}?", [f"a{i}"], {"famous": i % famous_every == 0}) for i in range(n)]


@pytest.mark.parametrize("steps,batch_size", [(3, 4), (7, 5)])  # within one epoch, and past it (n = 30)
def test_drawn_ids_are_the_questions_train_py_draws(recall, steps, batch_size):
    train = make_train(30)
    cfg = {"seed": 3, "steps": steps, "batch_size": batch_size}
    drawn = [train[i].id for i in recall.drawn_ids(cfg, len(train))]
    naive = []
    for step in range(steps):
        for q in batch_questions(train, step, batch_size, cfg["seed"]):
            if q.id not in naive:
                naive.append(q.id)
    assert drawn == naive
    assert len(drawn) == min(steps * batch_size, 30)


def test_question_sets_are_non_famous_disjoint_and_equal_sized(recall):
    train = make_train(40)
    cfg = {"seed": 0, "steps": 2, "batch_size": 8}
    sets = recall.question_sets(cfg, train, limit=0)
    drawn = {train[i].id for i in recall.drawn_ids(cfg, len(train))}
    assert {q.id for q in sets["drawn"]} == {q for q in drawn if int(q[1:]) % 4}  # the drawn non-famous ones
    assert len(sets["control"]) == len(sets["drawn"])
    assert not {q.id for q in sets["control"]} & drawn
    assert not any(q.meta["famous"] for q in sets["control"])
    assert recall.question_sets(cfg, train, limit=0)["control"] == sets["control"]  # seeded: runs of one seed agree
    assert len(recall.question_sets(cfg, train, limit=3)["drawn"]) == 3


def test_recall_tallies_no_search_answers(recall):
    records = [{"em": 1.0, "searches": 0}, {"em": 0.0, "searches": 0}, {"em": 1.0, "searches": 2},
               {"em": 0.0, "searches": 1}]
    got = recall.recall(records)
    assert got == {"n": 4, "no_search": 0.5, "no_search_em": 0.5, "no_search_right": 0.25, "em": 0.5}
    assert recall.recall([])["n"] == 0
