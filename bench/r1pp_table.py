"""The R1-Searcher++ ablation table from finished runs, and the floor on retrieval calls.

    python bench/r1pp_table.py                     # runs/r1pp-{full,nogroup,nomem,neither,baseline}
    python bench/r1pp_table.py --runs A B ...      # any train.py out_dirs

For each run: the held-out test EM and retrieval calls per question (RC) at its last evaluation
(`step` says how far a run got), by question type, and the rewrites L_M kept over the run; for
the first run, its first evaluation too (the model it starts from: stage 1's for the ablation
script's runs, which all start there). From each run's eval/ records: which hops it answered
without their passage, split by what it could know (`hop_sources`), and the EM of questions
answered with no search against those searched (`recall_vs_search`).
Then, from the test questions alone, the fewest retrievals a policy could make and still answer
every question: one per hop (one for both of a comparison's, which one search for the question
finds), except that it answers from memory (a) questions whose every hop
is about a famous entity, which the toy world's warm start teaches (toyworld.py; stage 1's
teacher recalls only these), (b) every famous hop, even beside one it looks up, and (c) also
every fact that a training question asks (what L_M teaches, at best).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
RUNS = ["full", "nogroup", "nomem", "neither", "baseline"]
TYPES = ["1hop", "2hop", "comparison"]


def locate(path: str) -> Path:
    """`path` as given when it exists (from the current directory), else under the repo root, so
    that the default runs/... and searchlite/... work from anywhere."""
    return Path(path) if Path(path).exists() else ROOT / path


def fail(message: str) -> NoReturn:
    """Stop with a one-line error (exit status 2), before any table."""
    print(f"r1pp_table: {message}", file=sys.stderr)
    sys.exit(2)


def need(path: Path, hint: str) -> Path:
    """`path`, or a one-line error naming it."""
    if not path.is_file():
        fail(f"no {path} ({hint})")
    return path


def check_questions(runs: list[Path], test: Path) -> None:
    """A one-line error (exit status 2) unless `test` carries the toy world's hops and every run was
    evaluated on its questions: the tables after the first look each record's question up there (those
    of its first and last evaluations, which are all they read)."""
    questions = [json.loads(line) for line in test.read_text(encoding="utf-8").splitlines() if line.strip()]
    lacking = next((q for q in questions if not {"id", "hops", "famous"} <= q.keys()), None)
    if lacking is not None:
        fail(f"{test}: question {lacking.get('id', '(no id)')!r} has no 'hops' or 'famous' field: the tables of "
             "hops read the toy world's questions (--data)")
    ids = {q["id"] for q in questions}
    for run in runs:
        files = sorted((run / "eval").glob("step_*.jsonl"))
        for f in files[:1] + files[1:][-1:]:
            other = next((r["id"] for r in map(json.loads, f.read_text(encoding="utf-8").splitlines())
                          if r["id"] not in ids), None)
            if other is not None:
                fail(f"{f}: question {other!r} is not in {test}: the run was evaluated on other questions (its "
                     "--test_data); --data names the folder of the toy world's files it used")


def run_summary(path: Path) -> tuple[dict, dict, int, int]:
    """(first eval row, last eval row, rewrites kept, rewrites tried) of a run's metrics.jsonl; a
    damaged line, or no evaluation yet, is a one-line error."""
    from searchlite.data import DataError, read_log

    try:
        rows = read_log(path, cut=False)  # a run still going: its half-written last line is left out
    except DataError as e:
        fail(str(e))
    evals = [r for r in rows if "eval/all" in r]
    if not evals:
        fail(f"{path}: no evaluation row yet")
    return evals[0], evals[-1], sum(r.get("mem_kept", 0) for r in rows), sum(r.get("mem_tried", 0) for r in rows)


def trained_facts(train: Path) -> set:
    """The (passage, value) facts that some training question's hops ask."""
    return {(h["doc_id"], h["answer"]) for line in train.read_text(encoding="utf-8").splitlines()
            for h in json.loads(line)["hops"]}


def hop_kind(h: dict, trained: set) -> str:
    """What a model could know of a hop: "famous" (the warm start taught it), "train" (a training
    question asks it, so L_M could have taught it) or "new" (it can only be looked up or guessed)."""
    return "famous" if h["famous"] else "train" if (h["doc_id"], h["answer"]) in trained else "new"


