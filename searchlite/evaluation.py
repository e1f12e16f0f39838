"""Score a model on QA sets: the multi-turn search agent and the papers' single-turn baselines.

    metrics, records = score_qa(sampler, retriever, tokenizer, protocol, qa, batch_size=64)   # train.py
    records = run_batch("rag", qa[:16], sampler, retriever, tokenizer, protocol, prompts=load_prompts())
    log = RecordLog("runs/eval/records.jsonl")                                            # evaluate.py
    records = evaluate_set("hotpotqa", "rag", qa, log, lambda chunk: run_batch("rag", chunk, ...))

Methods, all on the same retriever, top-k and model (Search-R1 §4.2's baselines):
- `direct`: the question alone, one generation (templates/direct.txt);
- `cot`: reasoning first, the answer after "the answer is" (templates/cot.txt);
- `rag`: one retrieval with the question as the query, the top-k passages in the prompt,
  one generation (templates/rag.txt);
- `search`: the multi-turn agent loop of rollout.py under either protocol. For an untrained
  instruct model under the paper's template this is the prompted, Search-o1-like baseline.
A baseline's answer is the text inside `<answer>` tags when the model wrote them, else the
first line it wrote, less an "Answer:" label (bold or not) or an `<answer>` that opens it
(direct, rag), or what follows the last "the answer is" (cot; none: no answer); a `\boxed{}`
is read for its content, and a question the model starts of its own ("Question:") is no part of it.

Per question (rewards.py): `em`, `f1`, `cover_em` (R1-Searcher++'s ACC_R: a gold answer within
the prediction, however long; the training reward's 10-word cap is not applied), `searches`
(retrieval calls, R1-Searcher++'s RC), `answered` (an answer was produced), `length` (words in
the answer, 0 without one) and, with a judge (judge.py), `judge` (R1-Searcher++'s LasJ).
`summarize` averages them over all questions and per question type (`question_type`: a line's
`type`, e.g. the toy world's 1hop / 2hop, or its `metadata.type`, where FlashRAG's HotpotQA
keeps bridge / comparison).

Resume: `RecordLog` appends each finished batch of records to a JSONL file, flushed and
fsynced, keyed by (dataset, method, question id); `evaluate_set` skips keys already there.
A torn last line (killed mid-write) is dropped on load, so its questions run again: none is
scored twice, none is lost. Left out on purpose: sampling several answers per question
(pass@k) and answer extraction by a second model.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from .data import append_log, read_log, write_durably
from .protocol import TEMPLATE_DIR, _last_boxed, template_sets
from .rewards import cover_exact_match, exact_match, f1_score
from .rollout import encode_text, rollout

METHODS = ("direct", "cot", "rag", "search")
# What scoring a record means, kept in a run's settings: records scored otherwise are not mixed in on a resume.
SCORING = ("cover-EM without a word cap, punctuation deleted or spaced; a baseline's unclosed <answer> stripped; "
           "\\boxed{} style wrappers and LaTeX spaces read as text, digit groups as one number; a baseline's "
           "answer before a question of its own, after the last 'the answer is' (cot) or a bold label, \\boxed{} "
           "unwrapped")
SAVE_EVERY = 60.0  # seconds between saves of re-judged records (each rewrites records.jsonl)
METRICS = ("em", "f1", "cover_em", "searches", "answered", "length")  # (+ "judge" when every record has one)
PLACEHOLDERS = {"direct": ("{question}",), "cot": ("{question}",), "rag": ("{question}", "{documents}")}


# ---------------------------------------------------------------------------- prompts and answers


def load_prompts(prompts: str | None = None) -> dict[str, str]:
    """The baselines' prompt templates, {method: text}. `prompts`: empty = searchlite's own
    (templates/<method>.txt, zero-shot instructions); a bare word W = the set
    templates/W_<method>.txt ("toy": the toy world's compact tag style; "fewshot": three
    worked examples in plain text, which small models follow far better); else (or a bare
    word that is no set but a folder here) a folder holding <method>.txt files (those missing fall back to searchlite's own). Trailing
    newlines are dropped, so a completion prompt can end in "Answer:".

    >>> sorted(load_prompts("fewshot")), load_prompts("fewshot")["direct"].endswith("Answer:")
    (['cot', 'direct', 'rag'], True)
    """
    out = {}
    for method, needed in PLACEHOLDERS.items():
        path = TEMPLATE_DIR / f"{method}.txt"
        if prompts and "/" not in prompts and "." not in prompts and not (
                Path(prompts).is_dir() and not any(TEMPLATE_DIR.glob(f"{prompts}_*.txt"))):  # a set, not a folder here
            path = TEMPLATE_DIR / f"{prompts}_{method}.txt"
            if not path.exists():
                sets = [w for w in template_sets(method) if not w.startswith("''")]
                raise ValueError(f"no prompt set '{prompts}': {path} does not exist; the sets here: "
                                 f"{', '.join(sets)}, '' (searchlite's own), or give a folder of <method>.txt files")
        elif prompts and (Path(prompts) / f"{method}.txt").exists():
            path = Path(prompts) / f"{method}.txt"
        elif prompts and not Path(prompts).is_dir():
            raise ValueError(f"--prompts {prompts}: not a folder of <method>.txt templates nor a prompt set name")
        text = path.read_text(encoding="utf-8").rstrip("\n")
        missing = [p for p in needed if p not in text]
        if missing:
            raise ValueError(f"{path}: the {method} template needs the placeholder(s) {', '.join(missing)}")
        out[method] = text
    return out


def fill(template: str, **values: str) -> str:
    """Replace each `{name}` of `values` in one pass (a passage that contains "{question}" stays as it is).

    >>> fill("Q: {question} D: {documents}", question="{documents}?", documents="d")
    'Q: {documents}? D: d'
    """
    return re.sub(r"\{(" + "|".join(values) + r")\}", lambda m: values[m.group(1)], template)


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_ANSWER_IS = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is\b(?!n't)\s*:?[ \t]*", re.I)  # not "This answer is"
# what may open a direct or rag reply before its answer: a label, Markdown bold or not, and an
# <answer> whose </answer> never came (answer_tokens ran out, or the generation stopped at "\nQuestion:")
_LEAD = re.compile(r"^\s*([*_]*(final\s+)?answer[*_]*\s*:[*_]*\s*)?(<answer>)?", re.I)
# a question the model starts of its own (the stop string is kept in the output): no part of the answer
_OWN_QUESTION = re.compile(r"(?:^|\n)[ \t]*Question:")


def extract_answer(method: str, text: str) -> str | None:
    """The answer in a baseline's output (None: no answer).

    >>> extract_answer("direct", "Answer: Paris.\\nIt is in France.")
    'Paris.'
    >>> extract_answer("rag", "I think <answer> Lyon </answer>")
    'Lyon'
    >>> extract_answer("cot", "Paris is in France. So the answer is: **Paris**.")
    'Paris'
    >>> extract_answer("cot", "I do not know.") is None
    True
    >>> extract_answer("cot", "So the answer is:\\n\\n**Paris**"), extract_answer("direct", "Answer:\\nParis")
    ('Paris', 'Paris')
    >>> extract_answer("direct", "<answer> Paris")
    'Paris'
    >>> extract_answer("cot", "So the answer is: Paris.\\nThis answer is right.")  # the last "the answer is"
    'Paris'
    >>> extract_answer("direct", "**Answer:** Paris"), extract_answer("cot", "The final answer is $\\\\boxed{Paris}$")
    ('Paris', 'Paris')
    >>> extract_answer("direct", "Answer:\\n\\nQuestion:") is None  # the stop string of a question of its own
    True
    """
    text = _OWN_QUESTION.split(text, maxsplit=1)[0]
    tag = _ANSWER_TAG.search(text)
    if tag:
        answer = tag.group(1).strip()
    elif method == "cot":
        last = None
        for last in _ANSWER_IS.finditer(text):
            pass
        line = text[last.end():].strip().split("\n", 1)[0] if last else ""  # the answer may start a new line
        answer = line.strip().strip("*\"' ").rstrip(".").strip("*\"' ")
    else:  # the label may stand on a line of its own
        lines = [line.strip() for line in _LEAD.sub("", text, count=1).splitlines()]
        answer = next((line for line in lines if line), "")
    if "\\boxed{" in answer:  # a model trained on math answers in LaTeX
        answer = _last_boxed(answer)[1] or answer
    return answer.strip() or None


# ---------------------------------------------------------------------------- methods


# Evaluation stops a turn where the model starts a question of its own, as the prompts' examples
# invite ("Question: ..."): no step of this trajectory. evaluate.py, train.py's evaluation and view alike.
# A turn that opens with "Question:" after passages or a prompt ending in a newline stops there too
# (rollout._cut_line_start).
QUESTION_STOP = ("\nQuestion:",)


def run_batch(method: str, qa: list, sampler, retriever, tokenizer, protocol, *, prompts: dict | None = None,
              topk: int = 3, answer_tokens: int = 64, chat_template: bool = True, greedy: bool = True,
              extra_stop: tuple[str, ...] = (), **rollout_kw) -> list[dict]:
    """One batch of questions through `method`: one scored record per question, in order.

    direct and rag generate at most `answer_tokens`; cot and each turn of search at most the
    sampler's `max_new_tokens`. Search runs `rollout` with `rollout_kw` (max_turns, ...); its
    turns also end at `extra_stop` (evaluate.py: "\nQuestion:", where a model prompted with
    examples starts a question of its own: no step of this trajectory, so an invalid turn).
    """
    if method == "search":
        if extra_stop:
            protocol = dataclasses.replace(protocol, stop=protocol.stop + tuple(extra_stop))
        ro = rollout(sampler, retriever, tokenizer, protocol, [q.question for q in qa], topk=topk,
                     chat_template=chat_template, greedy=greedy, **rollout_kw)
        return [make_record(q, method, ro.answers[i], ro.responses[i], int(ro.searches[i]), ro.docs[i])
                for i, q in enumerate(qa)]
    if method not in PLACEHOLDERS:
        raise ValueError(f"unknown method {method!r} (valid: {', '.join(METHODS)})")
    prompts = prompts or load_prompts()
    docs = retriever.search([q.question for q in qa], topk) if method == "rag" else [[] for _ in qa]
    texts = [fill(prompts[method], question=protocol.ask(q.question),
                  documents=protocol.format_passages(d).rstrip("\n")) for q, d in zip(qa, docs)]
    ids = [encode_text(tokenizer, t, chat_template) for t in texts]
    # Stop when the model starts a "Question:" of its own, as few-shot prompts invite: its
    # answer to that one would be read instead.
    stop = ("</answer>", *QUESTION_STOP)
    outs = sampler.generate(ids, stop=stop, max_new_tokens=None if method == "cot" else answer_tokens, greedy=greedy)
    records = []
    for q, out, d in zip(qa, outs, docs):
        response = tokenizer.decode(out, skip_special_tokens=True)
        records.append(make_record(q, method, extract_answer(method, response), response, int(method == "rag"), d))
    return records


def question_type(q) -> str | None:
    """The question's type: its line's `type`, else `metadata.type` (FlashRAG's HotpotQA and 2Wiki
    lines keep it there), else None.

    >>> from searchlite.data import QA
    >>> question_type(QA("1", "q?", ["a"], {"metadata": {"type": "bridge", "level": "hard"}}))
    'bridge'
    """
    nested = q.meta.get("metadata")
    return q.meta.get("type") or (nested.get("type") if isinstance(nested, dict) else None)


def make_record(q, method: str, prediction: str | None, trajectory: str, searches: int, docs: list) -> dict:
    """One question's result: its prediction, every metric, and the text the model produced."""
    return {
        "id": q.id, "question": q.question, "golden_answers": q.answers, "type": question_type(q),
        "method": method, "prediction": prediction, "em": exact_match(prediction, q.answers),
        "f1": f1_score(prediction, q.answers), "cover_em": cover_exact_match(prediction, q.answers, max_words=None),
        "searches": searches, "answered": float(prediction is not None),
        "length": len(prediction.split()) if prediction else 0, "trajectory": trajectory,
        "docs": [{"id": h.id, "title": h.title} for h in docs],
    }


def score_qa(sampler, retriever, tokenizer, protocol, qa: list, *, batch_size: int = 64, greedy: bool = True,
             progress: bool = True, **rollout_kw) -> tuple[dict, list[dict]]:
    """The search agent over `qa` in batches (train.py's held-out evaluation, asked as evaluate.py
    asks, `QUESTION_STOP` included): (summary, records)."""
    records = []
    for start in tqdm(range(0, len(qa), batch_size), desc="evaluate", disable=not progress, leave=False):
        records += run_batch("search", qa[start:start + batch_size], sampler, retriever, tokenizer, protocol,
                             greedy=greedy, extra_stop=QUESTION_STOP, **rollout_kw)
    return summarize(records), records


# ---------------------------------------------------------------------------- resumable runs


class RecordLog:
    """Finished records in a JSONL file, one a line, keyed by (dataset, method, id)."""

    KEY = ("dataset", "method", "id")  # a line without one is damaged (DataError names it), not a KeyError

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: dict[tuple, dict] = {}
        for r in read_log(self.path, need=self.KEY) if self.path.exists() else []:
            self.done.setdefault(self.key(r), r)

    @staticmethod
    def key(r: dict) -> tuple:
        return r["dataset"], r["method"], r["id"]

    def add(self, records: list[dict]) -> None:
        """Append records and force them to disk before the caller moves on."""
        append_log(self.path, records)
        for r in records:
            self.done.setdefault(self.key(r), r)

    def replace(self, records: list[dict]) -> None:
        """Rewrite records already in the log (e.g. judged later), atomically."""
        for r in records:
            self.done[self.key(r)] = r
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.done.values())
        write_durably(self.path, lambda f: f.write(text), "w")


