"""Retrievers on a hand-written ten-topic corpus: BM25 (both backends), dense with a tiny
random encoder built offline, the HTTP client against a stdlib Search-R1-style server."""

import json
import math
import re
import shutil
import threading
import time
import types
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from conftest import JSONHandler, free_port, save_bag_of_words_bert

from searchlite.data import Passage, passage_to_dict, write_jsonl
from searchlite.indexing import build_dense_folder
from searchlite.retrieval import (BM25Retriever, DenseRetriever, HTTPRetriever, Hit, Retriever, TextEncoder,
                                  build_retriever, config_retriever, default_prefixes, load_index)

CORPUS = [
    Passage("v0", "Volcano", "A volcano is a rupture in the crust where lava, ash and hot gases escape from a magma chamber below the surface."),
    Passage("v1", "Violin", "The violin is a wooden string instrument played with a bow, usually held under the chin in an orchestra."),
    Passage("v2", "Photosynthesis", "Photosynthesis lets green plants turn sunlight, water and carbon dioxide into sugar and oxygen inside chloroplasts."),
    Passage("v3", "Chess", "Chess is a board game for two players who move kings, queens, rooks, bishops, knights and pawns on sixty four squares."),
    Passage("v4", "Penguin", "Penguins are flightless seabirds of the southern hemisphere that swim with flippers and eat krill, squid and fish."),
    Passage("v5", "Bitcoin", "Bitcoin is a decentralized digital currency whose ledger, the blockchain, is maintained by miners solving cryptographic puzzles."),
    Passage("v6", "Pyramids of Giza", "The pyramids of Giza are ancient Egyptian royal tombs built from limestone blocks for pharaohs such as Khufu."),
    Passage("v7", "Insulin", "Insulin is a hormone made by the pancreas that lets cells absorb glucose from the blood; diabetes follows when it fails."),
    Passage("v8", "Tides", "Ocean tides are the rise and fall of sea level caused by the gravitational pull of the moon and the sun."),
    Passage("v9", "Espresso", "Espresso is a concentrated coffee brewed by forcing hot water at high pressure through finely ground beans."),
]

# natural questions: BM25 must match the gold passage's content words
BM25_QUERIES = [
    ("what escapes from a magma chamber during an eruption", "v0"),
    ("which instrument is played with a bow under the chin", "v1"),
    ("how do green plants make sugar from sunlight", "v2"),
    ("which seabirds cannot fly and eat krill", "v4"),
    ("who maintains the blockchain ledger", "v5"),
    ("what does the pancreas make to control blood glucose", "v7"),
    ("what causes ocean tides", "v8"),
]

# a distinctive phrase of the gold passage: a random bag-of-words encoder can only rank by shared words
DENSE_QUERIES = [
    ("lava ash and hot gases escape from a magma chamber", "v0"),
    ("wooden string instrument played with a bow", "v1"),
    ("sunlight water and carbon dioxide into sugar", "v2"),
    ("kings queens rooks bishops knights and pawns", "v3"),
    ("flightless seabirds that swim with flippers", "v4"),
    ("decentralized digital currency blockchain miners", "v5"),
    ("ancient egyptian royal tombs limestone pharaohs", "v6"),
    ("hormone made by the pancreas glucose", "v7"),
    ("rise and fall of sea level moon", "v8"),
    ("concentrated coffee forcing hot water through ground beans", "v9"),
]

LONG_QUERY = "volcano lava " * 900 + "x" * 2000  # ~13,700 characters


def _check_hits(hits, k):
    assert len(hits) <= k
    assert all(isinstance(h, Hit) and type(h.score) is float and type(h.id) is str for h in hits)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert len({h.id for h in hits}) == len(hits)
    by_id = {p.id: p for p in CORPUS}
    assert all((h.title, h.text) == (by_id[h.id].title, by_id[h.id].text) for h in hits)


# ---------------------------------------------------------------------------- base class


class _Spy(Retriever):
    def __init__(self):
        self.calls = []

    def _search_unique(self, queries, k):
        self.calls.append(list(queries))
        return [[Hit(q, "", "", float(i))] for i, q in enumerate(queries)]


def test_duplicate_queries_searched_once_and_aligned():
    spy = _Spy()
    out = spy.search(["a", "b", "a", "c", "b", "a"], k=3)
    assert spy.calls == [["a", "b", "c"]]
    assert [hits[0].id for hits in out] == ["a", "b", "a", "c", "b", "a"]
    out[0].append("junk")  # each position gets its own list
    assert len(out[2]) == 1


def test_search_rejects_bad_arguments():
    with pytest.raises(TypeError, match="takes a list of queries, not a single string"):
        _Spy().search("one string", k=3)
    with pytest.raises(ValueError, match="k must be"):
        _Spy().search(["q"], k=0)
    with pytest.raises(ValueError, match="k must be a positive integer, got True"):
        _Spy().search(["q"], k=True)


def test_a_retriever_of_ones_own_must_answer_each_distinct_query_once():
    """A subclass (a user's own retriever) that drops a query's list is an error naming the subclass and
    the counts, not a bare KeyError of a query; one without `_search_unique` says so (without either
    raise, test_retrieval passed)."""
    short = _Spy()
    short._search_unique = lambda queries, k: [[]] * (len(queries) - 1)
    with pytest.raises(RuntimeError, match="_Spy returned 1 result lists for 2 queries"):
        short.search(["a", "b", "a"], k=3)

    class Bare(Retriever):
        pass

    with pytest.raises(NotImplementedError):
        Bare().search(["a"], k=1)


def test_bm25_dedup_through_real_retriever():
    r = BM25Retriever(CORPUS)
    seen = []
    orig = r._search_unique
    r._search_unique = lambda qs, k: seen.append(list(qs)) or orig(qs, k)
    qs = ["what causes ocean tides", "what causes ocean tides", "who maintains the blockchain ledger"]
    out = r.search(qs, k=2)
    assert seen == [[qs[0], qs[2]]]
    assert out[0] == out[1] and out[0][0].id == "v8" and out[2][0].id == "v5"


# ---------------------------------------------------------------------------- BM25


