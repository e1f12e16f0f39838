"""bench/r1pp_table.py's accounting of retrievals, on hand-made questions and records."""

import json
from pathlib import Path

import pytest
from conftest import load_bench

from searchlite.data import write_jsonl


@pytest.fixture(scope="module")
def table():
    return load_bench("r1pp_table")


def hop(doc, answer, famous=False):
    """A hop whose query (an entity name) differs from its passage id, as in the toy world."""
    return {"query": f"entity {doc}", "doc_id": doc, "answer": answer, "famous": famous}


@pytest.fixture()
def world(tmp_path):
    """Training asks fact (b, B); the test set: a famous 1-hop, a 1-hop on a new fact, a 2-hop
    whose first hop is the trained fact and whose second is new, and a 2-hop whose first hop is
    famous and whose second is new."""
    train = [{"id": "t1", "type": "1hop", "famous": False, "hops": [hop("b", "B")]}]
    test = [{"id": "q1", "type": "1hop", "famous": True, "hops": [hop("a", "A", famous=True)]},
            {"id": "q2", "type": "1hop", "famous": False, "hops": [hop("c", "C")]},
            {"id": "q3", "type": "2hop", "famous": False, "hops": [hop("b", "B"), hop("d", "D")]},
            {"id": "q4", "type": "2hop", "famous": False, "hops": [hop("e", "E", famous=True), hop("f", "F")]}]
    for name, rows in (("train", train), ("test", test)):
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
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
    h = table.hop_sources(records + [{"id": "q3", "em": 1.0, "docs": []}], *world)
    assert (h["guessed"], h["guessed_em"], h["recalled"], h["recalled_em"]) == (2, 0.5, 1, 1.0)  # EM 0 and 1: 0.5
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
    """Without --runs, the ablation script's runs are read, the first named in the error (the default
    dropped, a bare command died in a TypeError and test_r1pp_table passed)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(tmp_path / "nope")])
    with pytest.raises(SystemExit) as e:
        table.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"{tmp_path / 'nope' / 'metrics.jsonl'}" in err
    monkeypatch.setattr("sys.argv", ["r1pp_table.py"])
    monkeypatch.setattr(table, "ROOT", tmp_path)  # (no runs there)
    with pytest.raises(SystemExit) as e:
        table.main()
    assert e.value.code == 2 and f"{tmp_path / 'runs' / 'r1pp-full' / 'metrics.jsonl'}" in capsys.readouterr().err


def test_a_data_folder_without_its_questions_is_a_one_line_error_naming_the_file(table, world, monkeypatch, tmp_path,
                                                                                 capsys):
    run = make_run(tmp_path)
    (tmp_path / "train.jsonl").unlink()
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(run), "--data", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        table.main()
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err == (
        f"r1pp_table: no {tmp_path / 'train.jsonl'} (--data names a folder with test.jsonl and train.jsonl)\n")


@pytest.mark.parametrize("evaluation", ["step_000000", "step_000002"])  # the first one's questions, and the last's
def test_a_run_on_other_questions_is_a_one_line_error_before_any_table(table, world, monkeypatch, tmp_path, capsys,
                                                                      evaluation):
    """A run evaluated on its own --test_data, or a --data folder whose questions carry no hops, ended
    in a KeyError traceback after the first table."""
    run = make_run(tmp_path)
    (run / "eval" / "step_000001.jsonl").unlink()  # two evaluations: the last one is also the second
    with open(run / "eval" / f"{evaluation}.jsonl", "a") as f:
        f.write(json.dumps({"id": "0", "em": 0.0, "searches": 1, "docs": []}) + "\n")
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(run), "--data", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        table.main()
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err == (
        f"r1pp_table: {run / 'eval' / f'{evaluation}.jsonl'}: question '0' is not in {tmp_path / 'test.jsonl'}: the "
        "run was evaluated on other questions (its --test_data); --data names the folder of the toy world's files "
        "it used\n")
    write_jsonl(tmp_path / "test.jsonl", [{"id": "0", "question": "who?", "golden_answers": ["x"]}])
    with pytest.raises(SystemExit) as e:
        table.main()
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err == (
        f"r1pp_table: {tmp_path / 'test.jsonl'}: question '0' has no 'hops' or 'famous' field: the tables of hops "
        "read the toy world's questions (--data)\n")


def test_a_run_without_an_evaluation_or_with_a_damaged_line_is_a_one_line_error_before_any_table(
        table, world, monkeypatch, tmp_path, capsys):
    """The second run's metrics hold no evaluation, then a damaged line before their last: each is a
    one-line error naming the file, exit status 2, before any table (the first table's header and the
    first run's row came first, and the status was 1; without the checks, an IndexError or an
    UnboundLocalError traceback)."""
    first = make_run(tmp_path)
    second = tmp_path / "second"
    second.mkdir()
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(first), str(second), "--data", str(tmp_path)])
    ev = json.dumps({"step": 0, "eval/all": {"em": 0.5, "searches": 1.0}})
    for text, error in ((json.dumps({"step": 1, "reward": 0.5}) + "\n", ": no evaluation row yet\n"),
                        (ev + '\n{"step": 1, "rew\n' + ev + "\n", ":2: bad JSON")):
        (second / "metrics.jsonl").write_text(text)
        with pytest.raises(SystemExit) as e:
            table.main()
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"r1pp_table: {second / 'metrics.jsonl'}{error}"), err


def test_a_run_still_going_or_with_a_small_evaluation_is_tabled(table, world, monkeypatch, tmp_path, capsys):
    """A half-written last line (train.py appending) was a JSONDecodeError traceback, and an
    evaluation without a question type (a small --eval_size) a KeyError."""
    run = tmp_path / "run"
    run.mkdir()
    ev = lambda em: {"eval/all": {"em": em, "searches": 1.0}, "eval/1hop": {"em": em, "searches": 0.5}}  # noqa: E731
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, **ev(0.25)}) + "\n" + json.dumps({"step": 1}) + "\n"
                                       + json.dumps({"step": 2, **ev(0.5)}) + '\n{"step": 3, "rew')
    written = (run / "metrics.jsonl").read_bytes()
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(run), "--data", str(tmp_path)])
    table.main()
    assert (run / "metrics.jsonl").read_bytes() == written  # the line train.py is writing is left to it
    out = capsys.readouterr().out
    assert "| run at its start | 0 | 0.250 | 1.00 | 0.250 / 0.50 | - | - | - |" in out
    assert "| run | 2 | 0.500 | 1.00 | 0.500 / 0.50 | - | - | (off) |" in out
    # no eval/ records: a row that says so in each table that reads them (the third left the run out)
    assert out.count("| run | (no eval/ records) |") == 2


def test_run_summary_takes_first_and_last_evaluation_and_sums_rewrites_over_all_rows(table, tmp_path):
    """First and last rows with eval/all (the last one lacking a type), and mem_kept / mem_tried summed
    over every row, training rows included: kept 2 + 1 + 0 = 3, tried 4 + 1 + 2 = 7."""
    ev = lambda em, types=("1hop",): {"eval/all": {"em": em, "searches": 1.0},  # noqa: E731
                                      **{f"eval/{t}": {"em": em, "searches": 1.0} for t in types}}
    rows = [{"step": 0, **ev(0.1)}, {"step": 1, "mem_kept": 2, "mem_tried": 4},
            {"step": 2, "mem_kept": 1, "mem_tried": 1, **ev(0.2)}, {"step": 3, "mem_tried": 2},
            {"step": 4, **ev(0.3, types=())}]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    first, last, kept, tried = table.run_summary(tmp_path / "metrics.jsonl")
    assert (first["step"], last["step"], kept, tried) == (0, 4, 3, 7)


def test_trained_facts_are_every_hop_of_every_training_question(table, tmp_path):
    """Both hops of a 2-hop training question are facts training asks, not only the first."""
    write_jsonl(tmp_path / "train.jsonl", [{"id": "t1", "hops": [hop("g", "G"), hop("b", "B")]},
                                           {"id": "t2", "hops": [hop("h", "H", famous=True)]}])
    assert table.trained_facts(tmp_path / "train.jsonl") == {("g", "G"), ("b", "B"), ("h", "H")}


def test_hop_sources_looks_hops_up_by_passage_id_among_all_retrieved(table, world):
    """A hop's passage counts as retrieved when any of the record's docs has its id (not only the
    first doc, and matched by doc_id, not by the hop's query text)."""
    records = [{"id": "q4", "em": 1.0, "docs": [{"id": "x"}, {"id": "f"}]},  # e (famous) missed, f found
               {"id": "q3", "em": 0.0, "docs": [{"id": "z"}, {"id": "b"}, {"id": "d"}]}]  # both found
    h = table.hop_sources(records, *world)
    assert (h["famous"], h["train"], h["new"]) == (1.0, 0.0, 0.0)
    assert (h["recalled"], h["guessed"]) == (0, 0)


def make_run(folder):
    """Metrics with evaluations at steps 0, 1 and 2 and 3 of 5 rewrites kept; eval/ records for each
    (step 1's, which no table reads, answer everything from its passages)."""
    run = folder / "run"
    (run / "eval").mkdir(parents=True)
    ev0 = {"eval/all": {"em": 0.5, "searches": 1.0}, "eval/1hop": {"em": 0.5, "searches": 0.5},
           "eval/2hop": {"em": 0.5, "searches": 1.5}}
    ev2 = {"eval/all": {"em": 0.5, "searches": 0.75}, "eval/1hop": {"em": 0.0, "searches": 0.5},
           "eval/2hop": {"em": 1.0, "searches": 1.0}}
    ev1 = {"eval/all": {"em": 1.0, "searches": 2.0}, "eval/1hop": {"em": 1.0, "searches": 1.0},
           "eval/2hop": {"em": 1.0, "searches": 3.0}}
    write_jsonl(run / "metrics.jsonl", [{"step": 0, **ev0}, {"step": 1, "mem_kept": 2, "mem_tried": 3, **ev1},
                                        {"step": 2, "mem_kept": 1, "mem_tried": 2, **ev2}])
    write_jsonl(run / "eval" / "step_000000.jsonl", [
        {"id": "q1", "em": 1.0, "searches": 0, "docs": []},
        {"id": "q2", "em": 0.0, "searches": 1, "docs": [{"id": "c"}]},
        {"id": "q3", "em": 0.0, "searches": 1, "docs": [{"id": "b"}]},
        {"id": "q4", "em": 1.0, "searches": 2, "docs": [{"id": "e"}, {"id": "f"}]}])
    write_jsonl(run / "eval" / "step_000001.jsonl", [
        {"id": q, "em": 1.0, "searches": 2, "docs": [{"id": d} for d in "abcdef"]} for q in ("q1", "q2", "q3", "q4")])
    write_jsonl(run / "eval" / "step_000002.jsonl", [
        {"id": "q1", "em": 0.0, "searches": 0, "docs": []},
        {"id": "q2", "em": 0.0, "searches": 0, "docs": []},
        {"id": "q3", "em": 1.0, "searches": 1, "docs": [{"id": "d"}]},
        {"id": "q4", "em": 1.0, "searches": 1, "docs": [{"id": "x"}, {"id": "f"}]}])
    return run


def test_main_prints_each_table_from_the_right_evaluation(table, world, tmp_path, monkeypatch, capsys):
    """The whole output: three tables under their headers and the floors; every number worked out by hand:
    start (step_000000): famous hops a missed, e found: 50%; trained b found: 0%; new c, f found, d
    missed: 33%; q3 lacks d: guessed 1 (EM 0). Famous q1 recalled (1, 1.0); others searched: q2 0,
    q3 0, q4 1 -> (3, 0.333).
    last (step_000002): a, e missed: 100%; b missed: 100%; c missed, d and f found: 33%; q3 recalled
    (EM 1), q2 guessed (EM 0). q1 recalled (1, 0.0); q2 recalled (1, 0.0); q3, q4 searched (2, 1.0).
    Floors: famous questions (0 + 1 + 2 + 2) / 4, famous hops (0 + 1 + 2 + 1) / 4, famous+train hops
    (0 + 1 + 1 + 1) / 4."""
    run = make_run(tmp_path)
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(run), "--data", str(tmp_path)])
    table.main()
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "| run | step | test EM | RC | 1hop EM / RC | 2hop EM / RC | comparison EM / RC | L_M rewrites kept |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        "| run at its start | 0 | 0.500 | 1.00 | 0.500 / 0.50 | 0.500 / 1.50 | - | - |",
        "| run | 2 | 0.500 | 0.75 | 0.000 / 0.50 | 1.000 / 1.00 | - | 3 of 5 |",
        "",
        "Hops answered without retrieving their passage (last evaluation), by what the model could know, and the "
        "questions that did so:",
        "",
        "| run | famous hops | hops a training question asks | other hops | questions lacking a training hop's "
        "passage: n, EM | lacking an other hop's: n, EM |",
        "|---|---:|---:|---:|---:|---:|",
        "| run at its start, step_000000 | 50% | 0% | 33% | 0, 0.000 | 1, 0.000 |",
        "| run, step_000002 | 100% | 100% | 33% | 1, 1.000 | 1, 0.000 |",
        "",
        "Questions answered with no search, and those searched (n, EM; famous: every hop famous):",
        "",
        "| run | famous, recalled | famous, searched | other, recalled | other, searched |",
        "|---|---:|---:|---:|---:|",
        "| run at its start, step_000000 | 1, 1.000 | 0, 0.000 | 0, 0.000 | 3, 0.333 |",
        "| run, step_000002 | 1, 0.000 | 0, 0.000 | 1, 0.000 | 2, 1.000 |",
        "",
        "fewest retrievals per test question, famous questions from memory: 1.250 (1hop 0.50, 2hop 2.00, "
        "comparison 0.00)",
        "fewest retrievals per test question, famous hops from memory: 1.000 (1hop 0.50, 2hop 1.50, comparison 0.00)",
        "fewest retrievals per test question, famous+train hops from memory: 0.750 (1hop 0.50, 2hop 1.00, "
        "comparison 0.00)"]


