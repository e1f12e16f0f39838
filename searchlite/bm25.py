"""Okapi BM25 as a sparse index built in one streaming pass and searched from memory-mapped
arrays, so a 21M-passage corpus never has to be in memory as text.

    index = build_bm25(batches(corpus, 10_000), len(corpus))   # (start, [Passage]) pairs
    index.save("indexes/bm25"); index = BM25Index.load("indexes/bm25")   # opens in a moment
    idx, scores = index.top_k(index.token_ids(tokenize(["who wrote hamlet"])[0]), k=3)

Scoring is bm25s's default, Lucene's BM25 (Kamphuis et al., ECIR 2020, "Which BM25 do you
mean?"): idf = ln(1 + (N - df + 0.5) / (df + 0.5)) and a term's weight in a passage is
idf · tf / (tf + k1 · (1 - b + b · |d| / avgdl)), k1 = 1.5, b = 0.75. Weights are computed at
build time and stored term-major (CSC: `indptr` per term, passage `indices`, weights `data`),
so a query reads only its own terms' posting lists. Tokens are bm25s's: lowercase words of
two or more characters, English stopwords dropped, no stemming. The files carry bm25s's
names, so `bm25s.BM25.load(folder)` opens the same index.

Search-R1's BM25 server (Pyserini's LuceneSearcher over its wiki-18 index) ranks differently:
k1 = 0.9, b = 0.4 (`retrieve.py build --k1 0.9 --b 0.4` takes those), Porter stemming, and
Lucene's tokenizer, which keeps one-character tokens ("Henry V", "3.5"). For its exact
ranking, point `--retriever http` at that server.

Building keeps (term, count) pairs per passage, never the text: the saved index takes 8
bytes per distinct term of each passage, the build peaks at about 4x that (1M synthetic
passages of ~100 words: 603 MiB on disk; wiki-18 at 21M passages: ~13 GB).
"""

from __future__ import annotations

import json
import os
from itertools import chain

import numpy as np

from searchlite.data import write_durably

FILES = {"data": "data.csc.index.npy", "indices": "indices.csc.index.npy", "indptr": "indptr.csc.index.npy"}


def tokenize(texts: list[str]) -> list[list[str]]:
    """bm25s's tokenizer: one list of terms per text."""
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)


def build_bm25(batches, num_docs: int | None = None, k1: float = 1.5, b: float = 0.75,
               progress: bool = True) -> "BM25Index":
    """Index passages arriving as (start, [Passage]) batches, in order, over `title\\ntext`."""
    from tqdm.auto import tqdm

    vocab: dict[str, int] = {}
    terms, counts, lengths, distinct = [], [], [], []  # one array per batch
    with tqdm(total=num_docs, unit="passage", desc="BM25 indexing", disable=not progress) as bar:
        for _, passages in batches:
            docs = [[vocab.setdefault(t, len(vocab)) for t in toks]
                    for toks in tokenize([f"{p.title}\n{p.text}" for p in passages])]
            lens = np.fromiter(map(len, docs), np.int64, len(docs))  # (n,) terms per passage
            flat = np.fromiter(chain.from_iterable(docs), np.int64, int(lens.sum()))  # (T,)
            doc = np.repeat(np.arange(len(docs), dtype=np.int64), lens)  # (T,)
            key, tf = np.unique(doc << 32 | flat, return_counts=True)  # (U,) sorted by passage, then term
            terms.append((key & 0xFFFFFFFF).astype(np.int32))
            counts.append(tf.astype(np.float32))
            distinct.append(np.bincount(key >> 32, minlength=len(docs)))
            lengths.append(lens)
            bar.update(len(docs))
    if not lengths or not sum(map(len, lengths)):
        raise ValueError("a BM25 index needs at least one passage")
    term, tf = np.concatenate(terms), np.concatenate(counts)  # (nnz,) each
    del terms, counts
    dl = np.concatenate(lengths).astype(np.float32)  # (N,) passage lengths in terms
    n = len(dl)
    doc = np.repeat(np.arange(n, dtype=np.int32), np.concatenate(distinct))  # (nnz,)
    df = np.bincount(term, minlength=len(vocab))  # (V,) passages holding each term
    idf = np.log1p((n - df + 0.5) / (df + 0.5)).astype(np.float32)  # (V,)
    norm = (k1 * (1 - b + b * dl / max(float(dl.mean()), 1e-9))).astype(np.float32)  # (N,)
    weight = idf[term] * tf / (tf + norm[doc])  # (nnz,) float32
    del tf, norm
    order = np.argsort(term, kind="stable")  # (nnz,) term-major; passages stay ascending within a term
    del term  # arrays are freed as soon as they are used up: peak memory is a few times the index
    data = weight[order]
    del weight
    indices = doc[order]
    del doc, order
    indptr = np.concatenate([[0], np.cumsum(df)]).astype(np.int64)  # (V+1,)
    return BM25Index(data, indices, indptr, vocab, n, k1, b)


