"""Build, query and serve retrieval indexes over a passage corpus.

    python retrieve.py build --corpus wiki-18.jsonl --kind bm25 --out indexes/bm25
    python retrieve.py build --corpus wiki-18.jsonl --kind dense --encoder intfloat/e5-base-v2 --out indexes/e5
    python retrieve.py query --index indexes/e5 "Who founded the Home Rule League?"
    python retrieve.py serve --index indexes/e5 --port 8000          # Search-R1's POST /retrieve
    python retrieve.py serve --corpus wiki-18.jsonl --index e5_Flat.index --encoder intfloat/e5-base-v2
    python retrieve.py query --url http://127.0.0.1:8000 "query one" "query two"

Corpora are JSONL in Search-R1's wiki-18 format or id/title/text (searchlite/data.py), read
lazily: memory goes to the index, not the text. `build` writes an index folder
(searchlite/indexing.py); a dense build is sharded and resumes when run again. `query` and
`serve` take such a folder, Search-R1's released faiss file with its corpus (the last serve
line), or just a corpus (indexed in memory at start; the toy world's by default).
"""

from __future__ import annotations

import os
import socket
import sys
import time

from searchlite.config import ArgumentParser, HelpFormatter, at_least, not_a_folder, plain_warnings, resolve_path
from searchlite.retrieval import HTTP_QUERY_CHARS
from searchlite.data import DataError


def port_taken(host: str, port: int) -> str | None:
    """Why a server cannot listen on `host:port` (another one holds it), or None if it can."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror
    return None


def check_port(host: str, port: int) -> None:
    """Exit with a message if `host:port` cannot be listened on: found before the index loads, not
    after, when uvicorn would say it."""
    why = port_taken(host, port)
    if why:
        sys.exit(f"error: --host {host} --port {port}: cannot listen there ({why}); another server may hold it: "
                 "pick another --port")


def is_jsonl(path) -> bool:
    """Whether the file `path` begins as a JSONL corpus does (a "{" after any blank or BOM), or is
    gzipped: a FAISS file begins with its index type's four letters."""
    with open(path, "rb") as f:
        head = f.read(4096)
    return head[:2] == b"\x1f\x8b" or head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"{"


def dense_device(device) -> str:
    """The torch device of a dense index's encoder for --device (unset: cpu; auto: the GPU when there is one),
    refused (ValueError) where this machine lacks it, before a corpus scan or an encoder load; asked for once
    the flags a device would be ignored with are refused, so that those are named first."""
    if device in (None, "cpu"):
        return "cpu"
    from searchlite.models import pick_device

    return str(pick_device(device))


def make(args):
    """The retriever the arguments name."""
    from searchlite.retrieval import build_retriever, index_kind, load_index

    dense_only = [f"--{k}" for k in ("encoder", "pooling", "query_prefix", "device") if getattr(args, k) is not None]
    dense_only += ["--mmap"] * args.mmap  # flags only a dense index reads: each refused where it would be ignored
    if getattr(args, "url", None):
        given = [f"--{k}" for k in ("corpus", "index") if getattr(args, k) is not None]
        given += ["--kind"] * (args.kind != "auto") + dense_only
        if given:
            raise ValueError(f"{' and '.join(given)}: --url {args.url} searches the server's own index and "
                             "encoder; give these to its retrieve.py serve")
        return build_retriever("http", url=args.url)
    corpus = resolve_path(args.corpus) if args.corpus else None
    kind = None if args.kind == "auto" else args.kind
    dense_kw = dict(mmap=args.mmap)  # (and its device, once a dense index will take it)
    if args.query_prefix is not None:
        dense_kw["query_prefix"] = args.query_prefix
    if args.index and os.path.isdir(args.index):
        kw = dense_kw if index_kind(args.index) == "dense" else {}
        if not kw and index_kind(args.index) and dense_only:
            raise ValueError(f"{' and '.join(dense_only)}: --index {args.index} holds a {index_kind(args.index)} "
                             "index, which encodes no queries; these flags are for a dense one")
        if kw:
            kw["device"] = dense_device(args.device)
        if kw and args.encoder:
            kw["encoder"] = args.encoder
        if kw and args.pooling is not None:  # not given: the folder's pooling
            kw["pooling"] = args.pooling
        return load_index(args.index, corpus, kind=kind, **kw)
    if args.index and not os.path.exists(args.index):
        raise FileNotFoundError(f"no index folder or FAISS file at {args.index}")
    if args.index and is_jsonl(args.index):  # else taken for a FAISS file, and "give --corpus" followed
        raise ValueError(f"--index {args.index} is a JSONL file, not an index: a corpus goes to --corpus (BM25 then "
                         f"indexes it in memory), or `retrieve.py build --corpus {args.index}` writes an index folder")
    if args.index and kind in ("bm25", "rank_bm25"):  # else the file was ignored and BM25 built in memory
        raise ValueError(f"--index {args.index} is a file: a --kind {kind} index must be a folder written by "
                         "`retrieve.py build` (a FAISS file is read with --kind dense)")
    if args.index and not corpus:
        raise ValueError(f"--index {args.index} is a FAISS file: give --corpus, the corpus it was built over")
    kind = kind or ("dense" if args.index or args.encoder else "bm25")  # a FAISS file or an encoder means dense
    if kind != "dense" and dense_only:
        raise ValueError(f"{' and '.join(dense_only)}: for a dense retriever, which encodes queries; --kind {kind} "
                         "does not")
    if kind == "dense" and not args.encoder and args.index:
        raise ValueError(f"--index {args.index} is a FAISS file: give --encoder, the sentence encoder that made its "
                         "passage vectors")
    if kind == "dense" and not args.encoder:
        raise ValueError("--kind dense needs --encoder (the sentence encoder) or --index (a folder that "
                         "retrieve.py build wrote)")
    if kind == "dense":
        dense_kw["device"] = dense_device(args.device)
    return build_retriever(kind, corpus or resolve_path("toy/corpus.jsonl"), encoder=args.encoder,
                           pooling=args.pooling or "mean", index=args.index, **(dense_kw if kind == "dense" else {}))


