"""Readers and writers for the two file formats searchlite shares with Search-R1 and FlashRAG.

    passages = read_corpus("wiki-18.jsonl")     # [Passage(id, title, text), ...]
    questions = read_qa("nq_test.jsonl")        # [QA(id, question, answers, meta), ...]
    write_jsonl("out.jsonl", map(qa_to_dict, questions))

Corpus lines are `{"id": "12", "contents": "\\"Title\\"\\nText ..."}` (Search-R1's wiki-18
form: the first line of `contents` is the title in double quotes, the rest is the text) or
`{"id", "title", "text"}` (`title` optional). QA lines are FlashRAG's
`{"id", "question", "golden_answers": [...]}`; `"answer"` (a string or a list) is accepted in
place of `golden_answers`, and every other field is kept in `QA.meta`.

Both readers skip blank lines and nothing else: any other bad line raises `DataError` naming
the file, the 1-based line number and what is wrong. An `id` may be an integer in the file (it
becomes a string); a missing `id` becomes the 0-based line index, `str(line_no - 1)`. Answers
must be non-empty strings: an empty gold answer would match an empty prediction. Files ending
in `.gz` are read and written gzipped; one cut off or damaged raises `DataError` too.
`append_log` / `read_log` keep an append-only JSONL log that survives an interrupt
(evaluate.py's records, stage 1's sampling). Corpora too large to
hold as a list (wiki-18: 21M passages) are read lazily by `searchlite.corpus.Corpus` with the
same per-line rules. Left out on purpose: Parquet and HF `datasets`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator


class DataError(ValueError):
    """A malformed corpus or QA file; the message reads `path:line: what is wrong`."""


def os_error_text(e: OSError) -> str:
    """An OSError in one line for a user: "path: reason" when it names a file, else its own text."""
    return f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)


@dataclass
class Passage:
    """One retrievable passage.

    >>> Passage("7", "Paris", "Paris is the capital of France.").contents
    '"Paris"\\nParis is the capital of France.'
    """

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """Search-R1's wiki-18 form: the title in double quotes, a newline, the text. A newline in
        the title (an id/title/text corpus may have one) becomes a space: the first newline is
        where `split_contents`, a server's client, finds the text."""
        title = self.title.replace("\n", " ")
        return f'"{title}"\n{self.text}'


@dataclass
class QA:
    """One question with its gold answers; `meta` keeps the line's other fields as-is."""

    id: str
    question: str
    answers: list[str]  # golden answers, each a non-empty string
    meta: dict = field(default_factory=dict)


def is_gz(path) -> bool:
    """Whether a data file is read as gzip: by its name, .gz in any case."""
    return os.fspath(path).lower().endswith(".gz")


