"""retrieve.py's command line end to end: the flags of `build` reach the index folder, `query`
prints what the index finds and refuses what it cannot search, `serve` probes the port it
will listen on and hands its address and request bounds to the server."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest
from conftest import free_port, held_port
from test_retrieval import CORPUS, _url, encoder_dir, server  # noqa: F401 (fixtures)
from test_server import _never_load

import retrieve
import searchlite.server
from searchlite import retrieval
from searchlite.config import TOY_DIR
from searchlite.data import lock_folder, passage_to_dict, read_corpus, write_jsonl
from searchlite.indexing import BUILD_LOCK, build_dense_folder
from searchlite.retrieval import BM25Retriever, DenseRetriever, TextEncoder, load_index


@pytest.fixture
def corpus_file(tmp_path):
    """CORPUS (test_retrieval's ten passages) as a Search-R1 JSONL file."""
    path = tmp_path / "c.jsonl"
    write_jsonl(path, map(passage_to_dict, CORPUS))
    return path


@pytest.fixture
def bm25_folder(tmp_path, corpus_file, capsys):
    """A BM25 index folder over corpus_file, written by `retrieve.py build`."""
    retrieve.main(["build", "--corpus", str(corpus_file), "--out", str(tmp_path / "bm25")])
    capsys.readouterr()
    return tmp_path / "bm25"


def _record_serve(monkeypatch) -> dict:
    """searchlite.server.serve replaced by a recorder of its host, port and settings; the index is not loaded."""
    seen = {}
    monkeypatch.setattr(retrieve, "make", lambda args: BM25Retriever(CORPUS))
    monkeypatch.setattr(searchlite.server, "serve",
                        lambda retriever, host, port, **settings: seen.update(host=host, port=port, **settings))
    return seen


# ---------------------------------------------------------------------------- build


def test_build_reports_the_folder_and_its_passage_count(tmp_path, corpus_file, capsys):
    """`build` ends with one line naming the folder, the passages indexed (CORPUS's 10) and the seconds taken."""
    retrieve.main(["build", "--corpus", str(corpus_file), "--out", str(tmp_path / "i")])
    out = capsys.readouterr().out
    assert re.fullmatch(re.escape(f"wrote {tmp_path / 'i'}: 10 passages in ") + r"\d+\.\ds\n", out), out


def test_no_command_or_a_build_without_corpus_or_out_is_a_usage_error(tmp_path, corpus_file, capsys):
    """Named by argparse before anything is read (a build without --out would have nowhere to write)."""
    for argv, missing in (([], ""), (["build", "--out", str(tmp_path / "i")], "--corpus"),
                          (["build", "--corpus", str(corpus_file)], "--out")):
        with pytest.raises(SystemExit) as stop:
            retrieve.main(argv)
        assert stop.value.code == 2 and "the following arguments are required: " + missing in capsys.readouterr().err
    # a --kind or --pooling outside its choices, too (without the choices, test_retrieve and test_server passed)
    for argv, bad in ((["build", "--corpus", str(corpus_file), "--out", str(tmp_path / "i"), "--kind", "rank_bm25"],
                       "rank_bm25"), (["query", "--kind", "elastic", "tides"], "elastic"),
                      (["query", "--pooling", "max", "tides"], "max")):
        with pytest.raises(SystemExit) as stop:
            retrieve.main(argv)
        assert stop.value.code == 2 and f"invalid choice: '{bad}'" in capsys.readouterr().err
    assert not (tmp_path / "i").exists()


def test_bm25_build_takes_the_bounds_of_k1_and_b(tmp_path, corpus_file, capsys):
    """--k1 0, --b 0 and --b 1 are in range (k1 >= 0, 0 <= b <= 1) and are the index's, not bm25s's
    defaults (1.5, 0.75); a refusal names each value out of range under its own flag, and not a flag
    left out (it was "--b None"); NaN is out of range (--k1 nan was taken)."""
    for k1, b in (("0", "1"), ("2", "0")):
        out = tmp_path / f"k{k1}b{b}"
        retrieve.main(["build", "--corpus", str(corpus_file), "--k1", k1, "--b", b, "--out", str(out)])
        index = load_index(out).index
        assert (index.k1, index.b) == (float(k1), float(b))
    for flags, got in ((["--k1", "-1"], "--k1 -1.0"), (["--b", "1.5"], "--b 1.5"), (["--k1", "nan"], "--k1 nan"),
                       (["--k1", "-0.5", "--b", "-0.1"], "--k1 -0.5 and --b -0.1"),
                       (["--k1", "1", "--b", "nan"], "--b nan")):
        refusal = f"error: BM25 needs --k1 >= 0 and 0 <= --b <= 1; got {got}"
        with pytest.raises(SystemExit, match="^" + re.escape(refusal) + "$"):
            retrieve.main(["build", "--corpus", str(corpus_file), *flags, "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_build_into_a_folder_another_build_holds_names_that_folder(tmp_path, corpus_file):
    """A second build into an --out another build is writing stops with a message naming that --out."""
    out = tmp_path / "busy"
    held = lock_folder(out, BUILD_LOCK)
    try:
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: another retrieve.py build is writing to {out}; "
                                                             "wait for it to finish, or choose another --out") + "$"):
            retrieve.main(["build", "--corpus", str(corpus_file), "--out", str(out)])
    finally:
        held.close()
    assert sorted(p.name for p in out.iterdir()) == [BUILD_LOCK]  # the other build's folder is left alone


def test_dense_build_flags_reach_the_folder(tmp_path, corpus_file, encoder_dir, monkeypatch):
    """A dense build keeps what its flags say: the pooling, both prefixes (the passages encoded with
    --passage_prefix), --max_length, an HNSW index with its --search_params, the --keep_shards shards
    of --shard_size passages, and the encoder run --batch_size passages at a time."""
    enc = str(encoder_dir / "tiny-bert")
    batch_sizes, real_init = [], TextEncoder.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        batch_sizes.append(self.batch_size)

    monkeypatch.setattr(TextEncoder, "__init__", recording_init)
    out = tmp_path / "d"
    retrieve.main(["build", "--corpus", str(corpus_file), "--encoder", enc, "--pooling", "cls", "--query_prefix", "q: ",
                   "--passage_prefix", "p: ", "--max_length", "16", "--faiss", "hnsw", "--search_params", "efSearch=16",
                   "--keep_shards", "--shard_size", "4", "--batch_size", "3", "--out", str(out)])
    assert batch_sizes == [3]
    settings = json.loads((out / "dense.json").read_text())
    assert {k: settings[k] for k in ("pooling", "query_prefix", "passage_prefix", "max_length", "search_params")} == {
        "pooling": "cls", "query_prefix": "q: ", "passage_prefix": "p: ", "max_length": 16,
        "search_params": "efSearch=16"}
    index = faiss.read_index(str(out / "index.faiss"))
    assert isinstance(faiss.downcast_index(index), faiss.IndexHNSWFlat) and index.ntotal == 10
    want = TextEncoder(enc, "cls", max_length=16).encode(["p: " + p.contents for p in CORPUS])
    np.testing.assert_allclose(index.reconstruct_n(0, 10), want, atol=1e-5)
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["000000.npy", "000001.npy", "000002.npy",
                                                                   "manifest.json"]  # 4 + 4 + 2 passages


def test_a_dense_build_keeps_256_tokens_a_passage_unless_told(tmp_path, corpus_file, encoder_dir):
    """--max_length defaults to 256, as its help says (dropped, test_retrieve and test_server passed:
    their dense builds give it)."""
    retrieve.main(["build", "--corpus", str(corpus_file), "--encoder", str(encoder_dir / "tiny-bert"),
                   "--out", str(tmp_path / "d")])
    assert json.loads((tmp_path / "d" / "dense.json").read_text())["max_length"] == 256


# ---------------------------------------------------------------------------- query


def printed(hits) -> list[str]:
    """The lines `retrieve.py query` prints for one query's hits: rank, score to 3 decimals, title, id,
    then the text."""
    return [line for rank, h in enumerate(hits, 1)
            for line in (f"  {rank}. [{h.score:.3f}] {h.title} (id {h.id})", f"     {h.text}")]


def test_query_prints_ranked_passages_and_says_when_none_matched(bm25_folder, capsys):
    """Each query is printed with its --k best passages (3 by default): rank, score to 3 decimals,
    title, id, then the text; a query sharing no word with the corpus gets '(no passage matched)'."""
    queries = ["hot water and the sun", "zzzz qqqq"]
    retrieve.main(["query", "--index", str(bm25_folder), *queries])
    expected = load_index(bm25_folder).search(queries, 3)
    assert len(expected[0]) == 3 and expected[1] == []
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["query: hot water and the sun", *printed(expected[0]),
                     "query: zzzz qqqq", "  (no passage matched)"]
    assert re.fullmatch(r"  1\. \[\d\.\d{3}\] Espresso \(id v9\)", lines[1])  # the one with both "hot" and "water"
    assert lines[2] == "     " + CORPUS[9].text
    retrieve.main(["query", "--index", str(bm25_folder), "--k", "1", queries[0]])
    assert capsys.readouterr().out.splitlines() == lines[:3]


def test_query_reads_the_toy_corpus_by_its_toy_name(capsys):
    """--corpus toy/corpus.jsonl names the toy world's corpus for query as it does for build."""
    p = read_corpus(TOY_DIR / "corpus.jsonl")[7]
    retrieve.main(["query", "--corpus", "toy/corpus.jsonl", "--k", "1", p.text])
    assert "1. [" in (out := capsys.readouterr().out) and f"{p.title} (id {p.id})" in out


def test_query_passes_mmap_and_device_to_a_dense_folder(tmp_path, corpus_file, encoder_dir, monkeypatch,
                                                         capsys):
    """--mmap and --device go to the dense index folder's loader (any device is taken here)."""
    DenseRetriever(CORPUS, str(encoder_dir / "tiny-bert"), max_length=48).save(tmp_path / "idx")
    calls, real = [], retrieval.load_index
    monkeypatch.setattr("searchlite.models.pick_device", lambda device: device)
    monkeypatch.setattr(retrieval, "load_index",
                        lambda *a, **kw: calls.append(kw) or real(*a, **{**kw, "device": "cpu"}))
    retrieve.main(["query", "--index", str(tmp_path / "idx"), "--corpus", str(corpus_file), "--mmap", "--device",
                   "cuda:1", "--k", "1", "wooden string instrument played with a bow"])
    assert calls == [{"kind": None, "device": "cuda:1", "mmap": True}]
    assert "] Violin (id v1)" in capsys.readouterr().out
    enc = str(encoder_dir / "tiny-bert")  # --encoder encodes the queries in place of the folder's encoder
    retrieve.main(["query", "--index", str(tmp_path / "idx"), "--corpus", str(corpus_file), "--encoder", enc, "violin"])
    assert calls[-1]["encoder"] == enc


def test_device_auto_reaches_a_dense_index_as_the_device_it_picks(tmp_path, corpus_file, encoder_dir, monkeypatch):
    """--device auto, which the no-GPU refusal suggests, went to torch as "auto" ("Expected one of cpu, cuda,
    ..."): a build, a query over a folder and one over a corpus now get the device it picks (cpu here)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    seen, real_build, real_load = [], build_dense_folder, retrieval.load_index
    monkeypatch.setattr("searchlite.indexing.build_dense_folder",
                        lambda *a, **kw: seen.append(("build", kw["device"])) or real_build(*a, **kw))
    monkeypatch.setattr(retrieval, "load_index",
                        lambda *a, **kw: seen.append(("load", kw["device"])) or real_load(*a, **kw))
    enc = str(encoder_dir / "tiny-bert")
    retrieve.main(["build", "--corpus", str(corpus_file), "--encoder", enc, "--out", str(tmp_path / "d"), "--device",
                   "auto", "--max_length", "48"])
    retrieve.main(["query", "--index", str(tmp_path / "d"), "--device", "auto", "violin"])
    made, real_dense = [], retrieval.DenseRetriever
    monkeypatch.setattr(retrieval, "DenseRetriever", lambda *a, **kw: made.append(kw["device"]) or real_dense(*a, **kw))
    retrieve.main(["query", "--corpus", str(corpus_file), "--encoder", enc, "--device", "auto", "violin"])
    assert seen == [("build", "cpu"), ("load", "cpu")] and made == ["cpu"]


def test_query_takes_an_empty_query_prefix_over_the_folders(tmp_path, corpus_file, encoder_dir, capsys):
    """--query_prefix '' on a folder built with an E5 encoder (its query prefix 'query: ') encodes the
    queries with no prefix: the scores printed are those of prefix-less queries."""
    enc = str(encoder_dir / "tiny-e5-bert")
    DenseRetriever(CORPUS, enc, max_length=48).save(tmp_path / "e5")
    index = ["--index", str(tmp_path / "e5"), "--corpus", str(corpus_file), "--k", "1", "violin"]
    printed = []
    for flags in ([], ["--query_prefix", ""]):
        retrieve.main(["query", *index, *flags])
        printed.append(capsys.readouterr().out.splitlines()[1])
    want = [DenseRetriever(CORPUS, enc, max_length=48, query_prefix=prefix).search(["violin"], 1)[0][0]
            for prefix in ("query: ", "")]
    assert [h.id for h in want] == ["v1", "v1"] and f"{want[0].score:.3f}" != f"{want[1].score:.3f}"
    assert printed == [f"  1. [{h.score:.3f}] Violin (id v1)" for h in want]


def test_query_with_an_encoder_alone_uses_its_pooling(corpus_file, encoder_dir, monkeypatch, capsys):
    """query --encoder --pooling cls over a corpus encodes it with CLS pooling, as searching with that pooling does."""
    made, real = [], retrieval.build_retriever
    monkeypatch.setattr(retrieval, "build_retriever", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    q = "wooden string instrument"
    retrieve.main(["query", "--encoder", str(encoder_dir / "tiny-bert"), "--pooling", "cls", "--corpus",
                   str(corpus_file), "--k", "1", q])
    assert [r.text_encoder.pooling for r in made] == ["cls"]
    [[want]] = DenseRetriever(CORPUS, str(encoder_dir / "tiny-bert"), pooling="cls").search([q], 1)
    assert f"  1. [{want.score:.3f}] {want.title} (id {want.id})" in capsys.readouterr().out.splitlines()


def test_query_refuses_flags_a_bm25_folder_would_ignore(bm25_folder):
    """--encoder, --query_prefix even when empty, and --device even cpu, are named on a BM25 folder; --kind dense or
    rank_bm25 is not searched as the folder's bm25 index."""
    for flags, named in ((["--encoder", "intfloat/e5-base-v2"], "--encoder"),
                         (["--query_prefix", ""], "--query_prefix"), (["--device", "cpu"], "--device")):
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: {named}: --index {bm25_folder} holds a bm25 "
                                                             "index, which encodes no queries")):
            retrieve.main(["query", "--index", str(bm25_folder), *flags, "x"])
    for kind in ("dense", "rank_bm25"):
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: {bm25_folder} holds a bm25 index, not a {kind} "
                                                             "one") + "$"):
            retrieve.main(["query", "--index", str(bm25_folder), "--kind", kind, "x"])