@pytest.fixture(scope="module", params=["bm25s", "rank_bm25"])
def bm25(request):
    return BM25Retriever(CORPUS, backend=request.param)


def test_bm25_gold_first(bm25):
    out = bm25.search([q for q, _ in BM25_QUERIES], k=3)
    for (q, gold), hits in zip(BM25_QUERIES, out):
        _check_hits(hits, 3)
        assert hits[0].id == gold, (q, [h.id for h in hits])
        assert hits[0].score > 0


def test_bm25_k_larger_than_corpus_and_only_matching_passages(bm25):
    [hits] = bm25.search(["hot water"], k=100)  # "hot" in v0 and v9, "water" in v2 and v9
    _check_hits(hits, 100)
    assert hits[0].id == "v9" and {h.id for h in hits} == {"v0", "v2", "v9"}


def test_bm25_empty_unknown_and_long_queries_do_not_raise(bm25):
    out = bm25.search(["", "   ", "zzzz qqqq", "the and of", LONG_QUERY, "?!"], k=3)
    assert out[:4] == [[], [], [], []]  # nothing shares a term (stopwords are dropped)
    assert out[4][0].id == "v0"
    assert out[5] == []


def test_bm25_a_term_in_half_the_passages_still_finds_them(bm25):
    """rank_bm25's idf of a term in 2 of 4 passages is 0: those passages still share it, so they
    are hits (with bm25s, whose idf stays positive, they were all along)."""
    passages = [Passage(str(i), "", text) for i, text in
                enumerate(["paris is big", "paris is old", "lyon is small", "rome is far"])]
    retriever = BM25Retriever(passages, backend=bm25.backend)
    assert [{h.id for h in hits} for hits in retriever.search(["paris", "old paris"], k=3)] == [{"0", "1"}, {"0", "1"}]
    assert retriever.search(["old paris"], k=3)[0][0].id == "1"


@pytest.mark.parametrize("backend", ["bm25s", "rank_bm25"])
def test_a_last_passage_without_an_indexable_term_is_indexed_and_never_found(backend):
    """Stopwords and punctuation alone, last in the corpus: its count of distinct terms is zero (with
    the bincount's minlength dropped, the index's arrays did not match and it failed to build; that
    passed test_retrieval, test_retrieval_scale, test_retrieve and test_server, which have no such
    passage)."""
    r = BM25Retriever(CORPUS + [Passage("e", "The", "Of the ...")], backend)
    out = r.search([q for q, _ in BM25_QUERIES] + ["the"], 20)
    assert [hits[0].id for hits in out[:-1]] == [gold for _, gold in BM25_QUERIES] and out[-1] == []
    assert "e" not in {h.id for hits in out for h in hits}


@pytest.mark.parametrize("backend", ["bm25s", "rank_bm25"])
def test_bm25_ties_come_in_corpus_order(backend):
    """Passages that score the same are ranked in corpus order, however many tie (numpy's default
    sort does not keep ties in order among several scores: with rank_bm25's stable sort dropped, it
    passed test_retrieval, test_retrieval_scale, test_retrieve and test_server)."""
    texts = ["The tide rises.", "The tide, the tide rises.", "Tide after tide after tide rises."]
    passages = [Passage(str(i), "Sea", texts[i * 7 % 3]) for i in range(90)] + CORPUS
    hits = BM25Retriever(passages, backend).search(["tide"], 90)[0]
    score = {passages[int(h.id)].text: h.score for h in hits}  # a text's score, the same for each copy
    assert len(hits) == 90 and len(set(score.values())) == 3
    assert [int(h.id) for h in hits] == sorted(range(90), key=lambda i: -score[passages[i].text])  # (stable)


def test_bm25_backends_agree_on_ranking():
    a, b = BM25Retriever(CORPUS, "bm25s"), BM25Retriever(CORPUS, "rank_bm25")
    qs = [q for q, _ in BM25_QUERIES]
    assert [[h.id for h in hs][:1] for hs in a.search(qs, 3)] == [[h.id for h in hs][:1] for hs in b.search(qs, 3)]


def test_bm25_rejects_unknown_backend_and_empty_corpus():
    with pytest.raises(ValueError, match="rank_bm25"):
        BM25Retriever(CORPUS, backend="lucene")
    with pytest.raises(ValueError, match="BM25Retriever needs at least one passage"):
        BM25Retriever([])
    from searchlite.bm25 import build_bm25

    for batches in ([], [(0, [])]):  # the index builder, called alone: no batch, or batches with no passage
        with pytest.raises(ValueError, match="a BM25 index needs at least one passage"):
            build_bm25(batches, progress=False)


def test_rank_bm25_scores_with_the_given_k1_and_b_by_hand():
    """rank_bm25's Okapi term score idf * tf (k1 + 1) / (tf + k1 (1 - b + b |d| / avgdl)), idf =
    ln((N - df + 0.5) / (df + 0.5)); k1 and b as given (Pyserini's 0.9 / 0.4), not the package's."""
    # tokens: [apple banana], [apple apple cherry date], [cherry], [elder fig grape]: avgdl 2.5, N 4
    passages = [Passage(str(i), "", t) for i, t in
                enumerate(["apple banana", "apple apple cherry date", "cherry", "elder fig grape"])]
    idf = math.log((4 - 1 + 0.5) / (1 + 0.5))  # banana, date: one passage each
    for k1, b in ((1.5, 0.75), (0.9, 0.4)):
        [hits] = BM25Retriever(passages, backend="rank_bm25", k1=k1, b=b).search(["banana date"], k=3)
        want = {str(i): idf * (k1 + 1) / (1 + k1 * (1 - b + b * dl / 2.5)) for i, dl in ((0, 2), (1, 4))}
        assert [h.id for h in hits] == ["0", "1"]
        assert {h.id: h.score for h in hits} == pytest.approx(want, rel=1e-9)