def _open(path, mode: str, gz: bool):
    return gzip.open(path, mode) if gz else open(path, mode)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_object(raw: bytes, path, line_no: int) -> dict | None:
    """One JSONL line as a dict; None for a blank line; `DataError` naming the line otherwise."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        gz = "; it is gzip-compressed: name it .gz" if line_no == 1 and raw.startswith(b"\x1f\x8b") else ""
        raise DataError(f"{path}:{line_no}: not valid UTF-8 ({e.reason}){gz}") from None
    if line_no == 1:
        line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
    if not line.strip():
        return None
    try:
        obj = json.loads(line, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        cut = e.pos >= len(line.rstrip()) or e.msg.startswith("Unterminated string")  # (e.pos: where it opened)
        why = "the line ends before its JSON does (cut off?)" if cut else f"{e.msg} (column {e.colno})"
        if line_no == 1 and (line.strip() == "{" or line.lstrip().startswith("[")):  # json.dump(..., indent=2)
            why = "the file looks like one JSON document (an array?) over many lines; JSONL holds one object a line"
        raise DataError(f"{path}:{line_no}: bad JSON: {why}") from None
    except ValueError as e:  # NaN / Infinity (not JSON), an integer past Python's digit limit
        raise DataError(f"{path}:{line_no}: bad JSON: {e}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
    if ("\\ud" in line or "\\uD" in line) and (bad := _lone_surrogate(obj)):  # only a \uD8xx-\uDFxx escape makes one
        where, ch = bad
        raise DataError(f"{path}:{line_no}: {where} holds \\u{ord(ch):04x}, half of a UTF-16 surrogate pair and no "
                        "character (no tokenizer or UTF-8 file takes it); replace it, e.g. with \\ufffd")
    return obj


def _lone_surrogate(value, where: str = "") -> tuple[str, str] | None:
    """(field, character) of the first unpaired surrogate in the strings of a JSON value, or None."""
    if isinstance(value, str):
        bad = next((c for c in value if "\ud800" <= c <= "\udfff"), None)
        return (where or "the line", bad) if bad else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and (bad := _lone_surrogate(k, where or "a field name")):
            return bad
        name = f"field '{k}'" if not where else f"{where}[{k!r}]"
        if bad := _lone_surrogate(v, name):
            return bad
    return None


def _objects(path) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, JSON object) for each non-blank line of a JSONL file.

    A `.gz` file that is cut off (EOFError), not gzip at all (BadGzipFile) or damaged inside
    (zlib.error, BadGzipFile for a bad CRC) raises `DataError` naming the line being read, which
    the scripts report in one line (train.py catches DataError only) instead of a traceback."""
    line_no = 0  # the last line read whole; the damage is met while reading line_no + 1
    try:
        with _open(path, "rb", is_gz(path)) as f:
            for line_no, raw in enumerate(f, 1):
                obj = parse_object(raw, path, line_no)
                if obj is not None:
                    yield line_no, obj
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}:{line_no + 1}: the gzip stream is cut off or damaged ({e})") from None


def _id(obj: dict, path, line_no: int) -> str:
    if "id" not in obj:
        return str(line_no - 1)
    v = obj["id"]
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise DataError(f"{path}:{line_no}: field 'id' must be a string or integer, got {type(v).__name__}")
    return str(v)


def _duplicate_id(path, line_no: int, obj: dict, pid: str, first: int) -> DataError:
    own = "" if "id" in obj else f"; this line has no 'id' field, so it takes its line index, {pid}"
    return DataError(f"{path}:{line_no}: duplicate id {pid!r} (first on line {first}{own})")


def _str(obj: dict, key: str, path, line_no: int, required: bool = True) -> str:
    if key not in obj:
        if required:
            raise DataError(f"{path}:{line_no}: missing field '{key}'")
        return ""
    v = obj[key]
    if not isinstance(v, str):
        raise DataError(f"{path}:{line_no}: field '{key}' must be a string, got {type(v).__name__}")
    return v


def split_contents(contents: str) -> tuple[str, str]:
    """Split wiki-18 `contents` into (title, text): the first line, less one pair of
    surrounding double quotes, and the rest. Without a newline it is all text.

    >>> split_contents('"Paris"\\nParis is the capital of France.')
    ('Paris', 'Paris is the capital of France.')
    """
    if "\n" not in contents:
        return "", contents
    title, text = contents.split("\n", 1)
    title = title.removesuffix("\r")  # a corpus written with Windows line ends inside contents
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text


def read_corpus(path) -> list[Passage]:
    """Read a corpus JSONL file (wiki-18 `contents` form or `title`/`text` form).

    Blank lines are skipped; a malformed line or a duplicate id raises `DataError`.
    """
    passages, first_seen = [], {}
    for line_no, obj in _objects(path):
        p = passage_from_object(obj, path, line_no)
        if p.id in first_seen:
            raise _duplicate_id(path, line_no, obj, p.id, first_seen[p.id])
        first_seen[p.id] = line_no
        passages.append(p)
    return passages


