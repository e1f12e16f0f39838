"""Search engines the rollout calls: BM25 and dense (encoder + FAISS) in-process, and an HTTP
client for a Search-R1-compatible server.

    r = build_retriever("bm25", "wiki-18.jsonl")
    hits = r.search(["who wrote hamlet", "capital of peru"], k=3)   # one list of Hit per query
    r = load_index("indexes/e5")                # a folder written by `retrieve.py build`

Every retriever answers a batch of queries with `search(queries, k)`; duplicate queries in
one call are searched once (a GRPO group often repeats a query) and the result lists stay
aligned with the input. Queries never raise on content: empty or 10,000-character queries are
fine (dense encoders truncate to `max_length` tokens). BM25 returns only passages sharing a
term with the query, as Lucene does for Search-R1, so a query of unknown words gets `[]`.

Passages may be a list or a lazy `Corpus` over a JSONL file (searchlite/corpus.py), which
holds line offsets, not text: that and memory-mapped indexes are how wiki-18 (21M passages)
fits. A dense retriever also takes Search-R1's released `e5_Flat.index` with wiki-18.jsonl
as they are (vector i = passage i). Building big indexes (sharded, resumable, HNSW or IVF-PQ)
is searchlite/indexing.py's job. Left out on purpose: GPU FAISS, rerankers, and caching
across calls.
"""

from __future__ import annotations

import functools
import http.client
import json
import numbers
import os
import re
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass

from searchlite.bm25 import FILES as BM25_FILES
from searchlite.corpus import Corpus, batches, open_corpus, sample_ids_digest
from searchlite.data import DataError, os_error_text, replace_durably, split_contents, write_durably

_SHOW_PROGRESS = 10_000  # passages; progress bars below this size are noise
HTTP_QUERY_CHARS = 4096  # searchlite's server cuts longer queries (server.make_app); Search-R1's takes any


@dataclass
class Hit:
    """One retrieved passage with its score (higher is better)."""

    id: str
    title: str
    text: str
    score: float


class Retriever:
    """Base class: deduplicates queries; subclasses implement `_search_unique`."""

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Top-`k` hits for each query, best first, aligned with `queries`."""
        if isinstance(queries, str):
            raise TypeError("search() takes a list of queries, not a single string")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        queries, k = list(queries), int(k)  # a generator is read twice below
        unique = list(dict.fromkeys(queries))  # first-seen order
        found = self._search_unique(unique, k)
        if len(found) != len(unique):
            raise RuntimeError(f"{type(self).__name__} returned {len(found)} result lists for {len(unique)} queries")
        by_query = dict(zip(unique, found))
        return [list(by_query[q]) for q in queries]  # a fresh list per position

    def _search_unique(self, queries: list[str], k: int) -> list[list[Hit]]:
        raise NotImplementedError


def _hits(passages, idx, scores) -> list[Hit]:
    out = []
    for i, s in zip(idx, scores):
        p = passages[int(i)]  # one read for a lazy Corpus
        out.append(Hit(p.id, p.title, p.text, float(s)))
    return out


def _corpus_record(folder, passages) -> dict:
    """What an index folder notes about its corpus: size and an id fingerprint, and for a
    file-backed corpus its path, size in bytes and modification time (an edit in place that
    keeps the ids shows in those), with its line offsets cached beside the index."""
    rec = dict(num_passages=len(passages), ids_sample_sha1=sample_ids_digest(passages), corpus=None)
    if isinstance(passages, Corpus):
        rec["corpus"] = os.path.abspath(passages.path)
        rec["corpus_bytes"], rec["corpus_mtime_ns"] = passages.stamp  # as it was when opened for the build
        rec["line_lengths_sha1"] = passages.lengths_digest()
        passages.save_offsets(os.path.join(folder, "corpus_offsets.npz"))
    return rec


# What each kind of index folder holds; `{kind}.json`, written last, marks it finished.
KIND_FILES = {"bm25": ("bm25.json", *BM25_FILES.values(), "vocab.index.json", "params.index.json"),
              "dense": ("dense.json", "index.faiss", "shards")}


def check_index_folder(folder, kind: str) -> None:
    """Refuse `folder` for a `kind` index if it holds another kind's files: a folder holds one
    index, so it never loads as the wrong kind."""
    other = next(k for k in KIND_FILES if k != kind)
    found = [name for name in KIND_FILES[other] if os.path.exists(os.path.join(folder, name))]
    if found:
        raise ValueError(f"{folder} holds files of a {other} index ({', '.join(found)}); write the {kind} index "
                         "to another folder, or delete those files first")


def begin_index_folder(folder, kind: str) -> None:
    """Ready `folder` to be written a `kind` index, just before its files are: `check_index_folder`,
    then delete the finished markers, so that a save cut short is unfinished, never old settings
    over new files. (A build that fails before saving leaves the old index as it was.)"""
    check_index_folder(folder, kind)
    os.makedirs(folder, exist_ok=True)
    for k in KIND_FILES:
        if os.path.exists(marker := os.path.join(folder, f"{k}.json")):
            os.remove(marker)  # on disk by the next replace_durably here, which syncs the folder


def read_settings(folder, kind: str) -> dict:
    """A finished folder's `{kind}.json`; one that does not parse is a ValueError naming it."""
    return read_json_object(os.path.join(folder, f"{kind}.json"), "index settings", "rebuild the index")