def evaluate_set(dataset: str, method: str, qa: list, log: RecordLog, run, *, batch_size: int = 16, judge=None,
                 progress: bool = True) -> list[dict]:
    """Records of every question of `qa` under `method`, running only those not in `log`.

    `run(chunk)` returns the chunk's records (e.g. a `run_batch` partial); each batch is
    judged (if `judge`) and appended to `log` before the next starts. Records in `log` whose
    judge stamp differs from `judge.stamp` (model, URL, max_tokens, prompt) are judged again,
    `batch_size` at a time, saved every SAVE_EVERY seconds and when it stops. A judge that fails
    (or a Ctrl-C while judging) costs no answer and no verdict received: the batch is saved
    unjudged; a rerun judges what lacks a stamp.
    """
    ids = [q.id for q in qa]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{dataset}: question id {dup!r} occurs more than once; ids key the resumable records")
    todo = [q for q in qa if (dataset, method, q.id) not in log.done]
    if judge is not None:  # records made before the judge was switched on, or judged by another setup
        # A record judged before records carried `judge_setup` cannot tell which prompt or endpoint
        # judged it, so it counts as stale too: one request per question, not a silent mix of judges.
        stale = [log.done[k] for k in ((dataset, method, i) for i in ids) if k in log.done
                 and not judge.judged(log.done[k])]
        # a batch at a time; a judge that fails midway keeps the verdicts it gave. log.replace rewrites
        # the whole file, so verdicts are saved every SAVE_EVERY seconds, not after every batch.
        judged, saved = [], time.monotonic()
        try:
            for start in range(0, len(stale), batch_size):
                chunk = stale[start:start + batch_size]
                try:
                    judge.score(chunk)
                finally:  # a failed request leaves only its own record stale
                    judged += [r for r in chunk if judge.judged(r)]
                if time.monotonic() - saved > SAVE_EVERY:
                    log.replace(judged)
                    judged, saved = [], time.monotonic()
        finally:
            if judged:
                log.replace(judged)
    with tqdm(total=len(qa), initial=len(qa) - len(todo), desc=f"{dataset} {method}", disable=not progress,
              unit="q", dynamic_ncols=True) as bar:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            records = run(chunk)
            for r in records:
                r["dataset"] = dataset
            # Saved even when judging fails (or is interrupted): unjudged records lack judge.stamp,
            # so the next run judges them as stale instead of generating them again.
            try:
                if judge is not None:
                    judge.score(records)
            finally:
                log.add(records)
            bar.update(len(chunk))
    return [log.done[(dataset, method, i)] for i in ids]


