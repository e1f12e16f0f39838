"""Did L_M make the model remember what it retrieved? Recall of training questions a run saw.

    python bench/r1pp_recall.py --runs runs/r1pp-full-s1 runs/r1pp-nomem-s1   # same --seed
    python bench/r1pp_recall.py --runs ... --limit 200                           # faster

R1-Searcher++'s memorization loss (§4.2.2) trains the policy on internal-only answers to the
questions whose passages it retrieved in training, so that it can later answer them without a
search. The held-out test set cannot show this: its non-famous facts are never asked in
training (toyworld.py). This script asks the training questions themselves. From each run's
config.json (seed, batch_size, steps) it recomputes the questions the run drew
(train.batch_questions), keeps the non-famous ones (a famous question can be recalled from
the warm start), and answers them greedily, as train.py's evaluation does, with the run's
final policy and with its starting model; beside them, as a control, as many non-famous
training questions that the run never drew. Per model and set: the share answered with no
search, the EM of those answers, and the EM of all. Memorization shows as more correct
no-search answers on the drawn questions than on the control, and than a run without L_M
(--mem_coef 0) from the same seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from searchlite.config import resolve_path  # noqa: E402
from searchlite.data import read_qa  # noqa: E402


def drawn_ids(cfg: dict, n_train: int) -> list[int]:
    """Indices into the training set of the questions the run's steps drew, in order, once each."""
    from train import batch_questions

    seen: dict[int, None] = {}
    for step in range(cfg["steps"]):
        for i in batch_questions(range(n_train), step, cfg["batch_size"], cfg["seed"]):  # indices, not questions
            seen.setdefault(i)
    return list(seen)


def question_sets(cfg: dict, train_qa: list, limit: int) -> dict[str, list]:
    """{"drawn": non-famous questions the run drew, "control": as many it never drew}, each at
    most `limit` (0 = no cap); the control is a seeded sample, the same for runs of one seed."""
    drawn = drawn_ids(cfg, len(train_qa))
    plain = lambda i: not train_qa[i].meta.get("famous", False)  # noqa: E731
    hit = [i for i in drawn if plain(i)]
    seen = set(drawn)
    rest = [i for i in range(len(train_qa)) if plain(i) and i not in seen]
    random.Random(cfg["seed"]).shuffle(rest)
    n = min(len(hit), limit or len(hit), len(rest))
    return {"drawn": [train_qa[i] for i in hit[:n]], "control": [train_qa[i] for i in rest[:n]]}


def answer(model_path: str, sets: dict, cfg: dict) -> dict:
    """Greedy search-agent answers of one model on each set: {set: records}."""
    from searchlite.evaluation import score_qa
    from searchlite.models import load_policy, load_tokenizer
    from searchlite.protocol import get_protocol
    from searchlite.retrieval import config_retriever
    from searchlite.sampler import HFSampler

    tokenizer = load_tokenizer(cfg["tokenizer"] or cfg["model"])
    sampler = HFSampler(load_policy(model_path, cfg["dtype"], "cpu"), tokenizer, max_new_tokens=cfg["max_new_tokens"])
    retriever = config_retriever(SimpleNamespace(**cfg))  # as train.py builds it
    protocol = get_protocol(cfg["protocol"], cfg["template"])
    kw = dict(max_turns=cfg["max_turns"], topk=cfg["topk"], max_obs_tokens=cfg["max_obs_tokens"],
              max_len=cfg["max_len"], chat_template=cfg["chat_template"])
    return {name: score_qa(sampler, retriever, tokenizer, protocol, qa, batch_size=64, progress=False, **kw)[1]
            for name, qa in sets.items()}


def recall(records: list[dict]) -> dict:
    """n, share answered with no search, EM of those, EM of all."""
    none = [r["em"] for r in records if r["searches"] == 0]
    return {"n": len(records), "no_search": len(none) / len(records) if records else 0.0,
            "no_search_em": sum(none) / len(none) if none else 0.0,
            "no_search_right": sum(none) / len(records) if records else 0.0,
            "em": sum(r["em"] for r in records) / len(records) if records else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, help="train.py out_dirs (with config.json and a checkpoint)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many questions a set (0 = all drawn)")
    ap.add_argument("--start", default="true", help="also answer with the first run's starting model (true/false)")
    args = ap.parse_args()

    cfgs = {run: json.loads((Path(run) / "config.json").read_text()) for run in args.runs}
    first = cfgs[args.runs[0]]
    bad = [r for r, c in cfgs.items() if (c["seed"], c["batch_size"], c["steps"], c["train_data"])
           != (first["seed"], first["batch_size"], first["steps"], first["train_data"])]
    if bad:
        sys.exit(f"error: {', '.join(bad)}: seed, batch_size, steps or train_data differ from {args.runs[0]}; "
                 "runs compared here must have drawn the same questions")
    sets = question_sets(first, read_qa(resolve_path(first["train_data"])), args.limit)
    models = ([("start: " + first["model"], resolve_path(first["model"]), first)] if args.start == "true" else [])
    models += [(run, str(Path(run) / "checkpoint" / "policy"), c) for run, c in cfgs.items()]
    print(f"{len(sets['drawn'])} non-famous training questions drawn by seed {first['seed']} "
          f"({first['steps']} steps x {first['batch_size']}), {len(sets['control'])} never drawn", flush=True)
    print("| model | drawn: no search | its EM | right with no search | EM | never drawn: no search | its EM "
          "| right with no search | EM |")
    print("|---|" + "---:|" * 8)
    for name, path, cfg in models:
        got = {k: recall(v) for k, v in answer(path, sets, cfg).items()}
        cells = [f"{got[s]['no_search']:.1%} | {got[s]['no_search_em']:.3f} | {got[s]['no_search_right']:.1%} "
                 f"| {got[s]['em']:.3f}" for s in ("drawn", "control")]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
