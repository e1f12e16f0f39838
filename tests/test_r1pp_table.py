"""bench/r1pp_table.py's accounting of retrievals, on hand-made questions and records."""

import json
from pathlib import Path

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def table():
    return load_bench("r1pp_table")


def hop(doc, answer, famous=False):
    return {"query": doc, "doc_id": doc, "answer": answer, "famous": famous}


@pytest.fixture()
def world(tmp_path):
    """Training asks fact (b, B); the test set: a famous 1-hop, a 1-hop on a new fact, a 2-hop
    whose first hop is the trained fact and whose second is new, and a 2-hop whose first hop is
    famous and whose second is new."""
    train = [{"id": "t1", "type": "1hop", "hops": [hop("b", "B")]}]
    test = [{"id": "q1", "type": "1hop", "hops": [hop("a", "A", famous=True)]},
            {"id": "q2", "type": "1hop", "hops": [hop("c", "C")]},
            {"id": "q3", "type": "2hop", "hops": [hop("b", "B"), hop("d", "D")]},
            {"id": "q4", "type": "2hop", "hops": [hop("e", "E", famous=True), hop("f", "F")]}]
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "test.jsonl", tmp_path / "train.jsonl"


def test_floors_count_one_search_per_hop_not_known(table, world):
    fl = table.floors(*world)
    assert fl["famous questions"]["all"] == pytest.approx((0 + 1 + 2 + 2) / 4)  # q4 is not famous throughout
    assert fl["famous hops"]["all"] == pytest.approx((0 + 1 + 2 + 1) / 4)
    assert fl["famous+train hops"]["all"] == pytest.approx((0 + 1 + 1 + 1) / 4)
    assert (fl["famous questions"]["2hop"], fl["famous hops"]["2hop"], fl["famous+train hops"]["2hop"]) == (2, 1.5, 1)
    assert fl["famous hops"]["comparison"] == 0  # none asked


def test_a_comparison_takes_one_search_for_both_its_hops(table, tmp_path):
    test = [{"id": "c1", "type": "comparison", "hops": [hop("a", "A"), hop("b", "B")]},
            {"id": "c2", "type": "comparison", "hops": [hop("c", "C", famous=True), hop("d", "D")]},
            {"id": "c3", "type": "comparison", "hops": [hop("e", "E", famous=True), hop("f", "F", famous=True)]},
            {"id": "h1", "type": "2hop", "hops": [hop("g", "G"), hop("h", "H")]}]  # the second hop needs the first
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    (tmp_path / "train.jsonl").write_text(json.dumps({"id": "t", "type": "1hop", "hops": [hop("a", "A")]}) + "\n")
    fl = table.floors(tmp_path / "test.jsonl", tmp_path / "train.jsonl")
    assert (fl["famous questions"]["comparison"], fl["famous hops"]["comparison"]) == (2 / 3, 2 / 3)
    assert fl["famous+train hops"]["comparison"] == pytest.approx(2 / 3)  # c1 still looks up b: one search
    assert fl["famous hops"]["all"] == pytest.approx((1 + 1 + 0 + 2) / 4)
    assert table.searches_needed("comparison", ["new", "new"], ()) == 1
    assert table.searches_needed("2hop", ["new", "new"], ()) == 2
    assert table.searches_needed("comparison", ["famous", "train"], ("famous", "train")) == 0


def test_hop_sources_splits_passage_less_hops_by_what_could_be_known(table, world):
    records = [{"id": "q1", "em": 1.0, "docs": []},  # famous hop from memory
               {"id": "q2", "em": 0.0, "docs": [{"id": "x"}]},  # searched, missed its passage: lacks a new hop
               {"id": "q3", "em": 1.0, "docs": [{"id": "d"}]}]  # recalled the trained hop, looked up the new one
    h = table.hop_sources(records, *world)
    assert (h["famous"], h["train"], h["new"]) == (1.0, 1.0, 0.5)
    assert (h["recalled"], h["recalled_em"], h["guessed"], h["guessed_em"]) == (1, 1.0, 1, 0.0)
    both = [{"id": "q3", "em": 0.0, "docs": []}]  # lacks both: counted with the new hop's, not as recalled
    h = table.hop_sources(both, *world)
    assert (h["famous"], h["train"], h["new"]) == (0.0, 1.0, 1.0)
    assert (h["recalled"], h["guessed"]) == (0, 1)
    unanswered = [{"id": "q3", "em": 0.0, "docs": [], "answered": 0.0}]  # gave no answer: answered no hop
    h = table.hop_sources(records + unanswered, *world)
    assert (h["new"], h["recalled"], h["guessed"]) == (0.5, 1, 1)  # as without it


def test_recall_vs_search_splits_questions_by_fame_and_search(table, world):
    test, _ = world
    famous = [{"id": "q1", "famous": True}]
    others = [{"id": f"q{i}", "famous": False} for i in (2, 3, 4)]
    test.write_text("".join(json.dumps(r) + "\n" for r in famous + others))
    records = [{"id": "q1", "searches": 0, "em": 1.0}, {"id": "q2", "searches": 0, "em": 0.0},
               {"id": "q3", "searches": 1, "em": 1.0}, {"id": "q4", "searches": 2, "em": 0.0}]
    rv = table.recall_vs_search(records, test)
    assert rv == {("famous", "recalled"): (1, 1.0), ("other", "recalled"): (1, 0.0), ("other", "searched"): (2, 0.5)}
    unanswered = [{"id": "q2", "searches": 0, "em": 0.0, "answered": 0.0},  # no answer: it recalled nothing
                  {"id": "q3", "searches": 1, "em": 0.0, "answered": 0.0}]  # it searched, then gave none
    assert table.recall_vs_search(records[:1] + unanswered, test) == {("famous", "recalled"): (1, 1.0),
                                                                      ("other", "searched"): (1, 0.0)}


def test_paths_are_taken_as_given_when_they_exist_else_under_the_repo_root(table, monkeypatch, tmp_path):
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert table.locate("runs/mine") == Path("runs/mine")  # from the current directory
    assert table.locate("searchlite/assets/toyworld") == table.ROOT / "searchlite/assets/toyworld"  # the default
    assert (table.locate("searchlite/assets/toyworld") / "test.jsonl").is_file()


def test_a_missing_run_is_a_one_line_error_naming_its_metrics(table, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(tmp_path / "nope")])
    with pytest.raises(SystemExit) as e:
        table.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"{tmp_path / 'nope' / 'metrics.jsonl'}" in err


def test_a_run_still_going_or_with_a_small_evaluation_is_tabled(table, world, monkeypatch, tmp_path, capsys):
    """A half-written last line (train.py appending) was a JSONDecodeError traceback, and an
    evaluation without a question type (a small --eval_size) a KeyError."""
    run = tmp_path / "run"
    run.mkdir()
    ev = lambda em: {"eval/all": {"em": em, "searches": 1.0}, "eval/1hop": {"em": em, "searches": 0.5}}  # noqa: E731
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, **ev(0.25)}) + "\n" + json.dumps({"step": 1}) + "\n"
                                       + json.dumps({"step": 2, **ev(0.5)}) + '\n{"step": 3, "rew')
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(run), "--data", str(tmp_path)])
    table.main()
    out = capsys.readouterr().out
    assert "| run at its start | 0 | 0.250 | 1.00 | 0.250 / 0.50 | — | — | — |" in out
    assert "| run | 2 | 0.500 | 1.00 | 0.500 / 0.50 | — | — | (off) |" in out
    # no eval/ records: a row that says so in each table that reads them (the third left the run out)
    assert out.count("| run | (no eval/ records) |") == 2