class BM25Index:
    """The sparse weights and the vocabulary; `top_k` answers one tokenized query."""

    def __init__(self, data, indices, indptr, vocab: dict, num_docs: int, k1: float = 1.5, b: float = 0.75):
        self.data, self.indices, self.indptr = data, indices, indptr  # (nnz,) f32, (nnz,) i32, (V+1,) i64
        self.vocab, self.num_docs, self.k1, self.b = vocab, int(num_docs), k1, b

    def token_ids(self, tokens: list[str]) -> list[int]:
        """Vocabulary ids of the known tokens, repeats kept (a repeated word counts twice, as in bm25s)."""
        return [self.vocab[t] for t in tokens if t in self.vocab]

    def top_k(self, ids: list[int], k: int):
        """(passage indices, scores) of the `k` best passages sharing a term with the query,
        best first, ties in corpus order. Of the passages tied at the k-th score, argpartition picks
        which get in, as bm25s does: the same for one k every time, but top_k(q, 5)[:3] may differ
        from top_k(q, 3) (the server searches each k on its own for that reason)."""
        spans = [(int(self.indptr[t]), int(self.indptr[t + 1])) for t in ids]
        if not spans:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        scores = np.zeros(self.num_docs, np.float32)  # (N,) calloc: untouched pages cost nothing
        for s, e in spans:
            scores[self.indices[s:e]] += self.data[s:e]  # a term lists each passage once
        if sum(e - s for s, e in spans) < self.num_docs // 8:
            cand = np.unique(np.concatenate([self.indices[s:e] for s, e in spans]))  # (C,) matched passages
        else:
            cand = np.flatnonzero(scores)
        if len(cand) > k:
            cand = cand[np.argpartition(-scores[cand], k - 1)[:k]]
        top = cand[np.lexsort((cand, -scores[cand]))].astype(np.int64)  # best first, ties by index
        return top, scores[top]

    def save(self, folder) -> None:
        """Write the arrays, `vocab.index.json` and `params.index.json` (bm25s's layout), each
        whole or not at all (`write_durably`)."""
        os.makedirs(folder, exist_ok=True)
        for name, path in FILES.items():
            write_durably(os.path.join(folder, path), lambda f: np.save(f, getattr(self, name)))
        write_durably(os.path.join(folder, "vocab.index.json"),
                      lambda f: json.dump(self.vocab, f, ensure_ascii=False), "w")
        params = dict(k1=self.k1, b=self.b, delta=0.5, method="lucene", idf_method="lucene", dtype="float32",
                      int_dtype="int32", num_docs=self.num_docs, backend="numpy")
        write_durably(os.path.join(folder, "params.index.json"), lambda f: json.dump(params, f, indent=2), "w")

    @classmethod
    def load(cls, folder, mmap: bool = True) -> "BM25Index":
        """Open a saved index; with `mmap` the arrays stay on disk and pages load on use. A file
        that does not read, or arrays that do not fit the vocabulary (files from two builds),
        raise ValueError naming the file or the folder."""
        def read(name, load):
            path = os.path.join(folder, name)
            try:
                return load(path)
            except (OSError, ValueError, EOFError) as e:  # a JSONDecodeError is a ValueError
                raise ValueError(f"{path}: not a readable BM25 index file ({e}); rebuild the index") from None

        def read_array(path):
            return np.load(path, mmap_mode="r" if mmap else None)

        def read_json(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)

        a = {name: read(path, read_array) for name, path in FILES.items()}
        vocab, p = read("vocab.index.json", read_json), read("params.index.json", read_json)
        # CSC: term t's postings are data/indices[indptr[t]:indptr[t + 1]], so the sizes must agree
        if (len(a["indptr"]) != len(vocab) + 1 or a["indptr"][-1] != len(a["data"])
                or len(a["data"]) != len(a["indices"])):
            raise ValueError(f"{folder}: the BM25 index files do not fit together ({len(vocab)} terms in "
                             f"vocab.index.json, {len(a['indptr'])} offsets in {FILES['indptr']}, {len(a['data'])} "
                             f"weights, {len(a['indices'])} passage indices): files of two builds? Rebuild the index")
        return cls(a["data"], a["indices"], a["indptr"], vocab, p["num_docs"], p["k1"], p["b"])
