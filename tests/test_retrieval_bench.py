"""bench/retrieval_bench.py: the figures it prints (build and search speed, CPU time, peak RSS,
recall@3, the server's latency percentiles), from stubbed children and a fake clock; its index
reuse, its server's start and stop, and its argument handling. Nothing here times a search."""

import json
import math
import os
import signal
import sys
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import free_port, held_port, load_bench

from searchlite.data import QA
from searchlite.retrieval import Hit, build_retriever


@pytest.fixture(scope="module")
def retrieval_bench():
    return load_bench("retrieval_bench")


def test_retrieval_bench_makes_local_paths_absolute_for_its_children(retrieval_bench, monkeypatch, tmp_path):
    (tmp_path / "qa.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    assert retrieval_bench.local_path("qa.jsonl") == str(tmp_path / "qa.jsonl")
    assert retrieval_bench.local_path("intfloat/e5-base-v2") == "intfloat/e5-base-v2"  # not here: a hub name
    assert retrieval_bench.local_path(None) is None


def test_retrieval_bench_child_peak_rss_is_its_own_not_the_parents(retrieval_bench, tmp_path):
    """The child's own peak: not the parent's 300 MiB (which ru_maxrss would give it), and its own 300 MiB counted."""
    script = tmp_path / "small.py"
    script.write_text("print('hello')\n")
    ballast = b"\1" * (300 * 2**20)
    _, _, peak_gib, out = retrieval_bench.run_measured([sys.executable, str(script)])
    assert out == "hello\n" and 0 < peak_gib * 1024 < 200 and len(ballast)
    del ballast
    script.write_text("b = b'\\1' * (300 * 2**20)\n")
    assert 300 < retrieval_bench.run_measured([sys.executable, str(script)])[2] * 1024 < 1000


def test_retrieval_bench_child_runs_its_script_as_main_from_the_repo_root(retrieval_bench, tmp_path, monkeypatch):
    """It runs `retrieve.py` by that name, from wherever the bench was started, and retrieve.py (as any
    script) does its work under `if __name__ == "__main__"`."""
    script = tmp_path / "guarded.py"
    script.write_text("import os\nif __name__ == '__main__':\n    print(os.getcwd())\n")
    monkeypatch.chdir(tmp_path)
    assert retrieval_bench.run_measured([sys.executable, str(script)])[3] == f"{retrieval_bench.ROOT}\n"


def test_retrieval_bench_child_gives_its_script_its_own_arguments_and_folder(retrieval_bench, tmp_path):
    """As `python SCRIPT ARGS` would: sys.argv is the script and its arguments (not the bench's --_measure
    call), and a module beside the script imports (retrieve.py imports searchlite from the repo root)."""
    script = tmp_path / "echo.py"
    script.write_text("import sys\nimport helper\nprint(sys.argv, helper.X)\n")
    (tmp_path / "helper.py").write_text("X = 7\n")
    out = retrieval_bench.run_measured([sys.executable, str(script), "--topk", "3"])[3]
    assert out == f"{[str(script), '--topk', '3']} 7\n"


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


def test_retrieval_bench_reuses_only_an_index_of_the_same_unchanged_corpus(retrieval_bench, tmp_path):
    """Index folders are named by the corpus file's stem, so --reuse took an index built over another
    file of that name (and scored recall@3 0.000 against its passages); it now builds again."""
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
    with held_port() as port:
        with pytest.raises(SystemExit, match=rf"bench: port {port} is taken .*pick --port"):
            retrieval_bench.serve_phase(str(tmp_path), str(tmp_path / "qa.jsonl"), port)


def test_retrieval_bench_shows_why_its_server_exited(retrieval_bench, monkeypatch, tmp_path):
    """The server's stderr went to /dev/null: 'the server exited at start' said nothing of why. It starts
    retrieve.py from the project's folder, whatever the current one."""
    monkeypatch.chdir(tmp_path)
    port = free_port()
    with pytest.raises(SystemExit, match=r"bench: the server exited at start:\n .*not a finished index folder"):
        retrieval_bench.serve_phase(str(tmp_path), str(tmp_path / "qa.jsonl"), port)


def test_retrieval_bench_synthetic_set_has_n_passages_and_asks_their_rarest_words(retrieval_bench, tmp_path):
    """Written into a folder that is not there yet (the default --out, runs/retrieval_bench, in a fresh clone)."""
    corpus, qa = retrieval_bench.write_synthetic(50, tmp_path / "runs" / "retrieval_bench")
    passages = [json.loads(line)["contents"].split("\n")[1].split() for line in corpus.read_text().splitlines()]
    questions = [json.loads(line) for line in qa.read_text().splitlines()]
    assert len(passages) == 50 and len(questions) == 50
    counts = Counter(w for p in passages for w in p)
    for q in questions:
        words, passage = q["question"].split(), passages[int(q["id"][1:])]
        assert q["golden_answers"] == [f"Synth {int(q['id'][1:]):07d}"]
        assert len(words) == 6 and set(words) <= set(passage)
        assert max(counts[w] for w in words) < sum(counts[w] for w in passage) / len(passage)  # rarer than average


def test_retrieval_bench_synthetic_set_past_one_chunk_has_each_passage_once_in_order(retrieval_bench, tmp_path):
    """Passages are drawn 10,000 at a time: the second chunk goes on from the first, to n in all."""
    corpus, qa = retrieval_bench.write_synthetic(10_005, tmp_path)
    ids = [json.loads(line)["id"] for line in corpus.read_text().splitlines()]
    assert ids == [str(i) for i in range(10_005)]
    assert len(qa.read_text().splitlines()) == 500


def test_retrieval_bench_synthetic_set_is_written_again_when_its_qa_is_missing(retrieval_bench, monkeypatch,
                                                                               tmp_path):
    """A run stopped while writing the questions leaves no corpus, so the next run writes both again
    instead of taking a corpus without its questions; with both there, neither is written again."""
    def interrupted(path, rows):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(retrieval_bench, "write_jsonl", interrupted)
        with pytest.raises(KeyboardInterrupt):
            retrieval_bench.write_synthetic(20, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".tmp")] == []
    corpus, qa = retrieval_bench.write_synthetic(20, tmp_path)
    qa.unlink()
    assert retrieval_bench.write_synthetic(20, tmp_path) == (corpus, qa) and len(qa.read_text().splitlines()) == 20
    def written_again(path, rows):
        raise AssertionError(f"{path} written again")

    monkeypatch.setattr(retrieval_bench, "write_jsonl", written_again)  # both there: taken as they are
    assert retrieval_bench.write_synthetic(20, tmp_path) == (corpus, qa)


