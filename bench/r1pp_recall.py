"""Did L_M make the model remember what it retrieved? Recall of training questions a run saw.

    python bench/r1pp_recall.py --runs runs/r1pp-full-s1 runs/r1pp-nomem-s1   # same --seed
    python bench/r1pp_recall.py --runs ... --limit 200                           # faster

R1-Searcher++'s memorization loss (§4.2.2) trains the policy on internal-only answers to the
questions whose passages it retrieved in training, so that it can later answer them without a
search. The held-out test set shows this only in part: every test question has a non-famous
fact that no training question asks (toyworld.py), so none can be answered whole from memory.
This script asks the training questions themselves. From each run's
config.json (seed, batch_size) and the step its checkpoint was saved at (trainer.pt: an
interrupted run's is short of config.json's `steps`) it recomputes the questions the run drew
(train.batch_questions), keeps the non-famous ones (a famous question can be recalled from
the warm start), and answers them greedily, as train.py's evaluation does, with the run's
final policy and with its starting model; beside them, as a control, as many non-famous
training questions that the run never drew. Per model and set: the share answered with no
search, the EM of those answers, and the EM of all. Memorization shows as more correct
no-search answers on the drawn questions than on the control, and than a run without L_M
(--mem_coef 0) from the same seed.

    python bench/r1pp_recall.py --runs runs/r1pp-full-s1 --sft_epochs 1,3,10,30

--sft_epochs adds a ceiling: how many passes the starting model needs to remember the drawn
questions at all. It trains that model by plain SFT (searchlite/sft.py, full weight, the run's
lr) on perfect internal-only answers to the drawn questions (the toy teacher's answer from
memory, teacher.Teacher.recall: what L_M would train on if every rewrite were kept), and after
each cumulative number of epochs asks the same two sets, then the held-out test set: its EM and
retrieval calls (RC), and the test questions that need a fact the drawn questions taught (a
non-famous hop that is one of theirs) against the others. In L_M each rewrite is one pass at
mu = 0.1 beside the policy gradient.
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

from bench.r1pp_table import from_memory, hop_kind, searches_needed  # noqa: E402
from searchlite.config import HelpFormatter, at_least, bool_arg, resolve_path  # noqa: E402
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


def load_runs(runs: list[str]) -> dict[str, tuple[dict, Path]]:
    """{run: (its config.json with "steps" set to the steps its checkpoint trained, that checkpoint)};
    exits unless all drew the same questions: same seed, batch_size, trained steps and train_data."""
    from searchlite.models import find_checkpoint, load_trainer_state

    out = {}
    for run in runs:
        ckpt = find_checkpoint(run)  # train.py's last complete checkpoint: the policy answered below
        if ckpt is None:
            sys.exit(f"error: {run}: no checkpoint (checkpoint/trainer.pt); give train.py out_dirs")
        cfg = json.loads((Path(run) / "config.json").read_text(encoding="utf-8"))
        out[run] = cfg | {"steps": load_trainer_state(ckpt, mmap=True)["step"]}, ckpt
    key = lambda c: (c["seed"], c["batch_size"], c["steps"], c["train_data"])  # noqa: E731
    first = key(out[runs[0]][0])
    bad = [run for run, (cfg, _) in out.items() if key(cfg) != first]
    if bad:
        sys.exit(f"error: {', '.join(bad)}: seed, batch_size, checkpoint step or train_data differ from {runs[0]}; "
                 "runs compared here must have drawn the same questions")
    return out


def agent(cfg: dict) -> SimpleNamespace:
    """What a run's config says the search agent works with, built once: tokenizer, retriever (as
    train.py builds it), protocol, and the rollout settings."""
    from searchlite.models import load_tokenizer
    from searchlite.protocol import get_protocol
    from searchlite.retrieval import config_retriever

    kw = dict(max_turns=cfg["max_turns"], topk=cfg["topk"], max_obs_tokens=cfg["max_obs_tokens"],
              max_len=cfg["max_len"], chat_template=cfg["chat_template"])
    return SimpleNamespace(tokenizer=load_tokenizer(cfg["tokenizer"] or cfg["model"]),
                           retriever=config_retriever(SimpleNamespace(**cfg)),
                           protocol=get_protocol(cfg["protocol"], cfg["template"]), kw=kw)


def answer(model, sets: dict, cfg: dict, ag: SimpleNamespace | None = None) -> dict:
    """Greedy search-agent answers of one model (a path, or a loaded policy) on each set: {set: records}.
    `ag`: the run's `agent`, built here when not given."""
    from searchlite.evaluation import score_qa
    from searchlite.models import load_policy
    from searchlite.sampler import HFSampler

    ag = ag or agent(cfg)
    policy = load_policy(model, cfg["dtype"], "cpu") if isinstance(model, (str, Path)) else model.eval()
    sampler = HFSampler(policy, ag.tokenizer, max_new_tokens=cfg["max_new_tokens"])
    return {name: score_qa(sampler, ag.retriever, ag.tokenizer, ag.protocol, qa, batch_size=64, progress=False,
                           **ag.kw)[1]
            for name, qa in sets.items()}


