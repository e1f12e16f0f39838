"""bench/ scripts' argument handling: paths resolved from the current directory, and a missing
file or a failed child reported in a line or two. Nothing here runs a benchmark."""

import sys

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def retrieval_bench():
    return load_bench("retrieval_bench")


def test_retrieval_bench_missing_corpus_is_a_one_line_error(retrieval_bench, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["retrieval_bench.py", "--corpus", "nope.jsonl", "--qa", "qa.jsonl"])
    with pytest.raises(SystemExit) as e:
        retrieval_bench.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--corpus nope.jsonl: no such file" in err


def test_retrieval_bench_makes_local_paths_absolute_for_its_children(retrieval_bench, monkeypatch, tmp_path):
    (tmp_path / "qa.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    assert retrieval_bench.local_path("qa.jsonl") == str(tmp_path / "qa.jsonl")
    assert retrieval_bench.local_path("intfloat/e5-base-v2") == "intfloat/e5-base-v2"  # not here: a hub name
    assert retrieval_bench.local_path(None) is None


def test_retrieval_bench_shows_a_failed_childs_stderr(retrieval_bench):
    cmd = [sys.executable, "-c", "import sys; sys.stderr.write('first\\nthe reason\\n'); sys.exit(3)"]
    with pytest.raises(SystemExit) as e:
        retrieval_bench.run_measured(cmd)
    assert "exit code 3" in str(e.value) and "the reason" in str(e.value)


def test_rollout_bench_missing_realqa_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    rollout_bench = load_bench("rollout_bench")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["rollout_bench.py", "--realqa", "no-realqa"])
    with pytest.raises(SystemExit) as e:
        rollout_bench.main()  # exits before loading a model or a corpus
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.count("\n") == 1 and "no-realqa/corpus.jsonl" in err and "omit --realqa" in err


def test_memory_bench_model_folder_is_taken_from_the_current_directory(monkeypatch, tmp_path):
    memory_bench = load_bench("memory_bench")
    (tmp_path / "mymodel").mkdir()
    monkeypatch.chdir(tmp_path)
    assert memory_bench.local_path("mymodel") == str(tmp_path / "mymodel")
    assert memory_bench.local_path("toy/model") == "toy/model"  # resolved by train.py (searchlite.config.resolve_path)


def test_memory_bench_failed_variant_shows_its_output_not_a_deleted_log(monkeypatch, tmp_path):
    memory_bench = load_bench("memory_bench")

    def failing(cmd, cwd, stdout, stderr):
        stdout.write("loading\nValueError: the reason\n")
        return 1

    monkeypatch.setattr(memory_bench.subprocess, "call", failing)
    with pytest.raises(SystemExit) as e:
        memory_bench.run_variant("adamw", [], ["--steps", "1"], tmp_path)
    assert "exit 1" in str(e.value) and "the reason" in str(e.value) and str(tmp_path) not in str(e.value)
