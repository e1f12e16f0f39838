"""Build and query retrieval indexes over a passage corpus.

    python retrieve.py query --corpus wiki.jsonl --kind bm25 --k 3 "Who founded the Home Rule League?"
    python retrieve.py query --url http://127.0.0.1:8000 "query one" "query two"
    python retrieve.py build --corpus wiki.jsonl --kind dense --encoder intfloat/e5-base-v2 --out indexes/e5
    python retrieve.py query --corpus wiki.jsonl --kind dense --index indexes/e5 "..."

Corpora are JSONL in Search-R1's wiki-18 format or id/title/text (searchlite/data.py).
BM25 indexes build in seconds and live in memory; dense indexes are encoded once, saved
with `build`, and loaded with `--index`.
"""

from __future__ import annotations

import argparse
import sys
import time

from searchlite.config import resolve_path
from searchlite.data import DataError
from searchlite.retrieval import KINDS, build_retriever


def make(args):
    corpus = resolve_path(args.corpus) if args.corpus else None
    kind = "http" if args.url else args.kind
    return build_retriever(kind, corpus, encoder=args.encoder, pooling=args.pooling, index=args.index, url=args.url)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (("query", "search a corpus (or a server) and print the top passages"),
                       ("build", "encode a corpus into a dense index folder")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--corpus", default="toy/corpus.jsonl", help="passages JSONL (default: the toy world's)")
        p.add_argument("--kind", default="bm25", choices=[k for k in KINDS if k != "http"],
                       help="retriever kind (default bm25, which uses bm25s)")
        p.add_argument("--encoder", default=None, help="dense: Hugging Face encoder folder or name")
        p.add_argument("--pooling", default="mean", choices=["mean", "cls"], help="dense: pooling (default mean)")
        p.add_argument("--index", default=None, help="dense: saved index folder to load")
        if name == "query":
            p.add_argument("--url", default=None, help="query a Search-R1-compatible server instead of a corpus")
            p.add_argument("--k", type=int, default=3, help="passages per query (default 3)")
            p.add_argument("queries", nargs="+", help="one or more queries")
        else:
            p.add_argument("--out", required=True, help="folder to write the dense index to")
            p.set_defaults(url=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            if args.kind != "dense":
                sys.exit("error: only dense indexes are built ahead; BM25 builds in memory at query time")
            t0 = time.time()
            make(args).save(args.out)
            print(f"wrote {args.out} in {time.time() - t0:.1f}s")
            return
        retriever = make(args)
        for query, hits in zip(args.queries, retriever.search(args.queries, args.k)):
            print(f"query: {query}")
            for rank, h in enumerate(hits, 1):
                print(f"  {rank}. [{h.score:.3f}] {h.title} (id {h.id})\n     {h.text[:300]}")
            if not hits:
                print("  (no passage matched)")
    except (DataError, ValueError, RuntimeError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
