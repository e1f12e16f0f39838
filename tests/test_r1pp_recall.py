"""bench/r1pp_recall.py: which training questions a run drew, the control set, and the tally."""

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import load_bench

import searchlite.models
import searchlite.sft
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
    assert recall.recall([]) == {"n": 0, "no_search": 0.0, "no_search_em": 0.0, "no_search_right": 0.0, "em": 0.0}
    unanswered = {"em": 0.0, "searches": 0, "answered": 0.0}  # no search and no answer: nothing recalled
    assert recall.recall(records + [unanswered])["no_search"] == 2 / 5


def hop(doc, answer, famous=False):
    return {"query": doc, "doc_id": doc, "answer": answer, "famous": famous}


def test_drawn_facts_are_the_non_famous_hops_of_the_drawn_questions(recall):
    drawn = [QA("t1", "q?", ["B"], {"hops": [hop("a", "A", famous=True), hop("b", "B")]}),
             QA("t2", "q?", ["D"], {"hops": [hop("c", "C"), hop("d", "D")]})]
    assert recall.drawn_facts(drawn) == {("b", "B"), ("c", "C"), ("d", "D")}
    assert recall.drawn_facts([]) == set()


@pytest.mark.parametrize("bos", [False, True])
def test_memory_rows_train_on_the_answer_from_memory_alone(recall, byte_tokenizer, bos):
    """Also under a tokenizer that puts a BOS before what it encodes: none lands inside a row
    (without add_special_tokens=False on the answers, test_r1pp_recall and test_bench_scripts passed)."""
    from conftest import with_bos

    from searchlite.protocol import get_protocol
    from searchlite.rollout import encode_prompt
    from searchlite.teacher import Teacher

    tok = with_bos(byte_tokenizer) if bos else byte_tokenizer
    pp = get_protocol("r1_searcher_pp", "toy")
    qa = [QA("t1", "Who founded Numel Works?", ["Rovo Thitas"], {"hops": [hop("n", "Rovo Thitas")]}),
          QA("t2", "When was X born?", ["1852"], {"hops": [hop("x", "1852")]})]
    rows = recall.memory_rows(qa, tok, pp, chat_template=False)
    teacher = Teacher(tok, pp, qa)
    for i, q in enumerate(qa):
        ids, lm, att = rows.input_ids[i], rows.loss_mask[i].bool(), rows.attention_mask[i].bool()
        trained = tok.decode(ids[lm].tolist(), skip_special_tokens=False)
        assert trained == teacher.recall(q.answers[0])
        assert "<|begin_internal_answer|>" in trained and "<|begin_external_search|>" not in trained
        assert pp.parse(trained).content == q.answers[0]
        prompt = encode_prompt(tok, pp, q.question, False)
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


def fake_run(folder, step, **cfg):
    """A train.py out_dir: config.json (10 steps of 4 questions, seed 1, unless `cfg` says otherwise),
    a checkpoint saved at `step` (trainer.pt only)."""
    (folder / "checkpoint").mkdir(parents=True)
    config = {"seed": 1, "batch_size": 4, "steps": 10, "train_data": "toy/train.jsonl", "model": "toy/model"} | cfg
    (folder / "config.json").write_text(json.dumps(config))
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


def test_start_flag_is_a_boolean_on_by_default_and_runs_is_required(recall, monkeypatch):
    asked = []
    run = {"r": ({"model": "m", "seed": 0, "batch_size": 1, "steps": 1, "train_data": "t"}, Path("r/checkpoint"))}
    monkeypatch.setattr(recall, "load_runs", lambda runs: run)
    monkeypatch.setattr(recall, "read_qa", lambda path: [])
    monkeypatch.setattr(recall, "resolve_path", str)
    one = [QA("q", "?", ["a"], {})]
    monkeypatch.setattr(recall, "question_sets", lambda cfg, qa, limit: {"drawn": one, "control": one})
    monkeypatch.setattr(recall, "answer", lambda model, sets, cfg: asked.append(str(model)) or
                        {"drawn": [], "control": []})
    both, trained = ["m", "r/checkpoint/policy"], ["r/checkpoint/policy"]
    for flags, models in ((["--start", "True"], both), (["--start", "0"], trained), ([], both)):  # start by default
        asked.clear()
        monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", "--runs", "r", *flags])
        recall.main()
        assert asked == models
    for argv in (["--runs", "r", "--start", "maybe"], []):  # and --runs is required
        monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", *argv])
        with pytest.raises(SystemExit) as e:
            recall.main()
        assert e.value.code == 2