def test_query_names_an_unfinished_or_missing_index(tmp_path):
    """A folder without bm25.json or dense.json is 'not a finished index folder' (with --encoder too);
    a path that is not there is named as such, in one line."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {tmp_path / 'empty'} is not a finished index "
                                                         "folder (no bm25.json or dense.json)")):
        retrieve.main(["query", "--index", str(tmp_path / "empty"), "--encoder", "x", "q"])
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: no index folder or FAISS file at {tmp_path / 'no'}")
                                         + "$"):
        retrieve.main(["query", "--index", str(tmp_path / "no"), "q"])


def test_a_corpus_edited_since_the_build_is_a_one_line_warning(bm25_folder, corpus_file):
    """Run as a script, retrieve.py prints searchlite's warning as 'warning: ...', not with the library
    line that raised it; the query still answers."""
    built = corpus_file.stat().st_mtime_ns
    corpus_file.write_text(corpus_file.read_text().replace("violin", "VIOLIN"))  # the same size
    os.utime(corpus_file, ns=(built + 10**9, built + 10**9))  # a later time, whatever the clock's tick
    done = subprocess.run([sys.executable, "retrieve.py", "query", "--index", str(bm25_folder), "--k", "1", "violin"],
                          cwd=Path(retrieve.__file__).parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("query: violin\n  1. ["), done.stderr
    assert done.stderr == (f"warning: {corpus_file} changed since {bm25_folder} was built from it (its size or "
                           "modification time differs): the index scores the text as it was; rebuild it with "
                           "`python retrieve.py build`\n")


def test_a_faiss_file_names_the_flags_it_needs(tmp_path, corpus_file):
    """A FAISS file needs --corpus (the corpus it was built over) and --encoder, each named by its flag."""
    faiss_file = tmp_path / "e5_Flat.index"
    faiss_file.write_bytes(b"not read")
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: --index {faiss_file} is a FAISS file: give --corpus, "
                                                         "the corpus it was built over") + "$"):
        retrieve.main(["query", "--index", str(faiss_file), "q"])
    refusal = (f"error: --index {faiss_file} is a FAISS file: give --encoder, the sentence encoder that made its "
               "passage vectors")
    with pytest.raises(SystemExit, match="^" + re.escape(refusal) + "$"):
        retrieve.main(["query", "--index", str(faiss_file), "--corpus", str(corpus_file), "q"])


def test_a_corpus_given_as_index_is_named_as_a_corpus(tmp_path, corpus_file):
    """A JSONL corpus (plain, after a BOM and blank lines, or gzipped) given to --index was taken for a
    FAISS file: "give --corpus", and then "--kind dense needs --encoder or --index" with --index given."""
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf\n \n" + corpus_file.read_bytes())
    gz = tmp_path / "c.jsonl.gz"
    write_jsonl(gz, map(passage_to_dict, CORPUS))
    for path in (corpus_file, bom, gz):
        for extra in ([], ["--corpus", str(corpus_file)]):
            refusal = (f"error: --index {path} is a JSONL file, not an index: a corpus goes to --corpus (BM25 then "
                       f"indexes it in memory), or `retrieve.py build --corpus {path}` writes an index folder")
            with pytest.raises(SystemExit, match="^" + re.escape(refusal) + "$"):
                retrieve.main(["query", "--index", str(path), *extra, "q"])


def test_flags_a_bm25_index_ignores_are_named_before_the_device_is_checked(bm25_folder, corpus_file, tmp_path,
                                                                          monkeypatch):
    """--device cuda on a machine without one, beside a BM25 folder, corpus or build: the flag is refused as
    one BM25 ignores (with --device cpu it was refused so, after "use --device cpu"); a dense index
    still has its device checked."""
    def no_gpu(device):
        raise ValueError(f"--device {device}: no GPU here")

    monkeypatch.setattr("searchlite.models.pick_device", no_gpu)
    for argv, refusal in ((["query", "--index", str(bm25_folder)], "holds a bm25 index, which encodes no queries"),
                          (["query", "--corpus", str(corpus_file)], "for a dense retriever, which encodes queries"),
                          (["serve", "--index", str(bm25_folder), "--port", str(free_port())], "holds a bm25 index"),
                          (["build", "--corpus", str(corpus_file), "--out", str(tmp_path / "b")],
                           "not for a bm25 build")):
        with pytest.raises(SystemExit, match="^error: --device: .*" + re.escape(refusal)):
            retrieve.main([*argv, "--device", "cuda", *(["x"] if argv[0] == "query" else [])])
    assert not (tmp_path / "b").exists()
    for argv in (["query", "--corpus", str(corpus_file), "--encoder", "e5", "x"],
                 ["build", "--corpus", str(corpus_file), "--out", str(tmp_path / "d"), "--encoder", "e5"]):
        with pytest.raises(SystemExit, match=r"^error: --device cuda: no GPU here$"):
            retrieve.main([*argv, "--device", "cuda"])
    assert not (tmp_path / "d").exists()


def test_query_of_a_server_prints_the_passages_it_returns(server, capsys):
    """query --url asks the server once, for --k passages, and prints them as a local index's."""
    retrieve.main(["query", "--url", _url(server), "--k", "2", "what causes ocean tides"])
    assert server.requests == [("/retrieve", {"queries": ["what causes ocean tides"], "topk": 2,
                                              "return_scores": True})]
    hits = server.index.search(["what causes ocean tides"], 2)[0]
    assert capsys.readouterr().out.splitlines() == ["query: what causes ocean tides", *printed(hits)]
    assert hits[0].id == "v8"


