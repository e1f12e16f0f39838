"""bench/r1pp_recall.py: which training questions a run drew, the control set, and the tally."""

import json
import sys
from pathlib import Path

import pytest
import torch
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
    unanswered = {"em": 0.0, "searches": 0, "answered": 0.0}  # no search and no answer: nothing recalled
    assert recall.recall(records + [unanswered])["no_search"] == 2 / 5


def hop(doc, answer, famous=False):
    return {"query": doc, "doc_id": doc, "answer": answer, "famous": famous}


def test_drawn_facts_are_the_non_famous_hops_of_the_drawn_questions(recall):
    drawn = [QA("t1", "q?", ["B"], {"hops": [hop("a", "A", famous=True), hop("b", "B")]}),
             QA("t2", "q?", ["D"], {"hops": [hop("c", "C"), hop("d", "D")]})]
    assert recall.drawn_facts(drawn) == {("b", "B"), ("c", "C"), ("d", "D")}
    assert recall.drawn_facts([]) == set()


def test_memory_rows_train_on_the_answer_from_memory_alone(recall, byte_tokenizer):
    from searchlite.protocol import get_protocol
    from searchlite.rollout import encode_prompt
    from searchlite.teacher import Teacher

    pp = get_protocol("r1_searcher_pp", "toy")
    qa = [QA("t1", "Who founded Numel Works?", ["Rovo Thitas"], {"hops": [hop("n", "Rovo Thitas")]}),
          QA("t2", "When was X born?", ["1852"], {"hops": [hop("x", "1852")]})]
    rows = recall.memory_rows(qa, byte_tokenizer, pp, chat_template=False)
    teacher = Teacher(byte_tokenizer, pp, qa)
    for i, q in enumerate(qa):
        ids, lm, att = rows.input_ids[i], rows.loss_mask[i].bool(), rows.attention_mask[i].bool()
        trained = byte_tokenizer.decode(ids[lm].tolist(), skip_special_tokens=False)
        assert trained == teacher.recall(q.answers[0])
        assert "<|begin_internal_answer|>" in trained and "<|begin_external_search|>" not in trained
        assert pp.parse(trained).content == q.answers[0]
        prompt = encode_prompt(byte_tokenizer, pp, q.question, False)
        assert ids[att][:len(prompt)].tolist() == prompt
        assert not lm[att][:len(prompt)].any()  # the prompt is not trained
        assert int(lm.sum()) == int(att.sum()) - len(prompt)


def test_by_shared_fact_splits_test_questions_on_their_non_famous_hops(recall):
    test = [QA("q1", "?", ["B"], {"hops": [hop("b", "B")]}),  # shares (b, B)
            QA("q2", "?", ["A"], {"hops": [hop("a", "A", famous=True)]}),  # (a, A) is famous: not counted
            QA("q3", "?", ["E"], {"hops": [hop("d", "D"), hop("e", "E")]}),  # shares (d, D)
            QA("q4", "?", ["Z"], {"hops": [hop("b", "Z")]})]  # same passage, another value
    records = [{"id": "q1", "em": 1.0, "searches": 0}, {"id": "q2", "em": 1.0, "searches": 0},
               {"id": "q3", "em": 0.0, "searches": 1}, {"id": "q4", "em": 0.0, "searches": 1}]
    got = recall.by_shared_fact(records, test, {("b", "B"), ("d", "D"), ("a", "A")})
    assert got["shares"] == {"n": 2, "no_search": 0.5, "no_search_em": 1.0, "no_search_right": 0.5, "em": 0.5}
    assert got["other"] == {"n": 2, "no_search": 0.5, "no_search_em": 1.0, "no_search_right": 0.5, "em": 0.5}
    assert recall.by_shared_fact(records[:1], test, set())["other"]["n"] == 1
    # searches left per question: q1 1 -> 0, q2 0, q3 2 -> 1, q4 1
    assert recall.floor_with(test, set()) == pytest.approx(4 / 4)
    assert recall.floor_with(test, {("b", "B"), ("d", "D"), ("a", "A")}) == pytest.approx(2 / 4)
    pair = QA("c", "?", ["X"], {"type": "comparison", "hops": [hop("x", "X"), hop("y", "Y")]})
    assert recall.floor_with([pair], set()) == 1  # one search finds both passages of a comparison