def test_a_bm25_index_of_another_size_or_of_two_builds_is_refused(tmp_path):
    """Hits would point at other passages, or past the corpus's end."""
    from searchlite.bm25 import BM25Index

    index = BM25Retriever(CORPUS).index
    with pytest.raises(ValueError, match=f"BM25 index holds {len(CORPUS)} passages but there are 3"):
        BM25Retriever(CORPUS[:3], index=index)
    for names in (["indices.csc.index.npy"], ["indices.csc.index.npy", "data.csc.index.npy"]):
        index.save(tmp_path)  # posting arrays that do not fit the offsets: files of another build
        for name in names:
            np.save(tmp_path / name, np.load(tmp_path / name)[:-1])
        with pytest.raises(ValueError, match="the BM25 index files do not fit together"):
            BM25Index.load(tmp_path)


# ---------------------------------------------------------------------------- dense


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    """A random bag-of-words BERT over the test vocabulary (conftest.save_bag_of_words_bert),
    saved twice: the second name selects E5's prefixes."""
    texts = [p.title + " " + p.text for p in CORPUS] + [q for q, _ in DENSE_QUERIES] + ['" query : passage']
    root = tmp_path_factory.mktemp("encoders")
    for name in ("tiny-bert", "tiny-e5-bert"):
        save_bag_of_words_bert(texts, root / name, hidden=128)
    return root


@pytest.fixture(scope="module")
def dense(encoder_dir):
    return DenseRetriever(CORPUS, str(encoder_dir / "tiny-bert"), batch_size=3, max_length=48)


def test_the_retrievers_called_from_code_refuse_what_they_cannot_do(encoder_dir, tmp_path):
    """The commands check these first; code that builds a retriever itself gets a message naming what
    is wrong (without each raise, test_retrieval and test_retrieval_scale passed)."""
    encoder = str(encoder_dir / "tiny-bert")
    with pytest.raises(ValueError, match="retriever kind 'bm25' needs a corpus"):
        build_retriever("bm25", None)
    with pytest.raises(ValueError, match=r"retriever kind 'dense' needs encoder= \(or index= a saved folder\)"):
        build_retriever("dense", CORPUS)
    with pytest.raises(ValueError, match="DenseRetriever needs at least one passage"):
        DenseRetriever([], encoder)
    with pytest.raises(FileNotFoundError, match=f"no FAISS index file at {re.escape(str(tmp_path / 'e5.index'))}"):
        DenseRetriever(CORPUS, encoder, index=str(tmp_path / "e5.index"))
    with pytest.raises(ValueError, match="unknown pooling 'max'; valid: 'mean', 'cls'"):
        TextEncoder(encoder, pooling="max")
    with pytest.raises(ValueError, match="only the 'bm25s' backend saves an index"):
        BM25Retriever(CORPUS, backend="rank_bm25").save(tmp_path / "index")
    assert not (tmp_path / "index").exists()


def test_dense_gold_first(dense):
    out = dense.search([q for q, _ in DENSE_QUERIES], k=3)
    for (q, gold), hits in zip(DENSE_QUERIES, out):
        _check_hits(hits, 3)
        assert hits[0].id == gold, (q, [(h.id, h.score) for h in hits])
        assert hits[0].score > hits[1].score + 1e-3


def test_dense_padding_does_not_change_embeddings(dense):
    short, long = "violin bow", CORPUS[0].text
    alone = dense.encode([short])
    batched = dense.encode([long, short, short + " chin"])
    np.testing.assert_allclose(batched[1], alone[0], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)


def test_dense_long_empty_and_large_k(dense):
    out = dense.search(["", LONG_QUERY, "violin"], k=50)
    for hits in out:
        _check_hits(hits, 50)
        assert len(hits) == len(CORPUS)


def test_no_queries_get_no_hits_and_no_search(dense, server):
    """An empty list of queries is answered at once by each kind, with no search (without its check, the
    dense retriever encoded none and handed FAISS no array); the client posts no request."""
    assert dense.search([], k=3) == [] and BM25Retriever(CORPUS).search([], k=3) == []
    assert HTTPRetriever(_url(server)).search([], k=3) == [] and server.requests == []


def test_encoding_the_passages_shows_one_bar_that_reaches_their_count(encoder_dir, monkeypatch):
    """A corpus of _SHOW_PROGRESS passages or more (10,000) shows its encoding on a bar, ticked per batch."""
    import tqdm.auto
    from conftest import recording_bars

    encoder = TextEncoder(str(encoder_dir / "tiny-bert"), batch_size=3, max_length=48)  # (its loading has bars too)
    monkeypatch.setattr("searchlite.retrieval._SHOW_PROGRESS", len(CORPUS))
    bars = recording_bars(monkeypatch, tqdm.auto)
    DenseRetriever(CORPUS, encoder)
    [bar] = bars
    assert bar.kw["total"] == bar.ticks == len(CORPUS) and not bar.kw["disable"] and bar.closed


def test_dense_cls_pooling_matches_manual_computation(encoder_dir):
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = str(encoder_dir / "tiny-bert")
    r = DenseRetriever(CORPUS, path, pooling="cls", batch_size=4)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()

    def cls(text):
        with torch.no_grad():
            h = model(**tok([text], return_tensors="pt")).last_hidden_state[0, 0]  # (H,)
        return (h / h.norm()).numpy()

    q = "wooden string instrument"
    expected = np.array([cls(p.contents) @ cls(q) for p in CORPUS])  # (N,)
    [hits] = r.search([q], k=4)
    assert [h.id for h in hits] == [CORPUS[i].id for i in np.argsort(-expected)[:4]]
    np.testing.assert_allclose([h.score for h in hits], np.sort(expected)[::-1][:4], atol=1e-5)


def test_dense_prefixes_from_name_and_used(encoder_dir):
    r = DenseRetriever(CORPUS[:3], str(encoder_dir / "tiny-e5-bert"))
    assert (r.query_prefix, r.passage_prefix) == ("query: ", "passage: ")
    stored = r.index.reconstruct_n(0, 3)  # (3, H)
    np.testing.assert_allclose(stored, r.encode(["passage: " + p.contents for p in CORPUS[:3]]), atol=1e-6)
    assert not np.allclose(stored, r.encode([p.contents for p in CORPUS[:3]]), atol=1e-3)
    [hits] = r.search(["violin"], k=1)
    assert hits[0].score == pytest.approx(float(r.encode(["query: violin"])[0] @ stored[1]), abs=1e-5)
    assert default_prefixes("BAAI/bge-base-en-v1.5") == ("Represent this sentence for searching relevant passages: ", "")


