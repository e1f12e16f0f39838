"""bench/ scripts' argument handling: paths resolved from the current directory, and a missing
file or a failed child reported in a line or two. Nothing here runs a benchmark."""

import sys
from pathlib import Path

import pytest
from conftest import free_port, load_bench


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


def test_retrieval_bench_shows_a_failed_childs_stderr(retrieval_bench, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys; sys.stderr.write('first\\nthe reason\\n'); sys.exit(3)\n")
    with pytest.raises(SystemExit) as e:
        retrieval_bench.run_measured([sys.executable, str(script)])
    assert "exit code 3" in str(e.value) and "the reason" in str(e.value)


def test_retrieval_bench_child_peak_rss_is_its_own_not_the_parents(retrieval_bench, tmp_path):
    script = tmp_path / "small.py"
    script.write_text("print('hello')\n")
    ballast = b"\1" * (300 * 2**20)  # the parent's peak RSS: over 300 MiB; ru_maxrss would give the child as much
    _, _, peak_gib, out = retrieval_bench.run_measured([sys.executable, str(script)])
    assert out == "hello\n" and 0 < peak_gib * 1024 < 200 and len(ballast)


def test_peak_rss_reads_vmhwm_and_falls_back_to_ru_maxrss(tmp_path):
    memory_bench = load_bench("memory_bench")
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  99999 kB\nVmHWM:\t   14916 kB\nVmRSS:\t   1000 kB\n")
    assert memory_bench.peak_rss_bytes(str(status)) == 14916 * 1024
    assert memory_bench.peak_rss_bytes(str(tmp_path / "missing")) > 0  # no /proc (macOS): getrusage


def test_retrieval_bench_dense_index_folder_names_faiss_and_encoder(retrieval_bench, tmp_path):
    corpus = tmp_path / "wiki.jsonl"
    folder = lambda kind, enc, faiss: retrieval_bench.index_folder(tmp_path, corpus, kind, enc, faiss)  # noqa: E731
    assert folder("bm25", "/x/enc/model", "hnsw") == tmp_path / "wiki-bm25"
    dense = folder("dense", "/x/enc/model", "flat")
    assert dense.name.startswith("wiki-dense-flat-model-")
    others = {folder("dense", "/x/enc/model", "hnsw"), folder("dense", "/y/enc/model", "flat"),
              folder("dense", "intfloat/e5-base-v2", "flat")}
    assert dense not in others and len(others) == 3  # --reuse never takes an index built with other settings
    assert folder("dense", "/x/enc/model", "flat") == dense


@pytest.mark.parametrize("name", ["rollout_bench", "sampler_bench", "update_bench"])
def test_repeats_must_be_positive(name, monkeypatch, capsys):
    bench = load_bench(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--repeats", "0"])
    with pytest.raises(SystemExit) as e:
        bench.main()  # an argparse error, before any model is loaded
    assert e.value.code == 2 and "--repeats: must be at least 1" in capsys.readouterr().err


def test_rollout_bench_plain_generate_matches_tokens_per_question_asked(monkeypatch, capsys):
    """--n beyond the training set: the plain call samples the rollout's tokens per question it had."""
    from types import SimpleNamespace

    import torch

    from searchlite.data import QA

    rollout_bench = load_bench("rollout_bench")

    class Sampler:  # as HFSampler; records the plain call's max_new_tokens
        plain = []

        def __init__(self, model, tok, max_new_tokens, seed):
            pass

        def generate(self, prompts, stop=(), max_new_tokens=None):
            Sampler.plain.append(max_new_tokens)
            return [[0] * max_new_tokens for _ in prompts]

    def rollout(sampler, retriever, tok, protocol, questions, **kw):  # 10 policy tokens per question
        n = len(questions)
        return SimpleNamespace(loss_mask=torch.ones(n, 10), turns=torch.ones(n), searches=torch.zeros(n))

    monkeypatch.setattr("searchlite.data.read_qa", lambda path: [QA(f"q{i}", f"q{i}?", ["a"]) for i in range(3)])
    monkeypatch.setattr("searchlite.models.load_tokenizer", lambda path: None)
    monkeypatch.setattr("searchlite.models.load_policy", lambda path: None)
    monkeypatch.setattr("searchlite.retrieval.build_retriever", lambda kind, corpus: None)
    monkeypatch.setattr("searchlite.rollout.encode_prompt", lambda tok, protocol, q: [1, 2])
    monkeypatch.setattr("searchlite.rollout.rollout", rollout)
    monkeypatch.setattr("searchlite.sampler.HFSampler", Sampler)
    rollout_bench.rollout_efficiency("m", n=80, repeats=1, seed=0)  # 80 asked, 3 in the training set
    assert Sampler.plain == [10, 10] and "3 trajectories" in capsys.readouterr().out


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


def test_realqa_eval_help_needs_no_data():
    """--help prints the script's header (what it runs, its environment) even where the data is missing."""
    import os
    import subprocess

    script = Path(__file__).resolve().parents[1] / "bench" / "realqa_eval.sh"
    res = subprocess.run(["bash", str(script), "--help"], env={**os.environ, "REALQA": "/nowhere"},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "Environment: REALQA (data folder)" in res.stdout, res.stderr
    assert "python evaluate.py --help" in res.stdout and "#" not in res.stdout.splitlines()[0]


def test_retrieval_bench_reuses_only_an_index_of_the_same_unchanged_corpus(retrieval_bench, tmp_path):
    """Index folders are named by the corpus file's stem, so --reuse took an index built over another
    file of that name (and scored recall@3 0.000 against its passages); it now builds again."""
    import os

    from searchlite.retrieval import build_retriever

    corpus, other = tmp_path / "c" / "wiki.jsonl", tmp_path / "d" / "wiki.jsonl"
    for path, word in ((corpus, "apple"), (other, "pear")):
        path.parent.mkdir()
        path.write_text("".join(f'{{"id": "{i}", "contents": "\\"T{i}\\"\\n{word} {i}"}}\n' for i in range(5)))
    folder = retrieval_bench.index_folder(tmp_path / "out", corpus, "bm25", None, "flat")
    assert folder == retrieval_bench.index_folder(tmp_path / "out", other, "bm25", None, "flat")  # one name
    assert retrieval_bench.stale(folder, "bm25", corpus) == "no finished index there"
    build_retriever("bm25", str(corpus)).save(str(folder))
    assert retrieval_bench.stale(folder, "bm25", corpus) is None
    assert retrieval_bench.stale(folder, "bm25", other) == f"it was built over {corpus}"
    os.utime(corpus, ns=(1, 1))  # the same file, changed since
    assert retrieval_bench.stale(folder, "bm25", corpus) == f"{corpus} changed since it was built"


def test_retrieval_bench_refuses_a_port_another_server_holds(retrieval_bench, tmp_path):
    """With the port taken, the bench's own server exited and the bench measured whatever answered there."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"bench: port {port} is taken .*pick --port"):
            retrieval_bench.serve_phase(str(tmp_path), str(tmp_path / "qa.jsonl"), port)


def test_retrieval_bench_shows_why_its_server_exited(retrieval_bench, tmp_path):
    """The server's stderr went to /dev/null: 'the server exited at start' said nothing of why."""
    port = free_port()
    with pytest.raises(SystemExit, match=r"bench: the server exited at start:\n .*not a finished index folder"):
        retrieval_bench.serve_phase(str(tmp_path), str(tmp_path / "qa.jsonl"), port)
