"""Score a policy on a QA set with greedy multi-turn rollouts: EM, F1, cover-EM, searches.

    metrics, records = score_qa(sampler, retriever, tokenizer, protocol, qa, batch_size=64)

`metrics` holds means over all questions and per question type (`meta["type"]`, e.g. the
toy world's 1hop / 2hop / comparison); `records` one dict per question with the prediction
and the whole trajectory text. Used by train.py's held-out evaluation and by evaluate.py.
"""

from __future__ import annotations

from collections import defaultdict

from tqdm import tqdm

from .rewards import cover_exact_match, exact_match, f1_score
from .rollout import rollout

METRICS = ("em", "f1", "cover_em", "searches", "answered", "length")


def score_qa(sampler, retriever, tokenizer, protocol, qa: list, *, batch_size: int = 64, greedy: bool = True,
             progress: bool = True, **rollout_kw) -> tuple[dict, list[dict]]:
    records = []
    for start in tqdm(range(0, len(qa), batch_size), desc="evaluate", disable=not progress, leave=False):
        chunk = qa[start:start + batch_size]
        ro = rollout(sampler, retriever, tokenizer, protocol, [q.question for q in chunk], greedy=greedy,
                     **rollout_kw)
        for i, q in enumerate(chunk):
            pred = ro.answers[i]
            records.append({
                "id": q.id, "question": q.question, "golden_answers": q.answers, "type": q.meta.get("type", "all"),
                "prediction": pred, "em": exact_match(pred, q.answers), "f1": f1_score(pred, q.answers),
                "cover_em": cover_exact_match(pred, q.answers), "searches": int(ro.searches[i]),
                "answered": float(ro.answered[i]), "length": len(pred.split()) if pred else 0,
                "trajectory": ro.responses[i],
            })
    return summarize(records), records


def summarize(records: list[dict]) -> dict:
    """Means of METRICS over all records and per record type."""
    groups = defaultdict(list)
    for r in records:
        groups["all"].append(r)
        groups[r["type"]].append(r)
    out = {}
    for name, rs in groups.items():
        if name != "all" and len(groups) == 2:
            continue  # a single type repeats "all"
        out[name] = {m: sum(r[m] for r in rs) / len(rs) for m in METRICS} | {"n": len(rs)}
    return out
