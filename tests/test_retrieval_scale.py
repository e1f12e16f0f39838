"""Wikipedia-scale retrieval on the toy corpus: the lazy corpus reader, the streaming BM25
index (against bm25s), sharded dense builds that resume, Search-R1's released corpus +
faiss file loaded as they are, and the HTTP server (Search-R1 round trip, validation,
batching, a 32-client load test, schemathesis fuzzing against its own OpenAPI schema)."""

import gc
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
from conftest import save_bag_of_words_bert

from searchlite import indexing
from searchlite.bm25 import tokenize
from searchlite.config import TOY_DIR
from searchlite.corpus import Corpus, batches, open_corpus, sample_ids_digest
from searchlite.data import DataError, Passage, passage_to_dict, read_corpus, write_jsonl
from searchlite.indexing import build_bm25_folder, build_dense_folder, checked_faiss, encode_shards, faiss_factory
from searchlite.retrieval import (BM25Retriever, DenseRetriever, HTTPRetriever, TextEncoder, build_retriever,
                                  load_index)

TOY = TOY_DIR / "corpus.jsonl"
QUERIES = ["press founder", "who was born in a city", "poet known for a book on stars", "company based in",
           "bank headquarters", "zzzz unknown words", "", "engines", "the of and",
           "press press founder"]  # compared across implementations; a repeated word counts twice, as in bm25s


@pytest.fixture(scope="module")
def toy_passages():
    return read_corpus(TOY)


# ---------------------------------------------------------------------------- lazy corpus


def test_corpus_matches_read_corpus_and_names_bad_lines(tmp_path, toy_passages):
    c = Corpus(TOY)
    assert len(c) == len(toy_passages) and list(c) == toy_passages
    assert c[-1] == toy_passages[-1] and [p for _, b in c.batches(100, start=400) for p in b] == toy_passages[400:]
    lines = ["\ufeff" + json.dumps({"id": "a", "contents": '"T"\nx'}), "", "  \r",
             json.dumps({"title": "Quito", "text": "Capital."}), '{"id": "c", "contents": 5}', json.dumps({"text": "end"})]
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(lines), encoding="utf-8")  # BOM, blank lines, no final newline
    c = Corpus(p)
    assert len(c) == 4 and c[0] == Passage("a", "T", "x") and c[1] == Passage("3", "Quito", "Capital.")
    assert c[3] == Passage("5", "", "end")  # a missing id is the 0-based line index, blank lines counted
    with pytest.raises(DataError, match=re.escape(f"{p}:5: field 'contents' must be a string")):
        c[2]
    with pytest.raises(IndexError):
        c[4]
    with pytest.raises(DataError, match="gunzip"):
        Corpus(tmp_path / "c.jsonl.gz")


@pytest.mark.parametrize("chunk", [1 << 26, 7, 1])  # the scan's read size: lines cut across reads
def test_corpus_skips_every_blank_line_read_corpus_skips(tmp_path, monkeypatch, chunk):
    """Whitespace-only lines of any length, Unicode whitespace too, are blank to both readers;
    a line that only begins with spaces is a passage."""
    import searchlite.corpus as corpus_module

    monkeypatch.setattr(corpus_module, "_CHUNK", chunk)
    row = lambda i: json.dumps({"id": str(i), "contents": f'"T{i}"\ntext {i}'})  # noqa: E731
    lines = [row(0), " " * 40, row(1), "\u00a0\t", row(2), "\u3000" * 9 + "\r", "\x1c", "   " + row(3), " ", row(4),
             "\t\t", "\x0b", "\u1680", "\u2003 ", row(5)]  # each byte that can begin one, first
    p = tmp_path / "c.jsonl"
    for end in ("", "\n"):
        p.write_text("\n".join(lines) + end, encoding="utf-8")
        want = read_corpus(p)
        assert [x.id for x in want] == ["0", "1", "2", "3", "4", "5"] and list(Corpus(p)) == want
        assert Corpus(p).line_no(4) == 10 and Corpus(p).line_no(5) == 15