def test_question_sets_without_a_famous_flag_are_plain(recall):
    """A training question with no "famous" field is not famous: it is kept (2 steps x 3 of 12 draw 6)."""
    train = [QA(f"q{i}", f"question {i}?", [f"a{i}"], {}) for i in range(12)]
    sets = recall.question_sets({"seed": 0, "steps": 2, "batch_size": 3}, train, limit=0)
    assert len(sets["drawn"]) == len(sets["control"]) == 6


def test_main_with_nothing_to_compare_or_no_hops_for_the_ceiling_says_so(recall, monkeypatch, capsys):
    """A training set the run drew whole (2 steps x 6 of 12) left no control, and a table of zeros; a
    ceiling over training or test questions without the toy world's hops ended in a KeyError traceback
    (the test set's after the whole SFT). Each is one line before any model answers."""
    base = {"model": "m", "seed": 0, "batch_size": 6, "steps": 2, "train_data": "t", "test_data": "e"}
    sets = {"t": [QA(f"q{i}", f"question {i}?", [f"a{i}"], {}) for i in range(12)], "e": []}
    monkeypatch.setattr(recall, "load_runs", lambda names: {"r": (base, Path("r/checkpoint"))})
    monkeypatch.setattr(recall, "read_qa", lambda path: sets[path])
    monkeypatch.setattr(recall, "resolve_path", str)
    monkeypatch.setattr(recall, "answer", lambda *a: pytest.fail("a model answered"))
    monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", "--runs", "r"])
    with pytest.raises(SystemExit, match=r"^error: r: no non-famous training question it drew has a never-drawn one "
                                         r"to stand beside \(12 questions in t\); nothing to compare$"):
        recall.main()
    base["steps"] = 1
    monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", "--runs", "r", "--sft_epochs", "1"])
    with pytest.raises(SystemExit, match=r"^error: --sft_epochs: training question 'q\d+' \(t\) has no 'hops' field"):
        recall.main()
    sets["t"] = [QA(q.id, q.question, q.answers, {"hops": [hop("b", "B")]}) for q in sets["t"]]
    sets["e"] = [QA("x1", "?", ["X"], {"type": "1hop"})]
    with pytest.raises(SystemExit, match=r"^error: --sft_epochs: test question 'x1' \(e\) has no 'hops' field"):
        recall.main()


def test_question_sets_cap_both_sets_at_the_smaller_one(recall):
    """When fewer non-famous questions were never drawn than were drawn, both sets have that many."""
    train = make_train(12)  # q0, q4, q8 famous
    cfg = {"seed": 2, "steps": 2, "batch_size": 4}
    drawn = recall.drawn_ids(cfg, 12)
    plain_drawn = [i for i in drawn if i % 4]
    plain_rest = [i for i in range(12) if i % 4 and i not in drawn]
    assert len(drawn) == 8 and len(plain_rest) < len(plain_drawn)
    sets = recall.question_sets(cfg, train, limit=0)
    assert len(sets["drawn"]) == len(sets["control"]) == len(plain_rest)
    assert [q.id for q in sets["drawn"]] == [f"q{i}" for i in plain_drawn[:len(plain_rest)]]


def test_question_sets_limit_keeps_the_first_drawn_and_as_many_controls(recall):
    """--limit 3: the first three non-famous questions in draw order, and three never drawn."""
    train = make_train(40)
    cfg = {"seed": 0, "steps": 2, "batch_size": 8}
    first = [f"q{i}" for i in recall.drawn_ids(cfg, 40) if i % 4][:3]
    sets = recall.question_sets(cfg, train, limit=3)
    assert [q.id for q in sets["drawn"]] == first
    assert len(sets["control"]) == 3


def test_the_control_is_a_shuffled_sample_not_the_first_never_drawn(recall):
    """The control is a seeded sample of the never-drawn questions, not simply the lowest-numbered ones."""
    train = make_train(40)
    cfg = {"seed": 0, "steps": 2, "batch_size": 8}
    drawn = set(recall.drawn_ids(cfg, 40))
    lowest = [f"q{i}" for i in range(40) if i % 4 and i not in drawn]
    sets = recall.question_sets(cfg, train, limit=0)
    assert [q.id for q in sets["control"]] != lowest[:len(sets["control"])]
    assert {q.id for q in sets["control"]} <= set(lowest)