# ---------------------------------------------------------------------------- summaries


def summarize(records: list[dict]) -> dict:
    """Means of METRICS (and `judge` when every record has one) over all records and per type."""
    metrics = METRICS + (("judge",) if records and all("judge" in r for r in records) else ())
    groups = defaultdict(list)
    for r in records:
        groups[str(r.get("type"))].append(r)
    mean = lambda rs: {m: sum(r[m] for r in rs) / len(rs) for m in metrics} | {"n": len(rs)}  # noqa: E731
    out = {"all": mean(records)} if records else {}
    if len(groups) > 1:  # a single type would repeat "all"
        out |= {name: mean(rs) for name, rs in groups.items() if name != "all"}
    return out


def average(results: dict) -> dict:
    """Per method, the unweighted mean over datasets of their "all" metrics (as the papers'
    "Avg." columns); `n` is the total question count. `results` is {dataset: {method: summary}}."""
    by_method = defaultdict(list)
    for per_method in results.values():
        for method, summary in per_method.items():
            by_method[method].append(summary["all"])
    out = {}
    for method, rows in by_method.items():
        keys = [k for k in rows[0] if k != "n" and all(k in r for r in rows)]
        out[method] = {k: sum(r[k] for r in rows) / len(rows) for k in keys} | {"n": sum(r["n"] for r in rows)}
    return out


COLUMNS = (("em", "EM"), ("f1", "F1"), ("cover_em", "cover-EM"), ("searches", "RC"), ("answered", "answered"),
           ("length", "length"), ("judge", "LasJ"))


def table(results: dict, avg: dict | None = None) -> str:
    """A Markdown table: one row per (dataset[/type], method), then the averages over datasets."""
    rows = [(f"{d}" if kind == "all" else f"{d}/{kind}", method, m)
            for d, per_method in results.items() for method, summary in per_method.items()
            for kind, m in summary.items()]
    rows += [("average", method, m) for method, m in (avg or {}).items()]
    cols = [(k, name) for k, name in COLUMNS if rows and all(k in m for _, _, m in rows)]
    lines = ["| data | method | n | " + " | ".join(name for _, name in cols) + " |",
             "|---|---|---:|" + "---:|" * len(cols)]
    for data, method, m in rows:
        lines.append(f"| {data} | {method} | {m['n']} | " + " | ".join(f"{m[k]:.3f}" for k, _ in cols) + " |")
    return "\n".join(lines)
