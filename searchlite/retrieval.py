"""Search engines the rollout calls: BM25 and dense (encoder + FAISS) in-process, and an HTTP
client for a Search-R1-compatible server.

    r = build_retriever("bm25", "wiki-18.jsonl")
    hits = r.search(["who wrote hamlet", "capital of peru"], k=3)   # one list of Hit per query

Every retriever answers a batch of queries with `search(queries, k)`; duplicate queries in
one call are searched once (a GRPO group often repeats a query) and the result lists stay
aligned with the input. Queries never raise on content: empty or 10,000-character queries are
fine (dense encoders truncate to `max_length` tokens). BM25 returns only passages sharing a
term with the query, as Lucene does for Search-R1, so a query of unknown words gets `[]`.

Left out on purpose: approximate FAISS indexes (IVF, HNSW), GPU FAISS and sharded indexes,
rerankers, and caching across calls. A flat inner-product index over normalised embeddings
is exact; for wiki-18 (21M passages) build it once on a GPU box and `serve` it over HTTP.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from searchlite.data import Passage, read_corpus, split_contents

_SHOW_PROGRESS = 10_000  # passages; progress bars below this size are noise


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
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        unique = list(dict.fromkeys(queries))  # first-seen order
        found = self._search_unique(unique, k)
        if len(found) != len(unique):
            raise RuntimeError(f"{type(self).__name__} returned {len(found)} result lists for {len(unique)} queries")
        by_query = dict(zip(unique, found))
        return [list(by_query[q]) for q in queries]  # a fresh list per position

    def _search_unique(self, queries: list[str], k: int) -> list[list[Hit]]:
        raise NotImplementedError


def _hits(passages: list[Passage], idx, scores) -> list[Hit]:
    return [Hit(passages[i].id, passages[i].title, passages[i].text, float(s)) for i, s in zip(idx, scores)]


# ---------------------------------------------------------------------------- BM25


class BM25Retriever(Retriever):
    """Okapi BM25 over `title + text`, with bm25s (fast, sparse matrix; the default) or
    rank_bm25 (pure Python, slower). Both use bm25s's tokenizer: lowercase, words of two or
    more characters, English stopwords removed; no stemming."""

    def __init__(self, passages: list[Passage], backend: str = "bm25s"):
        import bm25s

        if backend not in ("bm25s", "rank_bm25"):
            raise ValueError(f"unknown BM25 backend {backend!r}; valid: 'bm25s', 'rank_bm25'")
        if not passages:
            raise ValueError("BM25Retriever needs at least one passage")
        self.passages, self.backend = list(passages), backend
        texts = [f"{p.title}\n{p.text}" for p in self.passages]
        show = len(texts) >= _SHOW_PROGRESS
        if backend == "bm25s":
            tokens = bm25s.tokenize(texts, stopwords="en", show_progress=show)
            self.index = bm25s.BM25()
            self.index.index(tokens, show_progress=show)
        else:
            from rank_bm25 import BM25Okapi

            self.index = BM25Okapi(bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=show))

    def _scores(self, tokens: list[str]):
        import numpy as np

        if self.backend == "rank_bm25":
            return np.asarray(self.index.get_scores(tokens), dtype=np.float64)
        ids = self.index.get_tokens_ids(tokens)  # unknown words dropped
        if not ids:
            return np.zeros(len(self.passages))
        return self.index.get_scores_from_ids(ids)

    def _search_unique(self, queries: list[str], k: int) -> list[list[Hit]]:
        import bm25s
        import numpy as np

        tokenized = bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
        out = []
        for tokens in tokenized:
            scores = self._scores([t for t in tokens if t])  # (N,)
            kk = min(k, len(scores))
            top = np.argpartition(-scores, kk - 1)[:kk] if kk < len(scores) else np.arange(len(scores))
            top = top[np.lexsort((top, -scores[top]))]  # best first, ties in corpus order
            top = top[scores[top] > 0]  # no shared term, no hit
            out.append(_hits(self.passages, top, scores[top]))
        return out


# ---------------------------------------------------------------------------- dense


def default_prefixes(encoder: str) -> tuple[str, str]:
    """(query prefix, passage prefix) an encoder was trained with, judged by its name:
    E5 wants "query: " / "passage: "; BGE an instruction before queries only.

    >>> default_prefixes("intfloat/e5-base-v2")
    ('query: ', 'passage: ')
    >>> default_prefixes("sentence-transformers/all-MiniLM-L6-v2")
    ('', '')
    """
    name = os.path.basename(str(encoder).rstrip("/\\")).lower()
    if re.search(r"(^|[-_])e5([-_]|$)", name):
        return "query: ", "passage: "
    if "bge" in name:
        return "Represent this sentence for searching relevant passages: ", ""
    return "", ""


def _ids_digest(passages: list[Passage]) -> str:
    return hashlib.sha1("\n".join(p.id for p in passages).encode("utf-8")).hexdigest()


class DenseRetriever(Retriever):
    """Any Hugging Face encoder (AutoModel), mean or CLS pooling, L2-normalised embeddings,
    exact search in a FAISS `IndexFlatIP` (inner product = cosine). Passages are encoded as
    `passage_prefix + contents` (Search-R1's wiki-18 form), queries as `query_prefix + q`.
    `index` may be a built FAISS index or a path to one; otherwise the corpus is encoded."""

    def __init__(self, passages: list[Passage], encoder: str, pooling: str = "mean",
                 query_prefix: str | None = None, passage_prefix: str | None = None,
                 batch_size: int = 64, max_length: int = 256, device: str = "cpu", index=None):
        import faiss
        import torch
        from transformers import AutoModel, AutoTokenizer

        if pooling not in ("mean", "cls"):
            raise ValueError(f"unknown pooling {pooling!r}; valid: 'mean', 'cls'")
        if not passages:
            raise ValueError("DenseRetriever needs at least one passage")
        dq, dp = default_prefixes(encoder)
        self.passages, self.encoder, self.pooling = list(passages), str(encoder), pooling
        self.query_prefix = dq if query_prefix is None else query_prefix
        self.passage_prefix = dp if passage_prefix is None else passage_prefix
        self.batch_size, self.max_length, self.device = batch_size, max_length, torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(encoder)
        if self.tokenizer.pad_token is None:  # decoder-style encoders ship without one
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.model = AutoModel.from_pretrained(encoder).to(self.device).eval()
        if index is None:
            emb = self.encode([p.contents for p in self.passages], self.passage_prefix, progress=True)
            index = faiss.IndexFlatIP(emb.shape[1])
            index.add(emb)
        elif isinstance(index, (str, os.PathLike)):
            index = faiss.read_index(str(index))
        if index.ntotal != len(self.passages):
            raise ValueError(f"index holds {index.ntotal} vectors but there are {len(self.passages)} passages")
        self.index = index

    def encode(self, texts: list[str], prefix: str = "", progress: bool = False):
        """Normalised embeddings, float32 numpy (len(texts), dim), in batches sorted by length."""
        import numpy as np
        import torch
        import torch.nn.functional as F
        from tqdm.auto import tqdm

        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # less padding per batch
        out = None
        starts = range(0, len(texts), self.batch_size)
        for s in tqdm(starts, desc="encoding passages", disable=not progress or len(texts) < _SHOW_PROGRESS):
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
        return out

    def _search_unique(self, queries: list[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        q = self.encode(list(queries), self.query_prefix)  # (n, H)
        if q.shape[1] != self.index.d:
            raise ValueError(f"encoder gives {q.shape[1]}-dim vectors but the index holds {self.index.d}-dim ones")
        scores, idx = self.index.search(q, min(k, self.index.ntotal))  # (n, k) each
        return [_hits(self.passages, [i for i in row if i >= 0], srow[row >= 0]) for row, srow in zip(idx, scores)]

    def save(self, folder) -> None:
        """Write `index.faiss` and `dense.json` (encoder, pooling, prefixes, corpus check)."""
        import faiss

        os.makedirs(folder, exist_ok=True)
        faiss.write_index(self.index, os.path.join(folder, "index.faiss"))
        settings = dict(encoder=self.encoder, pooling=self.pooling, query_prefix=self.query_prefix,
                        passage_prefix=self.passage_prefix, max_length=self.max_length,
                        num_passages=len(self.passages), ids_sha1=_ids_digest(self.passages))
        with open(os.path.join(folder, "dense.json"), "w") as f:
            json.dump(settings, f, indent=2)

    @classmethod
    def load(cls, folder, passages: list[Passage], **overrides) -> "DenseRetriever":
        """Rebuild a retriever saved with `save` over the same passages, in the same order.
        `overrides` replace saved settings or set others (`device`, `batch_size`, `encoder`)."""
        with open(os.path.join(folder, "dense.json")) as f:
            settings = json.load(f)
        if settings.pop("ids_sha1") != _ids_digest(passages) or settings.pop("num_passages") != len(passages):
            raise ValueError(f"{folder} was built over a different corpus (passage ids or order differ)")
        settings.update(overrides)
        return cls(passages, index=os.path.join(folder, "index.faiss"), **settings)


# ---------------------------------------------------------------------------- HTTP


class HTTPRetriever(Retriever):
    """Client for Search-R1's retrieval server: POST {url}/retrieve with
    `{"queries", "topk", "return_scores": true}`; reads `{"result": [[{"document": {"id",
    "contents"}, "score"}, ...], ...]}`, or bare documents (score 0.0) when a server drops
    the wrapper. Connection errors, timeouts and 5xx/429 answers are retried with
    exponential backoff (`backoff`, 2·backoff, ...); other failures raise at once."""

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 1.0):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def _post(self, payload: dict) -> dict:
        data = json.dumps(payload).encode("utf-8")
        cause = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    body = resp.read()
            except urllib.error.HTTPError as e:
                cause = f"HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace')}"
                if e.code < 500 and e.code != 429:
                    break  # the request itself is wrong; retrying will not help
                continue
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                cause = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            try:
                return json.loads(body)
            except json.JSONDecodeError as e:
                raise RuntimeError(f"retrieval server {self.url} sent invalid JSON ({e.msg}): {body[:200]!r}") from None
        raise RuntimeError(f"retrieval server {self.url} failed after {attempt + 1} attempt(s): {cause}")

    def _search_unique(self, queries: list[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        reply = self._post({"queries": list(queries), "topk": k, "return_scores": True})
        result = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise RuntimeError(f"retrieval server {self.url} sent no 'result' list for {len(queries)} queries: {str(reply)[:200]}")
        return [[_parse_item(item) for item in items[:k]] for items in result]


def _parse_item(item: dict) -> Hit:
    doc = item["document"] if "document" in item else item
    if "contents" in doc:
        title, text = split_contents(doc["contents"])
    else:
        title, text = doc.get("title", ""), doc.get("text", "")
    return Hit(str(doc.get("id", "")), title, text, float(item.get("score", 0.0)))


# ---------------------------------------------------------------------------- factory

KINDS = ("bm25", "rank_bm25", "dense", "http")


def build_retriever(kind: str, corpus=None, *, encoder=None, pooling="mean", index=None, url=None, **kw) -> Retriever:
    """Build a retriever by name. `corpus` is a JSONL path (or a list of Passage) for every
    kind but "http", which needs `url`. For "dense", `index` may be a folder written by
    `DenseRetriever.save` (loaded, `encoder` then optional) or a FAISS file; else the corpus
    is encoded with `encoder`. Other keywords go to the retriever's constructor."""
    if kind not in KINDS:
        raise ValueError(f"unknown retriever kind {kind!r}; valid: {', '.join(KINDS)}")
    if kind == "http":
        if not url:
            raise ValueError("retriever kind 'http' needs url=")
        return HTTPRetriever(url, **kw)
    if corpus is None:
        raise ValueError(f"retriever kind {kind!r} needs a corpus")
    passages = read_corpus(corpus) if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    if kind in ("bm25", "rank_bm25"):
        return BM25Retriever(passages, backend="bm25s" if kind == "bm25" else "rank_bm25", **kw)
    if index is not None and os.path.isdir(index):
        if encoder is not None:
            kw["encoder"] = encoder
        return DenseRetriever.load(index, passages, **kw)
    if encoder is None:
        raise ValueError("retriever kind 'dense' needs encoder= (or index= a saved folder)")
    return DenseRetriever(passages, encoder, pooling=pooling, index=index, **kw)