@pytest.mark.parametrize("field,value", [("seed", 2), ("batch_size", 8), ("train_data", "other/train.jsonl")])
def test_load_runs_refuses_runs_that_drew_other_questions(recall, tmp_path, field, value):
    """Runs with another seed, batch_size or training set drew other questions: an error naming the run."""
    a, b = fake_run(tmp_path / "a", step=6), fake_run(tmp_path / "b", step=6, **{field: value})
    with pytest.raises(SystemExit, match=f"^error: {re.escape(b)}: seed, batch_size, checkpoint step or train_data "
                                         f"differ from {re.escape(a)}; runs compared here must have drawn the same"):
        recall.load_runs([a, b])


def test_load_runs_refuses_a_run_at_an_earlier_step_too(recall, tmp_path):
    """A second run whose checkpoint is behind the first's drew fewer questions: refused as well."""
    with pytest.raises(SystemExit, match="checkpoint step"):
        recall.load_runs([fake_run(tmp_path / "a", step=6), fake_run(tmp_path / "b", step=3)])


def test_memory_rows_train_on_the_first_gold_answer(recall, byte_tokenizer):
    """With several gold answers, the trained answer from memory is the first one."""
    from searchlite.protocol import get_protocol
    from searchlite.teacher import Teacher

    pp = get_protocol("r1_searcher_pp", "toy")
    qa = [QA("t1", "Who founded Numel Works?", ["Rovo Thitas", "R. Thitas"], {"hops": [hop("n", "Rovo Thitas")]})]
    rows = recall.memory_rows(qa, byte_tokenizer, pp, chat_template=False)
    trained = byte_tokenizer.decode(rows.input_ids[0][rows.loss_mask[0].bool()].tolist(), skip_special_tokens=False)
    assert trained == Teacher(byte_tokenizer, pp, qa).recall("Rovo Thitas")


class Rows(SimpleNamespace):
    """Stands in for memory_rows' Rollout: its tensors, and its length in rows."""

    def __init__(self, input_ids, loss_mask, attention_mask):
        super().__init__(input_ids=input_ids, loss_mask=loss_mask, attention_mask=attention_mask)

    def __len__(self):
        return self.input_ids.shape[0]


class FakeModel:
    def train(self):
        return self

    def eval(self):
        return self


def test_ceiling_trains_cumulative_epochs_and_tallies_the_test_set(recall, monkeypatch):
    """Epochs 0, 1, 3, 4: SFT passes of 1, 2 and 1 epochs (seeded seed + e, the run's lr) on one model;
    NLL weighted by answer tokens over chunks of 64 rows (64 rows of 1 token at loss 1, then 6 of 4
    tokens at loss 3: (64 + 72) / 88); the test summary (EM 1/2, RC (0 + 3) / 2), split by the drawn
    questions' facts (q1 shares drawn b; q2 shares only the control's z)."""
    calls, model = [], FakeModel()
    n = 70
    input_ids = torch.zeros(n, 6, dtype=torch.long)
    loss_mask = torch.zeros(n, 6, dtype=torch.long)
    loss_mask[:64, 5] = 1
    loss_mask[64:, 2:] = 1
    rows = Rows(input_ids, loss_mask, torch.ones(n, 6, dtype=torch.long))
    monkeypatch.setattr(recall, "agent", lambda cfg: SimpleNamespace(tokenizer=None, protocol=None))
    monkeypatch.setattr(recall, "memory_rows", lambda qa, tok, proto, chat: rows)
    monkeypatch.setattr(searchlite.models, "load_policy", lambda path, dtype, device: model)
    monkeypatch.setattr(searchlite.sft, "sft", lambda m, ids, lm, attention_mask, epochs, lr, batch_size, warmup,
                        seed, progress: calls.append((m is model, epochs, lr, seed)))
    monkeypatch.setattr(searchlite.sft, "sft_loss",
                        lambda m, ids, lm, att: torch.tensor(1.0 if len(ids) == 64 else 3.0))
    test_records = [{"id": "q1", "em": 1.0, "searches": 0}, {"id": "q2", "em": 0.0, "searches": 3}]
    monkeypatch.setattr(recall, "answer", lambda m, sets, cfg, ag: {
        "drawn": [{"em": 1.0, "searches": 0}], "control": [{"em": 0.0, "searches": 1}], "test": list(test_records)})
    drawn = [QA("t1", "?", ["B"], {"hops": [hop("b", "B")]})]
    control = [QA("t2", "?", ["Z"], {"hops": [hop("z", "Z")]})]
    test = [QA("q1", "?", ["B"], {"hops": [hop("b", "B")]}), QA("q2", "?", ["Z"], {"hops": [hop("z", "Z")]})]
    cfg = {"model": "m", "dtype": "float32", "seed": 5, "lr": 0.25, "chat_template": False}
    out = list(recall.ceiling(cfg, {"drawn": drawn, "control": control}, test, [0, 1, 3, 4]))
    assert calls == [(True, 1, 0.25, 6), (True, 2, 0.25, 8), (True, 1, 0.25, 9)]
    assert [e for e, *_ in out] == [0, 1, 3, 4]
    e, got, summary, split, nll = out[-1]
    assert nll == pytest.approx(136 / 88)
    assert summary == {"em": 0.5, "rc": 1.5}
    assert got["drawn"]["no_search_right"] == 1.0 and got["control"]["em"] == 0.0
    assert split["shares"] == {"n": 1, "no_search": 1.0, "no_search_em": 1.0, "no_search_right": 1.0, "em": 1.0}
    assert split["other"] == {"n": 1, "no_search": 0.0, "no_search_em": 0.0, "no_search_right": 0.0, "em": 0.0}
    calls.clear()
    assert [e for e, *_ in recall.ceiling(cfg, {"drawn": drawn, "control": control}, test, [2])] == [2]
    assert calls == [(True, 2, 0.25, 7)]  # a first count above 0 trains that many epochs from the start model


