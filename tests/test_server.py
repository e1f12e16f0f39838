"""retrieve.py's command line around the retrieval server: `serve` checks for FastAPI and its
flags before the index loads (minutes on wiki-18) and hands them to make_app; a bad flag is
named in the error. Then the server's edges: topk and body-size bounds inclusive, JSON error
positions, /health for a retriever without a passage count, a NaN score answered as an error,
requests held by a stopped batcher answered, a batcher that dies logged once and restarted, the
batch wait, and `serve`'s address and settings. Its round trip, validation, batching, load and
fuzz tests are in test_retrieval_scale.py."""

import asyncio
import json
import logging
import re
import sys
import threading

import pytest
import uvicorn
from fastapi.testclient import TestClient
from conftest import held_port
from test_retrieval_scale import QUERIES, CountingRetriever, _post, running, served, toy_passages  # noqa: F401

import retrieve
import searchlite.server
from searchlite.retrieval import BM25Retriever, Hit
from searchlite.server import Batcher, make_app


def _never_load(args):
    raise AssertionError("the index was loaded before the flags were checked")


def test_serve_checks_for_fastapi_before_loading_the_index(monkeypatch):
    monkeypatch.setattr(retrieve, "make", _never_load)
    monkeypatch.setitem(sys.modules, "searchlite.server", None)  # `import searchlite.server` raises ImportError
    with pytest.raises(SystemExit, match=r"^error: serving needs FastAPI and uvicorn \(.*\): "
                                         r"pip install -e '\.\[serve\]'$"):
        retrieve.main(["serve"])


def test_serve_checks_for_uvicorn_before_loading_the_index(monkeypatch):
    """FastAPI without uvicorn passed the check, loaded the index, then ended in a ModuleNotFoundError
    traceback when serve() imported uvicorn."""
    monkeypatch.setattr(retrieve, "make", _never_load)
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    monkeypatch.delitem(sys.modules, "searchlite.server")  # imported again, without uvicorn
    with pytest.raises(SystemExit, match=r"^error: serving needs FastAPI and uvicorn \(.*uvicorn.*\): "
                                         r"pip install -e '\.\[serve\]'$"):
        retrieve.main(["serve"])


@pytest.mark.parametrize("topk", ["0", "101"])
def test_serve_refuses_a_default_topk_out_of_range_before_loading(monkeypatch, topk):
    monkeypatch.setattr(retrieve, "make", _never_load)
    with pytest.raises(SystemExit, match=rf"^error: --topk must be 1\.\.100, got {topk}$"):
        retrieve.main(["serve", "--topk", topk])


def test_serve_refuses_a_port_another_server_holds_before_loading(monkeypatch):
    """It loaded the index (minutes on wiki-18), printed 'serving http://...', then uvicorn died on the port."""
    monkeypatch.setattr(retrieve, "make", _never_load)
    with held_port() as port:
        with pytest.raises(SystemExit, match=rf"^error: --host 127.0.0.1 --port {port}: cannot listen there "
                                             r"\(.*\); another server may hold it: pick another --port$"):
            retrieve.main(["serve", "--port", str(port)])


def test_serve_passes_its_flags_to_the_app(monkeypatch):
    """Without --host and --port it serves 127.0.0.1:8000: this machine only, on Search-R1's port,
    the one the client's 'Is the server running?' hint and the README's examples give."""
    seen = {}
    monkeypatch.setattr(retrieve, "check_port", lambda host, port: None)  # port 8000 may be taken here
    monkeypatch.setattr(searchlite.server, "serve",
                        lambda retriever, host, port, **settings: seen.update(settings, host=host, port=port))
    retrieve.main(["serve", "--topk", "5", "--max_queries", "7", "--max_query_chars", "9", "--batch_wait_ms", "20"])
    assert seen == {"default_topk": 5, "max_queries": 7, "max_query_chars": 9, "batch_wait": 0.02,
                    "host": "127.0.0.1", "port": 8000}