def test_query_of_a_server_refuses_the_flags_of_a_local_index(server, corpus_file):
    """query --url searches the server's index with the server's encoder: --corpus, --index, --kind and
    the dense flags are named, not dropped, and the server is not asked; --device cuda is named, not
    checked for a GPU."""
    url = _url(server)
    flags = ["--corpus", str(corpus_file), "--index", "/no/such/index", "--kind", "dense", "--encoder", "e5",
             "--pooling", "cls", "--query_prefix", "q: ", "--device", "cuda:7", "--mmap"]
    with pytest.raises(SystemExit, match="^" + re.escape(
            "error: --corpus and --index and --kind and --encoder and --pooling and --query_prefix and --device and "
            "--mmap: "
            f"--url {url} searches the server's own index and encoder; give these to its retrieve.py serve") + "$"):
        retrieve.main(["query", "--url", url, *flags, "tides"])
    with pytest.raises(SystemExit, match=r"^error: --query_prefix: --url "):
        retrieve.main(["query", "--url", url, "--query_prefix", "", "tides"])
    assert server.requests == []


def test_query_of_a_corpus_refuses_the_flags_of_a_dense_index(corpus_file):
    """Over a corpus indexed in memory by BM25, --query_prefix, --pooling (even mean), --device (even
    cpu) and --mmap would be ignored: they are named instead."""
    for flags, named in ((["--query_prefix", "query: "], "--query_prefix"), (["--pooling", "mean"], "--pooling"),
                         (["--mmap"], "--mmap"), (["--device", "cpu"], "--device"), (["--kind", "rank_bm25", "--query_prefix", ""], "--query_prefix")):
        kind = "rank_bm25" if "rank_bm25" in flags else "bm25"
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: {named}: for a dense retriever, which encodes "
                                                             f"queries; --kind {kind} does not") + "$"):
            retrieve.main(["query", "--corpus", str(corpus_file), *flags, "violin"])


