"""Evaluate a policy on QA sets with the multi-turn search agent (greedy decoding).

    python evaluate.py                                             # the toy warm start on the toy test set
    python evaluate.py --model runs/toy-grpo/checkpoint/policy --data toy/test.jsonl
    python evaluate.py --model M --data hotpotqa.jsonl,2wiki.jsonl --corpus wiki.jsonl --template ""

Prints a Markdown table (EM, F1, cover-EM, searches per question, answered, answer length)
per dataset and question type, and writes every prediction and trajectory to
`--out/predictions.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from searchlite.config import resolve_path
from searchlite.data import DataError, read_qa
from searchlite.evaluation import METRICS, score_qa


def table(results: dict) -> str:
    lines = ["| data | type | n | " + " | ".join(METRICS) + " |", "|" + "---|" * (len(METRICS) + 3)]
    for data, metrics in results.items():
        for kind, m in metrics.items():
            lines.append(f"| {data} | {kind} | {m['n']} | " + " | ".join(f"{m[k]:.3f}" for k in METRICS) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="toy/model", help="policy folder (a checkpoint's policy/ folder works)")
    ap.add_argument("--data", default="toy/test.jsonl", help="comma-separated QA JSONL files")
    ap.add_argument("--corpus", default="toy/corpus.jsonl", help="passages JSONL")
    ap.add_argument("--retriever", default="bm25", help="bm25 | rank_bm25 | dense | http")
    ap.add_argument("--url", default=None, help="retrieval server URL (with --retriever http)")
    ap.add_argument("--protocol", default="search_r1", help="search_r1 | r1_searcher_pp")
    ap.add_argument("--template", default="toy", help="template file or set name ('' = the paper's)")
    ap.add_argument("--topk", type=int, default=3, help="passages per search")
    ap.add_argument("--max_turns", type=int, default=4, help="search budget")
    ap.add_argument("--max_new_tokens", type=int, default=200, help="tokens per turn")
    ap.add_argument("--batch_size", type=int, default=64, help="questions per batched rollout")
    ap.add_argument("--limit", type=int, default=0, help="first N questions of each file (0 = all)")
    ap.add_argument("--out", default="runs/eval", help="folder for predictions.json")
    args = ap.parse_args(argv)

    from searchlite.models import load_policy, load_tokenizer
    from searchlite.protocol import get_protocol
    from searchlite.retrieval import build_retriever
    from searchlite.sampler import HFSampler

    try:
        tokenizer = load_tokenizer(args.model)
        model = load_policy(args.model)
        retriever = build_retriever(args.retriever, resolve_path(args.corpus) if args.retriever != "http" else None,
                                    url=args.url)
        protocol = get_protocol(args.protocol, args.template)
        sets = {Path(d).stem: read_qa(resolve_path(d)) for d in args.data.split(",")}
    except (DataError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    sampler = HFSampler(model, tokenizer, max_new_tokens=args.max_new_tokens)
    results, records = {}, {}
    for name, qa in sets.items():
        qa = qa[:args.limit] if args.limit else qa
        results[name], records[name] = score_qa(sampler, retriever, tokenizer, protocol, qa,
                                                batch_size=args.batch_size, max_turns=args.max_turns, topk=args.topk)
    print(table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predictions.json").write_text(json.dumps({"metrics": results, "records": records}, indent=1))
    print(f"wrote {out / 'predictions.json'}")


if __name__ == "__main__":
    main()