def passage_from_object(obj: dict, path, line_no: int) -> Passage:
    """The Passage of one parsed corpus line (either form); `DataError` names a bad field."""
    pid = _id(obj, path, line_no)
    if "contents" in obj:
        title, text = split_contents(_str(obj, "contents", path, line_no))
    elif "text" in obj:
        title, text = _str(obj, "title", path, line_no, required=False), _str(obj, "text", path, line_no)
    else:
        raise DataError(f"{path}:{line_no}: missing field 'contents' (or 'text')")
    return Passage(pid, title, text)


def _answers(obj: dict, key: str, path, line_no: int) -> list[str]:
    v = obj[key]
    if key == "answer" and isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise DataError(f"{path}:{line_no}: field '{key}' must be a list of strings, got {type(v).__name__}")
    if not v:
        raise DataError(f"{path}:{line_no}: field '{key}' is an empty list")
    for a in v:
        if not isinstance(a, str):
            raise DataError(f"{path}:{line_no}: field '{key}' holds {a!r} ({type(a).__name__}), not a string")
        if not a.strip():
            raise DataError(f"{path}:{line_no}: field '{key}' holds an empty answer")
    return list(v)


def read_qa(path, unique_ids: bool = False) -> list[QA]:
    """Read a QA JSONL file (FlashRAG form; `answer` accepted for `golden_answers`).

    Blank lines are skipped; a malformed line raises `DataError`, and so does an id seen before
    when `unique_ids` (evaluation keys its records by id; a training set merged from two may
    repeat one). A missing `id` becomes `str(line_no - 1)`; fields other than
    id/question/answers go to `QA.meta` unchanged. Gold answers that normalise to "" (an article
    or punctuation alone, e.g. blood type "A") are kept, with one warning: EM takes an empty
    prediction as right for them, cover-EM and F1 never do.
    """
    from .rewards import normalize_answer

    out, first_seen, blank = [], {}, []
    for line_no, obj in _objects(path):
        qid = _id(obj, path, line_no)
        if unique_ids and qid in first_seen:
            raise _duplicate_id(path, line_no, obj, qid, first_seen[qid])
        first_seen[qid] = line_no
        question = _str(obj, "question", path, line_no)
        if not question.strip():
            raise DataError(f"{path}:{line_no}: field 'question' is empty")
        key = "golden_answers" if "golden_answers" in obj else "answer" if "answer" in obj else None
        if key is None:
            raise DataError(f"{path}:{line_no}: missing field 'golden_answers' (or 'answer')")
        answers = _answers(obj, key, path, line_no)
        blank += [(line_no, a) for a in answers if not normalize_answer(a)]
        meta = {k: v for k, v in obj.items() if k not in ("id", "question", key)}
        out.append(QA(qid, question, answers, meta))
    if blank:
        warnings.warn(f"{path}: {len(blank)} gold answer(s) normalise to an empty string (line {blank[0][0]}: "
                      f"{blank[0][1]!r}); EM takes an empty prediction as right for them, cover-EM and F1 never do",
                      stacklevel=2)
    return out


def write_jsonl(path, rows: Iterable[dict]) -> None:
    """Write one JSON object a line (UTF-8, not ASCII-escaped); written to a temporary file
    and renamed, so a crash never leaves half a file. Parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        gz = is_gz(path.name)  # the header names the file, not its temporary name
        with gzip.GzipFile(path.name[:-3], "wb", fileobj=f) if gz else contextlib.nullcontext(f) as out:
            for row in rows:
                out.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))

    write_durably(path, write)


def replace_durably(tmp, path) -> None:
    """Rename the finished `tmp`, a file or a folder, to `path` so that a crash, or a power cut,
    leaves the old or the new, never half of one: its data reach the disk first (the rename alone
    orders nothing: after a power cut a renamed file can be empty), then the rename, then the
    folder's entry. A folder `path` must be absent or empty."""
    tmp, path = Path(tmp), Path(path)
    for f in [tmp, *tmp.rglob("*")] if tmp.is_dir() else [tmp]:
        _fsync(f)
    os.replace(tmp, path)
    _fsync(path.parent)