# ---------------------------------------------------------------------------- serve


def test_serve_on_a_free_port_passes_its_address_and_default_bounds(monkeypatch, capsys):
    """A free port is not refused; the server gets --host and --port as given and the documented
    defaults (topk 3, 4096 queries a request, 4096 characters a query, a 5 ms batch wait), and the
    address printed is the one it serves."""
    seen, port = _record_serve(monkeypatch), free_port()
    retrieve.main(["serve", "--host", "localhost", "--port", str(port)])
    assert seen == {"host": "localhost", "port": port, "default_topk": 3, "max_queries": 4096,
                    "max_query_chars": 4096, "batch_wait": 0.005}
    assert capsys.readouterr().out.endswith(f"; serving http://localhost:{port}/retrieve (schema at /docs)\n")


@pytest.mark.parametrize("cmd, flag, value, why", [
    ("build", "--shard_size", "0", "must be at least 1"), ("build", "--batch_size", "0", "must be at least 1"),
    ("build", "--max_length", "0", "must be at least 1"), ("serve", "--port", "0", "must be at least 1"),
    ("serve", "--port", "65536", "must be at most 65535"), ("serve", "--max_queries", "0", "must be at least 1"),
    ("serve", "--max_query_chars", "0", "must be at least 1")])
def test_int_flags_refuse_a_value_out_of_range_by_name(monkeypatch, capsys, tmp_path, cmd, flag, value, why):
    monkeypatch.setattr(retrieve, "make", _never_load)
    with pytest.raises(SystemExit) as stopped:
        retrieve.main([cmd, flag, value, *(["--out", str(tmp_path / "never")] if cmd == "build" else [])])
    assert stopped.value.code == 2 and f"argument {flag}: {why}, got {value}" in capsys.readouterr().err