def test_retrieval_bench_child_killed_by_a_signal_is_reported(retrieval_bench, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(f"import os; os.kill(os.getpid(), {int(signal.SIGKILL)})\n")
    with pytest.raises(SystemExit, match="failed with exit code -9"):
        retrieval_bench.run_measured([sys.executable, str(script)])


def test_retrieval_bench_shows_a_failed_childs_stderr(retrieval_bench, tmp_path, capfd):
    """Its exit code and the last 20 lines of its stderr; not quiet (a build, whose progress shows),
    its stderr goes to the terminal as it runs, and the message repeats none of it."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nfor i in range(30): print(f'line {i}', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(SystemExit) as e:
        retrieval_bench.run_measured([sys.executable, str(script)])
    assert "failed with exit code 3" in str(e.value) and "line 9\n" not in str(e.value)
    assert str(e.value).endswith("".join(f"line {i}\n" for i in range(10, 30)))
    assert capfd.readouterr().err == ""
    with pytest.raises(SystemExit) as e:
        retrieval_bench.run_measured([sys.executable, str(script)], quiet=False)
    assert str(e.value) == f"bench: {sys.executable} {script} failed with exit code 3"
    assert capfd.readouterr().err == "".join(f"line {i}\n" for i in range(30))


def test_retrieval_bench_cpu_seconds_are_user_plus_system_and_wall_seconds_the_run(retrieval_bench, monkeypatch,
                                                                                  tmp_path):
    wait4 = os.wait4
    usage = SimpleNamespace(ru_utime=1.25, ru_stime=0.5)
    monkeypatch.setattr(os, "wait4", lambda pid, opts: (*wait4(pid, opts)[:2], usage))
    monkeypatch.setattr(retrieval_bench, "time", SimpleNamespace(perf_counter=iter([1000.0, 1002.5]).__next__))
    script = tmp_path / "ok.py"
    script.write_text("")
    assert retrieval_bench.run_measured([sys.executable, str(script)])[:2] == (2.5, 1.75)


def test_retrieval_bench_disk_mib_counts_files_in_subfolders(retrieval_bench, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"\0" * 2**20)
    (tmp_path / "sub" / "b.bin").write_bytes(b"\0" * 2**19)
    assert retrieval_bench.disk_mib(tmp_path) == 1.5


def test_retrieval_bench_corrupt_index_settings_are_not_reused(retrieval_bench, tmp_path):
    corpus = tmp_path / "wiki.jsonl"
    corpus.write_text("")
    (tmp_path / "bm25.json").write_text("{not json")
    assert retrieval_bench.stale(tmp_path, "bm25", corpus) == "no finished index there"


class Clock:
    """Stands in for the `time` module: `now` moves only when a fake advances it. It does not start at 0,
    where a sum of two readings would pass for the time between them."""

    def __init__(self):
        self.now, self.cpu = 1000.0, 100.0

    def perf_counter(self):
        return self.now

    def process_time(self):
        return self.cpu

    def sleep(self, seconds):
        pass


def test_retrieval_bench_search_phase_speed_cpu_ms_and_recall(retrieval_bench, monkeypatch, capsys):
    """6 questions, --single 8 (more than there are), --batch 4 (then 2); each search call takes 10 ms wall,
    20 ms CPU.
    A question is found when any of its answers is in a passage: q4's second, both of q5's."""
    clock = Clock()
    hit = lambda title, text: Hit("0", title, text, 1.0)  # noqa: E731
    qa = [QA("0", "q0", ["Ed Wood"]), QA("1", "q1", ["Synth 0000001"]), QA("2", "q2", ["Paris"]),
          QA("3", "q3", ["nothing"]), QA("4", "q4", ["x", "The Beatles"]), QA("5", "q5", ["Oslo", "Norway"])]
    hits = {"q0": [hit("Film", "Ed Woodward starred")], "q1": [hit("Synth 0000001", "ba ka")],
            "q2": [hit("France", "the capital: Paris.")], "q3": [hit("A", "b")], "q4": [hit("Band", "beatles songs")],
            "q5": [hit("Oslo", "capital of Norway")]}
    calls = []

    class Index:
        def search(self, queries, k):
            assert k == 3
            calls.append(len(queries))
            clock.now, clock.cpu = clock.now + 0.01, clock.cpu + 0.02
            return [hits[q] for q in queries]

    def load_index(path):
        clock.now += 1.5
        return Index()

    monkeypatch.setattr(retrieval_bench, "time", clock)
    monkeypatch.setattr("searchlite.retrieval.load_index", load_index)
    monkeypatch.setattr("searchlite.data.read_qa", lambda path: qa)
    retrieval_bench.search_phase("idx", "qa.jsonl", single=8, batch=4)
    s = json.loads(capsys.readouterr().out)
    assert calls == [1, 4] + [1] * 6 + [4, 2]  # warm-ups, one at a time, batches
    assert s == pytest.approx(dict(load_s=1.5, single_qps=6 / 0.06, batched_qps=6 / 0.02, single_cpu_ms=20.0,
                                   batched_cpu_ms=40 / 6, recall3=4 / 6, recall3_substring=5 / 6, n=6))


@pytest.fixture
def fake_server(retrieval_bench, monkeypatch):
    """serve_phase with no server: Popen, /health and HTTPRetriever stubbed, time on a Clock; 7 questions.
    `state.health_failures` /health calls fail first; a search takes `state.latency(n)` s (n: calls so far)
    on the clock, and `state.pause` s of real time; the server's poll() gives `state.exit_code`, and it
    writes `state.stderr` (bytes) to its stderr; `state.stdout` is where its stdout went."""
    state = SimpleNamespace(popen=[], terminated=False, health_failures=0, health_calls=0, asked=[],
                            latency=lambda n: 0.001, fail_at=None, clock=Clock(), pause=0.0, exit_code=None,
                            stderr=b"", stdout=None)

    class Server:
        def __init__(self, cmd, **kw):
            state.popen.append((cmd, kw.get("cwd")))
            state.stdout = kw.get("stdout")
            kw["stderr"].write(state.stderr)

        def poll(self):
            return state.exit_code

        def terminate(self):
            state.terminated = True

        def wait(self):
            return 0

    def urlopen(url, timeout):
        state.health_calls += 1
        if state.health_calls <= state.health_failures:
            raise ConnectionRefusedError(111, "Connection refused")
        return SimpleNamespace(read=lambda: b"{}")

    class HTTP:
        def __init__(self, url, timeout, retries):
            pass

        def search(self, queries, k):
            time.sleep(state.pause)
            n = len(state.asked)
            state.asked.extend(queries)
            state.clock.now += state.latency(n)
            if n == state.fail_at:
                raise KeyError("passages")

    monkeypatch.setattr("retrieve.port_taken", lambda host, port: None)
    monkeypatch.setattr(retrieval_bench, "subprocess", SimpleNamespace(Popen=Server, DEVNULL=-3))
    monkeypatch.setattr(retrieval_bench, "urllib", SimpleNamespace(request=SimpleNamespace(urlopen=urlopen)))
    monkeypatch.setattr(retrieval_bench, "time", state.clock)
    monkeypatch.setattr("searchlite.retrieval.HTTPRetriever", HTTP)
    monkeypatch.setattr("searchlite.data.read_qa", lambda path: [QA(str(i), f"q{i}", ["a"]) for i in range(7)])
    return state


def test_retrieval_bench_serve_phase_latency_percentiles_rps_and_errors(retrieval_bench, fake_server):
    """101 requests taking 1, 2, ..., 100 ms, then one of 5 ms that fails; the server slow to answer /health.
    The percentiles lie between the fastest and slowest answers: p99 = 1 + 0.99 x 99 ms, not past 100 ms."""
    fake_server.latency = lambda n: (n + 1) / 1000 if n < 100 else 0.005
    fake_server.fail_at, fake_server.health_failures = 100, 1000
    v = retrieval_bench.serve_phase("idx", "qa.jsonl", 8731, clients=1, requests=101)
    assert fake_server.popen == [([retrieval_bench.PY, "retrieve.py", "serve", "--index", "idx", "--port", "8731"],
                                  retrieval_bench.ROOT)]
    assert fake_server.terminated and fake_server.health_calls == 1001
    assert fake_server.stdout == retrieval_bench.subprocess.DEVNULL  # its "serving http:..." line: not in the report
    assert v == pytest.approx(dict(p50_ms=50.5, p99_ms=99.01, rps=100 / 5.055, errors=1,
                                   first_error="KeyError: 'passages'"))


def test_retrieval_bench_serve_phase_with_one_answer_has_no_percentiles(retrieval_bench, fake_server):
    v = retrieval_bench.serve_phase("idx", "qa.jsonl", 8731, clients=1, requests=1)
    assert math.isnan(v["p50_ms"]) and math.isnan(v["p99_ms"]) and v["errors"] == 0


def test_retrieval_bench_serve_clients_ask_different_questions(retrieval_bench, fake_server):
    """Each client's requests are all in when it returns: they take real time (without the join, fewer)."""
    fake_server.pause = 0.02
    v = retrieval_bench.serve_phase("idx", "qa.jsonl", 8731, clients=3, requests=3)
    assert sorted(fake_server.asked) == ["q0", "q0", "q1", "q1", "q2", "q3", "q4", "q5", "q6"]  # 9 asks of 7
    assert v["rps"] == pytest.approx(9 / 0.009)  # 9 answers in the 9 ms the clock moved (1 ms a search)


def test_retrieval_bench_stops_when_its_server_exited_and_another_answers_its_port(retrieval_bench, fake_server):
    """/health answers while the bench's own server has exited (a server started on the port after the free
    check): it stops there, naming the port, not measuring that process's server (without the check, it did)."""
    fake_server.exit_code = 1
    with pytest.raises(SystemExit, match=r"^bench: the server exited, and another process answers on port 8731:"):
        retrieval_bench.serve_phase("idx", "qa.jsonl", 8731)
    assert fake_server.asked == [] and fake_server.terminated


def test_retrieval_bench_shows_a_server_log_that_is_not_utf8(retrieval_bench, fake_server):
    """The server's last lines are shown with an undecodable byte replaced: not a UnicodeDecodeError."""
    fake_server.exit_code, fake_server.health_failures = 1, 1
    fake_server.stderr = b"loading index\nno such file: /data/caf\xe9/index\n"  # a Latin-1 path
    with pytest.raises(SystemExit, match="^bench: the server exited at start:\n  loading index\n"
                                         "  no such file: /data/caf\ufffd/index$"):
        retrieval_bench.serve_phase("idx", "qa.jsonl", 8731)


def test_retrieval_bench_gives_up_on_a_server_silent_for_300_s(retrieval_bench, fake_server):
    fake_server.health_failures = 10**6
    with pytest.raises(SystemExit, match="did not answer /health in 300 s"):
        retrieval_bench.serve_phase("idx", "qa.jsonl", 8731)
    assert fake_server.health_calls == 1200 and fake_server.terminated  # 1200 x 0.25 s


SEARCH = dict(load_s=1.5, single_qps=50.0, batched_qps=400.0, single_cpu_ms=20.0, batched_cpu_ms=2.5, recall3=0.6,
              recall3_substring=0.8, n=5)
SERVE = dict(p50_ms=12.31, p99_ms=99.0, rps=1234.5, errors=2, first_error="KeyError: 'x'")


@pytest.fixture
def retrieval_main(retrieval_bench, monkeypatch, tmp_path):
    """retrieval_bench.main(argv) in tmp_path (wiki.jsonl, qa.jsonl there), with its children stubbed:
    returns (run_measured calls as (cmd, quiet), serve_phase calls)."""
    (tmp_path / "wiki.jsonl").write_text('{"id": "0", "contents": "\\"T\\"\\nx"}\n')
    (tmp_path / "qa.jsonl").write_text('{"id": "0", "question": "q", "golden_answers": ["a"]}\n')
    monkeypatch.chdir(tmp_path)
    measured, served = [], []

    def run_measured(cmd, quiet=True):
        measured.append((cmd, quiet))
        notices = "a library's notice\nanother\n"  # the child's figures are its last line
        return (0.1, 0.2, 0.75, notices + json.dumps(SEARCH) + "\n") if "--_search" in cmd \
            else (12.34, 20.5, 1.5, "")

    def serve_phase(index, qa, port):
        served.append((index, qa, port))
        return SERVE

    monkeypatch.setattr(retrieval_bench, "run_measured", run_measured)
    monkeypatch.setattr(retrieval_bench, "serve_phase", serve_phase)

    def main(*argv):
        monkeypatch.setattr(sys, "argv", ["retrieval_bench.py", *argv])
        retrieval_bench.main()
        return measured, served

    return main


def test_retrieval_bench_defaults_and_printed_figures(retrieval_bench, retrieval_main, tmp_path, capsys,
                                                     monkeypatch):
    with open(tmp_path / "wiki.jsonl", "a") as f:
        f.write(" " * (3 * 2**20 - f.tell()))  # 3 MiB
    monkeypatch.setattr(retrieval_bench, "peak_rss_bytes", lambda: 5 * 2**29)  # 2.5 GiB
    measured, served = retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl", "--out", "out")
    folder, qa = str(tmp_path / "out" / "wiki-bm25"), str(tmp_path / "qa.jsonl")
    assert measured == [
        ([retrieval_bench.PY, "retrieve.py", "build", "--corpus", str(tmp_path / "wiki.jsonl"), "--kind", "bm25",
          "--out", folder], False),  # progress bars stay on the terminal
        ([retrieval_bench.PY, retrieval_bench.__file__, "--_search", folder, "--qa", qa, "--single", "200",
          "--batch", "64"], True)]
    assert served == [(folder, qa, 8731)]
    out = capsys.readouterr().out
    assert f"corpus {tmp_path / 'wiki.jsonl'} (3.0 MiB); questions {qa}; peak RSS of the bench process itself " \
           "2.50 GiB\n" in out
    assert "[bm25] build 12.3s wall (20.5 CPU s), peak RSS 1.50 GiB, index on disk 0.0 MiB\n" in out
    assert ("[bm25] search: load 1.5s; batches of 64 8.00x the queries/s of one at a time (400.0 vs 50.0 q/s; "
            "CPU ms/query 2.50 vs 20.00), peak RSS 0.75 GiB; answer recall@3 0.600 over 5 questions "
            "(as a plain substring 0.800)\n") in out
    assert ("[bm25] server, 32 clients x 50 requests: p50 12.3 ms, p99 99.0 ms, 1,234.5 requests/s, 2 errors "
            "(KeyError: 'x')\n") in out


def test_retrieval_bench_runs_end_to_end_on_a_small_synthetic_corpus(retrieval_bench, tmp_path):
    """The command itself, its build and search children unfaked: a child that did not take its
    --_search phase ran the whole bench again (and failed) with every other test passing."""
    import subprocess

    cmd = [sys.executable, retrieval_bench.__file__, "--synthetic", "200", "--no_serve", "--single", "2",
           "--batch", "2", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split(" ")[:2] for line in lines[2:]] == [["[bm25]", "build"], ["[bm25]", "search:"]]
    # each question asks its passage's rarest words (the synthetic set): BM25 finds every answer
    assert lines[3].endswith("answer recall@3 1.000 over 200 questions (as a plain substring 1.000)")


def test_retrieval_bench_server_line_without_errors_names_none(retrieval_main, capsys, monkeypatch):
    monkeypatch.setitem(SERVE, "errors", 0)
    monkeypatch.setitem(SERVE, "first_error", None)
    retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl")
    assert capsys.readouterr().out.endswith(" requests/s, 0 errors\n")


def test_retrieval_bench_dense_build_names_encoder_and_faiss_and_no_serve_skips_the_server(retrieval_main):
    measured, served = retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl", "--kinds", "dense",
                                      "--encoder", "intfloat/e5-base-v2", "--faiss", "hnsw", "--no_serve")
    assert measured[0][0][-4:] == ["--encoder", "intfloat/e5-base-v2", "--faiss", "hnsw"] and served == []