def test_query_errors_name_the_flag(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --k must be a positive integer, got 0$"):
        retrieve.main(["query", "--k", "0", "who?"])
    faiss_file = tmp_path / "e5_Flat.index"
    faiss_file.write_bytes(b"not read")
    for kind in ("bm25", "rank_bm25"):  # the file used to be ignored and BM25 built over the corpus
        expected = f"error: --index {faiss_file} is a file: a --kind {kind} index must be a folder written by "
        with pytest.raises(SystemExit, match="^" + re.escape(expected + "`retrieve.py build`")):
            retrieve.main(["query", "--index", str(faiss_file), "--kind", kind, "--corpus", "toy/corpus.jsonl",
                           "who?"])


# ---------------------------------------------------------------------------- the server's edges


def test_topk_100_is_served_and_a_boolean_topk_is_refused(served):
    """100 is the top of topk's range, so it is answered; `true` is not a JSON integer, so it is a 422
    (pydantic alone would read it as 1)."""
    url, r = served
    q = QUERIES[0]
    code, reply = _post(url, json.dumps({"queries": [q], "topk": 100}).encode())
    assert code == 200 and [d["id"] for d in reply["result"][0]] == [h.id for h in r.inner.search([q], 100)[0]]
    for flag in (True, False):
        code, reply = _post(url, json.dumps({"queries": [q], "topk": flag}).encode())
        assert (code, reply) == (422, {"detail": "topk: Value error, Input should be a valid integer"}), flag


def test_a_body_of_exactly_max_body_bytes_is_read(toy_passages):
    """max_body_bytes is the largest body taken: one byte more is a 413."""
    r = BM25Retriever(toy_passages[:5])
    body = json.dumps({"queries": [toy_passages[0].title], "topk": 1}).encode()
    with running(make_app(r, max_body_bytes=100)) as url:
        exact = body[:-1] + b" " * (100 - len(body)) + b"}"
        assert len(exact) == 100
        code, reply = _post(url, exact)
        assert code == 200 and [d["id"] for d in reply["result"][0]] == [r.search([toy_passages[0].title], 1)[0][0].id]
        assert _post(url, exact[:-1] + b" }") == (413, {"detail": "request body over 100 bytes"})


def test_a_body_that_is_not_json_names_the_character_where_it_breaks(served):
    code, reply = _post(served[0], b'{"queries": [')
    assert (code, reply) == (422, {"detail": "body: not valid JSON (Expecting value at character 13; "
                                             "send a JSON object)"})


class NoHits:
    """A retriever that finds nothing and holds no passage count."""

    def search(self, queries, k):
        return [[] for _ in queries]


def test_make_app_takes_a_default_topk_of_1_to_100_only():
    for topk in (1, 100):
        make_app(NoHits(), default_topk=topk)
    for topk in (0, 101):
        with pytest.raises(ValueError, match=rf"^default_topk must be 1\.\.100, got {topk}$"):
            make_app(NoHits(), default_topk=topk)


def test_health_of_a_retriever_without_a_passage_count_says_null():
    with TestClient(make_app(NoHits())) as client:
        reply = client.get("/health")
    assert (reply.status_code, reply.json()) == (200, {"status": "ok", "passages": None})


def test_the_served_schema_gives_every_error_code_the_one_line_detail_body():
    """/openapi.json lists each code POST /retrieve answers with (400 a body not UTF-8, 411 no
    Content-Length, 413 too large, 422 invalid, 500 search failed), each as {"detail": string}:
    a client built from the schema expects that, not FastAPI's default 422 list of objects. A 200
    is a RetrieveResponse, and /health's a Health (without response_model, the schema said nothing
    of either)."""
    with TestClient(make_app(NoHits())) as client:
        schema = client.get("/openapi.json").json()
    responses = schema["paths"]["/retrieve"]["post"]["responses"]
    assert sorted(responses) == ["200", "400", "411", "413", "422", "500"]
    ok = lambda r: r["200"]["content"]["application/json"]["schema"]  # noqa: E731
    assert ok(responses) == {"$ref": "#/components/schemas/RetrieveResponse"}
    assert ok(schema["paths"]["/health"]["get"]["responses"]) == {"$ref": "#/components/schemas/Health"}
    for code in ("400", "411", "413", "422", "500"):
        body = responses[code]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/ErrorResponse"}, code
    error = schema["components"]["schemas"]["ErrorResponse"]
    assert (list(error["properties"]), error["properties"]["detail"]["type"], error["required"]) == (
        ["detail"], "string", ["detail"])


def test_a_nan_score_is_a_server_error_not_a_nan_in_the_json():
    """JSON has no NaN: an answer holding one is a 500 with a JSON detail, as every error is, never
    sent as `NaN` for a strict client to choke on."""
    class NanScores:
        def search(self, queries, k):
            return [[Hit("1", "T", "x", float("nan"))] for _ in queries]

    body = json.dumps({"queries": ["a"], "topk": 1, "return_scores": True}).encode()
    with running(make_app(NanScores())) as url:
        assert _post(url, body) == (500, {"detail": "search failed: a passage's score is NaN or infinite"})


def test_a_stopped_batcher_answers_the_batch_it_searches_the_one_waiting_and_the_queued():
    """Stopped (a shutdown's cancel) while it searches one batch, with a request that did not fit
    waiting to lead the next and another still queued, the batcher answers all three with
    RuntimeError('the search batcher was stopped'); none is left waiting."""
    release, searching = threading.Event(), threading.Event()

    class Blocking:
        def search(self, queries, k):
            searching.set()
            release.wait(5)
            return [[] for _ in queries]

    async def three():
        batcher = Batcher(Blocking(), wait=0.01, max_batch=1)
        futs = [asyncio.ensure_future(batcher.search([q], 1)) for q in QUERIES[:3]]
        await asyncio.sleep(0)  # all three queued
        while not searching.is_set():
            await asyncio.sleep(0.005)
        batcher.task.cancel()
        try:
            return await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 3)
        finally:
            release.set()

    answers = asyncio.run(three())
    assert [(type(a), str(a)) for a in answers] == [(RuntimeError, "the search batcher was stopped")] * 3


