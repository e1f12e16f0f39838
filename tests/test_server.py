"""retrieve.py's command line around the retrieval server: `serve` checks for FastAPI and its
flags before the index loads (minutes on wiki-18) and hands them to make_app; a bad flag is
named in the error. The server itself is tested in test_retrieval_scale.py."""

import re
import sys

import pytest

import retrieve


def _never_load(args):
    raise AssertionError("the index was loaded before the flags were checked")


def test_serve_checks_for_fastapi_before_loading_the_index(monkeypatch):
    monkeypatch.setattr(retrieve, "make", _never_load)
    monkeypatch.setitem(sys.modules, "searchlite.server", None)  # `import searchlite.server` raises ImportError
    with pytest.raises(SystemExit, match=r"^error: serving needs FastAPI and uvicorn \(.*\): "
                                         r"pip install -e '\.\[serve\]'$"):
        retrieve.main(["serve"])


@pytest.mark.parametrize("topk", ["0", "101"])
def test_serve_refuses_a_default_topk_out_of_range_before_loading(monkeypatch, topk):
    monkeypatch.setattr(retrieve, "make", _never_load)
    with pytest.raises(SystemExit, match=rf"^error: --topk must be 1\.\.100, got {topk}$"):
        retrieve.main(["serve", "--topk", topk])


def test_serve_refuses_a_port_another_server_holds_before_loading(monkeypatch):
    """It loaded the index (minutes on wiki-18), printed 'serving http://...', then uvicorn died on the port."""
    import socket

    monkeypatch.setattr(retrieve, "make", _never_load)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"^error: --host 127.0.0.1 --port {port}: cannot listen there "
                                             r"\(.*\); another server may hold it: pick another --port$"):
            retrieve.main(["serve", "--port", str(port)])


def test_serve_passes_its_flags_to_the_app(monkeypatch):
    import searchlite.server

    seen = {}
    monkeypatch.setattr(retrieve, "check_port", lambda host, port: None)  # port 8000 may be taken here
    monkeypatch.setattr(searchlite.server, "serve", lambda retriever, host, port, **settings: seen.update(settings))
    retrieve.main(["serve", "--topk", "5", "--max_queries", "7", "--max_query_chars", "9", "--batch_wait_ms", "20"])
    assert seen == {"default_topk": 5, "max_queries": 7, "max_query_chars": 9, "batch_wait": 0.02}


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