def test_retrieval_bench_port_given_is_a_number(retrieval_main):
    """serve_phase binds the port to check it is free: a string there was a TypeError."""
    _, served = retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl", "--port", "9000")
    assert served[0][2] == 9000  # not "9000"


def test_retrieval_bench_dense_default_faiss_is_flat(retrieval_main):
    measured, _ = retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl", "--kinds", "dense", "--encoder", "e")
    assert measured[0][0][-2:] == ["--faiss", "flat"]


def test_retrieval_bench_reuse_builds_when_no_index_is_there(retrieval_main, capsys):
    measured, _ = retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl", "--reuse", "--no_serve")
    assert "build" in measured[0][0] and "not reusing" in capsys.readouterr().out


def test_retrieval_bench_reuse_takes_an_index_built_over_this_corpus_unchanged(retrieval_main, tmp_path, capsys):
    corpus, folder = (tmp_path / "wiki.jsonl").resolve(), tmp_path / "out" / "wiki-bm25"
    folder.mkdir(parents=True)
    st = corpus.stat()
    (folder / "bm25.json").write_text(json.dumps({"corpus": str(corpus), "corpus_bytes": st.st_size,
                                                  "corpus_mtime_ns": st.st_mtime_ns}))
    measured, _ = retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl", "--out", "out", "--reuse", "--no_serve")
    assert [cmd[2] for cmd, _ in measured] == ["--_search"]  # no build
    assert f"[bm25] reusing {folder.resolve()} (0.0 MiB on disk)\n" in capsys.readouterr().out
    measured, _ = retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl", "--out", "out", "--no_serve")
    assert [cmd[2] for cmd, _ in measured] == ["--_search", "build", "--_search"]  # (both runs' children)
    # without --reuse: built again, and no word said of reusing
    assert "reusing" not in capsys.readouterr().out