def test_serve_takes_each_bound_at_its_ends(monkeypatch):
    """--topk 1 and 100 (the fewest and the most a request may ask for), --port 1 and 65535, and one
    query of one character a request."""
    seen = _record_serve(monkeypatch)
    monkeypatch.setattr(retrieve, "check_port", lambda host, port: None)
    retrieve.main(["serve", "--topk", "1", "--port", "65535", "--max_queries", "1", "--max_query_chars", "1"])
    assert (seen["default_topk"], seen["port"], seen["max_queries"], seen["max_query_chars"]) == (1, 65535, 1, 1)
    retrieve.main(["serve", "--topk", "100", "--port", "1"])
    assert (seen["default_topk"], seen["port"]) == (100, 1)


def test_serve_takes_a_port_whose_last_server_just_stopped(monkeypatch):
    """A port whose server (listening with SO_REUSEADDR, as uvicorn does) has just stopped, leaving a
    connection in TIME_WAIT, is not refused: a new server may listen there at once."""
    seen = _record_serve(monkeypatch)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = listener.accept()
            conn.close()  # the server's end closes first: it waits in TIME_WAIT
    retrieve.main(["serve", "--port", str(port)])
    assert seen["port"] == port


def test_serve_probes_the_host_it_will_listen_on(monkeypatch):
    """--host 0.0.0.0 (every address) with the port held on 127.0.0.1 is refused naming 0.0.0.0,
    the address uvicorn would fail to listen on."""
    monkeypatch.setattr(retrieve, "make", _never_load)
    with held_port() as port:
        with pytest.raises(SystemExit, match=rf"^error: --host 0\.0\.0\.0 --port {port}: cannot listen there "):
            retrieve.main(["serve", "--host", "0.0.0.0", "--port", str(port)])