def drawn_facts(drawn: list) -> set:
    """The (passage, value) facts that the non-famous hops of the `drawn` questions ask."""
    return {(h["doc_id"], h["answer"]) for q in drawn for h in q.meta["hops"] if not h["famous"]}


def memory_rows(qa: list, tokenizer, protocol, chat_template: bool):
    """Internal-only trajectories for `qa`: the plain question prompt, then the toy teacher's answer
    from memory (its first gold answer), loss_mask 1 on that answer alone. A Rollout."""
    from searchlite.rollout import _collate, encode_prompt
    from searchlite.teacher import Teacher

    teacher = Teacher(tokenizer, protocol, qa)
    prompts = [encode_prompt(tokenizer, protocol, q.question, chat_template) for q in qa]
    resp = [tokenizer.encode(teacher.recall(q.answers[0]), add_special_tokens=False) for q in qa]
    return _collate(prompts, resp, [[1] * len(r) for r in resp], [0] * len(qa), [1] * len(qa),
                    [q.answers[0] for q in qa], [[] for _ in qa], tokenizer)


def by_shared_fact(records: list[dict], test_qa: list, facts: set) -> dict:
    """Test records split by whether one of the question's non-famous hops is in `facts`
    ("shares" / "other"), each with n, the share answered with no search, and EM."""
    hops = {q.id: q.meta["hops"] for q in test_qa}
    out = {"shares": [], "other": []}
    for r in records:
        shares = any(hop_kind(h, facts) == "train" for h in hops[r["id"]])
        out["shares" if shares else "other"].append(r)
    return {k: recall(v) for k, v in out.items()}


def floor_with(test_qa: list, facts: set) -> float:
    """Retrievals per test question if every famous hop and every hop in `facts` were answered from
    memory and the others took the fewest searches (bench/r1pp_table.py's floors, with these facts)."""
    return sum(searches_needed(q.meta.get("type", ""), [hop_kind(h, facts) for h in q.meta["hops"]],
                               ("famous", "train")) for q in test_qa) / len(test_qa)


def ceiling(cfg: dict, sets: dict, test_qa: list, epochs: list[int]):
    """The starting model after each cumulative number of `epochs` of SFT on perfect internal-only
    answers to sets["drawn"]: yields (epochs, {set: recall}, test summary, test split by shared fact,
    the token-mean NLL of those answers)."""
    import torch

    from searchlite.models import load_policy
    from searchlite.sft import sft, sft_loss

    ag = agent(cfg)
    rows = memory_rows(sets["drawn"], ag.tokenizer, ag.protocol, cfg["chat_template"])
    torch.manual_seed(cfg["seed"])
    model, done = load_policy(resolve_path(cfg["model"]), cfg["dtype"], "cpu"), 0
    facts = drawn_facts(sets["drawn"])
    for e in epochs:
        if e > done:
            model.train()
            sft(model, rows.input_ids, rows.loss_mask, attention_mask=rows.attention_mask, epochs=e - done,
                lr=cfg["lr"], batch_size=16, warmup=2, seed=cfg["seed"] + e, progress=False)
            done = e
        with torch.no_grad():  # in chunks of 64 rows, weighted by their answer tokens
            model.eval()
            chunks = [slice(s, s + 64) for s in range(0, len(rows), 64)]
            nll = sum(float(sft_loss(model, rows.input_ids[c], rows.loss_mask[c], rows.attention_mask[c]))
                      * float(rows.loss_mask[c].sum()) for c in chunks) / float(rows.loss_mask.sum())
        got = answer(model, sets | {"test": test_qa}, cfg, ag)
        test = got.pop("test")
        summary = {"em": sum(r["em"] for r in test) / len(test), "rc": sum(r["searches"] for r in test) / len(test)}
        yield e, {k: recall(v) for k, v in got.items()}, summary, by_shared_fact(test, test_qa, facts), nll


