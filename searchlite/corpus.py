"""A corpus JSONL file read lazily, so that a 21M-passage Wikipedia costs memory for its
line offsets only (8 bytes a passage), not for its text.

    corpus = Corpus("wiki-18.jsonl")      # one scan for line starts (cached beside an index)
    len(corpus), corpus[17]                # Passage(id, title, text), read with os.pread
    for start, passages in corpus.batches(10_000):   # in order, for index builds
        ...

Passage i is the i-th non-blank line: Search-R1's released indexes number passages that
way (vector i of `e5_Flat.index` is line i of wiki-18.jsonl), and so do ours. Lines follow
`searchlite.data`'s rules (wiki-18 `contents` or id/title/text; a missing id is the 0-based
line index) and a bad line raises `DataError` naming the file and line when it is read,
not at open. `os.pread` keeps concurrent reads from threads safe.

Left out on purpose: read_corpus's duplicate-id check (it would hold every id in memory)
and gzipped files (they cannot be read at an offset; decompress them first).
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np

from searchlite.data import DataError, Passage, is_gz, parse_object, passage_from_object, read_corpus, write_durably

_CHUNK = 1 << 26  # bytes read per step of the line scan
# Bytes that can begin a character str.strip() removes (ASCII whitespace and "\n", \x1c-\x1f, and in
# UTF-8 U+0085, U+00A0, U+1680, U+2000-U+205F, U+3000) or a BOM: the scan reads again only the lines
# that begin with one, to find the blank ones (a JSON line begins with "{"). As in read_corpus, a BOM
# is skipped on the first line only.
_MAYBE_BLANK = np.zeros(256, bool)
_MAYBE_BLANK[[*range(0x09, 0x0E), *range(0x1C, 0x21), 0xC2, 0xE1, 0xE2, 0xE3, 0xEF]] = True


def scan_lines(path, progress: bool = True):
    """(starts, blank_at): `starts` (N+1,) int64 holds the byte offset of each non-blank line
    and then the file size; `blank_at` (B,) int64 holds, for each blank line, the index of
    the passage that follows it (how line numbers are recovered for error messages)."""
    from tqdm.auto import tqdm

    size = os.path.getsize(path)
    parts = [np.zeros(1, np.int64)]
    maybe = []  # per line: whether its first byte may begin whitespace
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"scanning {os.path.basename(path)}",
                                     disable=not progress or size < 1 << 28) as bar:
        pos, begins_here = 0, True  # begins_here: a line starts at this chunk's first byte
        while chunk := f.read(_CHUNK):
            arr = np.frombuffer(chunk, np.uint8)
            after = np.flatnonzero(arr == 10) + 1  # each line start after a "\n" in this chunk
            parts.append(after + pos)
            firsts = np.concatenate([np.zeros(int(begins_here), np.int64), after[after < len(arr)]])
            maybe.append(_MAYBE_BLANK[arr[firsts]])
            begins_here = len(after) > 0 and after[-1] == len(arr)
            pos += len(chunk)
            bar.update(len(chunk))
    starts = np.concatenate(parts)  # (L+1,) every line start, then the end
    if starts[-1] != size:  # the last line has no newline
        starts = np.append(starts, size)
    with open(path, "rb") as f:
        blank = [j for j in np.flatnonzero(np.concatenate([np.zeros(0, bool), *maybe]))
                 if not os.pread(f.fileno(), int(starts[j + 1] - starts[j]), int(starts[j]))
                 .decode("utf-8", "replace").removeprefix("\ufeff" if j == 0 else "").strip()]
    blank = np.asarray(blank, dtype=np.int64)
    return np.delete(starts, blank), blank - np.arange(len(blank))


class Corpus:
    """A passage sequence backed by a JSONL file: `len`, `corpus[i]`, `batches(n)`.
    `offsets` is an `.npz` file caching the line scan; it is reused while the corpus keeps
    its path, size and modification time (two files can share the last two: `touch -r`, a
    tarball), and (re)written otherwise."""

    def __init__(self, path, offsets=None, progress: bool = True):
        self.path = os.fspath(path)
        if is_gz(self.path):
            raise DataError(f"{self.path}: a gzipped corpus cannot be read lazily; decompress it first (gunzip -k)")
        st = os.stat(self.path)
        self.stamp = [st.st_size, st.st_mtime_ns]  # what the offsets cache must match
        cached = self._read_cache(offsets)
        self.starts, self.blank_at = cached if cached else scan_lines(self.path, progress)
        if offsets is not None and not cached:
            try:
                self.save_offsets(offsets)
            except OSError:  # e.g. a read-only index folder: the scan is redone next time, nothing lost
                pass
        self._fd = os.open(self.path, os.O_RDONLY)

    def _read_cache(self, offsets):
        """The cached line scan, or None when it is missing, made for another version of the
        file, or unreadable (a cache is never worth failing for: the file is scanned again)."""
        if offsets is None:
            return None
        try:
            with np.load(offsets) as z:
                same = z["stamp"].tolist() == self.stamp and str(z["path"]) == os.path.abspath(self.path)
                return (z["starts"], z["blank_at"]) if same else None
        except (OSError, ValueError, zipfile.BadZipFile, KeyError, EOFError):
            return None

    def save_offsets(self, path) -> None:
        """Write the line scan as an `offsets` cache for this version of the file."""
        where = np.asarray(os.path.abspath(self.path))
        write_durably(path, lambda f: np.savez(f, starts=self.starts, blank_at=self.blank_at,
                                               stamp=np.asarray(self.stamp), path=where))

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths_digest(self) -> str:
        """A fingerprint of every line's length, in order: an index folder notes it, so that a corpus
        given by another path with the same count and ids but its lines moved or edited is noticed."""
        import hashlib

        return hashlib.sha1(np.diff(self.starts).astype("<i8").tobytes()).hexdigest()

    def line_no(self, i: int) -> int:
        """1-based line of passage i in the file, blank lines counted."""
        return int(i) + 1 + int(np.searchsorted(self.blank_at, i, side="right"))

    def _parse(self, i: int, raw: bytes) -> Passage:
        line_no = self.line_no(i)
        raw = raw.split(b"\n", 1)[0]  # its own line: blank lines after it share its span (`scan_lines`)
        obj = parse_object(raw, self.path, line_no)
        if obj is None:
            raise DataError(f"{self.path}:{line_no}: a line of only whitespace where the scan found a passage: "
                            "the file changed since it was opened; open it again")
        return passage_from_object(obj, self.path, line_no)

    def __getitem__(self, i) -> Passage:
        n = len(self)
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"Corpus indices must be integers, not {type(i).__name__}")
        if not -n <= i < n:
            raise IndexError(f"passage {i} out of range for {self.path} ({n} passages)")
        i = int(i) % n
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return self._parse(i, self._read(a, b))

    def _read(self, a: int, b: int) -> bytes:
        """Bytes a..b of the file. One os.pread returns at most 2,147,479,552 bytes on Linux (and
        POSIX lets any read return less), so a batch over 2 GiB takes several."""
        parts = []
        while a < b:
            part = os.pread(self._fd, b - a, a)
            if not part:
                raise DataError(f"{self.path}: the file ends at byte {a}, short of the {b} its line scan found; "
                                "it changed after it was opened: open it again")
            parts.append(part)
            a += len(part)
        return b"".join(parts)  # one part: returned as is, no copy

    def batches(self, size: int, start: int = 0):
        """Yield (index of the first passage, list of Passage) for consecutive batches, in
        file order from passage `start`, with one read per batch."""
        for s in range(start, len(self), size):
            e = min(s + size, len(self))
            base = int(self.starts[s])
            data = self._read(base, int(self.starts[e]))
            yield s, [self._parse(i, data[int(self.starts[i]) - base:int(self.starts[i + 1]) - base]) for i in range(s, e)]

    def __iter__(self):
        for _, batch in self.batches(4096):
            yield from batch

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    def __repr__(self) -> str:
        return f"Corpus({self.path!r}, {len(self)} passages)"


def open_corpus(path, offsets=None):
    """A corpus path as passages: a lazy `Corpus`, or a list for a gzipped file; a DataError for
    a file without one (which a retriever would refuse without naming it)."""
    passages = read_corpus(path) if is_gz(path) else Corpus(path, offsets)
    if not len(passages):
        raise DataError(f"{path}: no passages in the corpus file")
    return passages


def batches(passages, size: int, start: int = 0):
    """`Corpus.batches` for a Corpus or any list of passages."""
    if isinstance(passages, Corpus):
        yield from passages.batches(size, start)
        return
    for s in range(start, len(passages), size):
        yield s, list(passages[s:s + size])


def sample_ids_digest(passages, n: int = 1000) -> str:
    """A fingerprint of a corpus's ids and order, from at most `n` evenly spaced passages, so
    checking that an index matches its corpus reads a thousand lines, not 21 million."""
    import hashlib

    picks = np.unique(np.linspace(0, len(passages) - 1, num=min(n, len(passages))).round().astype(np.int64))
    ids = [passages[int(i)].id for i in picks] if len(passages) else []
    return hashlib.sha1(json.dumps([len(passages), ids]).encode("utf-8")).hexdigest()