def test_a_run_with_one_evaluation_shows_its_rewrites(table, world, tmp_path, monkeypatch, capsys):
    """Its start row and its last row are the same evaluation; the last still counts L_M's rewrites."""
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [{"step": 0, "eval/all": {"em": 0.5, "searches": 1.0}},
                                        {"step": 1, "mem_kept": 2, "mem_tried": 3}])
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", str(run), "--data", str(tmp_path)])
    table.main()
    out = capsys.readouterr().out.splitlines()
    assert "| run at its start | 0 | 0.500 | 1.00 | - | - | - | - |" in out
    assert "| run | 0 | 0.500 | 1.00 | - | - | - | 2 of 3 |" in out


def test_the_tables_print_the_same_under_an_ascii_locale(table, world, tmp_path, monkeypatch, capsys):
    """Records and questions with accents are read as UTF-8, and the tables print in ASCII: an empty
    cell's em dash stopped the script with a UnicodeEncodeError under the C locale."""
    from conftest import run_under_ascii_locale

    run = make_run(tmp_path)
    for f in [*sorted((run / "eval").glob("*.jsonl")), tmp_path / "test.jsonl"]:
        rows = [json.loads(line) | {"question": "Which river flows through Z\u00fcrich?"}
                for line in f.read_text(encoding="utf-8").splitlines()]
        write_jsonl(f, rows)
    argv = ["--runs", str(run), "--data", str(tmp_path)]
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", *argv])
    table.main()
    script = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    done = run_under_ascii_locale(script, table.__file__, *argv)
    assert (done.returncode, done.stdout) == (0, capsys.readouterr().out), done.stderr


def test_only_the_first_run_has_a_start_row(table, world, tmp_path, monkeypatch, capsys):
    """The runs of an ablation all start from the one stage-1 model: each table shows its start once,
    from the first run, and then each run's last evaluation."""
    runs = [str(make_run(tmp_path / name)) for name in ("a", "b")]
    monkeypatch.setattr("sys.argv", ["r1pp_table.py", "--runs", *runs, "--data", str(tmp_path)])
    table.main()
    out = capsys.readouterr().out.splitlines()
    first_cells = [line.split(" | ")[0] for line in out if line.startswith("| run")]  # each table's header, rows
    assert first_cells == ["| run", "| run at its start", "| run", "| run",
                           "| run", "| run at its start, step_000000", "| run, step_000002", "| run, step_000002",
                           "| run", "| run at its start, step_000000", "| run, step_000002", "| run, step_000002"]