def test_serve_prints_an_ipv6_address_in_brackets(monkeypatch, capsys):
    """--host ::1 is served at http://[::1]:PORT/retrieve, the form a URL (and --retriever_url) needs."""
    seen = _record_serve(monkeypatch)
    monkeypatch.setattr(retrieve, "check_port", lambda host, port: None)
    retrieve.main(["serve", "--host", "::1", "--port", "8123"])
    assert seen["host"] == "::1"
    assert capsys.readouterr().out.endswith("; serving http://[::1]:8123/retrieve (schema at /docs)\n")


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_port_taken_tells_a_held_port_from_a_free_one_on_ipv4_and_ipv6(family, host):
    """A host with a colon is bound with an IPv6 socket: an IPv4 one cannot bind '::1' and called every
    port there taken."""
    with socket.socket(family) as held:
        try:
            held.bind((host, 0))
        except OSError:
            pytest.skip(f"no {host} loopback on this machine")
        held.listen()
        port = held.getsockname()[1]
        assert retrieve.port_taken(host, port)  # why: the OS's reason
    assert retrieve.port_taken(host, port) is None


@pytest.mark.parametrize("command, folder", [("build", ""), ("query", "an index folder's, else ")])
def test_the_dense_defaults_in_help_name_an_index_folder_for_query_alone(command, folder, monkeypatch, capsys):
    """`build` makes the folder whose pooling and query prefix `query` then reads: only query's --help
    says the folder's settings come first."""
    from test_readme import help_text

    text = " ".join(help_text(f"retrieve.py {command}", monkeypatch, capsys).split())
    assert f"--pooling {{mean,cls}} dense: pooling (default: {folder}mean, as E5; BGE takes cls)" in text
    assert f"dense: text before each query (default: {folder}by encoder name: 'query: ' for E5)" in text
