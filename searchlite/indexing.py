"""Build index folders from a corpus file, streaming: `retrieve.py build` calls these.

    build_bm25_folder("wiki-18.jsonl", "indexes/bm25")
    build_dense_folder("wiki-18.jsonl", "indexes/e5", "intfloat/e5-base-v2", faiss_index="flat")
    r = load_index("indexes/e5")                       # searchlite.retrieval

Memory follows the index, not the corpus: the corpus is read in batches through a lazy
`Corpus` (its line offsets cached in the folder as `corpus_offsets.npz`). A folder is
finished when its `bm25.json` or `dense.json` exists; saving the index deletes both first and
writes its own last, every file whole (renamed into place), so a save cut short leaves a folder
that refuses to load, and a build that fails before it leaves the old index as it was. A folder
holds one kind: a build refuses one with the other kind's files.

Dense builds encode the corpus in shards of `shard_size` passages, each written whole to
`shards/` and renamed into place, beside a `shards/manifest.json` of the settings. Run the
same command again after an interruption and it encodes only the missing shards (other
settings are refused). Then the vectors go into FAISS, inner product over normalised
vectors (cosine): "flat" is exact (Search-R1's e5_Flat; 4·dim bytes a passage), "hnsw" a
graph (HNSW32: faster, approximate, flat's size plus ~256 bytes a passage), "ivfpq" an
inverted file with product quantisation (dim/8 bytes a passage, 1/32 of flat, lossy; trained
on up to 100k sampled vectors, so it needs 10k passages); any faiss.index_factory string
also works. Search favours recall: nprobe=64 for an IVF index, efSearch=128 for HNSW, unless
`search_params` says otherwise. The shards are deleted once the index is written, unless
`keep_shards`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import numpy as np

from searchlite.corpus import Corpus
from searchlite.data import DataError, write_durably
from searchlite.retrieval import (BM25Retriever, DenseRetriever, TextEncoder, check_index_folder, default_prefixes,
                                  encoder_name, read_json_object)

FAISS_KINDS = ("flat", "hnsw", "ivfpq")
BUILD_LOCK = "build.lock"  # held by `retrieve.py build` in its --out
TRAIN_LIMIT = 100_000  # vectors sampled to train a quantizer: k-means time and memory grow with them


def _corpus(path, folder, kind: str) -> Corpus:
    """Open the corpus for a `kind` build into `folder`, checked first (`check_index_folder`):
    a folder of the other kind is refused before a long scan."""
    check_index_folder(folder, kind)
    os.makedirs(folder, exist_ok=True)
    corpus = Corpus(path, offsets=os.path.join(folder, "corpus_offsets.npz"))
    if not len(corpus):
        raise DataError(f"{path}: no passages to index (the file is empty or holds only blank lines)")
    return corpus


def build_bm25_folder(corpus_path, folder, progress: bool = True, k1: float = 1.5, b: float = 0.75) -> BM25Retriever:
    """Index a corpus file with BM25 (`k1`, `b`: see BM25Retriever) and save it to `folder`."""
    r = BM25Retriever(_corpus(corpus_path, folder, "bm25"), progress=progress, k1=k1, b=b)
    r.save(folder)
    return r


def faiss_factory(kind: str, dim: int, n: int) -> str:
    """The faiss.index_factory string for a kind name (other strings pass through).

    >>> faiss_factory("ivfpq", 768, 21_000_000)
    'IVF2564,PQ96'
    """
    if kind == "flat":
        return "Flat"
    if kind == "hnsw":
        return "HNSW32,Flat"
    if kind == "ivfpq":
        if n < 10_000:
            raise ValueError(f"--faiss 'ivfpq' needs at least 10,000 passages to train, the corpus has {n}; "
                             "use 'flat' or 'hnsw'")
        # faiss wants >= 39 training points per list, and the lists are trained on the sample, not on
        # all n vectors, so nlist follows the sample: wiki-18 gets 2,564 lists, not 4·sqrt(n) = 18,330,
        # which would need a 715k-vector sample (2.2 GB at 768 dims) and ~50x the k-means work.
        nlist = int(min(4 * np.sqrt(n), len(range(0, n, _train_step(n))) // 39))
        m = max(d for d in range(1, dim // 8 + 1) if dim % d == 0)  # 8-dim sub-vectors, 1 byte each
        return f"IVF{nlist},PQ{m}"
    return kind


def default_search_params(factory: str) -> str:
    """Search parameters that favour recall over speed, by the factory string's structure: an
    inverted file probes 64 lists (faiss caps that at nlist), an HNSW graph keeps 128 candidates.

    >>> default_search_params("IVF8,Flat"), default_search_params("HNSW32,Flat"), default_search_params("Flat")
    ('nprobe=64', 'efSearch=128', '')
    """
    if "IVF" in factory:
        return "nprobe=64"
    return "efSearch=128" if "HNSW" in factory else ""


def _shard_paths(folder, n: int, shard_size: int) -> list[str]:
    return [os.path.join(folder, "shards", f"{s // shard_size:06d}.npy") for s in range(0, n, shard_size)]


def _check_manifest(folder, manifest: dict) -> None:
    """Write the shard manifest, or refuse to resume shards made with other settings."""
    path = os.path.join(folder, "shards", "manifest.json")
    if os.path.exists(path):
        old = read_json_object(path, "build settings", f"delete {folder}/shards to encode the corpus afresh")
        old.setdefault("corpus_mtime_ns", manifest["corpus_mtime_ns"])  # written before it was recorded
        if old.get("encoder"):
            old["encoder"] = encoder_name(old["encoder"])  # kept as typed before it was made absolute
        diff = sorted(k for k in manifest.keys() | old.keys() if manifest.get(k) != old.get(k))
        if diff:
            raise ValueError(f"{folder}/shards holds a build with other settings ({', '.join(diff)} differ); "
                             f"use another --out or delete {folder}/shards")
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_durably(path, lambda f: json.dump(manifest, f, indent=2), "w")


def encode_shards(corpus: Corpus, folder, enc: TextEncoder, prefix: str, shard_size: int,
                  progress: bool = True) -> list[str]:
    """Encode every missing shard; return all shard paths, in order. Only the missing shards'
    passages are read: a resumed wiki-18 build does not parse 13 GB again to skip them."""
    from tqdm.auto import tqdm

    paths = _shard_paths(folder, len(corpus), shard_size)
    missing = [(i * shard_size, p) for i, p in enumerate(paths) if not os.path.exists(p)]
    done = len(corpus) - sum(min(shard_size, len(corpus) - start) for start, _ in missing)
    with tqdm(total=len(corpus), initial=done, unit="passage", desc="encoding passages", disable=not progress) as bar:
        for start, path in missing:
            _, chunk = next(corpus.batches(shard_size, start))
            emb = enc.encode([p.contents for p in chunk], prefix, bar=bar)  # (shard, H)
            write_durably(path, lambda f: np.save(f, emb))  # a shard is there whole or not at all
    return paths


def _train_step(n: int) -> int:
    """Train on every step-th of n vectors: at most TRAIN_LIMIT of them, spread over the corpus."""
    return max(1, -(-n // TRAIN_LIMIT))


def _training_sample(paths: list[str], n: int):
    step = _train_step(n)
    parts, offset = [], 0
    for p in paths:
        x = np.load(p, mmap_mode="r")  # (shard, H)
        parts.append(np.asarray(x[(-offset) % step::step]))
        offset += len(x)
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)  # (ceil(n/step), H)


def build_dense_folder(corpus_path, folder, encoder: str, *, pooling: str = "mean", query_prefix=None,
                       passage_prefix=None, faiss_index: str = "flat", search_params: str | None = None,
                       shard_size: int = 50_000, batch_size: int = 64, max_length: int = 256, device: str = "cpu",
                       keep_shards: bool = False, progress: bool = True) -> DenseRetriever:
    """Encode a corpus file (resumably, in shards) into a FAISS index saved to `folder`."""
    import faiss

    corpus = _corpus(corpus_path, folder, "dense")
    enc = TextEncoder(encoder, pooling, batch_size, max_length, device)
    dq, dp = default_prefixes(encoder)
    query_prefix = dq if query_prefix is None else query_prefix
    passage_prefix = dp if passage_prefix is None else passage_prefix
    dim = enc.dim
    factory, search_params = checked_faiss(faiss_index, search_params, dim, len(corpus))  # before hours of encoding
    _check_manifest(folder, dict(encoder=enc.name, pooling=pooling, passage_prefix=passage_prefix,
                                 max_length=enc.max_length, shard_size=shard_size, corpus=os.path.abspath(corpus.path),
                                 corpus_bytes=corpus.stamp[0], corpus_mtime_ns=corpus.stamp[1],
                                 num_passages=len(corpus)))
    paths = encode_shards(corpus, folder, enc, passage_prefix, shard_size, progress)
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(_training_sample(paths, len(corpus)))
    for p in paths:
        index.add(np.ascontiguousarray(np.load(p), dtype=np.float32))
    r = DenseRetriever(corpus, enc, query_prefix=query_prefix, passage_prefix=passage_prefix, index=index,
                       search_params=search_params)
    r.save(folder)
    if not keep_shards:  # its own files only: a shards/ the user keeps other files in stays
        for p in [*paths, os.path.join(folder, "shards", "manifest.json")]:
            os.remove(p)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(folder, "shards"))
    return r


def checked_faiss(kind: str, search_params: str | None, dim: int, n: int) -> tuple[str, str]:
    """(factory string, search parameters) for `kind` and `search_params` (None: the defaults),
    refused with a ValueError naming the flag unless faiss takes both and every parameter is a
    positive number (efSearch=0 returns fewer hits than asked, quietly)."""
    import faiss

    factory = faiss_factory(kind, dim, n)
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        raise ValueError(f"--faiss {kind!r}: faiss cannot make this index ({faiss_reason(e)}); "
                         f"use one of {', '.join(FAISS_KINDS)} or a faiss.index_factory string") from None
    if not index.is_trained:  # k-means wants a training vector a centroid: faiss says so only after the encoding
        m = -(-n // _train_step(n))  # the vectors _training_sample takes
        ivf = faiss.try_extract_index_ivf(index)
        pq = getattr(faiss.downcast_index(ivf if ivf is not None else index), "pq", None)
        need = max(ivf.nlist if ivf is not None else 0, pq.ksub if pq is not None else 0)
        if m < need:
            raise ValueError(f"--faiss {kind!r}: the {factory} index trains {need:,} centroids on {m:,} vectors (the "
                             "passages, or a sample of them), and faiss needs at least one a centroid: use fewer IVF "
                             f"lists or PQ bits, or one of {', '.join(FAISS_KINDS)}")
    params = default_search_params(factory) if search_params is None else search_params
    for item in filter(None, params.split(",")):
        name, _, value = item.partition("=")
        try:
            ok = float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--search_params {params!r}: {item!r} is not name=positive number (e.g. nprobe=64, "
                             "efSearch=128)")
    try:
        faiss.ParameterSpace().set_index_parameters(index, params)
    except RuntimeError as e:
        raise ValueError(f"--search_params {params!r}: faiss does not take it for a {factory} index "
                         f"({faiss_reason(e)})") from None
    return factory, params


def faiss_reason(e: Exception) -> str:
    """A faiss error's message without its C++ location ("Error in <signature> at <file>:<line>: ")."""
    return re.sub(r"^Error in .* at \S+:\d+: ?", "", str(e).strip().splitlines()[-1])