def test_ceiling_starts_from_the_start_model_and_trains_it(recall, byte_tokenizer, tmp_path):
    from dataclasses import asdict

    from conftest import make_tiny_llama
    from searchlite.config import Config
    from searchlite.data import write_jsonl

    make_tiny_llama(byte_tokenizer).save_pretrained(tmp_path / "m")
    byte_tokenizer.save_pretrained(tmp_path / "m")
    write_jsonl(tmp_path / "c.jsonl", [{"id": "0", "contents": "Numel Works\nFounded by Rovo Thitas."}])
    cfg = asdict(Config()) | {"model": str(tmp_path / "m"), "tokenizer": "", "corpus": str(tmp_path / "c.jsonl"),
                              "retriever": "bm25", "protocol": "r1_searcher_pp", "template": "toy",
                              "chat_template": False, "max_new_tokens": 8, "max_turns": 1, "lr": 3e-3, "seed": 0}
    drawn = [QA("t1", "Who founded Numel Works?", ["Rovo"], {"hops": [hop("0", "Rovo")]})]
    test = [QA("q1", "When was the founder of Numel Works born?", ["1900"],
               {"hops": [hop("0", "Rovo"), hop("9", "1900")]}),
            QA("q2", "Where is X?", ["Y"], {"hops": [hop("5", "Y")]})]
    sets = {"drawn": drawn, "control": drawn}
    out = list(recall.ceiling(cfg, sets, test, [0, 2]))
    assert [e for e, *_ in out] == [0, 2]
    start = {k: recall.recall(v) for k, v in recall.answer(str(tmp_path / "m"), sets, cfg).items()}
    assert out[0][1] == start  # 0 epochs: the start model itself
    for _, got, summary, split, nll in out:
        assert split["shares"]["n"] == 1 and split["other"]["n"] == 1
        assert 0.0 <= summary["em"] <= 1.0 and summary["rc"] >= 0.0
    assert out[1][4] < out[0][4] - 0.1  # two epochs of SFT lowered the NLL of the answer from memory


def fake_run(folder, step, steps=10, seed=1):
    """A train.py out_dir: config.json for `steps`, a checkpoint saved at `step` (trainer.pt only)."""
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"seed": seed, "batch_size": 4, "steps": steps,
                                                    "train_data": "toy/train.jsonl", "model": "toy/model"}))
    torch.save({"step": step, "config": {}}, folder / "checkpoint" / "trainer.pt")
    return str(folder)


def test_load_runs_takes_the_steps_the_checkpoint_trained(recall, tmp_path):
    a, b = fake_run(tmp_path / "a", step=6), fake_run(tmp_path / "b", step=6, steps=20)  # b: interrupted at 6
    runs = recall.load_runs([a, b])
    assert [cfg["steps"] for cfg, _ in runs.values()] == [6, 6]
    assert runs[a][1] == tmp_path / "a" / "checkpoint"
    with pytest.raises(SystemExit, match="checkpoint step"):
        recall.load_runs([a, fake_run(tmp_path / "c", step=10)])  # config.json's steps agree, checkpoints do not
    (tmp_path / "d").mkdir()
    with pytest.raises(SystemExit, match="no checkpoint"):
        recall.load_runs([str(tmp_path / "d")])


def test_start_flag_is_a_boolean(recall, monkeypatch):
    asked = []
    run = {"r": ({"model": "m", "seed": 0, "batch_size": 1, "steps": 1, "train_data": "t"}, Path("r/checkpoint"))}
    monkeypatch.setattr(recall, "load_runs", lambda runs: run)
    monkeypatch.setattr(recall, "read_qa", lambda path: [])
    monkeypatch.setattr(recall, "resolve_path", str)
    monkeypatch.setattr(recall, "question_sets", lambda cfg, qa, limit: {"drawn": [], "control": []})
    monkeypatch.setattr(recall, "answer", lambda model, sets, cfg: asked.append(str(model)) or
                        {"drawn": [], "control": []})
    for flag, models in (("True", ["m", "r/checkpoint/policy"]), ("0", ["r/checkpoint/policy"])):
        asked.clear()
        monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", "--runs", "r", "--start", flag])
        recall.main()
        assert asked == models
    monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", "--runs", "r", "--start", "maybe"])
    with pytest.raises(SystemExit) as e:
        recall.main()
    assert e.value.code == 2