def test_dense_save_load_round_trip(dense, tmp_path):
    dense.save(tmp_path / "idx")
    assert json.loads((tmp_path / "idx" / "dense.json").read_text())["pooling"] == "mean"
    loaded = DenseRetriever.load(tmp_path / "idx", CORPUS, batch_size=3)
    qs = [q for q, _ in DENSE_QUERIES]
    assert loaded.search(qs, 4) == dense.search(qs, 4)
    # another batch size changes float rounding only
    via_factory = build_retriever("dense", CORPUS, index=str(tmp_path / "idx"), batch_size=64)
    for a, b in zip(via_factory.search(qs, 4), dense.search(qs, 4)):
        assert [h.id for h in a] == [h.id for h in b]
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-6)
    with pytest.raises(ValueError, match="different corpus"):
        DenseRetriever.load(tmp_path / "idx", CORPUS[::-1])


def test_a_saved_folder_restores_its_query_prefix_pooling_and_max_length(encoder_dir, tmp_path):
    r = DenseRetriever(CORPUS, str(encoder_dir / "tiny-bert"), pooling="cls", query_prefix="query: ", max_length=8)
    r.save(tmp_path / "idx")
    loaded = load_index(tmp_path / "idx", CORPUS)
    assert (loaded.query_prefix, loaded.text_encoder.pooling, loaded.text_encoder.max_length) == ("query: ", "cls", 8)
    qs = [q for q, _ in DENSE_QUERIES]
    assert loaded.search(qs, 3) == r.search(qs, 3)


def test_a_sharded_build_keeps_vector_i_for_passage_i_and_its_prefixes(encoder_dir, tmp_path):
    """Shards are added in corpus order, each passage encoded with the passage prefix given, and
    the folder keeps the query prefix given (the encoder's name selects none of its own)."""
    enc = str(encoder_dir / "tiny-bert")
    write_jsonl(tmp_path / "c.jsonl", map(passage_to_dict, CORPUS))
    for prefix in ("", "passage: "):
        out = tmp_path / f"idx{len(prefix)}"
        r = build_dense_folder(tmp_path / "c.jsonl", out, enc, shard_size=3, max_length=48, progress=False,
                               query_prefix=prefix.replace("passage", "query") or None, passage_prefix=prefix or None)
        want = TextEncoder(enc, max_length=48).encode([prefix + p.contents for p in CORPUS])
        np.testing.assert_allclose(r.index.reconstruct_n(0, len(CORPUS)), want, atol=1e-6)
        assert load_index(out).query_prefix == prefix.replace("passage", "query")
    own = load_index(tmp_path / "idx0").search([p.contents for p in CORPUS], 1)
    assert [hits[0].id for hits in own] == [p.id for p in CORPUS]


@pytest.mark.parametrize("changed, field", [({"passage_prefix": "passage: "}, "passage_prefix"),
                                            ({"max_length": 16}, "max_length"), ({"pooling": "cls"}, "pooling"),
                                            ({"corpus_path": "copy"}, "corpus"),
                                            ({"corpus_path": "edited"},  # (a coarse clock may keep the time)
                                             "corpus_bytes, (?:corpus_mtime_ns, )?num_passages")])
def test_kept_shards_of_other_settings_or_another_corpus_are_refused(encoder_dir, tmp_path, changed, field):
    """Shards encoded one way would be joined with shards encoded another, under one dense.json; or
    shards of one corpus file under another's passages, or of the file before an edit (the pooling,
    the corpus path, its size and its passage count each dropped from the manifest, test_retrieval,
    test_retrieval_scale, test_retrieve and test_server passed)."""
    write_jsonl(tmp_path / "c.jsonl", map(passage_to_dict, CORPUS))
    kw = dict(max_length=48, keep_shards=True, progress=False)
    build_dense_folder(tmp_path / "c.jsonl", tmp_path / "idx", str(encoder_dir / "tiny-bert"), **kw)
    corpus = tmp_path / "c.jsonl"
    if changed.get("corpus_path") == "copy":  # the same bytes and modification time, at another path
        corpus = Path(shutil.copy2(corpus, tmp_path / "d.jsonl"))
    elif changed.get("corpus_path") == "edited":  # one passage more, in place
        write_jsonl(corpus, map(passage_to_dict, CORPUS + [Passage("x", "Extra", "One passage more.")]))
    changed = {k: v for k, v in changed.items() if k != "corpus_path"}
    with pytest.raises(ValueError, match=rf"shards holds a build with other settings \({field} differ\)"):
        build_dense_folder(corpus, tmp_path / "idx", str(encoder_dir / "tiny-bert"), **kw | changed)


def test_an_encoder_without_a_pad_token_pads_with_its_unk_token(encoder_dir, tmp_path):
    """Decoder-style encoders ship without a pad token: a batch must still pad, and the mask keep
    the padding out of the mean."""
    import shutil

    path = tmp_path / "no-pad"
    shutil.copytree(encoder_dir / "tiny-bert", path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).exists():
            cfg = json.loads((path / name).read_text())
            cfg.pop("pad_token", None)
            (path / name).write_text(json.dumps(cfg))
    te = TextEncoder(str(path), max_length=48)
    assert te.tokenizer.pad_token == te.tokenizer.unk_token
    short = "string instrument"
    np.testing.assert_allclose(te.encode([CORPUS[1].contents, short])[1], te.encode([short])[0], atol=1e-6)


# ---------------------------------------------------------------------------- HTTP