def test_corpus_takes_a_bom_on_the_first_line_only_as_read_corpus_does(tmp_path):
    """A BOM-only first line is blank to both readers; a BOM-only line further down is bad JSON
    to both, named by its line (the scan used to skip it as blank wherever it stood)."""
    row = lambda i: json.dumps({"id": str(i), "text": f"t{i}"})  # noqa: E731
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(["\ufeff", row(0), row(1)]) + "\n", encoding="utf-8")
    assert [x.id for x in read_corpus(p)] == ["0", "1"] and list(Corpus(p)) == read_corpus(p)
    p.write_text("\n".join([row(0), "\ufeff", row(1)]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{p}:2: bad JSON")):
        read_corpus(p)
    with pytest.raises(DataError, match=re.escape(f"{p}:2: bad JSON")):
        list(Corpus(p))


def test_corpus_offsets_cache_follows_the_file(tmp_path):
    p, cache = tmp_path / "c.jsonl", tmp_path / "offsets.npz"
    p.write_text('{"id": "1", "text": "one"}\n{"id": "2", "text": "two"}\n')
    assert len(Corpus(p, offsets=cache)) == 2 and cache.exists()
    assert len(Corpus(p, offsets=cache)) == 2  # reused
    p.write_text('{"id": "1", "text": "one"}\n{"id": "2", "text": "two"}\n{"id": "3", "text": "three"}\n')
    assert Corpus(p, offsets=cache)[2].id == "3"  # the file changed: scanned again
    other = tmp_path / "other.jsonl"  # same size and modification time, lines split otherwise
    other.write_text('{"id": "1", "text": "one"}\n{"id": "22", "text": "two"}\n{"id": "3", "text": "thre"}\n')
    os.utime(other, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns))
    assert other.stat().st_size == p.stat().st_size
    assert [x.id for x in Corpus(other, offsets=cache)] == ["1", "22", "3"]  # not p's offsets: a bad JSON line


def test_an_index_saved_from_code_keeps_its_corpus_line_scan_beside_it(tmp_path, monkeypatch):
    """A retriever over a Corpus opened without a cache writes the scan into the folder it is saved
    to, so that loading the folder does not scan the corpus again (minutes on wiki-18)."""
    import searchlite.corpus

    BM25Retriever(Corpus(TOY), progress=False).save(tmp_path / "i")
    scans, real = [], searchlite.corpus.scan_lines
    monkeypatch.setattr(searchlite.corpus, "scan_lines", lambda *a, **k: scans.append(a) or real(*a, **k))
    assert len(load_index(tmp_path / "i").passages) == 450 and scans == []


def test_a_cache_that_cannot_be_written_does_not_stop_the_corpus(tmp_path):
    """An offsets cache where no file can be made (a read-only index folder; here, under a file)
    costs a scan next time, never the run."""
    p, blocker = tmp_path / "c.jsonl", tmp_path / "a_file"
    p.write_text('{"id": "1", "text": "one"}\n\n{"id": "2", "text": "two"}\n')
    blocker.write_text("")
    c = Corpus(p, offsets=blocker / "offsets.npz")
    assert [x.id for x in c] == ["1", "2"] and c.line_no(1) == 3 and not (blocker / "offsets.npz").exists()


def test_corpus_offsets_cache_is_written_whole_and_an_unreadable_one_rescanned(tmp_path, monkeypatch):
    """A write cut short used to leave a broken zip that every later open failed on
    (zipfile.BadZipFile, naming no file)."""
    p, cache = tmp_path / "c.jsonl", tmp_path / "offsets.npz"
    p.write_text('{"id": "1", "text": "one"}\n{"id": "2", "text": "two"}\n')
    real = np.savez

    def cut_short(file, **arrays):  # the bytes are out, the write is not finished
        real(file, **arrays)
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", cut_short)
    with pytest.raises(KeyboardInterrupt):
        Corpus(p, offsets=cache)
    assert not cache.exists()  # never a cache that is not whole
    monkeypatch.undo()
    Corpus(p, offsets=cache)
    whole = cache.read_bytes()
    np.savez(tmp_path / "other.npz", starts=np.zeros(3, np.int64))
    for broken in (whole[:len(whole) // 2], b"", b"not a zip", (tmp_path / "other.npz").read_bytes()):
        cache.write_bytes(broken)  # BadZipFile, EOFError, ValueError, KeyError
        assert Corpus(p, offsets=cache)[1].id == "2"  # scanned again...
        assert cache.read_bytes() == whole  # ...and the cache rewritten


def test_corpus_reads_all_bytes_of_a_batch(tmp_path, monkeypatch, toy_passages):
    """os.pread returns at most 2,147,479,552 bytes on Linux: a batch over 2 GiB got short data,
    reported as cut-off JSON."""
    c, real = Corpus(TOY), os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: real(fd, min(n, 1000), offset))  # short reads
    assert [p for _, b in c.batches(200) for p in b] == toy_passages and c[3] == toy_passages[3]
    monkeypatch.undo()
    p = tmp_path / "c.jsonl"
    shutil.copy(TOY, p)
    c = Corpus(p)
    with open(p, "r+b") as f:
        f.truncate(1000)  # the file shrinks after its lines were scanned
    with pytest.raises(DataError, match=re.escape(f"{p}: the file ends at byte 1000")):
        list(c.batches(200))


def _rows(*ids):
    return "".join(json.dumps({"id": i, "text": f"t{i}"}) + "\n" for i in ids)


def test_a_carriage_return_only_line_is_blank_to_both_readers(tmp_path):
    """A line holding only "\\r" (a CRLF file's empty line) is skipped, and later passages keep
    their line numbers."""
    p = tmp_path / "c.jsonl"
    p.write_bytes(b'{"id": "0", "text": "a"}\r\n\r\n{"id": "1", "text": "b"}\r\n\r\n{"text": "c"}\r\n')
    want = read_corpus(p)
    assert [x.id for x in want] == ["0", "1", "4"]
    c = Corpus(p)
    assert len(c) == 3 and list(c) == want and c.line_no(2) == 5


def test_offsets_cache_is_not_reused_after_an_edit_of_the_same_size(tmp_path):
    """An edit that keeps the file's size but moves its line breaks (a later modification time)
    is scanned again, not read through the old offsets."""
    p, cache = tmp_path / "c.jsonl", tmp_path / "offsets.npz"
    p.write_text(_rows("1", "2", "333"))
    assert [x.id for x in Corpus(p, offsets=cache)] == ["1", "2", "333"]
    st = p.stat()
    p.write_text(_rows("1", "22", "33"))
    assert p.stat().st_size == st.st_size
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert [x.id for x in Corpus(p, offsets=cache)] == ["1", "22", "33"]


def test_offsets_cache_is_not_reused_after_the_file_grows_with_its_time_kept(tmp_path):
    """A file given back its old modification time (`touch -r`) but holding more lines is
    scanned again: the size is part of what the cache must match."""
    p, cache = tmp_path / "c.jsonl", tmp_path / "offsets.npz"
    p.write_text(_rows("1", "2"))
    assert len(Corpus(p, offsets=cache)) == 2
    st = p.stat()
    p.write_text(_rows("1", "2", "3"))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    c = Corpus(p, offsets=cache)
    assert len(c) == 3 and c[2] == Passage("3", "", "t3")


def test_a_line_emptied_after_the_scan_is_named(tmp_path):
    """A passage overwritten in place with spaces after the file was opened raises a DataError
    naming the file and line and saying the file changed."""
    p = tmp_path / "c.jsonl"
    p.write_text(_rows("1", "2", "3"))
    c = Corpus(p)
    data = p.read_bytes().split(b"\n")
    data[1] = b" " * len(data[1])
    p.write_bytes(b"\n".join(data))
    assert c[0].id == "1" and c[2].id == "3"
    with pytest.raises(DataError, match=re.escape(f"{p}:2: a line of only whitespace") + ".*the file changed"):
        c[1]
    with pytest.raises(DataError, match=re.escape(f"{p}:2: a line of only whitespace")):
        list(c)


def test_corpus_indices_are_integers_within_range(toy_passages):
    """Booleans and floats are refused with a TypeError; -len(corpus) is the first passage and
    len(corpus) is out of range, as for a list."""
    c = Corpus(TOY)
    n = len(c)
    for bad in (True, False, 1.0, "1"):
        with pytest.raises(TypeError, match="Corpus indices must be integers"):
            c[bad]
    assert c[-n] == toy_passages[0] and c[-1] == toy_passages[-1]
    for out in (n, -n - 1):
        with pytest.raises(IndexError, match=f"passage {out} out of range"):
            c[out]


def test_a_corpus_closes_its_file_when_closed_or_collected(monkeypatch):
    """A corpus holds its file open for its reads: a process that opens corpora again and again
    (an evaluation per checkpoint) keeps no descriptor of one it is done with."""
    closed, real = [], os.close
    monkeypatch.setattr(os, "close", lambda fd: closed.append(fd) or real(fd))
    c = Corpus(TOY)
    fd = c._fd
    c.close()
    c.close()  # a second close is harmless
    assert closed == [fd]
    dropped = Corpus(TOY)
    fd = dropped._fd
    del dropped
    gc.collect()
    assert fd in closed[1:]


@pytest.mark.parametrize("text", ["", "\n \n\t\n"])
def test_open_corpus_refuses_a_file_without_passages(tmp_path, text):
    """A corpus file with no passages (empty, or blank lines only) is a DataError naming it."""
    p = tmp_path / "empty.jsonl"
    p.write_text(text)
    with pytest.raises(DataError, match=re.escape(f"{p}: no passages in the corpus file")):
        open_corpus(p)
    p.write_text(_rows("1"))
    assert [x.id for x in open_corpus(p)] == ["1"]


def test_batches_start_where_asked_for_a_corpus_and_a_list(toy_passages):
    """`batches` yields (first index, passages) from `start` on, the same for a lazy corpus
    and a list of passages."""
    want = [(s, toy_passages[s:s + 150]) for s in range(390, len(toy_passages), 150)]
    assert list(batches(toy_passages, 150, start=390)) == want
    assert list(batches(Corpus(TOY), 150, start=390)) == want


def test_sample_ids_digest_covers_every_id_of_a_short_corpus():
    """Under `n` passages, every id counts: a changed id anywhere, or the order, changes the
    fingerprint."""
    ps = [Passage(str(i), "", f"t{i}") for i in range(5)]
    base = sample_ids_digest(ps)
    for k in range(5):
        changed = ps[:k] + [Passage("x", "", "t")] + ps[k + 1:]
        assert sample_ids_digest(changed) != base
    assert sample_ids_digest(ps[::-1]) != base and sample_ids_digest(list(ps)) == base


def test_sample_ids_digest_of_a_long_corpus_reads_a_thousand_evenly_spaced_ids():
    """Past 1,000 passages the fingerprint index folders record is the SHA-1 of [count, the ids at
    1,000 evenly spaced positions, rounded], so folders written earlier still match (with numpy's
    default of 50 positions, the four retrieval test files passed)."""
    ps = [Passage(f"p{i}", "", "t") for i in range(2500)]
    picks = [round(i * 2499 / 999) for i in range(1000)]  # 0, 3 (2.5015 rounded), ..., 2499
    assert len(set(picks)) == 1000 and picks[:3] == [0, 3, 5] and picks[-1] == 2499
    want = hashlib.sha1(json.dumps([2500, [f"p{i}" for i in picks]]).encode("utf-8")).hexdigest()
    assert sample_ids_digest(ps) == want


def test_lengths_digest_is_the_sha1_of_the_line_lengths(tmp_path):
    """The fingerprint index folders record is the SHA-1 of each passage's byte span (its line, newline
    and any blank lines after it) as little-endian int64s, so folders written earlier still match."""
    p = tmp_path / "c.jsonl"
    p.write_bytes(b'{"id": "1", "text": "a"}\n\n{"id": "2", "text": "bc"}\n{"id": "3", "text": "d"}')
    spans = [26, 26, 24]
    assert Corpus(p).lengths_digest() == hashlib.sha1(b"".join(n.to_bytes(8, "little") for n in spans)).hexdigest()


# ---------------------------------------------------------------------------- BM25


@pytest.mark.parametrize("k1, b", [(1.5, 0.75), (0.9, 0.4)])  # bm25s's defaults; Pyserini's (Search-R1's server)
def test_streaming_bm25_scores_equal_bm25s(toy_passages, tmp_path, k1, b):
    import bm25s

    r = build_bm25_folder(TOY, tmp_path / "bm25", progress=False, k1=k1, b=b)
    r = load_index(tmp_path / "bm25")  # the folder keeps k1 and b
    ref = bm25s.BM25(k1=k1, b=b)
    ref.index(bm25s.tokenize([f"{p.title}\n{p.text}" for p in toy_passages], stopwords="en", show_progress=False),
              show_progress=False)
    reopened = bm25s.BM25.load(tmp_path / "bm25")  # our files in bm25s's layout
    for q in QUERIES:
        tokens = tokenize([q])[0]
        if not set(tokens) & set(ref.vocab_dict):  # bm25s cannot score such a query; we answer nothing
            assert r.search([q], 5) == [[]]
            continue
        full = ref.get_scores(tokens)  # (N,)
        [hits] = r.search([q], k=5)
        assert [h.score for h in hits] == pytest.approx(sorted(full[full > 0], reverse=True)[:5], rel=1e-5)
        assert all(full[int(h.id)] == pytest.approx(h.score, rel=1e-5) for h in hits)  # toy ids = line index
        np.testing.assert_allclose(reopened.get_scores(tokens), full, rtol=1e-5, atol=1e-6)


def test_bm25_folder_round_trip_and_corpus_check(tmp_path, toy_passages):
    build_bm25_folder(TOY, tmp_path / "bm25", progress=False)
    loaded = load_index(tmp_path / "bm25")  # corpus from the folder, arrays memory-mapped
    assert isinstance(loaded.passages, Corpus) and isinstance(loaded.index.data, np.memmap)
    assert loaded.search(QUERIES, 3) == BM25Retriever(toy_passages).search(QUERIES, 3)
    p = toy_passages[5]  # its own text is the best match for itself
    assert build_retriever("bm25", str(TOY), index=str(tmp_path / "bm25")).search([p.text], 1)[0][0].id == p.id
    with pytest.raises(ValueError, match="different corpus"):
        load_index(tmp_path / "bm25", toy_passages[::-1])
    with pytest.raises(ValueError, match="holds a bm25 index, not a dense one"):
        load_index(tmp_path / "bm25", kind="dense")
    with pytest.raises(FileNotFoundError, match="not a finished index folder"):
        load_index(tmp_path)


def test_a_bm25_folder_with_accented_terms_builds_and_reopens_under_an_ascii_locale(tmp_path):
    """The vocabulary file holds its terms as UTF-8 (not JSON escapes), so it is written and read as
    UTF-8 whatever the locale (read in the locale's encoding, it passed test_retrieval, which runs under UTF-8)."""
    from conftest import run_under_ascii_locale

    corpus = tmp_path / "c.jsonl"
    write_jsonl(corpus, [passage_to_dict(Passage("1", "Z\u00fcrich", "Z\u00fcrich lies on a lake.")),
                         passage_to_dict(Passage("2", "Bern", "Bern is a city."))])
    script = ("import sys; from searchlite.indexing import build_bm25_folder; "
              "from searchlite.retrieval import load_index; "
              "build_bm25_folder(sys.argv[1], sys.argv[2], progress=False); "
              "print(load_index(sys.argv[2]).search(['Z\\u00fcrich lake'], 1)[0][0].id)")
    done = run_under_ascii_locale(script, str(corpus), str(tmp_path / "bm25"))
    assert (done.returncode, done.stdout.strip()) == (0, "1"), done.stderr
    assert "z\u00fcrich" in json.loads((tmp_path / "bm25" / "vocab.index.json").read_text(encoding="utf-8"))


def test_a_rebuild_refused_before_it_saves_leaves_the_old_index(tmp_path):
    """A rebuild that fails before writing anything (a gzipped corpus, an empty one) keeps the
    folder's finished index loadable."""
    out, empty = tmp_path / "bm25", tmp_path / "empty.jsonl"
    build_bm25_folder(TOY, out, progress=False)
    empty.write_text("")
    for corpus in (str(TOY) + ".gz", empty):
        with pytest.raises(DataError):
            build_bm25_folder(corpus, out, progress=False)
    assert load_index(out).search(QUERIES, 3) == BM25Retriever(read_corpus(TOY)).search(QUERIES, 3)


@pytest.mark.parametrize("cut", ["before_vocab", "during_vocab"])
def test_bm25_rebuild_cut_short_is_an_unfinished_folder(tmp_path, monkeypatch, toy_passages, cut):
    """A rebuild over a finished folder (same ids, new texts) cut short used to load with the old
    bm25.json: new arrays over the old vocabulary (wrong passages) or an empty vocabulary file
    (a bare JSONDecodeError)."""
    import builtins

    corpus, folder = tmp_path / "c.jsonl", tmp_path / "i"
    shutil.copy(TOY, corpus)
    build_bm25_folder(corpus, folder, progress=False)
    texts = [p.text for p in toy_passages[1:] + toy_passages[:1]]
    write_jsonl(corpus, [passage_to_dict(Passage(p.id, p.title, t)) for p, t in zip(toy_passages, texts)])
    real_open = builtins.open

    def open_then_interrupt(file, mode="r", *args, **kw):
        if os.path.basename(file).startswith("vocab.index.json") and "w" in mode:
            if cut == "during_vocab":
                real_open(file, mode, *args, **kw).close()  # opened (and truncated), nothing written
            raise KeyboardInterrupt
        return real_open(file, mode, *args, **kw)

    monkeypatch.setattr(builtins, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        build_bm25_folder(corpus, folder, progress=False)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="not a finished index folder"):
        load_index(folder)
    build_bm25_folder(corpus, folder, progress=False)
    assert load_index(folder).search(QUERIES, 3) == BM25Retriever(read_corpus(corpus)).search(QUERIES, 3)


def test_damaged_bm25_files_are_named(tmp_path):
    folder = tmp_path / "i"
    build_bm25_folder(TOY, folder, progress=False)
    vocab_file, data_file = folder / "vocab.index.json", folder / "data.csc.index.npy"
    vocab, data = vocab_file.read_text(), data_file.read_bytes()
    vocab_file.write_text(json.dumps(dict(list(json.loads(vocab).items())[:-1])))  # files of two builds
    with pytest.raises(ValueError, match=re.escape(f"{folder}: the BM25 index files do not fit together")):
        load_index(folder)
    vocab_file.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{vocab_file}: not a readable BM25 index file")):
        load_index(folder)
    vocab_file.write_text(vocab)
    data_file.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(f"{data_file}: not a readable BM25 index file")):
        load_index(folder)


def test_damaged_index_settings_are_named(tmp_path):
    """A bm25.json that did not parse failed with json's bare "Expecting property name ...: line 2
    column 1", naming no file; retrieve.py printed just that."""
    import retrieve

    folder = tmp_path / "i"
    build_bm25_folder(TOY, folder, progress=False)
    settings = folder / "bm25.json"
    for text, why in (("{\n", "not valid JSON (Expecting property name"), ("[]", "expected a JSON object")):
        settings.write_text(text)
        for load in (lambda: load_index(folder), lambda: BM25Retriever.load(folder, read_corpus(TOY))):
            with pytest.raises(ValueError, match=re.escape(f"{settings}: {why}")):
                load()
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {settings}: expected a JSON object")):
        retrieve.main(["query", "--index", str(folder), "who?"])


def test_a_corpus_edited_in_place_under_an_index_folder_warns(tmp_path, toy_passages):
    """Only the passage count and ids were checked: a corpus whose text was edited in place
    loaded silently, and the index scored the old text."""
    import warnings

    corpus, folder = tmp_path / "c.jsonl", tmp_path / "i"
    shutil.copy(TOY, corpus)
    build_bm25_folder(corpus, folder, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_index(folder)  # unchanged: no warning
    data, st = bytearray(corpus.read_bytes()), os.stat(corpus)
    data[data.index(b"\\n") + 2] ^= 0x20  # the case of the first passage's first letter: same ids, same size
    corpus.write_bytes(data)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later edit, whatever the clock's grain
    for given in (None, str(corpus)):
        with pytest.warns(UserWarning, match=re.escape(f"{corpus} changed since {folder} was built from it")):
            load_index(folder, given)
    settings = json.loads((folder / "bm25.json").read_text())
    del settings["corpus_bytes"], settings["corpus_mtime_ns"]  # a folder built before they were recorded
    (folder / "bm25.json").write_text(json.dumps(settings))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_index(folder)


def test_a_folder_holds_one_kind_of_index(tmp_path, encoder):
    """A dense build into a BM25 folder used to succeed, and the folder then loaded as BM25."""
    build_bm25_folder(TOY, tmp_path / "i", progress=False)
    built = sorted(os.listdir(tmp_path / "i"))
    with pytest.raises(ValueError, match=re.escape("holds files of a bm25 index (bm25.json, data.csc.index.npy")):
        build_dense_folder(TOY, tmp_path / "i", encoder, max_length=48, progress=False)
    assert sorted(os.listdir(tmp_path / "i")) == built  # refused before the encoding: no shards/
    assert isinstance(load_index(tmp_path / "i"), BM25Retriever)  # refused before anything changed
    (tmp_path / "d" / "shards").mkdir(parents=True)  # a dense build's encodings, kept
    with pytest.raises(ValueError, match=re.escape("holds files of a dense index (shards)")):
        build_bm25_folder(TOY, tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match=re.escape("holds files of a dense index (shards)")):
        load_index(tmp_path / "i").save(tmp_path / "d")  # a retriever saved in code is refused too
    (tmp_path / "i" / "dense.json").write_text("{}")  # as an older searchlite could leave it
    with pytest.raises(ValueError, match="holds both bm25.json and dense.json"):
        load_index(tmp_path / "i")


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_build_over_an_empty_corpus_names_the_file(tmp_path, encoder, text):
    import retrieve

    p = tmp_path / "empty.jsonl"
    p.write_text(text)
    message = re.escape(f"{p}: no passages to index")
    with pytest.raises(DataError, match=message):
        build_bm25_folder(p, tmp_path / "b", progress=False)
    with pytest.raises(DataError, match=message):
        build_dense_folder(p, tmp_path / "d", encoder, progress=False)
    with pytest.raises(SystemExit, match="error: " + message):
        retrieve.main(["build", "--corpus", str(p), "--kind", "dense", "--encoder", encoder, "--out", str(tmp_path / "d")])


# ---------------------------------------------------------------------------- dense


@pytest.fixture(scope="module")
def encoder(tmp_path_factory, toy_passages):
    """A random bag-of-words BERT over the toy corpus (conftest.save_bag_of_words_bert), in a
    folder whose name selects E5's prefixes."""
    path = tmp_path_factory.mktemp("enc") / "tiny-e5-bert"
    save_bag_of_words_bert([p.contents for p in toy_passages] + ["query passage"], path, hidden=32)
    return str(path)


def test_sharded_dense_build_resumes_after_interruption(tmp_path, encoder, monkeypatch, capsys):
    full = build_dense_folder(TOY, tmp_path / "full", encoder, shard_size=100, max_length=48, progress=False)
    calls, real = [], TextEncoder.encode

    def dies_on_third_shard(self, texts, prefix="", bar=None):
        if len(texts) > 20:  # passages come a shard at a time; queries (and the dimension probe) are short lists
            if len(calls) == 2:
                raise KeyboardInterrupt
            calls.append(len(texts))
        return real(self, texts, prefix, bar)

    monkeypatch.setattr(TextEncoder, "encode", dies_on_third_shard)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        build_dense_folder(TOY, out, encoder, shard_size=100, max_length=48, progress=False)
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["000000.npy", "000001.npy", "manifest.json"]
    assert not (out / "dense.json").exists()  # unfinished: nothing loads it
    with pytest.raises(ValueError, match="shard_size"):
        build_dense_folder(TOY, out, encoder, shard_size=50, max_length=48, progress=False)
    import retrieve  # the command says what is kept, where a KeyboardInterrupt traceback came out

    calls.clear()
    with pytest.raises(SystemExit) as stopped:
        retrieve.main(["build", "--corpus", str(TOY), "--kind", "dense", "--encoder", encoder, "--out", str(tmp_path / "cli"),
                       "--shard_size", "100", "--max_length", "48"])
    assert stopped.value.code == 130 and "a dense build keeps its finished shards" in capsys.readouterr().err
    calls.clear()
    monkeypatch.setattr(TextEncoder, "encode", lambda self, texts, prefix="", bar=None:
                        calls.append(len(texts)) or real(self, texts, prefix, bar))
    resumed = build_dense_folder(TOY, out, encoder, shard_size=100, max_length=48, progress=False)
    assert calls == [1, 100, 100, 50]  # the dimension probe, then only the missing shards
    assert not (out / "shards").exists()
    np.testing.assert_allclose(resumed.index.reconstruct_n(0, 450), full.index.reconstruct_n(0, 450), atol=1e-6)
    loaded = load_index(out)
    assert (loaded.query_prefix, loaded.passage_prefix) == ("query: ", "passage: ")
    assert [[h.id for h in hs] for hs in loaded.search(QUERIES, 3)] == [[h.id for h in hs] for hs in full.search(QUERIES, 3)]


def test_resumed_encoding_reads_only_the_missing_shards(tmp_path, monkeypatch):
    """A resume used to read and parse every passage to skip the shards it had (13 GB for wiki-18)."""
    class ZeroEncoder:
        def encode(self, texts, prefix="", bar=None):
            return np.zeros((len(texts), 2), np.float32)  # (n, 2)

    corpus, read, real = Corpus(TOY), [], Corpus._parse
    monkeypatch.setattr(Corpus, "_parse", lambda self, i, raw: read.append(i) or real(self, i, raw))
    (tmp_path / "shards").mkdir()
    paths = encode_shards(corpus, tmp_path, ZeroEncoder(), "", 100, progress=False)
    assert read == list(range(450)) and len(paths) == 5
    os.remove(paths[2])
    os.remove(paths[4])
    read.clear()
    encode_shards(corpus, tmp_path, ZeroEncoder(), "", 100, progress=False)
    assert read == list(range(200, 300)) + list(range(400, 450))


def test_shards_of_a_corpus_edited_in_place_are_refused(tmp_path, encoder):
    """Shards were matched to the corpus by its size alone: an edit that kept the size reused them."""
    corpus, out = tmp_path / "c.jsonl", tmp_path / "e5"
    shutil.copy(TOY, corpus)
    build_dense_folder(corpus, out, encoder, max_length=48, keep_shards=True, progress=False)
    data, st = bytearray(corpus.read_bytes()), os.stat(corpus)
    data[data.index(b"\\n") + 2] ^= 0x20  # the case of the first passage's first letter
    corpus.write_bytes(data)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later edit, whatever the clock's grain
    assert os.path.getsize(corpus) == st.st_size
    with pytest.raises(ValueError, match=r"corpus_mtime_ns differ"):
        build_dense_folder(corpus, out, encoder, max_length=48, keep_shards=True, progress=False)
    manifest = out / "shards" / "manifest.json"  # shards begun before the time was recorded: kept
    old = json.loads(manifest.read_text())
    del old["corpus_mtime_ns"]
    old["encoder"] = os.path.relpath(old["encoder"])  # and the encoder kept as typed, before it was made absolute
    manifest.write_text(json.dumps(old))
    build_dense_folder(corpus, out, encoder, max_length=48, keep_shards=True, progress=False)


def test_a_damaged_shard_manifest_is_named(tmp_path, encoder):
    """A manifest that did not parse failed with json's bare "Expecting property name ...: line 2
    column 1", naming no file."""
    manifest = tmp_path / "e5" / "shards" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    for text, why in (("{\n", "not valid JSON (Expecting property name"), ("[]", "expected a JSON object")):
        manifest.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{manifest}: {why}")):
            build_dense_folder(TOY, tmp_path / "e5", encoder, max_length=48, progress=False)


def test_hnsw_build_and_faiss_kinds(tmp_path, encoder):
    r = build_dense_folder(TOY, tmp_path / "hnsw", encoder, faiss_index="hnsw", max_length=48, progress=False)
    assert json.loads((tmp_path / "hnsw" / "dense.json").read_text())["search_params"] == "efSearch=128"
    exact = DenseRetriever(Corpus(TOY), TextEncoder(encoder, max_length=48))
    agree = [a[0].id == b[0].id for a, b in zip(load_index(tmp_path / "hnsw").search(QUERIES, 1), exact.search(QUERIES, 1))]
    assert sum(agree) >= len(QUERIES) - 1 and len(r.passages) == 450
    assert faiss_factory("ivfpq", 384, 14_171) == "IVF363,PQ48" and faiss_factory("IVF64,Flat", 8, 10) == "IVF64,Flat"
    with pytest.raises(ValueError, match="^--faiss 'ivfpq' needs at least 10,000 passages"):
        faiss_factory("ivfpq", 384, 450)


def test_the_training_sample_takes_every_step_th_vector_across_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(indexing, "TRAIN_LIMIT", 4)  # 10 vectors: every 3rd
    paths = []
    for s, (a, b) in enumerate([(0, 4), (4, 8), (8, 10)]):  # row i holds (i, i)
        np.save(tmp_path / f"{s}.npy", np.repeat(np.arange(a, b, dtype=np.float64)[:, None], 2, axis=1))
        paths.append(str(tmp_path / f"{s}.npy"))
    sample = indexing._training_sample(paths, 10)
    assert sample.dtype == np.float32 and sample.flags.c_contiguous
    assert sample.tolist() == [[0, 0], [3, 3], [6, 6], [9, 9]]


def test_ivfpq_lists_fit_the_training_sample():
    """faiss wants >= 39 training vectors per list, and the lists train on a sample of every
    ceil(n / 100k)-th vector, not on all n: wiki-18's 18,330 lists got ~5 vectors each."""
    sample = {10_000: 10_000, 14_171: 14_171, 150_000: 75_000, 21_000_000: 100_000}  # hand-derived
    for n, trained_on in sample.items():
        nlist = int(re.match(r"IVF(\d+),PQ", faiss_factory("ivfpq", 768, n))[1])
        assert 39 * nlist <= trained_on
    assert faiss_factory("ivfpq", 768, 21_000_000) == "IVF2564,PQ96"
    assert faiss_factory("ivfpq", 768, 150_000) == "IVF1549,PQ96"  # 4 sqrt(n), below the sample's 75,000 // 39


def test_search_params_default_follows_the_factory_string(tmp_path, encoder):
    """An IVF index named by its factory string used to get nprobe 1, not the documented 64."""
    import faiss

    build_dense_folder(TOY, tmp_path / "ivf", encoder, faiss_index="IVF8,Flat", max_length=48, progress=False)
    assert json.loads((tmp_path / "ivf" / "dense.json").read_text())["search_params"] == "nprobe=64"
    assert faiss.extract_index_ivf(load_index(tmp_path / "ivf").index).nprobe == 64


def test_a_bad_faiss_kind_or_search_parameter_is_refused_before_the_encoding(tmp_path, encoder, monkeypatch):
    """A typo in --faiss or --search_params was reported after the whole corpus was encoded (hours
    on wiki-18), and efSearch=0 was taken: an HNSW search then returned 1 hit of the 3 asked."""
    texts, real = [], TextEncoder.encode
    monkeypatch.setattr(TextEncoder, "encode", lambda self, t, prefix="", bar=None:
                        texts.append(len(t)) or real(self, t, prefix, bar))
    for kind, params, error in (("hnws", None, r"--faiss 'hnws': faiss cannot make this index \(could not parse "
                                                r"index string hnws\); use one of flat, hnsw, ivfpq"),
                                ("hnsw", "efSearch=0", r"'efSearch=0' is not name=positive number"),
                                ("hnsw", "efSearch=-5", r"'efSearch=-5' is not name=positive number"),
                                ("IVF8,Flat", "nprobe=abc", r"'nprobe=abc' is not name=positive number"),
                                ("hnsw", "foo=3", r"--search_params 'foo=3': faiss does not take it for a HNSW32,Flat "
                                                  r"index \(.*could not set parameter foo\)"),
                                ("flat", "nprobe=8", r"does not take it for a Flat index")):
        texts.clear()
        with pytest.raises(ValueError, match=error):
            build_dense_folder(TOY, tmp_path / kind, encoder, faiss_index=kind, search_params=params, max_length=48,
                               progress=False)
        assert texts == [1], (kind, params)  # the dimension probe alone: no passage was encoded
        assert not (tmp_path / kind / "shards").exists()  # nor a manifest of a build that never began
    # k-means needs a training vector a centroid (IVF lists, 2**bits PQ codes): faiss said so after the encoding
    for kind, need in (("IVF1000,Flat", "1,000"), ("IVF16,PQ8x12", "4,096")):
        texts.clear()
        with pytest.raises(ValueError, match="^" + re.escape(f"--faiss {kind!r}: the {kind} index trains {need} "
                                                             "centroids on 450 vectors")):
            build_dense_folder(TOY, tmp_path / "k", encoder, faiss_index=kind, max_length=48, progress=False)
        assert texts == [1]
    assert checked_faiss("IVF16,PQ8x12", None, 32, 4096) == ("IVF16,PQ8x12", "nprobe=64")  # one vector a code: enough
    with pytest.raises(ValueError, match=re.escape("the PQ8x12 index trains 4,096 centroids on 450 vectors")):
        checked_faiss("PQ8x12", None, 32, 450)  # PQ without IVF lists
    with pytest.raises(ValueError, match=re.escape("the OPQ8,IVF16,PQ8x12 index trains 4,096 centroids on 450")):
        checked_faiss("OPQ8,IVF16,PQ8x12", None, 32, 450)  # the IVF's PQ codes, under a rotation: not 16 lists
    assert checked_faiss("IVF450,Flat", None, 32, 450) == ("IVF450,Flat", "nprobe=64")
    with pytest.raises(ValueError, match=r"on 100,000 vectors \(the passages, or a sample of them\)"):
        checked_faiss("IVF262144,Flat", None, 32, 21_000_000)  # wiki-18's sample: refused before 21M encodings
    assert checked_faiss("hnsw", "efSearch=16", 32, 450) == ("HNSW32,Flat", "efSearch=16")
    assert checked_faiss("IVF8,Flat", None, 32, 450) == ("IVF8,Flat", "nprobe=64")
    assert checked_faiss("IVF8,Flat", "nprobe=1", 32, 450) == ("IVF8,Flat", "nprobe=1")  # the least positive count


def test_a_dense_build_removes_only_its_own_shard_files(tmp_path, encoder):
    """It removed the whole of --out/shards, files of the user's in it too."""
    out = tmp_path / "idx"
    (out / "shards").mkdir(parents=True)
    (out / "shards" / "notes.txt").write_text("mine")
    build_dense_folder(TOY, out, encoder, shard_size=200, max_length=48, progress=False)
    assert [p.name for p in (out / "shards").iterdir()] == ["notes.txt"]
    build_dense_folder(TOY, tmp_path / "own", encoder, shard_size=200, max_length=48, progress=False)
    assert not (tmp_path / "own" / "shards").exists()


def test_an_approximate_index_that_finds_fewer_than_k_returns_only_what_it_found(tmp_path, encoder):
    """FAISS pads a search that finds fewer than k vectors (IVF probing one list) with id -1 and
    score -3.4e38: those are no hits, not the corpus's last passage."""
    import faiss

    build_dense_folder(TOY, tmp_path / "ivf", encoder, faiss_index="IVF8,Flat", max_length=48, progress=False)
    r = load_index(tmp_path / "ivf")
    faiss.extract_index_ivf(r.index).nprobe = 1
    n = r.index.ntotal
    [hits] = r.search(["press founder"], k=n)
    assert 0 < len(hits) < n and len({h.id for h in hits}) == len(hits)
    assert all(h.score > -1e30 for h in hits)


def test_search_r1_corpus_and_faiss_index_load_unchanged(tmp_path, encoder, toy_passages):
    """wiki-18.jsonl + e5_Flat.index as Search-R1 releases them: vector i is line i, E5
    prefixes, mean pooling, normalised; written here by transformers and faiss directly."""
    import faiss
    import torch
    from transformers import AutoModel, AutoTokenizer

    corpus = tmp_path / "wiki-18.jsonl"
    shutil.copy(TOY, corpus)  # the toy corpus is already in wiki-18 form: {"id": "0", "contents": "\"T\"\n..."}
    tok, model = AutoTokenizer.from_pretrained(encoder), AutoModel.from_pretrained(encoder).eval()

    def embed(texts):
        batch = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = model(**batch).last_hidden_state  # (b, T, H)
        m = batch["attention_mask"].unsqueeze(-1).float()
        e = (h * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(e, dim=-1).numpy()  # (b, H)

    lines = [json.loads(line)["contents"] for line in corpus.read_text().splitlines()]
    vectors = np.concatenate([embed(["passage: " + c for c in lines[s:s + 64]]) for s in range(0, len(lines), 64)])
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    faiss.write_index(flat, str(tmp_path / "e5_Flat.index"))

    expected = embed(["query: " + q for q in QUERIES]) @ vectors.T  # (Q, N)
    for mmap in (False, True):
        r = build_retriever("dense", str(corpus), encoder=encoder, index=str(tmp_path / "e5_Flat.index"), mmap=mmap)
        for row, hits in zip(expected, r.search(QUERIES, 3)):
            assert [h.score for h in hits] == pytest.approx(np.sort(row)[::-1][:3], abs=1e-5)
            assert all(row[int(h.id)] == pytest.approx(h.score, abs=1e-5) for h in hits)
            assert all(Passage(h.id, h.title, h.text).contents == lines[int(h.id)] for h in hits)
    with pytest.raises(ValueError, match="449 passages"):
        build_retriever("dense", toy_passages[:-1], encoder=encoder, index=str(tmp_path / "e5_Flat.index"))

    # an encoder folder whose name does not say E5: `retrieve.py query/serve --query_prefix` says it
    import argparse

    import retrieve

    unnamed = tmp_path / "encoder"
    unnamed.symlink_to(encoder, target_is_directory=True)
    flags = dict(url=None, corpus=str(corpus), kind="dense", device="cpu", mmap=False, pooling="mean",
                 index=str(tmp_path / "e5_Flat.index"), encoder=str(unnamed))
    with pytest.warns(UserWarning, match="neither E5 nor BGE.*--query_prefix 'query: '"):
        assert retrieve.make(argparse.Namespace(**flags, query_prefix=None)).query_prefix == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a prefix given, or an E5 name, is not warned of
        r = retrieve.make(argparse.Namespace(**flags, query_prefix="query: "))
        build_retriever("dense", str(corpus), encoder=encoder, index=str(tmp_path / "e5_Flat.index"))
        # train.py, evaluate.py and view: --query_prefix (a run's config field)
        from types import SimpleNamespace

        from searchlite.retrieval import config_retriever

        cfg = SimpleNamespace(retriever="dense", corpus=str(corpus), encoder=str(unnamed), pooling="mean",
                              index=str(tmp_path / "e5_Flat.index"), retriever_url="", topk=3, query_prefix="query: ")
        for row, hits in zip(expected, config_retriever(cfg).search(QUERIES, 3)):
            assert [h.score for h in hits] == pytest.approx(np.sort(row)[::-1][:3], abs=1e-5)
    for row, hits in zip(expected, r.search(QUERIES, 3)):
        assert [h.score for h in hits] == pytest.approx(np.sort(row)[::-1][:3], abs=1e-5)


def test_cli_build_and_query(tmp_path, capsys, toy_passages):
    import retrieve

    p = toy_passages[7]
    retrieve.main(["build", "--corpus", "toy/corpus.jsonl", "--kind", "bm25", "--out", str(tmp_path / "i")])
    retrieve.main(["query", "--index", str(tmp_path / "i"), "--k", "1", p.text])
    out = capsys.readouterr().out
    assert "wrote" in out and "1. [" in out and f"{p.title} (id {p.id})" in out
    with pytest.raises(SystemExit, match="needs --encoder"):
        retrieve.main(["build", "--corpus", "toy/corpus.jsonl", "--kind", "dense", "--out", str(tmp_path / "d")])
    with pytest.raises(SystemExit, match="error: --kind dense needs --encoder .* or --index"):
        retrieve.main(["query", "--kind", "dense", "who?"])  # the flags, not build_retriever's arguments
    retrieve.main(["build", "--corpus", "toy/corpus.jsonl", "--out", str(tmp_path / "auto")])  # auto: bm25
    assert (tmp_path / "auto" / "bm25.json").is_file()
    retrieve.main(["build", "--corpus", "toy/corpus.jsonl", "--k1", "0.9", "--b", "0.4", "--out", str(tmp_path / "p")])
    pyserini, plain = load_index(tmp_path / "p").index, load_index(tmp_path / "i").index
    assert (pyserini.k1, pyserini.b, plain.k1, plain.b) == (0.9, 0.4, 1.5, 0.75)
    assert not np.allclose(pyserini.data, plain.data)
    for bad in (["--k1", "-1"], ["--b", "1.5"]):
        with pytest.raises(SystemExit, match="BM25 needs --k1 >= 0 and 0 <= --b <= 1"):
            retrieve.main(["build", "--corpus", "toy/corpus.jsonl", *bad, "--out", str(tmp_path / "bad")])
    missing = ["--corpus", "nowhere.jsonl"]
    for argv in (["build", *missing, "--out", str(tmp_path / "n")], ["query", *missing, "q"]):
        with pytest.raises(SystemExit, match="--corpus nowhere.jsonl: no such file"):
            retrieve.main(argv)


def test_cli_build_refuses_flags_it_would_ignore_and_bad_paths(tmp_path, capsys, encoder, monkeypatch):
    """A forgotten --encoder built a BM25 index and ignored --faiss and --pooling without a word;
    --k1 on a dense build did nothing; --out a file and --corpus a folder were OS errors; a build
    that failed at start-up left a new --out holding corpus_offsets.npz; a BM25 build's Ctrl-C
    spoke of dense shards."""
    import retrieve

    toy = ["--corpus", "toy/corpus.jsonl"]
    for extra, error in ((["--faiss", "hnsw", "--pooling", "cls"], "error: --pooling and --faiss: not for a bm25 build "
                                                                     r"\(--kind auto: dense with --encoder, else bm25\)"),
                         (["--kind", "bm25", "--encoder", encoder], "error: --encoder: not for a bm25 build$"),
                         (["--kind", "bm25", "--keep_shards"], "error: --keep_shards: not for a bm25 build$"),
                         (["--device", "cpu"], "error: --device: not for a bm25 build "),
                         (["--encoder", encoder, "--k1", "0.9", "--b", "0.4"], "error: --k1 and --b: not for a dense "
                                                                              "build")):
        with pytest.raises(SystemExit, match=error):
            retrieve.main(["build", *toy, *extra, "--out", str(tmp_path / "x")])
        assert not (tmp_path / "x").exists()
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match=rf"error: --out {re.escape(str(tmp_path / 'afile'))} is a file; expected a "
                                         "folder"):
        retrieve.main(["build", *toy, "--out", str(tmp_path / "afile")])
    with pytest.raises(SystemExit, match=rf"error: --corpus {re.escape(str(tmp_path))}: a folder, not a file"):
        retrieve.main(["build", "--corpus", str(tmp_path), "--out", str(tmp_path / "x")])
    bad = tmp_path / "bad.jsonl"  # a line that does not parse: the new folder goes again
    bad.write_text(TOY.read_text(encoding="utf-8") + '{"id": "x",\n', encoding="utf-8")
    with pytest.raises(SystemExit, match="bad.jsonl:451"):
        retrieve.main(["build", "--corpus", str(bad), "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    retrieve.main(["build", *toy, "--out", str(tmp_path / "ok")])  # a finished build keeps its folder
    assert (tmp_path / "ok" / "bm25.json").is_file()
    capsys.readouterr()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    from searchlite import retrieval

    kinds, real = [], retrieval.build_retriever  # query --encoder alone: dense, as build takes it (it searched BM25)
    monkeypatch.setattr(retrieval, "build_retriever", lambda kind, *a, **k: kinds.append(kind) or real(kind, *a, **k))
    retrieve.main(["query", "--encoder", encoder, "--k", "1", "press founder"])
    assert kinds == ["dense"]
    capsys.readouterr()
    monkeypatch.setattr("searchlite.indexing.BM25Retriever", interrupted)
    with pytest.raises(SystemExit):
        retrieve.main(["build", *toy, "--out", str(tmp_path / "cut")])
    assert capsys.readouterr().err == "\ninterrupted\n"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_device_cuda_without_a_gpu_is_one_line(tmp_path):
    """--device cuda here was torch's AssertionError traceback, after the corpus scan."""
    import retrieve

    for argv in (["build", "--corpus", "toy/corpus.jsonl", "--kind", "dense", "--encoder", "x", "--out",
                  str(tmp_path / "d"), "--device", "cuda"], ["query", "--kind", "dense", "--encoder", "x", "--device",
                                                             "cuda", "who?"]):
        with pytest.raises(SystemExit, match=r"error: --device cuda: torch .* sees no CUDA GPU here"):
            retrieve.main(argv)
    assert not (tmp_path / "d").exists()


def test_cli_build_help_describes_build(capsys):
    """build's help used to offer the query flags' defaults (a toy corpus) and kinds (rank_bm25)."""
    import retrieve

    with pytest.raises(SystemExit):
        retrieve.main(["build", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert "toy world" not in out and "--kind {auto,bm25,dense}" in out and "nprobe=64 for an IVF" in out
    for argv, error in ((["build", "--out", "x"], "required: --corpus"),
                        (["build", "--corpus", "toy/corpus.jsonl", "--kind", "rank_bm25", "--out", "x"],
                         "invalid choice: 'rank_bm25'")):
        with pytest.raises(SystemExit):
            retrieve.main(argv)
        assert error in capsys.readouterr().err


# ---------------------------------------------------------------------------- server


@contextmanager
def running(app):
    """Serve `app` with uvicorn on a free loopback port in a thread; yield its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class CountingRetriever:
    """A BM25 retriever that counts `search` calls (how batching shows) and keeps the last queries."""

    def __init__(self, passages):
        self.inner, self.calls, self.passages, self.queries = BM25Retriever(passages), [], passages, []

    def search(self, queries, k):
        self.calls.append(len(queries))
        self.queries = queries
        return self.inner.search(queries, k)


@pytest.fixture(scope="module")
def served(toy_passages):
    from searchlite.server import make_app

    r = CountingRetriever(toy_passages)
    with running(make_app(r, max_queries=64, max_query_chars=500, batch_wait=0.005)) as url:
        yield url, r


def _post(url, body: bytes, ctype="application/json"):
    req = urllib.request.Request(url + "/retrieve", data=body, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_search_r1_round_trip(served, toy_passages):
    url, r = served
    code, reply = _post(url, json.dumps({"queries": QUERIES[:3], "topk": 2, "return_scores": True}).encode())
    assert code == 200 and len(reply["result"]) == 3
    lines = {p.id: p.contents for p in toy_passages}
    for q, items in zip(QUERIES, reply["result"]):
        expected = r.inner.search([q], 2)[0]
        assert [it["document"]["id"] for it in items] == [h.id for h in expected]
        assert all(it["document"]["contents"] == lines[it["document"]["id"]] for it in items)
        assert [it["score"] for it in items] == pytest.approx([h.score for h in expected], rel=1e-6)
    code, bare = _post(url, json.dumps({"queries": QUERIES[:1], "topk": 1, "extra": "ignored"}).encode())
    assert code == 200 and bare["result"] == [[reply["result"][0][0]["document"]]]  # no scores: bare documents
    assert HTTPRetriever(url).search(QUERIES, 3) == r.inner.search(QUERIES, 3)
    code, empty = _post(url, b'{"queries": []}')
    assert (code, empty) == (200, {"result": []})


def test_merged_requests_with_different_topk_get_what_each_would_alone(toy_passages):
    """The batcher merges concurrent requests; the best 5 cut to 3 need not be the best 3 when
    passages tie at the 3rd score, so each topk is searched on its own."""
    import asyncio

    from searchlite.server import Batcher

    r = CountingRetriever(toy_passages)
    names = [p.title for p in toy_passages[:300]]
    q = next(n for n in names if r.inner.search([n], 5)[0][:3] != r.inner.search([n], 3)[0])  # a tie at the cut

    async def both():
        batcher = Batcher(r, wait=0.05, max_batch=4096)  # its first search starts it
        try:
            return await asyncio.gather(batcher.search([q], 3), batcher.search([q, QUERIES[0]], 5))
        finally:
            batcher.task.cancel()

    r.calls.clear()
    three, five = asyncio.run(both())
    assert three == r.inner.search([q], 3) and five == r.inner.search([q, QUERIES[0]], 5)
    assert r.calls == [1, 2]  # one batch, searched once per topk


def test_our_client_never_sends_our_server_a_query_it_refuses(toy_passages):
    """One 10,000-character query (a rambling <search>) used to get the whole request a 422."""
    from searchlite.retrieval import HTTP_QUERY_CHARS
    from searchlite.server import make_app

    r = CountingRetriever(toy_passages)
    long = (QUERIES[0] + " ") * (10_000 // len(QUERIES[0]))
    with running(make_app(r)) as url:  # the server's default bounds
        hits = HTTPRetriever(url).search([long, QUERIES[1]], 2)
    assert hits == r.inner.search([long[:HTTP_QUERY_CHARS], QUERIES[1]], 2) and len(long) > HTTP_QUERY_CHARS


@pytest.mark.parametrize("body, field", [
    ({"queries": ["a"], "topk": 101}, "topk: Input should be less than or equal to 100"),
    ({"queries": ["a"], "topk": -1}, "topk: Input should be greater than or equal to 0"),
    ({"queries": ["a"], "topk": "3"}, "topk: Value error, Input should be a valid integer"),
    ({"queries": ["a"], "topk": 2.5}, "topk: Value error, Input should be a valid integer"),
    ({"queries": ["a"], "topk": float("nan")}, "topk: Value error, Input should be a valid integer"),
    ({"queries": ["a"], "topk": float("inf")}, "topk: Value error, Input should be a valid integer"),  # was a 500
    ({"queries": ["a"], "topk": float("-inf")}, "topk: Value error, Input should be a valid integer"),
    ({"queries": ["a"], "return_scores": "maybe"}, "return_scores: Input should be a valid boolean"),
    ({"queries": ["a"] * 65}, "queries: List should have at most 64 items"),
    ({"queries": "one string"}, "queries"),
    ({"queries": [3]}, "queries.0"),
    ({"topk": 3}, "queries: Field required"),
    ([1, 2], "body: Input should be a valid dictionary or object to extract fields from "
             "(send a JSON object with Content-Type: application/json)"),
])
def test_bad_requests_get_422_naming_the_field(served, body, field):
    code, reply = _post(served[0], json.dumps(body).encode())
    assert code == 422 and field in reply["detail"], reply


def test_malformed_json_and_oversized_body(served):
    for body in (b'{"queries": [', b"\xff\xfe{}"):  # cut off; UTF-16 (its BOM), which JSON allows
        code, reply = _post(served[0], body)
        assert code == 422 and reply["detail"].startswith("body: not valid JSON ("), reply
    code, reply = _post(served[0], b'{"queries": ["\xe9"]}')  # a Latin-1 byte: not UTF-8
    assert code == 400, reply
    from searchlite.server import make_app

    with running(make_app(BM25Retriever(read_corpus(TOY)[:5]), max_body_bytes=100)) as url:
        code, reply = _post(url, json.dumps({"queries": ["x" * 200]}).encode())
    assert code == 413 and "100 bytes" in reply["detail"]


@pytest.mark.parametrize("jobs, calls", [
    ([QUERIES[0:3], QUERIES[3:6], QUERIES[6:7], QUERIES[0:5], QUERIES[7:9]], [3, 3 + 1, 5, 2]),  # 5: alone
    ([QUERIES[0:1], QUERIES[1:3], QUERIES[3:5], QUERIES[5:7]], [1 + 2, 2 + 2]),
])
def test_a_batch_holds_at_most_max_batch_queries_in_arrival_order(toy_passages, jobs, calls):
    """The batcher took one more request whenever the batch was under max_batch, so a batch
    reached almost twice that; a request that does not fit now leads the next batch. A batch is
    filled by queries, not requests: a request over max_batch runs alone, and 1 + 2 queries leave
    no room for 2 more."""
    import asyncio

    from searchlite.server import Batcher

    r = CountingRetriever(toy_passages)

    async def all_jobs():
        batcher = Batcher(r, wait=0.01, max_batch=4)
        try:
            return await asyncio.gather(*(batcher.search(qs, 2) for qs in jobs))
        finally:
            batcher.task.cancel()

    found = asyncio.run(all_jobs())
    assert found == [r.inner.search(qs, 2) for qs in jobs]
    assert r.calls == calls


def test_a_client_gone_from_a_batch_does_not_shift_the_others_hits(toy_passages):
    """A cancelled request's share of a merged batch is still stepped over: the requests after it
    get their own hits, not the next request's."""
    import asyncio

    from searchlite.server import Batcher

    r = CountingRetriever(toy_passages)

    async def three():
        batcher = Batcher(r, wait=0.1, max_batch=4096)
        try:
            gone = asyncio.ensure_future(batcher.search(QUERIES[0:2], 2))
            rest = [asyncio.ensure_future(batcher.search(qs, 2)) for qs in (QUERIES[2:3], QUERIES[3:5])]
            await asyncio.sleep(0.02)  # all three queued, the batch not yet searched
            gone.cancel()
            return await asyncio.gather(*rest)
        finally:
            batcher.task.cancel()

    second, third = asyncio.run(three())
    assert r.calls == [5]  # one merged search, the gone request's queries included
    assert second == r.inner.search(QUERIES[2:3], 2) and third == r.inner.search(QUERIES[3:5], 2)


def test_make_app_holds_batches_to_its_max_batch(toy_passages):
    from searchlite.server import make_app

    r = CountingRetriever(toy_passages)
    body = lambda q: json.dumps({"queries": [q], "topk": 1, "return_scores": True}).encode()  # noqa: E731
    with running(make_app(r, max_batch=2, batch_wait=0.3)) as url, ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda q: _post(url, body(q))[1]["result"][0][0]["document"]["id"], QUERIES[:4]))
    assert found == [hits[0].id for hits in r.inner.search(QUERIES[:4], 1)]
    assert sum(r.calls) == 4 and max(r.calls) <= 2  # four requests in one wait: batches of 2 at most


def test_our_client_reaches_our_server_by_a_url_with_a_trailing_slash(served):
    """http://host:port/ is a common way to write the URL: '//retrieve' is a 404 on this server (the
    stdlib test server of test_retrieval.py folds the double slash, so it cannot tell)."""
    url, r = served
    assert HTTPRetriever(url + "/").search(QUERIES[:2], 2) == r.inner.search(QUERIES[:2], 2)


def test_an_app_mounted_in_another_answers(toy_passages):
    """Starlette runs no lifespan of a mounted app: the batcher never started and /retrieve hung."""
    from fastapi import FastAPI

    from searchlite.server import make_app

    r = BM25Retriever(toy_passages)
    outer = FastAPI()
    outer.mount("/search", make_app(r))
    with running(outer) as url:
        code, reply = _post(url + "/search", json.dumps({"queries": [QUERIES[0]], "topk": 2}).encode())
    expected = [[passage_to_dict(Passage(h.id, h.title, h.text)) for h in r.search([QUERIES[0]], 2)[0]]]
    assert (code, reply) == (200, {"result": expected})


def _errors_logged(caplog) -> list[str]:
    gc.collect()  # asyncio reports a failed task nobody read when the task is collected
    return [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]


def test_an_app_served_on_one_event_loop_after_another_answers(toy_passages, caplog):
    """The batcher's queue was made with the app and bound to the first event loop that used it:
    served again on a second loop (a second TestClient), every request started a batcher task
    that died ("is bound to a different event loop", reported as "Task exception was never
    retrieved")."""
    from fastapi.testclient import TestClient

    from searchlite.server import make_app

    r = BM25Retriever(toy_passages)
    app = make_app(r)
    expected = {"result": [[passage_to_dict(Passage(h.id, h.title, h.text)) for h in r.search([QUERIES[0]], 2)[0]]]}
    for _ in range(2):
        with TestClient(app) as client:  # a lifespan on a loop of its own
            for _ in range(2):
                reply = client.post("/retrieve", json={"queries": [QUERIES[0]], "topk": 2})
                assert (reply.status_code, reply.json()) == (200, expected)
    client = TestClient(app)  # no lifespan: each request runs on a loop of its own
    for _ in range(2):
        assert client.post("/retrieve", json={"queries": [QUERIES[0]], "topk": 2}).json() == expected
    assert _errors_logged(caplog) == []


def test_a_batcher_that_fails_answers_500_and_serves_the_next_request(toy_passages, monkeypatch, caplog):
    """A batcher that died with a batch in hand left those requests waiting forever; now each
    gets a 500 naming the error, and the next request is served."""
    from searchlite.server import Batcher, make_app

    r = CountingRetriever(toy_passages)
    body = json.dumps({"queries": [QUERIES[0]], "topk": 2}).encode()
    with running(make_app(r)) as url:
        assert _post(url, body)[0] == 200
        r.search = lambda queries, k: None  # not a list per query: handing the hits out fails
        code, reply = _post(url, body)  # hung (a timeout here) before
        assert code == 500 and reply["detail"].startswith("search failed: TypeError: 'NoneType' object")
        del r.search
        assert _post(url, body)[0] == 200

        def die(self, queue, jobs):
            raise RuntimeError("boom")

        monkeypatch.setattr(Batcher, "_fill", die)  # the batcher's own loop fails, a batch in hand
        assert _post(url, body) == (500, {"detail": "search failed: RuntimeError: boom"})
        monkeypatch.undo()
        assert _post(url, body)[0] == 200  # started again
    errors = _errors_logged(caplog)
    assert errors == ["the search batcher stopped; the next request restarts it"]  # said once, not "never retrieved"


def test_missing_null_or_zero_topk_gets_the_default_as_in_search_r1(toy_passages):
    """Search-R1's server does `if not request.topk: request.topk = config.retrieval_topk`, and its
    clients may lean on it. return_scores stays a JSON boolean, as the served schema says (a fuzz
    test holds the server to it): Search-R1's clients send one."""
    from searchlite.server import make_app

    r = CountingRetriever(toy_passages)
    q = QUERIES[0]
    two, five = [[h.id for h in r.inner.search([q], k)[0]] for k in (2, 5)]
    assert len(five) == 5
    with running(make_app(r, default_topk=2)) as url:
        for extra, ids in (({}, two), ({"topk": None}, two), ({"topk": 0}, two), ({"topk": 5}, five),
                           ({"topk": 5.0}, five)):
            code, reply = _post(url, json.dumps({"queries": [q], **extra}).encode())
            assert code == 200 and [d["id"] for d in reply["result"][0]] == ids, extra
        for flag, keys in ((True, {"document", "score"}), (False, {"id", "contents"})):
            code, reply = _post(url, json.dumps({"queries": [q], "return_scores": flag}).encode())
            assert code == 200 and [set(item) for item in reply["result"][0]] == [keys, keys], flag
        for flag in ("true", 1, 0):
            code, reply = _post(url, json.dumps({"queries": [q], "return_scores": flag}).encode())
            assert (code, reply) == (422, {"detail": "return_scores: Input should be a valid boolean"}), flag
    for bad in (0, 101):
        with pytest.raises(ValueError, match=f"default_topk must be 1..100, got {bad}"):
            make_app(r, default_topk=bad)
    for ends in (1, 100):  # both ends of the range are served
        make_app(r, default_topk=ends)


def test_a_query_over_max_query_chars_is_cut_not_refused(served):
    """Search-R1's client sends queries of any length, and a 422 crashes it (KeyError 'result')."""
    url, r = served  # max_query_chars=500
    long = (QUERIES[2] + " ") * 40
    code, reply = _post(url, json.dumps({"queries": [long, QUERIES[1]], "topk": 2}).encode())
    assert len(long) > 500 and r.queries == [long[:500], QUERIES[1]]
    expected = r.inner.search([long[:500], QUERIES[1]], 2)
    assert code == 200 and [[d["id"] for d in docs] for docs in reply["result"]] == [[h.id for h in hits]
                                                                                      for hits in expected]


def test_a_body_without_content_length_gets_411(toy_passages):
    """A chunked upload announces no size, so the max_body_bytes check never saw it."""
    import http.client

    from searchlite.server import make_app

    body = json.dumps({"queries": ["x" * 200]}).encode()
    with running(make_app(BM25Retriever(toy_passages[:5]), max_body_bytes=100)) as url:
        host = url.removeprefix("http://")
        conn = http.client.HTTPConnection(host, timeout=5)
        conn.request("POST", "/retrieve", body=iter([body[:100], body[100:]]),  # an iterable is sent chunked
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())) == (
            411, {"detail": "a Content-Length header is required (no chunked bodies)"})
        conn.close()
        conn = http.client.HTTPConnection(host, timeout=5)
        conn.putrequest("POST", "/retrieve")  # no body, no Content-Length
        conn.endheaders()
        assert conn.getresponse().status == 411
        conn.close()
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            assert (resp.status, json.loads(resp.read())) == (200, {"status": "ok", "passages": 5})
        assert _post(url, b'{"queries": []}') == (200, {"result": []})  # a Content-Length under the limit


def test_a_large_answer_is_written_off_the_event_loop():
    """A 57 MB answer was turned into JSON on the event loop and held /health up for 2 s. Here
    writing the answer blocks until /health has answered; the bytes are JSONResponse's."""
    from searchlite.server import make_app

    writing, health_answered = threading.Event(), threading.Event()

    class SlowHit:  # its text is read while the answer is written
        id, title, score = "7", "Zürich", 1.5

        @property
        def text(self):
            writing.set()
            health_answered.wait(3)
            return "Zürich is a city."

    class SlowRetriever:
        def search(self, queries, k):
            return [[SlowHit()] for _ in queries]

    body = json.dumps({"queries": ["city"], "topk": 1, "return_scores": True}).encode()
    with running(make_app(SlowRetriever())) as url, ThreadPoolExecutor(1) as pool:
        req = urllib.request.Request(url + "/retrieve", data=body, headers={"Content-Type": "application/json"})
        answer = pool.submit(urllib.request.urlopen, req, timeout=10)
        assert writing.wait(5)
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            assert resp.status == 200
        health_answered.set()
        with answer.result() as resp:
            assert resp.headers["Content-Type"] == "application/json"
            doc = {"id": "7", "contents": '"Zürich"\nZürich is a city.'}
            expected = {"result": [[{"document": doc, "score": 1.5}]]}
            assert resp.read() == json.dumps(expected, ensure_ascii=False, separators=(",", ":")).encode()


def test_concurrent_requests_share_one_search(served):
    url, r = served
    r.calls.clear()
    with ThreadPoolExecutor(16) as pool:
        out = list(pool.map(lambda q: HTTPRetriever(url).search([q], 2), QUERIES * 4))
    assert out == [r.inner.search([q], 2) for q in QUERIES * 4]
    assert sum(r.calls) == len(out) and len(r.calls) < len(out)  # requests were merged


def test_load_32_clients_50_requests_each(served):
    url, r = served
    pool_queries = [[q] for q in QUERIES] + [QUERIES[i:i + 3] for i in range(len(QUERIES) - 2)]
    expected = {tuple(qs): r.inner.search(qs, 3) for qs in pool_queries}

    def client(c):
        http = HTTPRetriever(url, timeout=30, retries=0)
        for i in range(50):
            qs = pool_queries[(c * 7 + i) % len(pool_queries)]
            assert http.search(qs, 3) == expected[tuple(qs)]
        return 50

    with ThreadPoolExecutor(32) as pool:
        assert sum(pool.map(client, range(32))) == 1600  # an error in any client re-raises here


def test_fuzz_against_own_openapi_schema(served):
    """schemathesis generates valid and invalid bodies from /openapi.json; no answer is a 5xx
    and every answer matches the schema (status codes, response bodies)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    url = served[0]
    with urllib.request.urlopen(url + "/openapi.json") as resp:
        schema = schemathesis.openapi.from_dict(json.loads(resp.read()))
    for path, method in (("/retrieve", "POST"), ("/health", "GET")):
        op = schema[path][method]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call(base_url=url)
                assert response.status_code < 500, (case.body, response.text)
                case.validate_response(response)

            if mode is GenerationMode.POSITIVE or method == "POST":
                check()


def test_client_fails_clearly_when_the_server_is_gone(toy_passages):
    from searchlite.server import make_app

    with running(make_app(BM25Retriever(toy_passages[:5]))) as url:
        client = HTTPRetriever(url, timeout=2, retries=2, backoff=0.01)
        assert client.search([toy_passages[0].text], 1)[0]
    with pytest.raises(RuntimeError, match=re.escape(url + "/retrieve") + r" failed after 3 attempt\(s\).*retrieve.py serve"):
        client.search([toy_passages[0].text], 1)


def test_serve_refuses_a_port_no_socket_has(capsys):
    """--port 99999 printed 'serving http://127.0.0.1:99999/retrieve' and listened on a random port."""
    import retrieve

    with pytest.raises(SystemExit):
        retrieve.main(["serve", "--port", "99999"])
    assert "argument --port: must be at most 65535, got 99999" in capsys.readouterr().err


def test_a_dense_folder_built_with_a_relative_encoder_loads_from_anywhere(tmp_path, encoder, monkeypatch):
    """dense.json kept --encoder as typed ("enc/x"): read from another folder it was a hub name."""
    shutil.copytree(encoder, tmp_path / "enc" / "tiny-e5-bert")
    monkeypatch.chdir(tmp_path)
    build_dense_folder(TOY, tmp_path / "idx", "enc/tiny-e5-bert", max_length=48, progress=False)
    assert json.loads((tmp_path / "idx" / "dense.json").read_text())["encoder"] == str(tmp_path / "enc" / "tiny-e5-bert")
    here = load_index(tmp_path / "idx").search(QUERIES[:3], 3)
    monkeypatch.chdir(TOY_DIR)
    assert load_index(tmp_path / "idx").search(QUERIES[:3], 3) == here
    # a build resumed from another folder is the same build
    build_dense_folder(TOY, tmp_path / "idx", str(tmp_path / "enc" / "tiny-e5-bert"), max_length=48, progress=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # a hub lookup that cannot connect
    with pytest.raises(ValueError, match=re.escape("encoder 'enc/nowhere' could not be loaded")):  # took 50 s
        TextEncoder("enc/nowhere")


def test_max_length_past_the_encoders_positions_is_cut_to_them(encoder):
    """--max_length 1024 over a 512-position encoder was saved, and the first long text crashed in torch
    (in a server, every request batched with it got a 500)."""
    with pytest.warns(UserWarning, match="max_length 1024 is more than encoder .* 512 positions"):
        enc = TextEncoder(encoder, max_length=1024)
    assert enc.max_length == 512
    assert enc.encode(["press founder " * 400, "bank"]).shape[0] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as many as it has: no warning
        assert TextEncoder(encoder, max_length=512).max_length == 512


def test_an_encoder_that_names_no_position_limit_keeps_max_length(encoder, tmp_path):
    """XLNet has relative positions, no position table: its config says -1, and a tokenizer with no
    model_max_length has transformers' huge stand-in. No limit, so --max_length is kept, with no warning."""
    import torch
    from transformers import AutoTokenizer, XLNetConfig, XLNetModel

    tok = AutoTokenizer.from_pretrained(encoder)
    tok.save_pretrained(tmp_path)
    torch.manual_seed(0)
    XLNetModel(XLNetConfig(vocab_size=len(tok), d_model=32, n_layer=1, n_head=2, d_inner=64)).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc = TextEncoder(str(tmp_path), max_length=1024)
    assert enc.model.config.max_position_embeddings == -1 and enc.tokenizer.model_max_length > 10**20
    assert enc.max_length == 1024 and enc.encode(["press founder", "bank"]).shape[0] == 2


def test_an_index_over_a_copy_with_lines_moved_warns(tmp_path, toy_passages):
    """Count and sampled ids matched, so a corpus with two lines swapped, given by another path, loaded
    silently and showed one passage's text with another's score."""
    import warnings

    folder = tmp_path / "i"
    build_bm25_folder(TOY, folder, progress=False)
    rows = [json.loads(line) for line in TOY.read_text().splitlines()]
    a, b = 3, next(i for i in range(4, len(rows)) if len(json.dumps(rows[i])) != len(json.dumps(rows[3])))
    rows[a], rows[b] = {**rows[b], "id": rows[a]["id"]}, {**rows[a], "id": rows[b]["id"]}  # ids stay in place
    (tmp_path / "moved.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(TOY, tmp_path / "copy.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_index(folder, str(tmp_path / "copy.jsonl"))  # the same lines by another path: no warning
    with pytest.warns(UserWarning, match=re.escape(f"{tmp_path / 'moved.jsonl'} is not the file {folder} was built")):
        load_index(folder, str(tmp_path / "moved.jsonl"))


class Picky(CountingRetriever):
    """Fails any search that holds the query "bad"."""

    def search(self, queries, k):
        if "bad" in queries:
            raise RuntimeError("no such query")
        return super().search(queries, k)


def test_one_failing_request_in_a_batch_fails_alone(toy_passages):
    """The merged batch's search failed for all: a short query batched with a bad one got a 500 too."""
    import asyncio

    from searchlite.server import Batcher

    r = Picky(toy_passages)

    async def three():
        batcher = Batcher(r, wait=0.05, max_batch=4096)
        try:
            return await asyncio.gather(batcher.search([QUERIES[0]], 3), batcher.search(["bad"], 3),
                                        batcher.search([QUERIES[1]], 3), return_exceptions=True)
        finally:
            batcher.task.cancel()

    first, bad, last = asyncio.run(three())
    assert first == r.inner.search([QUERIES[0]], 3) and last == r.inner.search([QUERIES[1]], 3)
    assert isinstance(bad, RuntimeError) and str(bad) == "no such query"


def test_a_failing_request_whose_client_went_away_fails_no_other(toy_passages):
    """The bad request's client is gone (its future cancelled) when its batch fails: the error is
    not set on it (that raised InvalidStateError, which stopped the batcher before it answered the
    two good requests queued beside it: they waited for ever), and the batcher keeps serving."""
    import asyncio

    from searchlite.server import Batcher

    r = Picky(toy_passages)

    async def three():
        batcher = Batcher(r, wait=0.1, max_batch=4096)
        try:
            gone = asyncio.ensure_future(batcher.search(["bad"], 3))
            rest = [asyncio.ensure_future(batcher.search([q], 3)) for q in QUERIES[:2]]
            await asyncio.sleep(0.02)  # all three queued, the batch not yet searched
            gone.cancel()
            found = await asyncio.wait_for(asyncio.gather(*rest), 10)
            return found, batcher.task.done()
        finally:
            batcher.task.cancel()

    found, stopped = asyncio.run(three())
    assert found == [r.inner.search([q], 3) for q in QUERIES[:2]] and not stopped


@pytest.mark.parametrize("flag", ["--shard_size", "--batch_size", "--max_length"])
def test_cli_build_sizes_are_checked_before_anything_is_written(tmp_path, capsys, flag):
    """--shard_size 0 failed after writing a manifest that then refused the corrected rerun."""
    import retrieve

    with pytest.raises(SystemExit):
        retrieve.main(["build", "--corpus", str(TOY), "--encoder", "x", "--out", str(tmp_path / "o"), flag, "0"])
    assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