DENSE_BUILD = ("encoder", "pooling", "query_prefix", "passage_prefix", "faiss", "search_params", "keep_shards",
               "device")
BM25_BUILD = ("k1", "b")


def build_kind(args) -> str:
    """The kind `build` makes: --kind, else dense with --encoder, else bm25."""
    return args.kind if args.kind != "auto" else "dense" if args.encoder else "bm25"


def check_build(args, kind: str) -> None:
    """Exit with a message for flags a `kind` build cannot use: the other kind's (a forgotten
    --encoder built BM25 without a word, its --faiss and --pooling ignored), bad BM25 parameters,
    an --out that cannot be a folder."""
    other = [f"--{k}" for k in (BM25_BUILD if kind == "dense" else DENSE_BUILD)
             if getattr(args, k) not in (None, False)]
    if other:
        why = "" if args.kind != "auto" else " (--kind auto: dense with --encoder, else bm25)"
        sys.exit(f"error: {' and '.join(other)}: not for a {kind} build{why}")
    if kind == "dense" and not args.encoder:
        sys.exit("error: a dense build needs --encoder (e.g. intfloat/e5-base-v2)")
    bad = [f"--k1 {args.k1}"] * (args.k1 is not None and not args.k1 >= 0)
    bad += [f"--b {args.b}"] * (args.b is not None and not 0 <= args.b <= 1)
    if kind == "bm25" and bad:  # (a flag left out takes its default)
        sys.exit(f"error: BM25 needs --k1 >= 0 and 0 <= --b <= 1; got {' and '.join(bad)}")
    if why := not_a_folder("--out", args.out):
        sys.exit(f"error: {why}")


def build(args) -> None:
    from searchlite.data import held_folder
    from searchlite.indexing import BUILD_LOCK

    corpus, t0 = resolve_path(args.corpus), time.time()
    kind = build_kind(args)
    check_build(args, kind)
    device = dense_device(args.device) if kind == "dense" else None
    busy = ValueError(f"another retrieve.py build is writing to {args.out}; wait for it to finish, or choose "
                      "another --out")
    with held_folder(args.out, BUILD_LOCK, busy, scratch=("corpus_offsets.npz",)):  # a failed fresh build: no folder
        r = build_folder(kind, corpus, args, device)
    print(f"wrote {args.out}: {len(r.passages)} passages in {time.time() - t0:.1f}s")


def build_folder(kind: str, corpus: str, args, device: str | None):
    from searchlite.indexing import build_bm25_folder, build_dense_folder

    if kind == "dense":
        return build_dense_folder(corpus, args.out, args.encoder, pooling=args.pooling or "mean",
                                  query_prefix=args.query_prefix, passage_prefix=args.passage_prefix,
                                  faiss_index=args.faiss or "flat", search_params=args.search_params,
                                  shard_size=args.shard_size, batch_size=args.batch_size, max_length=args.max_length,
                                  device=device, keep_shards=args.keep_shards)
    given = {k: getattr(args, k) for k in BM25_BUILD if getattr(args, k) is not None}  # else bm25s's 1.5 and 0.75
    return build_bm25_folder(corpus, args.out, **given)