class _SearchR1Handler(JSONHandler):
    """Search-R1's /retrieve over a BM25 "index"; `fail_first` answers `fail_code` (500) that many times."""

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.requests.append((self.path, body))
        time.sleep(srv.delays.pop(0) if srv.delays else 0)
        if srv.status != 200 or srv.fail_first > 0:
            srv.fail_first -= 1
            return self.send_json(srv.status if srv.status != 200 else srv.fail_code, {"detail": "boom"})
        if isinstance(srv.reply, bytes):  # a page that is not JSON
            self.send_response(200)
            self.send_header("Content-Length", str(len(srv.reply)))
            self.end_headers()
            return self.wfile.write(srv.reply)
        if srv.reply is not None:  # a server of another shape
            return self.send_json(200, srv.reply)
        result = []
        for hits in srv.index.search(body["queries"], body["topk"]):
            docs = [{"id": h.id, "contents": Passage(h.id, h.title, h.text).contents} for h in hits]
            if body.get("return_scores") and srv.wrap:
                result.append([{"document": d, "score": h.score} for d, h in zip(docs, hits)])
            else:
                result.append(docs)
        self.send_json(200, {"result": result})


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SearchR1Handler)
    srv.index, srv.requests, srv.fail_first, srv.status, srv.wrap = BM25Retriever(CORPUS), [], 0, 200, True
    srv.delays, srv.reply = [], None  # seconds each next request waits before its answer; a fixed reply
    srv.fail_code = 500
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv):
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_http_client_parses_search_r1_reply(server):
    qs = ["what causes ocean tides", "who maintains the blockchain ledger", "what causes ocean tides"]
    out = HTTPRetriever(_url(server) + "/").search(qs, k=2)
    assert out == server.index.search(qs, 2)  # ids, titles, texts and scores survive the trip
    assert server.requests == [("/retrieve", {"queries": qs[:2], "topk": 2, "return_scores": True})]
    assert HTTPRetriever(_url(server) + "/retrieve").search(qs[:1], k=1)[0][0].id == "v8"
    assert server.requests[-1][0] == "/retrieve"  # a URL that ends in /retrieve is posted to as given


def test_http_client_keeps_the_first_k_of_a_longer_reply(server):
    """A server that ignores topk (sends its 5 best for k = 2): the passages past k would lengthen
    every observation."""
    docs = [{"document": {"id": f"d{i}", "contents": f'"T{i}"\nText {i}.'}, "score": 5.0 - i} for i in range(5)]
    server.reply = {"result": [docs]}
    [hits] = HTTPRetriever(_url(server)).search(["q"], k=2)
    assert [h.id for h in hits] == ["d0", "d1"]


def test_http_client_accepts_bare_documents(server):
    server.wrap = False
    [hits] = HTTPRetriever(_url(server)).search(["what causes ocean tides"], k=2)
    assert [(h.id, h.title, h.score) for h in hits][0] == ("v8", "Tides", 0.0)
    # title and text fields in place of Search-R1's contents: each read as it is
    server.reply = {"result": [[{"document": {"id": "7", "title": "Paris", "text": "The capital."}, "score": 2.0}]]}
    assert HTTPRetriever(_url(server)).search(["q"], k=1) == [[Hit("7", "Paris", "The capital.", 2.0)]]


@pytest.mark.parametrize("result, message", [
    ([[{"doc": {"id": "7", "contents": '"Paris"\nCapital.'}}]], "a result item is not a document with 'contents'"),
    ([[{"document": {"id": "7", "body": "Capital."}, "score": 1.0}]], "not a document with 'contents'"),
    ([["Paris is the capital"]], 'not a document .*: "Paris is the capital"'),
    ([[{"document": {"contents": "x"}, "score": "high"}]], "could not convert string to float"),
    ([[{"document": {"title": None, "text": "x"}}]], "'title' and 'text'\\) strings"),  # was the title 'None'
    ([None], "answered query 'q' with null, not a list of documents"),
    ([], r"sent no 'result' list for 1 queries: \{'result': \[\]\}"),  # a list, but not one a query
])
def test_http_client_names_the_server_of_a_reply_it_cannot_read(server, result, message):
    """Items of another shape were empty passages ('Doc 1(Title: ) ') or a bare AttributeError."""
    server.reply = {"result": result}
    with pytest.raises(RuntimeError, match=f"retrieval server http://127.0.0.1:\\d+/retrieve.*{message}"):
        HTTPRetriever(_url(server), retries=0).search(["q"], k=1)


def test_http_client_names_a_reply_that_is_no_json_object(server):
    """A reply that is a JSON list (a result list without its {"result": ...}) was a bare AttributeError."""
    server.reply = [[]]
    with pytest.raises(RuntimeError, match=r"retrieval server http://127.0.0.1:\d+/retrieve sent no 'result' list "
                                           r"for 1 queries: \[\[\]\]"):
        HTTPRetriever(_url(server), retries=0).search(["q"], k=1)


def test_http_client_retries_server_errors(server, monkeypatch):
    """Each retry waits twice as long as the one before: 0.5 s, then 1 s with a 0.5 s backoff."""
    waits = []
    clock = types.SimpleNamespace(sleep=waits.append, monotonic=time.monotonic)
    monkeypatch.setattr("searchlite.retrieval.time", clock)
    server.fail_first = 2
    out = HTTPRetriever(_url(server), retries=3, backoff=0.5).search(["what causes ocean tides"], k=1)
    assert out[0][0].id == "v8" and len(server.requests) == 3 and waits == [0.5, 1.0]


def test_http_client_retries_a_429(server):
    """429 Too Many Requests is the server asking to come back later, not a bad request."""
    server.fail_first, server.fail_code = 1, 429
    out = HTTPRetriever(_url(server), retries=2, backoff=0.01).search(["what causes ocean tides"], k=1)
    assert out[0][0].id == "v8" and len(server.requests) == 2


def test_http_client_splits_queries_into_requests_of_max_queries(server):
    qs = [q for q, _ in BM25_QUERIES[:5]]
    assert HTTPRetriever(_url(server), max_queries=2).search(qs, k=2) == server.index.search(qs, 2)
    assert [body["queries"] for _, body in server.requests] == [qs[0:2], qs[2:4], qs[4:5]]


def test_http_client_gives_up_with_clear_error(server):
    server.fail_first = 10
    with pytest.raises(RuntimeError, match=r"/retrieve failed after 3 attempt\(s\): HTTP 500"):
        HTTPRetriever(_url(server), retries=2, backoff=0.01).search(["q"], k=1)
    assert len(server.requests) == 3


