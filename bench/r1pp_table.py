"""The R1-Searcher++ ablation table from finished runs, and the floor on retrieval calls.

    python bench/r1pp_table.py                     # runs/r1pp-{full,nogroup,nomem,neither,baseline}
    python bench/r1pp_table.py --runs A B ...      # any train.py out_dirs

For each run: the held-out test EM and retrieval calls per question (RC) at its first and last
evaluation (the first is the stage-1 model every run starts from; `step` says how far a run
got), by question type, and the rewrites L_M kept over the run. Then, from the test questions
alone, the fewest retrievals a policy could make and still answer every question: one per hop,
except hops about famous entities, which the toy world's warm start teaches (toyworld.py); and
the same if it had also memorised every fact that a training question asks (what L_M teaches,
at best).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ["full", "nogroup", "nomem", "neither", "baseline"]
TYPES = ["1hop", "2hop", "comparison"]


def run_summary(path: Path) -> tuple[dict, dict, int, int]:
    """(first eval row, last eval row, rewrites kept, rewrites tried) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/all" in r]
    if not evals:
        raise SystemExit(f"{path}: no evaluation row yet")
    return evals[0], evals[-1], sum(r.get("mem_kept", 0) for r in rows), sum(r.get("mem_tried", 0) for r in rows)


def floors(test: Path, train: Path) -> dict:
    """Mean retrievals per test question, by type, when famous hops (and, second, hops a training
    question asks) are answered from memory and every other hop takes one search."""
    seen = {(h["doc_id"], h["answer"]) for line in train.read_text().splitlines()
            for h in json.loads(line)["hops"]}
    out: dict = {"famous": {}, "famous+train": {}}
    qs = [json.loads(line) for line in test.read_text().splitlines()]
    for t in TYPES + ["all"]:
        sub = [q for q in qs if t in ("all", q["type"])]
        out["famous"][t] = sum(sum(not h["famous"] for h in q["hops"]) for q in sub) / len(sub)
        out["famous+train"][t] = sum(sum(not h["famous"] and (h["doc_id"], h["answer"]) not in seen
                                         for h in q["hops"]) for q in sub) / len(sub)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="*", default=[f"runs/r1pp-{r}" for r in RUNS], help="train.py out_dirs")
    ap.add_argument("--data", default="searchlite/assets/toyworld", help="folder with train.jsonl and test.jsonl")
    args = ap.parse_args()

    print("| run | step | test EM | RC | " + " | ".join(f"{t} EM / RC" for t in TYPES) + " | L_M rewrites kept |")
    print("|---|---:|---:|---:|" + "---:|" * len(TYPES) + "---:|")
    for i, run in enumerate(args.runs):
        first, last, kept, tried = run_summary(ROOT / run / "metrics.jsonl")
        rows = [("stage 1 (start)", first)] if i == 0 else []
        for name, ev in rows + [(Path(run).name, last)]:
            cells = [f"{ev[f'eval/{t}']['em']:.3f} / {ev[f'eval/{t}']['searches']:.2f}" for t in TYPES]
            mem = "—" if ev is first else (f"{kept:,} of {tried:,}" if tried else "(off)")
            print(f"| {name} | {ev['step']} | {ev['eval/all']['em']:.3f} | {ev['eval/all']['searches']:.2f} | "
                  + " | ".join(cells) + f" | {mem} |")
    data = ROOT / args.data
    fl = floors(data / "test.jsonl", data / "train.jsonl")
    for name, f in fl.items():
        print(f"fewest retrievals per test question, {name} hops from memory: {f['all']:.3f} ("
              + ", ".join(f"{t} {f[t]:.2f}" for t in TYPES) + ")")


if __name__ == "__main__":
    main()