CANNED = {"drawn": [{"em": 1.0, "searches": 0}, {"em": 0.0, "searches": 0}, {"em": 1.0, "searches": 1},
                    {"em": 0.0, "searches": 2}],
          "control": [{"em": 0.0, "searches": 1}]}
CANNED_CELLS = "50.0% | 0.500 | 25.0% | 0.500 | 0.0% | 0.000 | 0.0% | 0.000"  # CANNED's row, drawn then never drawn


def test_main_answers_each_run_with_its_own_config_and_prints_its_row(recall, monkeypatch, capsys):
    """Each run is answered from its checkpoint's policy with its own config, on --limit 2 questions a
    set; a row reads drawn then never drawn: no search 2/4, its EM 1/2, right with no search 1/4, EM
    2/4; then 0/1, 0, 0, 0."""
    base = {"model": "m", "seed": 0, "batch_size": 8, "steps": 2, "train_data": "t", "max_turns": 4}
    runs = {"r1": (base, Path("r1/checkpoint")), "r2": (base | {"max_turns": 6}, Path("r2/checkpoint"))}
    asked = []
    monkeypatch.setattr(recall, "load_runs", lambda names: runs)
    monkeypatch.setattr(recall, "read_qa", lambda path: make_train(40))
    monkeypatch.setattr(recall, "resolve_path", str)
    monkeypatch.setattr(recall, "answer", lambda model, sets, cfg: asked.append(
        (str(model), len(sets["drawn"]), len(sets["control"]), cfg["max_turns"])) or CANNED)
    monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", "--runs", "r1", "r2", "--start", "false", "--limit", "2"])
    recall.main()
    assert asked == [("r1/checkpoint/policy", 2, 2, 4), ("r2/checkpoint/policy", 2, 2, 6)]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2 non-famous training questions drawn by seed 0 (2 steps x 8), 2 never drawn")
    assert f"| r1 | {CANNED_CELLS} |" in out


def test_answer_rolls_out_with_the_runs_own_settings(recall, monkeypatch):
    """A run's turn budget, passages a search, their token cap, its length cap, chat-template choice
    and tokens a turn reach the rollout (each dropped, the rollout's defaults stood in and
    test_r1pp_recall and test_bench_scripts passed)."""
    import searchlite.evaluation

    seen = []
    monkeypatch.setattr(searchlite.evaluation, "score_qa", lambda sampler, *args, **kw: seen.append(
        (sampler.max_new_tokens, kw)) or (None, []))
    cfg = dict(model="toy/model", tokenizer="", dtype="float32", retriever="bm25", corpus="toy/corpus.jsonl",
               encoder="", pooling="mean", index="", retriever_url="", protocol="search_r1", template="toy",
               max_turns=2, topk=1, max_obs_tokens=40, max_len=700, chat_template=False, max_new_tokens=9)
    recall.answer("toy/model", {"drawn": []}, cfg)
    assert seen == [(9, dict(batch_size=64, progress=False, max_turns=2, topk=1, max_obs_tokens=40, max_len=700,
                             chat_template=False))]