def test_a_batcher_that_dies_of_an_error_logs_it_once_and_the_next_request_restarts_it(caplog):
    """Its request gets the error, the log one line with the traceback (unread, asyncio would print
    "Task exception was never retrieved" at some later point), and the next request is answered."""

    def broken(queue, jobs):
        raise ValueError("boom")

    async def twice():
        batcher = Batcher(NoHits(), wait=0, max_batch=8)
        batcher._fill = broken
        with pytest.raises(ValueError, match="^boom$"):
            await batcher.search(["a"], 1)
        await asyncio.sleep(0)  # the dead task's done callbacks run
        del batcher._fill
        return await batcher.search(["b"], 1)

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(twice()) == [[]]
    logged = [(r.getMessage(), type(r.exc_info[1])) for r in caplog.records if r.name == "searchlite.server"]
    assert logged == [("the search batcher stopped; the next request restarts it", ValueError)]


def test_stop_cancels_the_batcher_running_on_this_loop(caplog):
    async def started_then_stopped():
        batcher = Batcher(NoHits(), wait=0, max_batch=8)
        batcher.stop()  # never started: nothing to cancel
        batcher.start()
        batcher.stop()
        await asyncio.sleep(0)
        return batcher.task.cancelled()

    assert asyncio.run(started_then_stopped())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a stop is no failure to report


def test_a_served_app_starts_its_batcher_with_the_server_and_cancels_it_at_shutdown(monkeypatch):
    """The app's lifespan: the batcher runs from start-up, and shutting down cancels it rather than
    leaving its task pending on a closing loop (without the lifespan, test_server, test_retrieve,
    test_retrieval_scale and test_retrieval passed: the first request starts it; without the stop,
    test_server passed: the task ended cancelled all the same as the test client closed)."""
    made, stopped = [], []

    class Recorded(Batcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def stop(self):
            stopped.append(self.task.done())  # running until the shutdown stops it
            super().stop()

    monkeypatch.setattr(searchlite.server, "Batcher", Recorded)
    with TestClient(make_app(NoHits())) as client:
        [batcher] = made
        task = batcher.task
        assert task is not None and not task.done()  # before any request
        assert client.post("/retrieve", json={"queries": ["a"]}).json() == {"result": [[]]}
    assert stopped == [False] and task.cancelled()


def test_a_request_within_batch_wait_of_the_first_joins_its_batch(toy_passages):
    """batch_wait is how long the batcher waits after the first request for others to join it."""
    r = CountingRetriever(toy_passages)

    async def two():
        batcher = Batcher(r, wait=1.0, max_batch=4096)  # a stall under 0.95 s keeps the second in
        try:
            first = asyncio.ensure_future(batcher.search([QUERIES[0]], 2))
            await asyncio.sleep(0.05)  # well inside the wait
            return await asyncio.gather(first, batcher.search([QUERIES[1]], 2))
        finally:
            batcher.task.cancel()

    first, second = asyncio.run(two())
    assert first == r.inner.search([QUERIES[0]], 2) and second == r.inner.search([QUERIES[1]], 2)
    assert r.calls == [2]


def test_serve_binds_loopback_and_passes_its_settings_to_the_app(monkeypatch, toy_passages):
    """serve runs uvicorn on 127.0.0.1:8000 unless told otherwise, without an access log, and its
    settings reach make_app (here: default_topk)."""
    seen = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append((app, kw)))
    r = BM25Retriever(toy_passages)
    searchlite.server.serve(r, default_topk=5)
    searchlite.server.serve(r, host="0.0.0.0", port=9000)
    assert [kw for _, kw in seen] == [{"host": "127.0.0.1", "port": 8000, "access_log": False},
                                      {"host": "0.0.0.0", "port": 9000, "access_log": False}]
    with TestClient(seen[0][0]) as client:
        reply = client.post("/retrieve", json={"queries": [QUERIES[0]]})
    assert [d["id"] for d in reply.json()["result"][0]] == [h.id for h in r.search([QUERIES[0]], 5)[0]]