def read_json_object(path, what: str, fix: str) -> dict:
    """The JSON object (of `what`) in `path`; a file that does not parse, or holds another JSON
    value, is a ValueError naming it and saying how to `fix` it."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object of {what}, got {type(obj).__name__}; {fix}")
    return obj


def _write_settings(folder, settings: dict) -> None:
    write_durably(os.path.join(folder, f"{settings['kind']}.json"), lambda f: json.dump(settings, f, indent=2), "w")


def _check_corpus(folder, settings: dict, passages) -> None:
    expected = settings.get("ids_sample_sha1")
    if settings.get("num_passages") != len(passages) or (expected and expected != sample_ids_digest(passages)):
        raise ValueError(f"{folder} was built over a different corpus (passage ids or order differ): it holds "
                         f"{settings.get('num_passages')} passages, the corpus given has {len(passages)}")
    # Same ids, same count: an edit in place of the passages' text shows only in the file's size
    # or time (folders built before these were recorded are not checked). A warning, not an
    # error: the index still answers, but it scores the text as it was.
    built = [settings.get("corpus_bytes"), settings.get("corpus_mtime_ns")]
    same_file = isinstance(passages, Corpus) and settings.get("corpus") == os.path.abspath(passages.path)
    if same_file and None not in built and built != passages.stamp:
        warnings.warn(f"{passages.path} changed since {folder} was built from it (its size or modification time "
                      "differs): the index scores the text as it was; rebuild it with `python retrieve.py build`",
                      stacklevel=3)
    elif (isinstance(passages, Corpus) and not same_file and settings.get("line_lengths_sha1")
          and settings["line_lengths_sha1"] != passages.lengths_digest()):
        # another file with the ids in place: a copy written anew (other JSON spacing), or lines moved, which
        # would show one passage's text with another's score (folders built before this was noted: unchecked)
        warnings.warn(f"{passages.path} is not the file {folder} was built from ({settings.get('corpus')}): its "
                      "lines differ in length, so its passages may be other texts or in another order than the "
                      "index scores; rebuild the index over it with `python retrieve.py build`", stacklevel=3)


# ---------------------------------------------------------------------------- BM25


class BM25Retriever(Retriever):
    """Okapi BM25 over `title + text` with bm25s's tokenizer and Lucene scoring: the "bm25s"
    backend is searchlite.bm25's streaming, memory-mappable index (bm25s's file layout);
    "rank_bm25" is the pure-Python package, slower, for comparison on small corpora (its own
    Okapi idf and term weight, not Lucene's: it can rank otherwise).
    `index` is a prebuilt `BM25Index` to use instead of indexing `passages`. `k1` and `b` are
    bm25s's defaults; Search-R1's BM25 server (Pyserini) scores with k1 = 0.9, b = 0.4."""

    def __init__(self, passages, backend: str = "bm25s", index=None, progress: bool = True,
                 k1: float = 1.5, b: float = 0.75):
        from searchlite.bm25 import build_bm25

        if backend not in ("bm25s", "rank_bm25"):
            raise ValueError(f"unknown BM25 backend {backend!r}; valid: 'bm25s', 'rank_bm25'")
        if not len(passages):
            raise ValueError("BM25Retriever needs at least one passage")
        self.passages = passages if isinstance(passages, Corpus) else list(passages)
        self.backend = backend
        if backend == "rank_bm25":
            from rank_bm25 import BM25Okapi
            from searchlite.bm25 import tokenize

            self.index = BM25Okapi(tokenize([f"{p.title}\n{p.text}" for p in self.passages]), k1=k1, b=b)
        elif index is not None:
            if index.num_docs != len(self.passages):
                raise ValueError(f"BM25 index holds {index.num_docs} passages but there are {len(self.passages)}")
            self.index = index
        else:
            show = progress and len(self.passages) >= _SHOW_PROGRESS
            self.index = build_bm25(batches(self.passages, 10_000), len(self.passages), k1, b, progress=show)

    def _search_unique(self, queries: list[str], k: int) -> list[list[Hit]]:
        import numpy as np
        from searchlite.bm25 import tokenize

        out = []
        for tokens in tokenize(list(queries)):
            tokens = [t for t in tokens if t]
            if self.backend == "bm25s":
                top, scores = self.index.top_k(self.index.token_ids(tokens), k)
            else:
                scores = np.asarray(self.index.get_scores(tokens), dtype=np.float64)  # (N,)
                # no shared term, no hit: told from the passage's terms, not the score's sign (rank_bm25's
                # idf is 0 for a term in half the passages, and floored where it would be negative)
                shared = np.flatnonzero([any(t in terms for t in tokens) for terms in self.index.doc_freqs])
                top = shared[np.argsort(-scores[shared], kind="stable")[:k]]  # best first, ties in corpus order
                scores = scores[top]
            out.append(_hits(self.passages, top, scores))
        return out

    def save(self, folder) -> None:
        """Write the index (bm25s's files) and `bm25.json`, last: a folder without it is unfinished."""
        if self.backend != "bm25s":
            raise ValueError("only the 'bm25s' backend saves an index")
        begin_index_folder(folder, "bm25")
        self.index.save(folder)
        _write_settings(folder, dict(kind="bm25", **_corpus_record(folder, self.passages)))

    @classmethod
    def load(cls, folder, passages) -> "BM25Retriever":
        """Open a folder written by `save` (arrays memory-mapped) over the same passages."""
        from searchlite.bm25 import BM25Index

        _check_corpus(folder, read_settings(folder, "bm25"), passages)
        return cls(passages, index=BM25Index.load(folder))


# ---------------------------------------------------------------------------- dense


def encoder_name(name) -> str:
    """`name` as an index folder keeps it: a folder here as an absolute path, so that dense.json
    loads from anywhere ("enc/x" read from another folder would be a hub name); its symlinks kept,
    as their names may say E5 (`default_prefixes`)."""
    name = str(name)
    return os.path.abspath(name) if os.path.exists(name) else name


def default_prefixes(encoder: str) -> tuple[str, str]:
    """(query prefix, passage prefix) an encoder was trained with, judged by its name:
    E5 wants "query: " / "passage: "; BGE an instruction before queries only. A folder in the
    Hugging Face cache (models--org--name/snapshots/<commit>) goes by its model's name.

    >>> default_prefixes("intfloat/e5-base-v2")
    ('query: ', 'passage: ')
    >>> default_prefixes("/hf/hub/models--intfloat--e5-base-v2/snapshots/1c644c92ad3ba1efdad3f1451a637716616a20e8")
    ('query: ', 'passage: ')
    >>> default_prefixes("models--intfloat--e5-small-v2/snapshots/1c64")  # named from inside the cache
    ('query: ', 'passage: ')
    >>> default_prefixes("sentence-transformers/all-MiniLM-L6-v2")
    ('', '')
    """
    parts = str(encoder).replace("\\", "/").rstrip("/").split("/")
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        parts = parts[:-2]  # the cache's models--org--name folder
    name = parts[-1].lower()
    if re.search(r"(^|[-_])e5([-_]|$)", name):
        return "query: ", "passage: "
    if "bge" in name:
        return "Represent this sentence for searching relevant passages: ", ""
    return "", ""


class TextEncoder:
    """Any Hugging Face encoder (AutoModel) with mean or CLS pooling and L2-normalised
    output, so inner product = cosine (E5's and BGE's recipe; Search-R1 uses E5, mean)."""

    def __init__(self, name: str, pooling: str = "mean", batch_size: int = 64, max_length: int = 256,
                 device: str = "cpu"):
        import torch
        from transformers import AutoModel, AutoTokenizer

        if pooling not in ("mean", "cls"):
            raise ValueError(f"unknown pooling {pooling!r}; valid: 'mean', 'cls'")
        name = encoder_name(name)
        self.name, self.pooling, self.batch_size = name, pooling, batch_size
        self.device = torch.device(device)
        from .config import is_hub_name

        if not os.path.exists(name) and "/" in name and not is_hub_name(name):  # a path: the hub would be asked
            raise ValueError(f"encoder {name!r}: no such folder")  # for it, and answer "Repo id must be ..."
        if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(f"encoder {name!r}: no config.json in that folder; expected a Hugging Face encoder "
                             "folder (save_pretrained) or a hub name such as intfloat/e5-base-v2")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name)
            self.model = AutoModel.from_pretrained(name).to(self.device).eval()
        except (OSError, ValueError) as e:  # no such folder and no hub (offline), no such name there, no tokenizer
            raise ValueError(f"encoder {name!r} could not be loaded: {' '.join(str(e).split())}") from None
        if self.tokenizer.pad_token is None:  # decoder-style encoders ship without one
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        # a longer text would reach past the encoder's position table (BERT's 512; RoBERTa's 514 holds
        # 512 tokens, as its tokenizer's model_max_length says) and fail in torch
        limits = [getattr(self.model.config, "max_position_embeddings", None), self.tokenizer.model_max_length]
        positions = min((n for n in limits if isinstance(n, int) and 0 < n < 1_000_000), default=None)
        if positions is not None and max_length > positions:
            warnings.warn(f"max_length {max_length} is more than encoder {name}'s {positions} positions: "
                          f"texts are cut to {positions} tokens", stacklevel=2)
            max_length = positions
        self.max_length = max_length

    @functools.cached_property
    def dim(self) -> int:
        """The size of its vectors, from one short forward pass (once)."""
        return self.encode(["dimension probe"]).shape[1]

    def encode(self, texts: list[str], prefix: str = "", bar=None):
        """Normalised embeddings, float32 numpy (len(texts), dim), in batches sorted by length
        (less padding); `bar`, a tqdm bar, advances per batch."""
        import numpy as np
        import torch
        import torch.nn.functional as F

        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = None
        for s in range(0, len(texts), self.batch_size):
            idx = order[s:s + self.batch_size]
            batch = self.tokenizer([prefix + texts[i] for i in idx], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.no_grad():
                h = self.model(**batch).last_hidden_state.float()  # (b, T, H)
            if self.pooling == "mean":
                m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)  # (b, T, 1)
                e = (h * m).sum(1) / m.sum(1).clamp(min=1)  # (b, H)
            else:
                e = h[:, 0]  # (b, H) the [CLS] token
            e = F.normalize(e, dim=-1).cpu().numpy()
            if out is None:
                out = np.empty((len(texts), e.shape[1]), dtype=np.float32)  # (n, H)
            out[idx] = e
            if bar is not None:
                bar.update(len(idx))
        return out


class DenseRetriever(Retriever):
    """Queries encoded as `query_prefix + q`, searched in a FAISS index of passages encoded
    as `passage_prefix + contents` (Search-R1's wiki-18 form). `index` may be a built FAISS
    index, a path to one (`mmap` maps a flat one instead of reading it into memory), or None:
    then the passages are encoded here into an exact `IndexFlatIP`, 50k at a time.
    `search_params` tunes an approximate index (faiss.ParameterSpace, e.g. "efSearch=128").
    `encoder` is a name or folder, or a loaded `TextEncoder`."""

    def __init__(self, passages, encoder, pooling: str = "mean", query_prefix: str | None = None,
                 passage_prefix: str | None = None, batch_size: int = 64, max_length: int = 256,
                 device: str = "cpu", index=None, search_params: str = "", mmap: bool = False):
        import faiss

        if not len(passages):
            raise ValueError("DenseRetriever needs at least one passage")
        self.passages = passages if isinstance(passages, Corpus) else list(passages)
        self.text_encoder = encoder if isinstance(encoder, TextEncoder) else \
            TextEncoder(encoder, pooling, batch_size, max_length, device)
        dq, dp = default_prefixes(self.text_encoder.name)
        self.query_prefix = dq if query_prefix is None else query_prefix
        self.passage_prefix = dp if passage_prefix is None else passage_prefix
        given_index = index is not None  # (one built here from the passages fits the encoder)
        if index is None:
            index = self._encode_flat()
        elif isinstance(index, (str, os.PathLike)):
            if not os.path.isfile(index):
                raise FileNotFoundError(f"no FAISS index file at {index}")
            if query_prefix is None and (dq, dp) == ("", ""):  # a file keeps no prefixes: the name is all we go by
                warnings.warn(f"encoder {self.text_encoder.name}: its name says neither E5 nor BGE, so queries are "
                              f"encoded with no prefix; the passage vectors in {index} may want one (Search-R1's "
                              "e5_Flat.index: 'query: '): give it with --query_prefix 'query: ', or the encoder "
                              "under a name with e5 in it", stacklevel=2)
            index = faiss.read_index(str(index), faiss.IO_FLAG_MMAP_IFC if mmap else 0)
        if given_index and self.text_encoder.dim != index.d:  # (it failed at the first search)
            raise ValueError(f"encoder {self.text_encoder.name} gives {self.text_encoder.dim}-dim vectors but the "
                             f"index holds {index.d}-dim ones: its passages were encoded by another encoder, which "
                             "the queries need (an index folder names it: leave --encoder out)")
        if index.ntotal != len(self.passages):
            raise ValueError(f"index holds {index.ntotal} vectors but the corpus has {len(self.passages)} passages: a "
                             "FAISS file goes with the corpus it was built over (--corpus; the default is the toy "
                             "world's)")
        if search_params:
            faiss.ParameterSpace().set_index_parameters(index, search_params)
        self.index, self.search_params = index, search_params

    def _encode_flat(self):
        import faiss
        from tqdm.auto import tqdm

        index = None
        with tqdm(total=len(self.passages), unit="passage", desc="encoding passages",
                  disable=len(self.passages) < _SHOW_PROGRESS) as bar:
            for _, chunk in batches(self.passages, 50_000):
                emb = self.encode([p.contents for p in chunk], self.passage_prefix, bar=bar)  # (n, H)
                index = index or faiss.IndexFlatIP(emb.shape[1])
                index.add(emb)
        return index

    @property
    def encoder(self) -> str:
        return self.text_encoder.name

    def encode(self, texts: list[str], prefix: str = "", bar=None):
        """`TextEncoder.encode` with this retriever's encoder."""
        return self.text_encoder.encode(texts, prefix, bar)

    def _search_unique(self, queries: list[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        q = self.encode(list(queries), self.query_prefix)  # (n, H): the index's size, checked as it was given
        scores, idx = self.index.search(q, min(k, self.index.ntotal))  # (n, k) each
        return [_hits(self.passages, row[row >= 0], srow[row >= 0]) for row, srow in zip(idx, scores)]

    def settings(self) -> dict:
        """What `load` needs to rebuild this retriever around a saved index."""
        te = self.text_encoder
        return dict(kind="dense", encoder=te.name, pooling=te.pooling, query_prefix=self.query_prefix,
                    passage_prefix=self.passage_prefix, max_length=te.max_length, search_params=self.search_params)

    def save(self, folder) -> None:
        """Write `index.faiss`, then `dense.json` (encoder, pooling, prefixes, corpus check)."""
        import faiss

        begin_index_folder(folder, "dense")
        path = os.path.join(folder, "index.faiss")
        faiss.write_index(self.index, path + ".tmp")
        replace_durably(path + ".tmp", path)
        _write_settings(folder, {**self.settings(), **_corpus_record(folder, self.passages)})

    @classmethod
    def load(cls, folder, passages, **overrides) -> "DenseRetriever":
        """Rebuild a retriever saved with `save` over the same passages, in the same order.
        `overrides` replace saved settings or set others (`device`, `batch_size`, `mmap`)."""
        settings = read_settings(folder, "dense")
        _check_corpus(folder, settings, passages)
        keep = ("encoder", "pooling", "query_prefix", "passage_prefix", "max_length", "search_params")
        kw = {k: settings[k] for k in keep if k in settings}
        kw.update(overrides)
        return cls(passages, index=os.path.join(folder, "index.faiss"), **kw)


# ---------------------------------------------------------------------------- HTTP


_DOWN = (" Is the server running? Start one with `python retrieve.py serve --index INDEX --port 8000`, or "
         "fix the URL.")
_SLOW = (" The server accepted the request but did not answer in time: it is busy, or its index is slow for "
         "this many queries (a flat dense index on a CPU); a GPU or IVF index, or fewer queries a request, helps.")


class HTTPRetriever(Retriever):
    """Client for Search-R1's retrieval server (or `retrieve.py serve`): POST {url}/retrieve
    with `{"queries", "topk", "return_scores": true}`, at most `max_queries` queries a request;
    reads `{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`, or bare
    documents (score 0.0) when a server drops the wrapper. Connection errors, timeouts and
    5xx/429 answers are retried with exponential backoff (`backoff`, 2·backoff, ...); other
    failures raise at once. A timed-out request is retried with twice the timeout: the server
    is still working on it, and a slow index is not made faster by asking again as impatiently.
    Every error names the URL."""

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 1.0,
                 max_queries: int = 1024):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retrieval server URL {url!r} needs its scheme, e.g. http://{url.lstrip('/')}")
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout, self.retries, self.backoff, self.max_queries = timeout, retries, backoff, max_queries

    def _post(self, payload: dict) -> dict:
        data = json.dumps(payload).encode("utf-8")
        cause, hint, t0, timeout = None, "", time.monotonic(), self.timeout
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    body = resp.read()
            except urllib.error.HTTPError as e:
                cause, hint = f"HTTP {e.code}: {e.read()[:300].decode('utf-8', 'replace')}", ""
                if e.code < 500 and e.code != 429:
                    break  # the request itself is wrong; retrying will not help
                continue
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                if isinstance(e, TimeoutError):  # connected and sent; the answer is late (urllib wraps
                    cause, hint = f"no answer within {timeout:g}s", _SLOW  # a connect timeout in URLError)
                    timeout *= 2
                else:
                    cause, hint = f"{type(e).__name__}: {getattr(e, 'reason', e)}", _DOWN
                continue
            try:
                return json.loads(body)
            except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError: a proxy's page in latin-1
                raise RuntimeError(f"retrieval server {self.url} sent invalid JSON ({getattr(e, 'msg', e)}): "
                                   f"{body[:200]!r}") from None
        raise RuntimeError(f"retrieval server {self.url} failed after {attempt + 1} attempt(s): {cause} "
                           f"(gave up after {time.monotonic() - t0:.1f}s).{hint}")

    def _search_unique(self, queries: list[str], k: int) -> list[list[Hit]]:
        out = []
        for s in range(0, len(queries), self.max_queries):
            # queries are cut to what `retrieve.py serve` accepts: a longer one would fail the whole request
            chunk = [q[:HTTP_QUERY_CHARS] for q in queries[s:s + self.max_queries]]
            reply = self._post({"queries": chunk, "topk": k, "return_scores": True})
            result = reply.get("result") if isinstance(reply, dict) else None
            if not isinstance(result, list) or len(result) != len(chunk):
                raise RuntimeError(f"retrieval server {self.url} sent no 'result' list for {len(chunk)} queries: "
                                   f"{str(reply)[:200]}")
            for query, items in zip(chunk, result):
                if not isinstance(items, list):
                    raise RuntimeError(f"retrieval server {self.url} answered query {query[:80]!r} with "
                                       f"{json.dumps(items)[:200]}, not a list of documents")
                try:
                    out.append([_parse_item(item) for item in items[:k]])
                except (TypeError, ValueError) as e:  # (a score that is no number)
                    raise RuntimeError(f"retrieval server {self.url}: {e}") from None
        return out


def _parse_item(item) -> Hit:
    """A Hit from one item of a Search-R1 server's result: {"document": {"id", "contents"}, "score"},
    a bare document, or title and text fields; anything else is a ValueError that shows the item."""
    doc = item.get("document", item) if isinstance(item, dict) else None
    fields = {"contents", "title", "text"} & doc.keys() if isinstance(doc, dict) else set()
    if not fields or any(not isinstance(doc[f], str) for f in fields):  # (a null would read as "None")
        raise ValueError(f"a result item is not a document with 'contents' (or 'title' and 'text') strings: "
                         f"{json.dumps(item)[:200]}")
    if "contents" in doc:
        title, text = split_contents(doc["contents"])
    else:
        title, text = doc.get("title", ""), doc.get("text", "")
    return Hit(str(doc.get("id", "")), title, text, float(item.get("score", 0.0)))


# ---------------------------------------------------------------------------- factory

KINDS = ("bm25", "rank_bm25", "dense", "http")


def index_kind(folder) -> str | None:
    """"bm25" or "dense" for a finished index folder, else None."""
    found = [kind for kind in KIND_FILES if os.path.isfile(os.path.join(folder, f"{kind}.json"))]
    if len(found) > 1:  # only a folder written before begin_index_folder can be both
        raise ValueError(f"{folder} holds both bm25.json and dense.json; rebuild it into an empty folder")
    return found[0] if found else None


def other_index_kind(retriever: str, index: str) -> str | None:
    """Why --retriever `retriever` cannot read the folder --index `index` (for a message after the
    retriever's flag): it holds the other kind of index; else None. --retriever's default, bm25, with a
    dense folder was "X holds a dense index, not a bm25 one", which named no flag."""
    from .config import resolve_path

    found = index_kind(resolve_path(index)) if index else None  # (None for a FAISS file, or nothing there)
    if found and retriever in ("bm25", "dense") and found != retriever:
        return f"{retriever} with --index {index}, which holds a {found} index: give --retriever {found}"
    return None


def load_index(folder, corpus=None, kind: str | None = None, **kw) -> Retriever:
    """Open a folder written by `retrieve.py build` (or a retriever's `save`). `corpus`, a
    path or passages, defaults to the corpus file the folder was built from; `kind`, when
    given, must match the folder's. Keywords go to the dense retriever (`device`, `mmap`,
    `encoder`); `pooling`, when given, must be the folder's (its passage vectors were pooled so)."""
    found = index_kind(folder)
    if found is None:
        raise FileNotFoundError(f"{folder} is not a finished index folder (no bm25.json or dense.json); "
                                "build one with `python retrieve.py build` (a stopped dense build continues when "
                                "its command is run again)")
    if kind is not None and kind != found:
        raise ValueError(f"{folder} holds a {found} index, not a {kind} one")
    settings = read_settings(folder, found)
    pooling = kw.pop("pooling", None)
    if pooling is not None and found == "dense" and pooling != settings.get("pooling"):
        raise ValueError(f"pooling {pooling!r}: index {folder} holds {settings.get('pooling')}-pooled passage vectors, "
                         f"which {pooling}-pooled queries would not match; leave pooling out, or build an index with it")
    encoder = kw.get("encoder")
    if encoder is not None and found == "dense" and encoder_name(encoder) != settings.get("encoder"):
        warnings.warn(f"index {folder} holds passages encoded by {settings.get('encoder')}; queries will be encoded "
                      f"by {encoder_name(encoder)}: unless that is the same model, their vectors do not match "
                      "(leave the encoder out to take the folder's)", stacklevel=2)
    if corpus is None:
        corpus = settings.get("corpus")
        if not corpus or not os.path.isfile(corpus):
            raise FileNotFoundError(f"{folder} was built from corpus {corpus!r}, which is not there; pass the corpus "
                                    "(--corpus)")
    if isinstance(corpus, (str, os.PathLike)):
        offsets = os.path.join(folder, "corpus_offsets.npz")
        same = settings.get("corpus") and os.path.abspath(corpus) == settings["corpus"]
        passages = open_corpus(corpus, offsets if same else None)
    else:
        passages = corpus
    if found == "bm25":
        return BM25Retriever.load(folder, passages)
    return DenseRetriever.load(folder, passages, **kw)


def build_retriever(kind: str, corpus=None, *, encoder=None, pooling="mean", index=None, url=None,
                    query_prefix: str | None = None, **kw) -> Retriever:
    """Build a retriever by name. `corpus` is a JSONL path (or a list of Passage) for every
    kind but "http", which needs `url`. `index` may be a folder written by `retrieve.py build`
    (loaded; for "dense", `encoder` then overrides the saved one, and a `pooling` other than the
    default "mean" must be the saved one) or, for "dense", a FAISS
    file such as Search-R1's e5_Flat.index; else the corpus is indexed now. `query_prefix`
    (dense only; None: an index folder's, else by the encoder's name) goes before each query.
    Other keywords go to the retriever's constructor."""
    if kind not in KINDS:
        raise ValueError(f"unknown retriever kind {kind!r}; valid: {', '.join(KINDS)}")
    dense_only = [f"{name} {value!r}" for name, value, given in (
        ("query prefix", query_prefix, query_prefix is not None), ("encoder", encoder, encoder is not None),
        ("pooling", pooling, pooling != "mean")) if given]
    if kind != "dense" and dense_only:  # else ignored without a word (a query prefix: BM25's TypeError)
        raise ValueError(f"{' and '.join(dense_only)}: only a dense retriever encodes queries (a server has its "
                         f"own: retrieve.py serve --encoder, --query_prefix), not retriever kind {kind!r}")
    if query_prefix is not None:
        kw["query_prefix"] = query_prefix
    if kind == "http":
        if not url:
            raise ValueError("retriever kind 'http' needs url=")
        if index is not None:
            raise ValueError(f"index {index}: a server searches its own index (retrieve.py serve --index), not one "
                             "named here")
        return HTTPRetriever(url, **kw)
    if index is not None and not os.path.isdir(index) and kind != "dense":  # else ignored: BM25 built in memory
        raise ValueError(f"index {index} is not a folder: a {kind} index is a folder written by `retrieve.py "
                         "build`; a FAISS file (such as Search-R1's e5_Flat.index) needs retriever kind 'dense'")
    if index is not None and kind == "rank_bm25":  # it was read as the bm25s index it is, without a word
        raise ValueError(f"retriever kind 'rank_bm25' builds its BM25 in memory (the rank_bm25 package): index "
                         f"{index} is read by kind 'bm25' (bm25s)")
    if index is not None and os.path.isdir(index):
        if encoder is not None:
            kw["encoder"] = encoder
        if pooling != "mean":  # every caller's default: the folder's pooling
            kw["pooling"] = pooling
        return load_index(index, corpus, kind=kind, **kw)
    if corpus is None:
        raise ValueError(f"retriever kind {kind!r} needs a corpus")
    passages = open_corpus(corpus) if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    if kind in ("bm25", "rank_bm25"):
        return BM25Retriever(passages, backend="bm25s" if kind == "bm25" else "rank_bm25", **kw)
    if encoder is None:
        raise ValueError("retriever kind 'dense' needs encoder= (or index= a saved folder)")
    return DenseRetriever(passages, encoder, pooling=pooling, index=index, **kw)


def check_server(url: str, topk: int = 1) -> None:
    """Raise ConfigError if the retrieval server at `url` does not answer one search for `topk`
    passages (10 s, no retry), so that a run learns it, or that the server refuses its topk,
    before loading a model, not at its first rollout."""
    from searchlite.config import ConfigError

    try:
        HTTPRetriever(url, timeout=10, retries=0).search(["test"], topk)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"--retriever_url {url}: the retrieval server does not answer: {e}") from None


def config_retriever(cfg) -> Retriever:
    """The retriever a run's config names (its retriever, corpus, encoder, pooling, index and
    retriever_url fields): train.py's, stage 1's, and any script that replays a run. A server
    that does not answer, an index or encoder that does not load, is a ConfigError, which
    those commands print in one line."""
    from searchlite.config import NEEDS_URL, ConfigError

    if cfg.retriever == "http" and not cfg.retriever_url:  # (view: check_config does not see its flags)
        raise ConfigError(NEEDS_URL)
    if cfg.retriever == "http":
        check_server(cfg.retriever_url, cfg.topk)
    corpus = None if cfg.retriever == "http" else index_corpus(cfg.corpus, cfg.index)
    try:
        return build_retriever(cfg.retriever, corpus, encoder=cfg.encoder or None, pooling=cfg.pooling,
                               index=cfg.index or None, url=cfg.retriever_url or None,
                               query_prefix=getattr(cfg, "query_prefix", "") or None)  # empty: the folder's, or by name
    except DataError:  # a bad corpus line: it names its file and line already
        raise
    except OSError as e:
        raise ConfigError(os_error_text(e)) from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def index_corpus(corpus: str, index: str = "") -> str | None:
    """The corpus path to open beside `index`: an index folder reads the corpus it was built from
    (None) unless `corpus` names one other than the default toy corpus (`toy/corpus.jsonl` as the
    default spells it: a flag cannot tell it from no flag); else `corpus`, resolved."""
    from searchlite.config import Config, resolve_path

    if index and os.path.isdir(index) and corpus == Config.corpus:
        return None
    return resolve_path(corpus)