def test_main_sft_ceiling_rows_and_floors(recall, monkeypatch, capsys):
    """--sft_epochs 3,0,1,3 asks the ceiling for epochs [0, 1, 3] (0: the start model as it is), and
    --limit 0 takes every drawn question. Floors over the test set (famous x, drawn
    facts b and y, control fact z): every famous hop recalled q1 0 + q2 2 + q3 1 + q4 1 = 4 / 4; with the
    drawn facts too 0 + 1 + 1 + 0 = 2 / 4. A ceiling row prints its NLL, test EM and RC, then the
    questions sharing a fact before the others. The whole output, headers included."""
    cfg = {"model": "m", "seed": 0, "batch_size": 1, "steps": 1, "train_data": "train", "test_data": "test"}
    drawn = [QA("t1", "?", ["B"], {"hops": [hop("b", "B"), hop("y", "Y")]})]
    control = [QA("t2", "?", ["Z"], {"hops": [hop("z", "Z")]})]
    test = [QA("q1", "?", ["X"], {"type": "1hop", "hops": [hop("x", "X", famous=True)]}),
            QA("q2", "?", ["C"], {"type": "2hop", "hops": [hop("b", "B"), hop("c", "C")]}),
            QA("q3", "?", ["Z"], {"type": "1hop", "hops": [hop("z", "Z")]}),
            QA("q4", "?", ["Y"], {"type": "1hop", "hops": [hop("y", "Y")]})]
    asked = []
    monkeypatch.setattr(recall, "load_runs", lambda names: {"r": (cfg, Path("r/checkpoint"))})
    monkeypatch.setattr(recall, "read_qa", lambda path: test if path == "test" else [])
    monkeypatch.setattr(recall, "resolve_path", str)
    limits = []
    monkeypatch.setattr(recall, "question_sets",
                        lambda c, qa, limit: limits.append(limit) or {"drawn": drawn, "control": control})
    monkeypatch.setattr(recall, "answer", lambda model, sets, c: CANNED)
    split = {"shares": {"n": 1, "no_search": 1.0, "em": 1.0}, "other": {"n": 3, "no_search": 0.0, "em": 0.25}}
    got = {s: recall.recall(v) for s, v in CANNED.items()}

    def ceiling(c, sets, test_qa, epochs):
        asked.append(epochs)
        for e in epochs:
            yield e, got, {"em": 0.5, "rc": 1.25}, split, 0.75

    monkeypatch.setattr(recall, "ceiling", ceiling)
    monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", "--runs", "r", "--start", "false", "--sft_epochs", "3,0,1,3",
                                      "--limit", "0"])
    recall.main()
    assert asked == [[0, 1, 3]] and limits == [0]
    row = "1, 100.0%, 1.000 | 3, 0.0%, 0.250"
    assert capsys.readouterr().out.splitlines() == [
        "1 non-famous training questions drawn by seed 0 (1 steps x 1), 1 never drawn",
        "| model | drawn: no search | its EM | right with no search | EM | never drawn: no search | its EM "
        "| right with no search | EM |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| r | {CANNED_CELLS} |",
        f"| start + 0 epochs of SFT on the drawn answers | {CANNED_CELLS} |",
        f"| start + 1 epochs of SFT on the drawn answers | {CANNED_CELLS} |",
        f"| start + 3 epochs of SFT on the drawn answers | {CANNED_CELLS} |",
        "",
        "Held-out test set after that SFT; questions sharing a fact: one of their non-famous hops is a hop of a "
        "drawn question. Fewest retrievals per test question with every famous hop recalled: 1.000; and every "
        "drawn fact too: 0.500",
        "",
        "| epochs | NLL of the drawn answers | test EM | RC | sharing a fact: n, no search, EM "
        "| the others: n, no search, EM |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| 0 | 0.750 | 0.500 | 1.25 | {row} |",
        f"| 1 | 0.750 | 0.500 | 1.25 | {row} |",
        f"| 3 | 0.750 | 0.500 | 1.25 | {row} |"]


@pytest.mark.parametrize("flags,error", [(["--limit", "-1"], "--limit: must be at least 0, got -1"),
                                         (["--sft_epochs", "1,-1"], "--sft_epochs '1,-1': each must be"),
                                         (["--sft_epochs", "1,x"], "--sft_epochs '1,x': each must be")])
def test_a_negative_limit_or_epoch_count_is_refused(recall, monkeypatch, capsys, flags, error):
    """--limit -1 cut one question off each set (and the two sets apart), and a negative epoch count
    printed the start model under "-1 epochs": both are refused before any model loads."""
    monkeypatch.setattr(recall, "load_runs", lambda names: pytest.fail("a run was read"))
    monkeypatch.setattr(sys, "argv", ["r1pp_recall.py", "--runs", "r", *flags])
    with pytest.raises(SystemExit) as e:
        recall.main()
    assert e.value.code == 2 and error in capsys.readouterr().err