def test_http_client_does_not_retry_client_errors(server):
    server.status = 422
    with pytest.raises(RuntimeError, match="HTTP 422"):
        HTTPRetriever(_url(server), retries=3, backoff=0.01).search(["q"], k=1)
    assert len(server.requests) == 1


def test_http_client_waits_twice_as_long_for_a_slow_server(server):
    """A timed-out request is still being searched: it is asked again with twice the timeout,
    and the error, if it comes to that, says the server is slow, not that it is not running."""
    server.delays = [0.45, 0.45]  # over 0.4 s by the sleep alone; 0.35 s to spare under 0.8 s for a loaded machine
    out = HTTPRetriever(_url(server), timeout=0.4, retries=1, backoff=0.01).search(["what causes ocean tides"], k=1)
    assert out[0][0].id == "v8" and len(server.requests) == 2  # 0.4 s was too short, 0.8 s was not
    server.delays = [0.6, 0.6]
    with pytest.raises(RuntimeError, match=r"no answer within 0\.2s .*did not answer in time") as err:
        HTTPRetriever(_url(server), timeout=0.1, retries=1, backoff=0.01).search(["q"], k=1)
    assert "Is the server running" not in str(err.value)


def test_http_client_needs_a_url_scheme():
    with pytest.raises(ValueError, match=re.escape("'localhost:8000' needs its scheme, e.g. http://localhost:8000")):
        HTTPRetriever("localhost:8000")


def test_http_client_dead_port():
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    with pytest.raises(RuntimeError, match=re.escape(url)):
        HTTPRetriever(url, timeout=1.0, retries=2, backoff=0.01).search(["q"], k=3)


# ---------------------------------------------------------------------------- factory


def test_build_retriever(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", map(passage_to_dict, CORPUS))
    for kind, backend in (("bm25", "bm25s"), ("rank_bm25", "rank_bm25")):  # (the backend dropped, it passed)
        r = build_retriever(kind, str(tmp_path / "c.jsonl"))
        assert r.backend == backend and r.search(["what causes ocean tides"], 1)[0][0].id == "v8"
    assert isinstance(build_retriever("http", url="http://localhost:8000"), HTTPRetriever)
    with pytest.raises(ValueError, match="bm25, rank_bm25, dense, http"):
        build_retriever("elastic", str(tmp_path / "c.jsonl"))
    with pytest.raises(ValueError, match="url"):
        build_retriever("http")
    build_retriever("bm25", str(tmp_path / "c.jsonl")).save(tmp_path / "idx")
    assert build_retriever("bm25", index=str(tmp_path / "idx")).search(["what causes ocean tides"], 1)[0][0].id == "v8"
    with pytest.raises(ValueError, match="kind 'rank_bm25' builds its BM25 in memory"):  # it read the bm25s index
        build_retriever("rank_bm25", index=str(tmp_path / "idx"))
    with pytest.raises(ValueError, match="holds a bm25 index, not a dense one"):  # (load_index's kind= dropped,
        build_retriever("dense", index=str(tmp_path / "idx"))  # it loaded the BM25 folder and passed)
    with pytest.raises(ValueError, match="encoder"):
        build_retriever("dense", CORPUS)
    # an encoder or pooling for a retriever that encodes no queries, or an index for a server, was ignored
    for kind, kw, error in (("bm25", {"encoder": "e5"}, "encoder 'e5': only a dense retriever encodes queries"),
                            ("bm25", {"index": str(tmp_path / "idx"), "pooling": "cls"}, "pooling 'cls': only a dense"),
                            ("rank_bm25", {"encoder": "e5", "pooling": "cls"}, "encoder 'e5' and pooling 'cls': only"),
                            ("http", {"url": "http://localhost:8000", "encoder": "e5"}, "not retriever kind 'http'"),
                            ("http", {"url": "http://localhost:8000", "index": "idx"}, "index idx: a server searches "
                                                                                      "its own index")):
        with pytest.raises(ValueError, match=error):
            build_retriever(kind, str(tmp_path / "c.jsonl"), **kw)


def test_config_retriever_follows_the_run_config(tmp_path, server):
    from types import SimpleNamespace

    from searchlite.config import ConfigError

    write_jsonl(tmp_path / "c.jsonl", map(passage_to_dict, CORPUS))
    cfg = SimpleNamespace(retriever="bm25", corpus=str(tmp_path / "c.jsonl"), encoder="", pooling="mean", index="",
                          retriever_url="", topk=5)
    assert config_retriever(cfg).search(["what causes ocean tides"], 1)[0][0].id == "v8"
    http = config_retriever(SimpleNamespace(**{**vars(cfg), "retriever": "http", "corpus": "missing.jsonl",
                                               "retriever_url": _url(server)}))
    assert isinstance(http, HTTPRetriever) and http.url == _url(server) + "/retrieve"  # the corpus is not read
    assert server.requests == [("/retrieve", {"queries": ["test"], "topk": 5, "return_scores": True})]  # the probe,
    # at the run's topk: a server that refuses it is named before a model loads
    server.fail_first = 1  # one failure: the probe does not retry, so a server that is down is named at once
    with pytest.raises(ConfigError, match=re.escape(f"--retriever_url {_url(server)}: the retrieval server does "
                                                    "not answer") + r".*HTTP 500"):
        config_retriever(SimpleNamespace(**{**vars(cfg), "retriever": "http", "retriever_url": _url(server)}))



def test_config_retriever_gives_a_silent_server_one_wait_of_10_s(monkeypatch):
    """A server that takes the request and never answers is named after one wait of 10 s, as check_server
    says (the client's own default is 30 s a try)."""
    from types import SimpleNamespace

    from searchlite.config import ConfigError

    def urlopen(req, timeout):
        waits.append(timeout)
        raise TimeoutError("timed out")

    waits = []
    monkeypatch.setattr("urllib.request.urlopen", urlopen)
    cfg = SimpleNamespace(retriever="http", retriever_url="http://127.0.0.1:9", topk=3)
    with pytest.raises(ConfigError, match=r"failed after 1 attempt\(s\): no answer within 10s"):
        config_retriever(cfg)
    assert waits == [10]


def test_config_retriever_builds_a_dense_retriever_with_the_runs_pooling(tmp_path, encoder_dir):
    """train.py's --pooling cls reaches the encoder (dropped from config_retriever, the run encoded
    with mean pooling and passed test_retrieval, test_retrieval_scale, test_retrieve and test_server)."""
    from types import SimpleNamespace

    write_jsonl(tmp_path / "c.jsonl", map(passage_to_dict, CORPUS))
    for pooling in ("cls", "mean"):
        cfg = SimpleNamespace(retriever="dense", corpus=str(tmp_path / "c.jsonl"), pooling=pooling,
                              encoder=str(encoder_dir / "tiny-bert"), index="", retriever_url="", topk=3)
        assert config_retriever(cfg).text_encoder.pooling == pooling
    # an index folder of cls-pooled vectors, with the run's default pooling (mean, "the folder's"): cls
    DenseRetriever(CORPUS, str(encoder_dir / "tiny-bert"), pooling="cls", max_length=48).save(tmp_path / "cls")
    cfg = SimpleNamespace(retriever="dense", corpus=str(tmp_path / "c.jsonl"), pooling="mean", encoder="",
                          index=str(tmp_path / "cls"), retriever_url="", topk=3)
    assert config_retriever(cfg).text_encoder.pooling == "cls"


def test_an_index_folder_reads_the_corpus_it_was_built_from(tmp_path):
    """--index alone: the folder's own corpus, not the default toy one (which the folder refuses);
    --corpus naming another still wins; a FAISS file is only for a dense retriever."""
    from types import SimpleNamespace

    from searchlite.config import TOY_DIR, Config
    from searchlite.indexing import build_bm25_folder

    write_jsonl(tmp_path / "c.jsonl", map(passage_to_dict, CORPUS))
    build_bm25_folder(str(tmp_path / "c.jsonl"), str(tmp_path / "idx"), progress=False)
    cfg = SimpleNamespace(retriever="bm25", corpus=Config.corpus, encoder="", pooling="mean",
                          index=str(tmp_path / "idx"), retriever_url="", topk=3)
    assert config_retriever(cfg).search(["what causes ocean tides"], 1)[0][0].id == "v8"
    with pytest.raises(ValueError, match="built over a different corpus"):  # the toy corpus, named on purpose
        config_retriever(SimpleNamespace(**{**vars(cfg), "corpus": str(TOY_DIR / "corpus.jsonl")}))
    (tmp_path / "e5_Flat.index").write_bytes(b"\0")
    with pytest.raises(ValueError, match="FAISS file .* needs retriever kind 'dense'"):
        config_retriever(SimpleNamespace(**{**vars(cfg), "index": str(tmp_path / "e5_Flat.index")}))


def test_an_index_folder_whose_corpus_is_gone_names_it_and_another_corpus_keeps_its_offsets_cache(tmp_path):
    """The corpus a folder recorded, moved away: the error names it and --corpus. A corpus passed
    beside the folder is scanned on its own: the folder's offsets cache, for its own corpus, stays."""
    from searchlite.indexing import build_bm25_folder

    built, other, idx = tmp_path / "c.jsonl", tmp_path / "other.jsonl", tmp_path / "idx"
    write_jsonl(built, map(passage_to_dict, CORPUS))
    build_bm25_folder(str(built), str(idx), progress=False)
    assert load_index(idx).search(["what causes ocean tides"], 1)[0][0].id == "v8"
    cache = idx / "corpus_offsets.npz"
    before = cache.read_bytes()
    other.write_text("\n" + built.read_text())  # the same passages a line lower: other offsets
    assert load_index(idx, str(other)).search(["what causes ocean tides"], 1)[0][0].id == "v8"
    assert cache.read_bytes() == before
    built.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{idx} was built from corpus {str(built)!r}, which is not "
                                                          "there; pass the corpus (--corpus)")):
        load_index(idx)