def main(argv=None) -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    helps = {"build": "index a corpus file into a folder (BM25 or dense)",
             "query": "search an index, a corpus or a server and print the top passages",
             "serve": "serve an index over HTTP with Search-R1's POST /retrieve API"}
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        a = p.add_argument
        if name == "build":
            a("--corpus", required=True, help="passages JSONL to index")
            a("--kind", default="auto", choices=["auto", "bm25", "dense"],
              help="index kind (auto: dense with --encoder, else bm25; rank_bm25 needs no build: query and serve "
                   "index the corpus in memory)")
        else:
            a("--corpus", default=None, help="passages JSONL (default: the index folder's, else the toy world's)")
            a("--kind", default="auto", choices=["auto", "bm25", "rank_bm25", "dense"],
              help="retriever kind (auto: the index's, else dense with --encoder, else bm25)")
            a("--index", default=None, help="index folder from `build`, or a FAISS file such as Search-R1's "
              "e5_Flat.index")
            a("--mmap", action="store_true", help="dense: memory-map a flat FAISS index instead of reading it in")
        a("--encoder", default=None, help="dense: Hugging Face encoder name or folder")
        a("--pooling", default=None, choices=["mean", "cls"], help="dense: pooling (default: " + (
          "" if name == "build" else "an index folder's, else ") + "mean, as E5; BGE takes cls)")
        a("--device", default=None, help="dense: torch device of the encoder: cpu (the default), cuda, cuda:N, "
          "or auto (the GPU when there is one)")
        a("--query_prefix", default=None, help="dense: text before each query (default: " + (
          "" if name == "build" else "an index folder's, else ") + "by encoder name: 'query: ' for E5)")
        if name == "build":
            a("--out", required=True, help="folder to write the index to (rerun to resume a dense build)")
            a("--faiss", default=None, help="dense: flat (the default) | hnsw | ivfpq | a faiss.index_factory string")
            a("--search_params", default=None, help="dense: faiss search parameters (default nprobe=64 for an IVF "
              "index, efSearch=128 for HNSW, none for flat)")
            a("--passage_prefix", default=None, help="dense: text before each passage (default: by encoder name)")
            a("--shard_size", type=at_least(1), default=50_000, help="dense: passages per saved shard")
            a("--batch_size", type=at_least(1), default=64, help="dense: passages per encoder forward")
            a("--max_length", type=at_least(1), default=256, help="dense: tokens kept per passage and query (at most "
              "the encoder's positions)")
            a("--keep_shards", action="store_true", help="dense: keep the encoded shards after the build")
            a("--k1", type=float, default=None, help="bm25: term-frequency saturation (default 1.5, bm25s's; "
              "Search-R1's BM25 server, Pyserini, uses 0.9)")
            a("--b", type=float, default=None, help="bm25: passage-length normalisation (default 0.75; Pyserini: 0.4)")
        elif name == "query":
            a("--url", default=None, help="query a Search-R1-compatible server instead (it searches with its "
              "own index and encoder: no --corpus, --index, --kind or dense flags such as --device)")
            a("--k", type=int, default=3, help="passages per query (default 3)")
            a("queries", nargs="+", help="one or more queries")
        else:
            a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
            a("--port", type=at_least(1, 65535), default=8000, help="port to listen on")
            a("--max_queries", type=at_least(1), default=4096, help="queries per request at most")
            a("--topk", type=int, default=3, help="passages per query for a request that sends no topk, null or 0 "
              "(Search-R1's server does the same with its --topk)")
            a("--max_query_chars", type=at_least(1), default=HTTP_QUERY_CHARS,
              help="a longer query is cut to this many characters (default %(default)s, where searchlite's "
                   "client cuts its queries)")
            a("--batch_wait_ms", type=float, default=5.0, help="how long to gather concurrent requests into a batch")
    args = ap.parse_args(argv)
    if args.corpus and not os.path.isfile(resolve_path(args.corpus)):
        what = "a folder, not a file (a passages JSONL)" if os.path.isdir(resolve_path(args.corpus)) else "no such file"
        sys.exit(f"error: --corpus {args.corpus}: {what}")
    if args.cmd == "query" and args.k < 1:
        sys.exit(f"error: --k must be a positive integer, got {args.k}")
    if args.cmd == "serve":  # before the index loads, which takes minutes on wiki-18
        try:
            from searchlite.server import MAX_TOPK, serve
        except ImportError as e:
            sys.exit(f"error: serving needs FastAPI and uvicorn ({e}): pip install -e '.[serve]'")
        if not 1 <= args.topk <= MAX_TOPK:
            sys.exit(f"error: --topk must be 1..{MAX_TOPK}, got {args.topk}")
        check_port(args.host, args.port)
    try:
        if args.cmd == "build":
            return build(args)
        t0 = time.time()
        retriever = make(args)
        if args.cmd == "serve":
            host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address, as a URL writes it
            print(f"loaded {type(retriever).__name__} in {time.time() - t0:.1f}s; serving http://{host}:{args.port}"
                  "/retrieve (schema at /docs)", flush=True)
            return serve(retriever, args.host, args.port, default_topk=args.topk, max_queries=args.max_queries,
                         max_query_chars=args.max_query_chars, batch_wait=args.batch_wait_ms / 1000)
        for query, hits in zip(args.queries, retriever.search(args.queries, args.k)):
            print(f"query: {query}")
            for rank, h in enumerate(hits, 1):
                print(f"  {rank}. [{h.score:.3f}] {h.title} (id {h.id})\n     {h.text[:300]}")
            if not hits:
                print("  (no passage matched)")
    except (DataError, ValueError, RuntimeError, OSError) as e:  # OSError: an encoder the hub cannot give, ...
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # a traceback said nothing of what is kept
        dense = args.cmd == "build" and build_kind(args) == "dense"
        sys.stderr.write("\ninterrupted" + (": a dense build keeps its finished shards, and the same command "
                                             "continues from them\n" if dense else "\n"))
        sys.exit(130)


if __name__ == "__main__":
    plain_warnings(__file__)
    main()
