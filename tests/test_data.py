"""Corpus and QA readers: both accepted forms, every malformed case with its line number,
and write/read round trips."""

import gzip
import json
import re
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from searchlite.data import (QA, DataError, Passage, passage_to_dict, qa_to_dict, read_corpus, read_qa,
                             split_contents, write_jsonl)


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_log_line_torn_by_an_interrupt_is_cut_so_the_next_append_starts_whole(tmp_path):
    from searchlite.data import append_log, read_log

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"st')
    assert read_log(log, cut=False) == [{"step": 1}] and log.read_text().endswith('{"st')  # a reader leaves it
    assert read_log(log) == [{"step": 1}] and log.read_text() == '{"step": 1}\n'
    append_log(log, [{"step": 2, "answer": "Zoë"}])
    assert read_log(log) == [{"step": 1}, {"step": 2, "answer": "Zoë"}]
    assert log.read_text(encoding="utf-8").endswith('"Zoë"}\n')  # not ASCII-escaped, as write_jsonl writes


def test_appended_log_lines_are_on_disk_when_append_log_returns(tmp_path, monkeypatch):
    """The sampling log's promise (each finished batch survives a crash): the lines are flushed
    and fsynced before append_log returns, not left in a buffer or the page cache."""
    import os

    from searchlite.data import append_log

    log, synced, fsync = tmp_path / "rejection_sampling.jsonl", [], os.fsync

    def spy(fd):  # what the file holds when it is synced: the lines, flushed from Python's buffer
        name = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((name, Path(name).read_bytes()))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    append_log(log, [{"next": 4}, {"next": 8}])
    assert synced == [(str(log), b'{"next": 4}\n{"next": 8}\n')]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path):
    from searchlite.data import write_durably

    path = tmp_path / "index.json"
    path.write_text("old")

    def half(f):
        f.write("new, half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_durably(path, half, "w")
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"] and path.read_text() == "old"


def test_logs_and_durable_text_files_are_written_in_utf8_under_an_ascii_locale(tmp_path):
    """A log record or an index file (a BM25 vocabulary) holding an accent is written as UTF-8 under
    an ASCII locale too (in the locale's encoding, the write failed; the tests that reach the lines
    run under UTF-8)."""
    from conftest import run_under_ascii_locale

    script = ("import sys; from searchlite.data import append_log, write_durably; "
              "append_log(sys.argv[1], [{'q': 'Z\\u00fcrich'}]); "
              "write_durably(sys.argv[2], lambda f: f.write('Z\\u00fcrich'), 'w')")
    done = run_under_ascii_locale(script, str(tmp_path / "log.jsonl"), str(tmp_path / "vocab.json"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "log.jsonl").read_bytes() == '{"q": "Z\u00fcrich"}\n'.encode("utf-8")
    assert (tmp_path / "vocab.json").read_bytes() == "Z\u00fcrich".encode("utf-8")


def test_corpus_wiki18_form(tmp_path):
    p = _write_lines(tmp_path / "c.jsonl", [
        json.dumps({"id": "12", "contents": '"Paris"\nParis is the capital of France.\nSecond line.'}),
        json.dumps({"id": 13, "contents": '"The "Best" Film"\nA film.'}),  # inner quotes kept
        json.dumps({"id": "14", "contents": "no title line"}),
    ])
    assert read_corpus(p) == [
        Passage("12", "Paris", "Paris is the capital of France.\nSecond line."),
        Passage("13", 'The "Best" Film', "A film."),
        Passage("14", "", "no title line"),
    ]


def test_corpus_title_text_form_and_blank_lines(tmp_path):
    p = _write_lines(tmp_path / "c.jsonl", [
        json.dumps({"id": "a", "title": "Lima", "text": "Lima is the capital of Peru."}),
        "",
        "   ",
        json.dumps({"id": "b", "text": "No title here."}),
        json.dumps({"title": "Quito", "text": "Capital of Ecuador."}),  # no id: 0-based line index
    ])
    assert read_corpus(p) == [
        Passage("a", "Lima", "Lima is the capital of Peru."),
        Passage("b", "", "No title here."),
        Passage("4", "Quito", "Capital of Ecuador."),
    ]


def test_qa_golden_answers_and_answer_forms(tmp_path):
    p = _write_lines(tmp_path / "q.jsonl", [
        json.dumps({"id": "q1", "question": "Capital of Peru?", "golden_answers": ["Lima", "Lima, Peru"],
                    "type": "bridge", "hops": 2}),
        json.dumps({"id": 7, "question": "Capital of France?", "answer": "Paris"}),
        json.dumps({"question": "Capital of Ecuador?", "answer": ["Quito"]}),
        json.dumps({"id": "q4", "question": "Capital of Chile?", "golden_answers": ["Santiago"], "answer": "Lima"}),
    ])
    assert read_qa(p) == [
        QA("q1", "Capital of Peru?", ["Lima", "Lima, Peru"], {"type": "bridge", "hops": 2}),
        QA("7", "Capital of France?", ["Paris"], {}),
        QA("2", "Capital of Ecuador?", ["Quito"], {}),
        QA("q4", "Capital of Chile?", ["Santiago"], {"answer": "Lima"}),  # golden_answers first; answer kept as meta
    ]


GOOD_C = json.dumps({"id": "1", "contents": '"T"\nx'})
GOOD_Q = json.dumps({"id": "1", "question": "q?", "golden_answers": ["x"]})


@pytest.mark.parametrize("reader,good,bad,words", [
    (read_corpus, GOOD_C, '{"id": "2", "contents": ', "bad JSON: the line ends before its JSON does (cut off?)"),
    (read_corpus, GOOD_C, '{"id": "2", "conte', "bad JSON: the line ends before its JSON does (cut off?)"),  # in a string
    (read_corpus, GOOD_C, '{"id": "2" "contents": "x"}', "bad JSON: Expecting ',' delimiter (column 12)"),
    (read_corpus, GOOD_C, '["not", "an", "object"]', "JSON object"),
    (read_corpus, GOOD_C, '{"id": "2"}', "contents"),
    (read_corpus, GOOD_C, '{"id": "2", "contents": 5}', "'contents' must be a string"),
    (read_corpus, GOOD_C, '{"id": 2.5, "contents": "x"}', "'id' must be a string or integer"),
    (read_corpus, GOOD_C, '{"id": true, "contents": "x"}', "'id' must be a string or integer, got bool"),
    (read_corpus, GOOD_C, '{"id": "2", "title": 3, "text": "x"}', "'title' must be a string"),
    (read_corpus, GOOD_C, '{"id": "1", "contents": "dup"}', "duplicate id '1' (first on line 1)"),
    (read_qa, GOOD_Q, "{'single': 'quotes'}", "bad JSON"),
    (read_qa, GOOD_Q, '{"id": "2", "golden_answers": ["a"]}', "missing field 'question'"),
    (read_qa, GOOD_Q, '{"id": "2", "question": "q?"}', "missing field 'golden_answers'"),
    (read_qa, GOOD_Q, '{"id": "2", "question": "q?", "golden_answers": []}', "empty list"),
    (read_qa, GOOD_Q, '{"id": "2", "question": "q?", "golden_answers": "a"}', "must be a list"),
    (read_qa, GOOD_Q, '{"id": "2", "question": "q?", "golden_answers": [1990]}', "not a string"),
    (read_qa, GOOD_Q, '{"id": "2", "question": "q?", "golden_answers": [" "]}', "empty answer"),
    (read_qa, GOOD_Q, '{"id": "2", "question": "q?", "answer": 3}', "'answer' must be a list"),
    (read_qa, GOOD_Q, '{"id": "2", "question": ["q?"], "answer": "a"}', "'question' must be a string"),
    (read_qa, GOOD_Q, '{"id": "2", "question": "  ", "answer": "a"}', "'question' is empty"),
    (read_qa, GOOD_Q, '{"id": null, "question": "q?", "answer": "a"}', "'id' must be"),
    (read_qa, GOOD_Q, '{"id": "2", "question": "q?", "answer": "a", "score": NaN}', "NaN is not a JSON value"),
    (read_corpus, GOOD_C, '{"id": "2", "contents": "x", "n": ' + "9" * 5000 + "}", "bad JSON: Exceeds the limit"),
])
def test_malformed_line_names_file_and_line(tmp_path, reader, good, bad, words):
    # good line, a blank line (still counted), then the bad one on line 3
    p = _write_lines(tmp_path / "f.jsonl", [good, "", bad, good.replace('"1"', '"9"')])
    with pytest.raises(DataError) as e:
        reader(p)
    assert str(e.value).startswith(f"{p}:3: "), str(e.value)
    assert words in str(e.value)


def test_contents_wins_over_title_and_text_on_one_line(tmp_path):
    """A line holding both forms is read as Search-R1's: `contents` (FlashRAG's corpora keep both)."""
    line = {"id": "1", "title": "Lima", "text": "other", "contents": '"Paris"\nThe capital.'}
    assert read_corpus(_write_lines(tmp_path / "c.jsonl", [json.dumps(line)])) == [Passage("1", "Paris", "The capital.")]


def test_a_windows_line_end_inside_contents_leaves_the_title_clean(tmp_path):
    p = _write_lines(tmp_path / "c.jsonl", [json.dumps({"id": "1", "contents": '"Paris"\r\nThe capital.'})])
    assert [(x.title, x.text) for x in read_corpus(p)] == [("Paris", "The capital.")]


def test_invalid_utf8_names_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(GOOD_C.encode() + b"\n" + b'{"id": "2", "contents": "\xff"}\n')
    with pytest.raises(DataError, match=r":2: not valid UTF-8"):
        read_corpus(p)
    p.write_bytes(b'{"id": "2", "contents": "\xff"}\n')  # on line 1, but no gzip magic: no gzip hint
    with pytest.raises(DataError, match=r"c.jsonl:1: not valid UTF-8 \([^)]*\)$"):
        read_corpus(p)
    (tmp_path / "c.jsonl").write_bytes(gzip.compress(GOOD_C.encode() + b"\n"))  # gzip under a plain name
    with pytest.raises(DataError, match=r"c.jsonl:1: not valid UTF-8 \(.*\); it is gzip-compressed: name it .gz$"):
        read_corpus(p)
    (tmp_path / "C.JSONL.GZ").write_bytes(gzip.compress(GOOD_C.encode() + b"\n"))
    assert [x.id for x in read_corpus(tmp_path / "C.JSONL.GZ")] == ["1"]


def test_an_unpaired_surrogate_escape_names_line_and_field(tmp_path):
    """JSON's "\\ud83d" alone parses to half a UTF-16 pair: it failed later, in the tokenizer or a
    UTF-8 log, with no file or line. A pair (how json.dumps writes an emoji) is one character."""
    from searchlite.corpus import Corpus

    pair = '{"id": "1", "question": "smile \\ud83d\\ude00", "golden_answers": ["x"]}'
    alone = '{"id": "2", "question": "who", "golden_answers": ["x", "half \\uD83D"]}'
    q = _write_lines(tmp_path / "q.jsonl", [pair, alone])
    with pytest.raises(DataError, match=r"q.jsonl:2: field 'golden_answers'\[1\] holds \\ud83d, half of a UTF-16 "
                                        r"surrogate pair"):
        read_qa(q)
    assert read_qa(_write_lines(tmp_path / "ok.jsonl", [pair]))[0].question == "smile \U0001f600"
    c = _write_lines(tmp_path / "c.jsonl", [GOOD_C, '{"id": "2", "contents": "\\"T\\"\\ncut \\udc00"}'])
    for read in (read_corpus, lambda p: list(Corpus(p))):
        with pytest.raises(DataError, match=r"c.jsonl:2: field 'contents' holds \\udc00"):
            read(c)


def test_a_line_with_an_escaped_pair_reads_whatever_its_other_values_are(tmp_path):
    """An escaped pair sends the line through the surrogate check, which walks every value: numbers,
    true and null are no text to check, not an error (a QA line may carry metadata of any JSON type)."""
    line = ('{"id": 7, "question": "smile \\ud83d\\ude00", "golden_answers": ["x"], '
            '"metadata": {"level": 2, "hard": true, "source": null, "weight": 0.5}}')
    qa = read_qa(_write_lines(tmp_path / "q.jsonl", [line]))
    assert [(q.id, q.question) for q in qa] == [("7", "smile \U0001f600")]
    assert qa[0].meta == {"metadata": {"level": 2, "hard": True, "source": None, "weight": 0.5}}


def test_a_surrogate_in_a_field_name_or_at_the_range_ends_is_named(tmp_path):
    """Field names are checked too, and both ends of the surrogate range (U+D800, U+DFFF) count."""
    for line, where, ch in [('{"id": "1", "q\\ud800": 1, "question": "q?", "golden_answers": ["x"]}',
                             "a field name", "d800"),
                            ('{"id": "1", "question": "q? \\udfff", "golden_answers": ["x"]}',
                             "field 'question'", "dfff")]:
        p = _write_lines(tmp_path / "q.jsonl", [line])
        with pytest.raises(DataError, match=re.escape(f"{p}:1: {where} holds \\u{ch}, half of a UTF-16")):
            read_qa(p)


def _damaged_gz(kind, good):
    """The bytes of a .gz file holding one line `good`, damaged as `kind` says."""
    raw = gzip.compress((good + "\n").encode())
    if kind == "cut":  # an interrupted download: the last bytes are missing
        return raw[: len(raw) // 2]
    if kind == "plain":  # plain JSONL under a .gz name
        return (good + "\n").encode()
    if kind == "crc":  # the data inflate, but their checksum is wrong
        return raw[:-8] + struct.pack("<I", zlib.crc32(b"other")) + raw[-4:]
    return raw[:10] + b"\x07"  # "block": a deflate block of the reserved type 3 (zlib.error)


@pytest.mark.parametrize("reader,good", [(read_corpus, GOOD_C), (read_qa, GOOD_Q)], ids=["corpus", "qa"])
@pytest.mark.parametrize("kind,line,why", [
    ("cut", 1, "Compressed file ended before the end-of-stream marker was reached"),  # EOFError
    ("plain", 1, "Not a gzipped file"),  # gzip.BadGzipFile
    ("crc", 2, "CRC check failed"),  # gzip.BadGzipFile, met after the one line was read
    ("block", 1, "invalid block type"),  # zlib.error
], ids=["cut", "plain", "crc", "block"])
def test_damaged_gzip_names_file_and_line(tmp_path, reader, good, kind, line, why):
    p = tmp_path / "f.jsonl.gz"
    p.write_bytes(_damaged_gz(kind, good))
    with pytest.raises(DataError) as e:  # not a bare EOFError/BadGzipFile/zlib.error: train.py catches DataError
        reader(p)
    assert str(e.value).startswith(f"{p}:{line}: the gzip stream is cut off or damaged ("), str(e.value)
    assert why in str(e.value)


def test_cut_gzip_names_the_line_reached(tmp_path):
    # many lines, cut halfway: the lines before the cut are read, the error names the one after
    p = tmp_path / "c.jsonl.gz"
    write_jsonl(p, ({"id": str(i), "contents": f'"T{i}"\ntext {i} ' + "w" * (i % 37)} for i in range(3000)))
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(DataError) as e:
        read_corpus(p)
    m = re.match(rf"{re.escape(str(p))}:(\d+): the gzip stream is cut off or damaged \(Compressed file ended", str(e.value))
    assert m and 1 < int(m.group(1)) < 3000, str(e.value)


def test_write_read_round_trip(tmp_path):
    passages = [Passage("1", "Paris", "Capitale de la France — « ville lumière ».\nLine two."),
                Passage("2", "", "Untitled\r text\u2028 with odd line breaks")]
    questions = [QA("q1", "Where?", ["Paris", "France"], {"type": "bridge", "supporting": [1, 2]}),
                 QA("q2", "Who?", ["Zoë"])]
    sub = tmp_path / "sub" / "dir"  # parent folders are created
    for suffix in ("jsonl", "jsonl.gz"):
        write_jsonl(sub / f"c.{suffix}", map(passage_to_dict, passages))
        write_jsonl(sub / f"q.{suffix}", map(qa_to_dict, questions))
        assert read_corpus(sub / f"c.{suffix}") == passages
        assert read_qa(sub / f"q.{suffix}") == questions
    with gzip.open(sub / "q.jsonl.gz", "rt", encoding="utf-8") as f:  # really gzipped
        assert json.loads(f.readline()) == {"id": "q1", "question": "Where?", "golden_answers": ["Paris", "France"],
                                            "type": "bridge", "supporting": [1, 2]}
    raw = (sub / "q.jsonl.gz").read_bytes()  # its header names the file (gunzip -N), not a temporary
    assert raw[3] & 8 and raw[10:].split(b"\0")[0] == b"q.jsonl"
    assert "Zoë" in (sub / "q.jsonl").read_text(encoding="utf-8")  # not ASCII-escaped
    assert not list(sub.glob("*.tmp"))


def test_an_os_error_reads_path_and_reason_only_when_it_has_both():
    from searchlite.data import os_error_text

    assert os_error_text(FileNotFoundError(2, "No such file or directory", "c.jsonl")) == \
        "c.jsonl: No such file or directory"
    assert os_error_text(OSError(28, "No space left on device")) == "[Errno 28] No space left on device"
    assert os_error_text(PermissionError("c.jsonl is read-only")) == "c.jsonl is read-only"


def test_qa_to_dict_meta_cannot_override_core_fields():
    d = qa_to_dict(QA("q", "Q?", ["a"], {"question": "other", "hops": 2}))
    assert d == {"id": "q", "question": "Q?", "golden_answers": ["a"], "hops": 2}


@settings(max_examples=200, deadline=None)
@given(title=st.text().filter(lambda t: "\n" not in t), text=st.text())
def test_contents_round_trip(title, text):
    p = Passage("0", title, text)
    assert split_contents(p.contents) == (title, text)


def test_contents_with_a_bare_or_a_short_quoted_title():
    """Only a first line both opened and closed by a double quote loses its quotes: a bare title
    (some corpora leave them out) stays whole, and so does a lone quote; "" is an empty title."""
    assert split_contents("Paris\nThe capital.") == ("Paris", "The capital.")
    assert split_contents('"P"\nx') == ("P", "x") and split_contents('""\nx') == ("", "x")
    assert split_contents('"\nx') == ('"', "x") and split_contents('"Paris\nx') == ('"Paris', "x")


def test_a_newline_in_a_title_stays_in_the_title():
    """The first newline of `contents` ends the title: one inside it became a space, not the start of
    the text (what a retrieval server's client read: title 'Multi', text 'line title\\nbody')."""
    assert split_contents(Passage("0", "Multi\nline title", "body").contents) == ("Multi line title", "body")


def _write_many(path, k: int, errors) -> None:
    from searchlite.data import write_durably

    try:
        for _ in range(30):
            write_durably(path, lambda f: f.write(bytes([k]) * 200_000))
    except OSError as e:  # noqa: PERF203
        errors.put(f"{type(e).__name__}: {e}")


def test_processes_writing_one_file_at_once_each_finish(tmp_path):
    """torchrun ranks refresh one index folder's offsets cache together: each writes its own
    temporary file, so none finds its file renamed away by another, and the file is whole."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    errors, path = ctx.Queue(), tmp_path / "cache.bin"
    procs = [ctx.Process(target=_write_many, args=(path, k, errors)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert errors.empty(), errors.get()
    data = path.read_bytes()
    assert len(data) == 200_000 and len(set(data)) == 1 and list(tmp_path.iterdir()) == [path]


def test_read_qa_refuses_a_repeated_id_only_when_asked(tmp_path):
    """Evaluation keys its records by id; a training set merged from two may repeat one."""
    p = _write_lines(tmp_path / "q.jsonl", [GOOD_Q, "", GOOD_Q.replace('"q?"', '"other?"')])
    assert [q.question for q in read_qa(p)] == ["q?", "other?"]
    with pytest.raises(DataError, match=re.escape(f"{p}:3: duplicate id '1' (first on line 1)")):
        read_qa(p, unique_ids=True)


def test_read_qa_warns_once_about_golds_that_normalise_to_nothing(tmp_path):
    rows = [{"id": "1", "question": "Blood type?", "golden_answers": ["A"]},
            {"id": "2", "question": "q?", "golden_answers": ["Paris", "The."]},
            {"id": "3", "question": "q?", "golden_answers": ["Rome"]}]
    p = _write_lines(tmp_path / "q.jsonl", [json.dumps(r) for r in rows])
    blank = f"{p}: 2 gold answer(s) normalise to an empty string (line 1: 'A')"
    with pytest.warns(UserWarning, match=re.escape(blank)):
        assert [q.answers for q in read_qa(p)] == [["A"], ["Paris", "The."], ["Rome"]]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_qa(_write_lines(tmp_path / "ok.jsonl", [json.dumps(rows[2])]))


def test_a_folder_without_locks_is_used_with_a_warning(tmp_path, monkeypatch):
    """flock fails with ENOLCK on Lustre mounted without -o flock: the run goes on, unlocked, warned."""
    import errno
    import fcntl

    from searchlite.data import lock_folder

    a = tmp_path / "runs" / "a"  # made with its parents, as --out_dir runs/a is on a fresh clone
    held = lock_folder(a, "run.lock")
    assert held is not None and lock_folder(a, "run.lock") is None  # another holds it
    held.close()

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="cannot lock run.lock \\(No locks available\\); nothing stops a second run"):
        lock = lock_folder(tmp_path / "b", "run.lock")
    assert lock is not None
    lock.close()


def test_a_line_without_an_id_that_collides_says_where_its_id_came_from(tmp_path):
    p = _write_lines(tmp_path / "q.jsonl", [GOOD_Q, '{"question": "q2?", "answer": "a"}'])  # line 2: id "1"
    with pytest.raises(DataError, match=re.escape(f"{p}:2: duplicate id '1' (first on line 1; this line has no 'id' "
                                                  "field, so it takes its line index, 1)")):
        read_qa(p, unique_ids=True)


def test_a_pretty_printed_json_file_is_named_as_such(tmp_path):
    """It was 'the line ends before its JSON does (cut off?)', which sent users looking for a cut file."""
    for head in ("[", '[{"question": "q?", "golden_answers": ["a"]},'):  # an array, its objects a line each
        (tmp_path / "qa.json").write_text(head + '\n  {"question": "q?", "golden_answers": ["a"]}\n]\n')
        with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'qa.json'}:1: bad JSON: the file looks like one "
                                                      "JSON document (an array?) over many lines; JSONL holds one "
                                                      "object a line")):
            read_qa(tmp_path / "qa.json")


def test_a_first_line_cut_off_is_named_as_cut_not_as_a_json_document(tmp_path):
    """The JSON-document message is for a first line that opens an array or an object alone; a
    first line that is an object cut short is still 'cut off?'."""
    p = _write_lines(tmp_path / "qa.jsonl", ['{"question": "q?", "golden_answers": ["a"]', GOOD_Q])
    with pytest.raises(DataError, match=re.escape(f"{p}:1: bad JSON: the line ends before its JSON does (cut off?)")):
        read_qa(p)


def test_held_folder_removes_only_a_folder_it_made_and_left_bare(tmp_path):
    """A run stopped at start-up leaves no folder; a run that wrote its work, or a folder that was
    there before, keeps every file."""
    from searchlite.data import held_folder

    busy = RuntimeError("busy")
    with held_folder(tmp_path / "bare", "run.lock", busy, scratch=("run.json",)):
        (tmp_path / "bare" / "run.json").write_text("{}")
    assert not (tmp_path / "bare").exists()
    with held_folder(tmp_path / "worked", "run.lock", busy, scratch=("run.json",)):
        (tmp_path / "worked" / "run.json").write_text("{}")
        (tmp_path / "worked" / "records.jsonl").write_text("{}\n")
        (tmp_path / "worked" / "eval").mkdir()
    assert sorted(p.name for p in (tmp_path / "worked").iterdir()) == ["eval", "records.jsonl", "run.json", "run.lock"]
    (tmp_path / "before").mkdir()
    with held_folder(tmp_path / "before", "run.lock", busy, scratch=("run.json",)):
        (tmp_path / "before" / "run.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "before").iterdir()) == ["run.json", "run.lock"]
    with held_folder(tmp_path / "held", "run.lock", busy):  # a second holder is refused
        with pytest.raises(RuntimeError, match="busy"):
            with held_folder(tmp_path / "held", "run.lock", busy):
                pass


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts this process's descriptors in /proc")
def test_durable_writes_leave_no_descriptor_open(tmp_path):
    """Each durable write opens the file (a folder: each file in it) and its folder to fsync them:
    a descriptor left open each time, a long run would reach its open-file limit."""
    from searchlite.data import replace_durably, write_durably

    def descriptors() -> int:
        return len(list(Path("/proc/self/fd").iterdir()))

    before = descriptors()
    for i in range(10):
        write_jsonl(tmp_path / "rows.jsonl", [{"i": i}])
        write_durably(tmp_path / "blob.bin", lambda f: f.write(b"x"))
        (tmp_path / "tmp" / "sub").mkdir(parents=True)
        (tmp_path / "tmp" / "sub" / "a.txt").write_text("a")
        replace_durably(tmp_path / "tmp", tmp_path / f"folder{i}")  # a folder: each file in it too
    assert descriptors() == before
    assert [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()] == [{"i": 9}]