def test_search_takes_any_iterable_of_queries_and_numpy_k():
    """A generator was read twice: the second time empty, so search() returned []."""
    spy = _Spy()
    assert [h[0].id for h in spy.search((q for q in ["a", "b", "a"]), k=np.int64(2))] == ["a", "b", "a"]


def test_http_client_names_the_server_of_a_reply_that_is_not_utf8(server):
    """A proxy's latin-1 page raised a bare UnicodeDecodeError that named no server."""
    server.reply = "caf\u00e9 page".encode("latin-1")
    with pytest.raises(RuntimeError, match=r"retrieval server http://127.0.0.1:\d+/retrieve sent invalid JSON"):
        HTTPRetriever(_url(server), retries=0).search(["q"], k=1)


def test_config_retriever_names_an_encoder_that_does_not_load(tmp_path):
    """A run with a mistyped --encoder ended in a traceback from transformers."""
    from types import SimpleNamespace

    from searchlite.config import ConfigError

    write_jsonl(tmp_path / "c.jsonl", map(passage_to_dict, CORPUS))
    cfg = SimpleNamespace(retriever="dense", corpus=str(tmp_path / "c.jsonl"), encoder=str(tmp_path / "no" / "enc"),
                          pooling="mean", index="", retriever_url="", topk=3)
    with pytest.raises(ConfigError, match="^" + re.escape(f"encoder '{tmp_path / 'no' / 'enc'}': no such folder")):
        config_retriever(cfg)


def test_a_folder_that_is_not_an_encoder_is_named_in_one_line(tmp_path):
    """A folder without config.json says so; one whose tokenizer cannot load gives transformers' reason on
    one line (it was five, and named neither the encoder nor its folder)."""
    enc = tmp_path / "enc"
    enc.mkdir()
    with pytest.raises(ValueError, match="^" + re.escape(f"encoder '{enc}': no config.json in that folder; expected "
                                                         "a Hugging Face encoder folder") + ".*e5-base-v2$"):
        TextEncoder(str(enc))
    with pytest.raises(ValueError, match="^" + re.escape(f"encoder '{tmp_path / 'none'}': no such folder") + "$"):
        TextEncoder(str(tmp_path / "none"))  # was the hub's "Repo id must be in the form ..."
    (enc / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match="^" + re.escape(f"encoder '{enc}' could not be loaded: ")) as e:
        TextEncoder(str(enc))
    assert "\n" not in str(e.value) and "  " not in str(e.value)