def recall(records: list[dict]) -> dict:
    """n, share answered with no search (one left unanswered is not), EM of those, EM of all."""
    none = [r["em"] for r in records if from_memory(r)]
    return {"n": len(records), "no_search": len(none) / len(records) if records else 0.0,
            "no_search_em": sum(none) / len(none) if none else 0.0,
            "no_search_right": sum(none) / len(records) if records else 0.0,
            "em": sum(r["em"] for r in records) / len(records) if records else 0.0}


def cells(got: dict) -> str:
    """One table row's cells: each set's recall (see `recall`)."""
    return " | ".join(f"{got[s]['no_search']:.1%} | {got[s]['no_search_em']:.3f} | {got[s]['no_search_right']:.1%} "
                      f"| {got[s]['em']:.3f}" for s in ("drawn", "control"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True,
                    help="train.py out_dirs (with config.json and a checkpoint; each at the same step)")
    ap.add_argument("--limit", type=at_least(0), default=0, help="at most this many questions a set (0 = all drawn)")
    ap.add_argument("--start", type=bool_arg, default=True,
                    help="also answer with the first run's starting model: true or false (default true)")
    ap.add_argument("--sft_epochs", default="", help="comma-separated cumulative epochs of SFT on perfect "
                    "internal-only answers to the drawn questions, from the starting model (a ceiling; '' = none)")
    args = ap.parse_args()
    try:
        epochs = sorted({at_least(0)(e) for e in args.sft_epochs.split(",")}) if args.sft_epochs else []
    except (ValueError, argparse.ArgumentTypeError) as e:
        ap.error(f"--sft_epochs {args.sft_epochs!r}: each must be a whole number of epochs, 0 or more ({e})")

    runs = load_runs(args.runs)
    first = runs[args.runs[0]][0]
    train_qa = read_qa(resolve_path(first["train_data"]))
    sets = question_sets(first, train_qa, args.limit)
    if not sets["drawn"]:  # (all drawn, or all famous): a table of zeros said nothing
        sys.exit(f"error: {args.runs[0]}: no non-famous training question it drew has a never-drawn one to stand "
                 f"beside ({len(train_qa)} questions in {first['train_data']}); nothing to compare")
    test_qa = read_qa(resolve_path(first["test_data"])) if epochs else []
    for what, questions, data in (("training", sets["drawn"], "train_data"), ("test", test_qa, "test_data")):
        if epochs and (lacking := next((q for q in questions if "hops" not in q.meta), None)):  # before any model
            sys.exit(f"error: --sft_epochs: {what} question {lacking.id!r} ({first[data]}) has no 'hops' field: the "
                     "ceiling's facts are the toy world's hops")
    models = ([("start: " + first["model"], resolve_path(first["model"]), first)] if args.start else [])
    models += [(run, str(ckpt / "policy"), c) for run, (c, ckpt) in runs.items()]
    print(f"{len(sets['drawn'])} non-famous training questions drawn by seed {first['seed']} "
          f"({first['steps']} steps x {first['batch_size']}), {len(sets['control'])} never drawn", flush=True)
    print("| model | drawn: no search | its EM | right with no search | EM | never drawn: no search | its EM "
          "| right with no search | EM |")
    print("|---|" + "---:|" * 8)
    for name, path, cfg in models:
        got = {k: recall(v) for k, v in answer(path, sets, cfg).items()}
        print(f"| {name} | {cells(got)} |", flush=True)
    if not epochs:
        return
    tests = []
    for e, got, summary, split, nll in ceiling(first, sets, test_qa, epochs):
        print(f"| start + {e} epochs of SFT on the drawn answers | {cells(got)} |", flush=True)
        tests.append((e, summary, split, nll))
    facts = drawn_facts(sets["drawn"])
    print(f"\nHeld-out test set after that SFT; questions sharing a fact: one of their non-famous hops "
          f"is a hop of a drawn question. Fewest retrievals per test question with every famous hop "
          f"recalled: {floor_with(test_qa, set()):.3f}; and every drawn fact too: {floor_with(test_qa, facts):.3f}\n")
    print("| epochs | NLL of the drawn answers | test EM | RC | sharing a fact: n, no search, EM "
          "| the others: n, no search, EM |")
    print("|---:|---:|---:|---:|---:|---:|")
    for e, summary, split, nll in tests:
        print(f"| {e} | {nll:.3f} | {summary['em']:.3f} | {summary['rc']:.2f} | " + " | ".join(
            f"{split[k]['n']}, {split[k]['no_search']:.1%}, {split[k]['em']:.3f}" for k in ("shares", "other")) + " |")


if __name__ == "__main__":
    main()