def searches_needed(qtype: str, kinds: list[str], known: tuple[str, ...]) -> int:
    """The fewest searches for a question of `qtype` whose hops are of `kinds` (hop_kind), when the
    hops of a kind in `known` are answered from memory: one for each other hop, but one for both
    of a comparison's (BM25's top 3 for the question holds both its passages: 60 of 60 test
    comparisons, 539 of 540 training ones). A 2-hop question's second hop names the first's
    answer, so it takes its own search."""
    left = sum(k not in known for k in kinds)
    return min(left, 1) if qtype == "comparison" else left


def floors(test: Path, train: Path) -> dict:
    """Mean retrievals per test question, by type, when every hop takes a search (a comparison one
    for both, `searches_needed`) except those answered from memory: the hops of questions that are
    famous throughout ("famous questions"), every famous hop ("famous hops"), and also every hop a
    training question asks ("famous+train hops"); 0 for a type with no question."""
    trained = trained_facts(train)
    known = {"famous hops": ("famous",), "famous+train hops": ("famous", "train")}
    out: dict = {"famous questions": {}, "famous hops": {}, "famous+train hops": {}}
    lines = test.read_text(encoding="utf-8").splitlines()
    qs = [(q["type"], [hop_kind(h, trained) for h in q["hops"]]) for q in map(json.loads, lines)]
    for t in TYPES + ["all"]:
        sub = [(qt, k) for qt, k in qs if t in ("all", qt)] or [("", [])]
        out["famous questions"][t] = sum(searches_needed(qt, k, ()) * (k.count("famous") < len(k))
                                         for qt, k in sub) / len(sub)
        for name, kinds in known.items():
            out[name][t] = sum(searches_needed(qt, k, kinds) for qt, k in sub) / len(sub)
    return out


def from_memory(record: dict) -> bool:
    """Answered with no search (a record that gave no answer recalled nothing, though it made no search)."""
    return bool(record.get("answered", 1.0)) and record["searches"] == 0


def hop_sources(records: list[dict], test: Path, train: Path) -> dict:
    """The share of each `hop_kind` that a policy answered without retrieving its passage (from
    memory, or its search missed), over the questions it answered. Also how many questions did so
    for a "train" hop (and for no "new" one), and how many for a "new" hop, each with its EM."""
    trained = trained_facts(train)
    hops = {q["id"]: q["hops"] for q in map(json.loads, test.read_text(encoding="utf-8").splitlines())}
    n = {k: [0, 0] for k in ("famous", "train", "new")}  # kind -> [hops, hops without their passage]
    recalled, guessed = [], []  # em of each question that answered a train / a new hop without its passage
    for r in filter(lambda r: r.get("answered", 1.0), records):
        got, guess, recall = {d["id"] for d in r["docs"]}, False, False
        for h in hops[r["id"]]:
            kind, missed = hop_kind(h, trained), h["doc_id"] not in got
            n[kind][0] += 1
            n[kind][1] += missed
            guess |= kind == "new" and missed
            recall |= kind == "train" and missed
        if guess:
            guessed.append(r["em"])
        elif recall:
            recalled.append(r["em"])
    out = {k: b / a if a else 0.0 for k, (a, b) in n.items()}
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return out | {"recalled": len(recalled), "recalled_em": mean(recalled),
                  "guessed": len(guessed), "guessed_em": mean(guessed)}


def recall_vs_search(records: list[dict], test: Path) -> dict:
    """(questions, mean EM) of the famous questions (every hop famous) and of the others, split by
    whether the policy answered with no search ("recalled") or searched: what a retrieval saved
    costs in EM. Questions left unanswered with no search are in neither."""
    famous = {q["id"]: q["famous"] for q in map(json.loads, test.read_text(encoding="utf-8").splitlines())}
    out: dict = {}
    for r in records:
        if r["searches"] == 0 and not from_memory(r):
            continue  # left unanswered with no search
        key = ("famous" if famous[r["id"]] else "other", "recalled" if from_memory(r) else "searched")
        out.setdefault(key, []).append(r["em"])
    return {k: (len(v), sum(v) / len(v)) for k, v in out.items()}