def write_durably(path, write, mode: str = "wb") -> None:
    """Write `path` by calling `write(f)` on a temporary file beside it, then `replace_durably`:
    a crash or a Ctrl-C leaves the old file or the new one, never a half-written one that fails
    to parse (index folders write every file this way). The temporary name is this process's
    own, so processes writing the same file at once (torchrun ranks) each finish theirs."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            write(f)
        replace_durably(tmp, path)
    finally:
        if os.path.exists(tmp):  # the write failed: no stray file
            os.remove(tmp)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a folder too: its entries
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_line(record: dict) -> str:
    """`record` as one JSON line, a float that is not finite (NaN, inf: not JSON) written as null."""
    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return {k: finite(x) for k, x in v.items()} if isinstance(v, dict) else v

    return json.dumps(finite(record)) + "\n"


def read_log(path, cut: bool = True, need: tuple[str, ...] = (), check=None) -> list[dict]:
    """The records of an append-only JSONL log (`append_log`). A last line without its newline
    was torn by an interrupt: it is cut from the file, so the next append starts a whole line
    (cut=False only skips it: a reader while another process appends, e.g. plot.py). A record
    lacking a field of `need`, or one that `check(record)` finds fault with (it returns what is
    wrong, else None), raises `DataError` naming its line."""
    path = Path(path)
    raw = path.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]
    if cut and len(keep) != len(raw):
        path.write_bytes(keep)
    records = []
    for n, line in enumerate(keep.splitlines(), 1):
        if (obj := parse_object(line, path, n)) is not None:
            if missing := [k for k in need if k not in obj]:
                raise DataError(f"{path}:{n}: record lacks '{missing[0]}'")
            if check and (fault := check(obj)):
                raise DataError(f"{path}:{n}: {fault}")
            records.append(obj)
    return records


def lock_folder(folder, name: str):
    """An exclusive lock on `folder` for this process: the open file `folder/name` (closing it, or
    the process ending, lets go), or None when another process holds it. Two runs writing one
    folder would mix their checkpoints and logs. flock: Linux and macOS; on a filesystem without
    it (Lustre without -o flock, some NFS) a warning, and the file unlocked."""
    import fcntl

    Path(folder).mkdir(parents=True, exist_ok=True)
    lock = open(Path(folder) / name, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    except OSError as e:  # ENOLCK, ENOSYS: no locks here, so no check that this run is alone in the folder
        warnings.warn(f"{folder}: cannot lock {name} ({e.strerror}); nothing stops a second run from writing here",
                      stacklevel=2)
    return lock


@contextlib.contextmanager
def held_folder(folder, name: str, busy: Exception, scratch: tuple[str, ...] = ()):
    """`lock_folder(folder, name)` held for one run; `busy` is raised when another process holds
    it. A folder the run made is removed again if it leaves nothing in it but the lock and the
    `scratch` files (it stopped at start-up: a bad line, a model that does not load), so a run
    stopped before its work began changes no file."""
    folder = Path(folder)
    made = not folder.exists()
    lock = lock_folder(folder, name)
    if lock is None:
        raise busy
    try:
        yield lock
    finally:
        left = {p.name for p in folder.iterdir()} if made else set()
        if name in left and left <= {name, *scratch}:
            for entry in sorted(left - {name}) + [name]:  # the lock last, while still held: no other run has it
                (folder / entry).unlink()
            with contextlib.suppress(OSError):  # another run put a file there meanwhile: the folder stays
                folder.rmdir()
        lock.close()


def append_log(path, records: list[dict]) -> None:
    """Append `records` to a JSONL log, a line each, on disk before the caller moves on."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def passage_to_dict(p: Passage) -> dict:
    """Search-R1's corpus line: `{"id", "contents"}`."""
    return {"id": p.id, "contents": p.contents}


def qa_to_dict(q: QA) -> dict:
    """FlashRAG's QA line: `{"id", "question", "golden_answers", **meta}`."""
    core = {"id": q.id, "question": q.question, "golden_answers": list(q.answers)}
    return {**core, **{k: v for k, v in q.meta.items() if k not in core}}