def test_retrieval_bench_synthetic_corpus_keeps_a_given_qa(retrieval_bench, retrieval_main, monkeypatch, tmp_path,
                                                           capsys):
    synthetic = (tmp_path / "wiki.jsonl", tmp_path / "s.jsonl")

    def write(n, out):
        with open(synthetic[0], "a") as f:
            f.write(" " * (3 * 2**19 - f.tell()))  # 1.5 MiB
        return synthetic

    monkeypatch.setattr(retrieval_bench, "write_synthetic", write)
    monkeypatch.setattr(retrieval_bench, "time", SimpleNamespace(perf_counter=iter([100.0, 102.4]).__next__))
    measured, _ = retrieval_main("--synthetic", "10", "--qa", "qa.jsonl", "--no_serve")
    assert measured[1][0][5] == str(tmp_path / "qa.jsonl")
    assert f"synthetic corpus {synthetic[0]}: 10 passages, 1.5 MiB (2s)\n" in capsys.readouterr().out


def test_retrieval_bench_takes_one_single_query_and_batches_of_one(retrieval_main):
    measured, _ = retrieval_main("--corpus", "wiki.jsonl", "--qa", "qa.jsonl", "--single", "1", "--batch", "1",
                                 "--no_serve")
    assert measured[1][0][-4:] == ["--single", "1", "--batch", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--corpus", "wiki.jsonl"], "give --corpus and --qa, or --synthetic N"),
    (["--corpus", "nope.jsonl", "--qa", "qa.jsonl"], "--corpus nope.jsonl: no such file"),
    (["--corpus", ".", "--qa", "qa.jsonl"], "--corpus .: no such file"),
    (["--synthetic", "10", "--single", "0"], "--single and --batch must be at least 1"),
    (["--synthetic", "10", "--batch", "0"], "--single and --batch must be at least 1")])
def test_retrieval_bench_bad_arguments_are_one_line_errors(retrieval_main, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        retrieval_main(*argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err