def test_pooling_other_than_the_index_folders_is_refused(dense, tmp_path):
    """--pooling cls on a folder of mean-pooled vectors was dropped without a word (the folder's
    pooling won) while evaluate.py recorded cls."""
    dense.save(tmp_path / "idx")
    with pytest.raises(ValueError, match=r"pooling 'cls': index .*idx holds mean-pooled passage vectors"):
        build_retriever("dense", CORPUS, pooling="cls", index=str(tmp_path / "idx"))
    loaded = build_retriever("dense", CORPUS, index=str(tmp_path / "idx"))  # the default: the folder's pooling
    assert loaded.search(["Paris"], k=2)[0][0].id == dense.search(["Paris"], k=2)[0][0].id
    import retrieve

    with pytest.raises(SystemExit, match=r"pooling 'cls': index .*idx holds mean-pooled"):  # the CLI too
        retrieve.main(["query", "--index", str(tmp_path / "idx"), "--pooling", "cls", "Paris"])


def test_another_encoder_than_the_index_folders_is_warned_of(dense, encoder_dir, tmp_path, recwarn):
    """retrieve.py query --encoder B on a folder built with A searched A's passage vectors with B's
    query vectors without a word (a copy of A elsewhere is the same model: a warning, not a refusal)."""
    import shutil

    dense.save(tmp_path / "idx")
    build_retriever("dense", CORPUS, encoder=dense.text_encoder.name, index=str(tmp_path / "idx"))  # its own: quiet
    build_retriever("dense", CORPUS, index=str(tmp_path / "idx"))
    assert not [w for w in recwarn if "encoded by" in str(w.message)]
    shutil.copytree(encoder_dir / "tiny-bert", tmp_path / "other")
    with pytest.warns(UserWarning, match=rf"index .*idx holds passages encoded by {re.escape(dense.text_encoder.name)}; "
                                         rf"queries will be encoded by {re.escape(str(tmp_path / 'other'))}: unless"):
        build_retriever("dense", CORPUS, encoder=str(tmp_path / "other"), index=str(tmp_path / "idx"))


def test_an_encoder_of_another_vector_size_is_refused_as_the_index_loads(dense, tmp_path):
    """An --encoder whose vectors are not the index's size passed every check at start and failed at the
    first search (train.py: a traceback after its files were written; serve: a 500 for every request)."""
    dense.save(tmp_path / "idx")
    save_bag_of_words_bert([p.title + " " + p.text for p in CORPUS], tmp_path / "enc64", hidden=64)
    with pytest.raises(ValueError, match="^" + re.escape(f"encoder {tmp_path / 'enc64'} gives 64-dim vectors but the "
                                                         "index holds 128-dim ones: its passages were encoded by "
                                                         "another encoder")):
        build_retriever("dense", CORPUS, encoder=str(tmp_path / "enc64"), index=str(tmp_path / "idx"))
    import faiss

    faiss.write_index(dense.index, str(tmp_path / "e5_Flat.index"))  # a FAISS file alone, as Search-R1's
    with pytest.raises(ValueError, match="gives 64-dim vectors but the index holds 128-dim ones"):
        DenseRetriever(CORPUS, str(tmp_path / "enc64"), index=str(tmp_path / "e5_Flat.index"), query_prefix="")


def test_dense_flags_on_a_bm25_folder_are_refused(tmp_path):
    """retrieve.py query --encoder / --pooling / --query_prefix on a BM25 folder were dropped without a word."""
    import retrieve

    write_jsonl(tmp_path / "c.jsonl", map(passage_to_dict, CORPUS))
    retrieve.main(["build", "--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "bm25")])
    with pytest.raises(SystemExit, match=r"--pooling and --query_prefix: --index .*bm25 holds a bm25 index, which "
                                         r"encodes no queries"):
        retrieve.main(["query", "--index", str(tmp_path / "bm25"), "--pooling", "cls", "--query_prefix", "q: ", "x"])


@pytest.mark.filterwarnings("ignore:encoder .* neither E5 nor BGE")  # the warning of a FAISS file without a prefix
def test_a_faiss_file_over_another_corpus_says_which_corpus_to_give(dense, encoder_dir, tmp_path):
    """train.py --index e5_Flat.index without --corpus read the toy corpus and said only 'index holds
    21015324 vectors but there are 450 passages'."""
    dense.save(tmp_path / "idx")
    with pytest.raises(ValueError, match=rf"index holds {len(CORPUS)} vectors but the corpus has 3 passages: a FAISS "
                                         r"file goes with the corpus it was built over \(--corpus"):
        build_retriever("dense", CORPUS[:3], encoder=str(encoder_dir / "tiny-bert"),
                        index=str(tmp_path / "idx" / "index.faiss"))


def test_retrieve_cli_pooling_defaults_to_the_index_folders(encoder_dir, tmp_path, capsys):
    """`retrieve.py query --pooling` defaulted to mean, and mean was taken to mean "the folder's":
    on a folder of cls-pooled vectors, --pooling mean typed out was dropped without a word."""
    import retrieve

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in CORPUS))
    DenseRetriever(CORPUS, str(encoder_dir / "tiny-bert"), pooling="cls", batch_size=3, max_length=48).save(
        tmp_path / "cls")
    index = ["--index", str(tmp_path / "cls"), "--corpus", str(corpus)]
    retrieve.main(["query", *index, "Paris"])  # not given: the folder's pooling
    assert "Paris" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"pooling 'mean': index .*cls holds cls-pooled"):
        retrieve.main(["query", *index, "--pooling", "mean", "Paris"])


def test_an_empty_corpus_file_is_named(tmp_path):
    """train.py --corpus empty.jsonl said only 'BM25Retriever needs at least one passage'."""
    from types import SimpleNamespace

    from searchlite.data import DataError

    (tmp_path / "empty.jsonl").write_text("\n")
    cfg = SimpleNamespace(retriever="bm25", corpus=str(tmp_path / "empty.jsonl"), encoder="", pooling="mean",
                          index="", retriever_url="", topk=3)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'empty.jsonl'}: no passages in the corpus file")):
        config_retriever(cfg)