def main() -> None:
    from searchlite.config import HelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--runs", nargs="*", default=[f"runs/r1pp-{r}" for r in RUNS],
                    help="train.py out_dirs (each as given if it exists, else under the repo root)")
    ap.add_argument("--data", default="searchlite/assets/toyworld",
                    help="folder with train.jsonl and test.jsonl (as given if it exists, else under the repo root)")
    args = ap.parse_args()
    runs = [locate(run) for run in args.runs]
    data = locate(args.data)
    for run in runs:
        need(run / "metrics.jsonl", "bash bench/r1pp_ablation.sh makes the default runs; --runs names others")
    for name in ("test.jsonl", "train.jsonl"):
        need(data / name, "--data names a folder with test.jsonl and train.jsonl")
    check_questions(runs, data / "test.jsonl")
    summaries = [run_summary(run / "metrics.jsonl") for run in runs]

    print("| run | step | test EM | RC | " + " | ".join(f"{t} EM / RC" for t in TYPES) + " | L_M rewrites kept |")
    print("|---|---:|---:|---:|" + "---:|" * len(TYPES) + "---:|")
    for i, (run, (first, last, kept, tried)) in enumerate(zip(runs, summaries)):
        rewrites = f"{kept:,} of {tried:,}" if tried else "(off)"
        rows = [(f"{run.name} at its start", first, "-")] if i == 0 else []  # (stage 1, for the ablation's runs)
        for name, ev, mem in rows + [(run.name, last, rewrites)]:
            # a type the evaluation did not hold (a small --eval_size): a dash
            cells = [f"{ev[f'eval/{t}']['em']:.3f} / {ev[f'eval/{t}']['searches']:.2f}" if f"eval/{t}" in ev else "-"
                     for t in TYPES]
            print(f"| {name} | {ev['step']} | {ev['eval/all']['em']:.3f} | {ev['eval/all']['searches']:.2f} | "
                  + " | ".join(cells) + f" | {mem} |")
    print("\nHops answered without retrieving their passage (last evaluation), by what the model could"
          " know, and the questions that did so:\n")
    print("| run | famous hops | hops a training question asks | other hops "
          "| questions lacking a training hop's passage: n, EM | lacking an other hop's: n, EM |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, run in enumerate(runs):
        files = sorted((run / "eval").glob("step_*.jsonl"))
        if not files:
            print(f"| {run.name} | (no eval/ records) | | | | |")
            continue
        for name, f in ([(f"{run.name} at its start", files[0])] if i == 0 else []) + [(run.name, files[-1])]:
            records = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]
            h = hop_sources(records, data / "test.jsonl", data / "train.jsonl")
            print(f"| {name}, {f.stem} | {h['famous']:.0%} | {h['train']:.0%} | {h['new']:.0%} | "
                  f"{h['recalled']}, {h['recalled_em']:.3f} | {h['guessed']}, {h['guessed_em']:.3f} |")
    print("\nQuestions answered with no search, and those searched (n, EM; famous: every hop famous):\n")
    print("| run | famous, recalled | famous, searched | other, recalled | other, searched |")
    print("|---|---:|---:|---:|---:|")
    for i, run in enumerate(runs):
        files = sorted((run / "eval").glob("step_*.jsonl"))
        if not files:
            print(f"| {run.name} | (no eval/ records) | | | |")
            continue
        for name, f in ([(f"{run.name} at its start", files[0])] if i == 0 else []) + [(run.name, files[-1])]:
            records = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]
            rv = recall_vs_search(records, data / "test.jsonl")
            print(f"| {name}, {f.stem} | " + " | ".join(
                "{}, {:.3f}".format(*rv.get((k, m), (0, 0.0))) for k in ("famous", "other")
                for m in ("recalled", "searched")) + " |")
    print()
    fl = floors(data / "test.jsonl", data / "train.jsonl")
    for name, f in fl.items():
        print(f"fewest retrievals per test question, {name} from memory: {f['all']:.3f} ("
              + ", ".join(f"{t} {f[t]:.2f}" for t in TYPES) + ")")


if __name__ == "__main__":
    main()
