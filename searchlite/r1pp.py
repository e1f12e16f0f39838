"""R1-Searcher++ (Song et al. 2025, arXiv 2505.17005): the SFT cold start and what its RL adds.

    python -m searchlite.r1pp stage1 --preset toy-r1pp-sft   # stage 1: rejection sampling + SFT -> out_dir/model
    python train.py --preset toy-r1pp                        # stage 2: REINFORCE++ with the pieces below

Stage 1 (§4.1), `stage1`: roll out `group` trajectories for each of `sft_questions` train
questions under the internal/external protocol, keep the correct, well-formed, distinct ones
(`rejection_sample`), SFT the model on them with retrieved tokens masked (searchlite.sft), and
save it; each finished batch of sampling is appended to out_dir/rejection_sampling.jsonl, so
`--resume` after an interrupt samples only what is missing. The sampler is the model itself
(`cold_start_sampler = "policy"`, the paper's way: a prompted instruct model; through transformers,
or an in-process vLLM engine under `--sampler vllm`, closed before the SFT) or, in the toy
world, whose warm start never saw this protocol, the scripted teacher (`"teacher"`), which then
plays the prompted model. A prompted instruct model can also follow the rewrite prompt below; a
toy model cannot without seeing it done, so the teacher adds `sft_rewrites` demonstrations
(`rewrite_demos`): a kept trajectory's documents in the rewrite prompt, answered from memory
with that trajectory's (correct) answer.

Stage 2 (§4.2), called by train.py when `reward = "r1pp"` or `mem_coef > 0`:
- `reward_terms`: R = R_format (0 / -2) + R_answer (cover-EM, 0 past 10 words) + R_group,
  R_group = min(2 sigma^2, eta) to the correct rollout(s) with the fewest retrievals (§4.2.1);
- `memorization_batch`: the stage-1 model (frozen; under `--sampler vllm`, the policy's engine
  given its weights: vllm_sampler.SharedVLLMSampler) reads the documents a correct rollout
  retrieved and answers from them "as from memory"; the correct internal-only answers become
  trajectories *question prompt -> answer*, documents gone (§4.2.2);
- `memorization_backward`: adds mu * L_M, L_M the token-mean NLL of those trajectories.

The paper released no code, so these choices are ours (and read off its text):
- "correct" means cover-EM = 1 *and* well formed, everywhere: a malformed rollout neither
  earns the group reward nor seeds rejection sampling or memorization;
- sigma is the population std of the search counts of the whole group, right and wrong
  rollouts alike, as we read §4.2.1 (`group_sigma = "correct"`: of the
  correct rollouts only, the other reading); ties for the fewest searches all get R_group
  (rewards.group_reward);
- well formed = the protocol's tag check (Protocol.format_ok: one tag span open at a time, each
  closed by its own tag, one non-empty \\boxed{} and no span opened after it) on the policy's own
  text, after cutting out the result blocks the environment inserted, with no result tags the
  model wrote itself and no invalid action (the injected correction message); R_format also
  needs a final answer;
- one rewrite per correct rollout that searched, its passages each once; a rewrite is kept
  when well formed, correct, without search tags or result tags, and without a word (outside the
  answer's own words) that gives away that documents were shown (`GIVEAWAY`);
- with several mini-batches a step, each mini-batch's optimizer step takes its share of the
  memorization trajectories, so mu * L_M weighs the same as with one.
The paper's LLM-judged evaluation is judge.py's (`evaluate.py --judge_url`). Left out on
purpose: any rewrite model other than the frozen stage-1 policy.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import re
import sys
import time
from pathlib import Path

import torch

from . import distributed as dist
from .data import DataError, append_log, parse_object, read_log
from .evaluation import fill
from .protocol import rewrite_path
from .retrieval import Hit
from .rewards import cover_exact_match, format_reward, group_reward
from .rollout import Rollout, _collate, encode_prompt, encode_text, rollout
from .sft import sft_loss

# Words a rewrite may not use: the trajectory must read as recalled, not as read (§4.2.2).
GIVEAWAY = re.compile(r"\b(documents?|passages?|notes?|provided|search results?|retriev\w*|doc ?\d+|according to|"
                      r"context|sources?)\b|title:", re.I)  # "Doc 1(Title: t)": how the passages were shown
INTERNAL_OPEN = "<|begin_internal_answer|>"  # a rewrite must recall with it at least once


# ---------------------------------------------------------------------------- judging one rollout


TOKEN_TAIL = 16  # the most characters a stop string's last token may add past it


def well_formed(response: str, protocol) -> bool:
    """R_format's test of a whole response (§4.2.1): see the module docstring."""
    if protocol.invalid_message in response:
        return False
    # The environment appends "\n<open>passages<close>\n" right after the turn that closed a search
    # (the first stop string in both protocols); cut those blocks, keep the tag. The sampler stops
    # on a whole token, which may run past the tag (SmolLM2 has ">." and ">,", others ">\n"), so
    # up to TOKEN_TAIL characters of it may sit between the two.
    close = re.escape(protocol.stop[0])
    inserted = re.compile(f"({close}.{{0,{TOKEN_TAIL}}}?)\n{re.escape(protocol.info_open)}.*?"
                          f"{re.escape(protocol.info_close)}\n", re.S)
    own = inserted.sub(lambda m: m.group(1), response)
    if protocol.info_open in own or protocol.info_close in own:
        return False
    return protocol.format_ok(own)


def is_correct(response: str, answer: str | None, golds, protocol) -> bool:
    """Correct = well formed and the answer covers a gold one (cover-EM, at most 10 words)."""
    return well_formed(response, protocol) and cover_exact_match(answer, golds) == 1.0


def reward_terms(ro, questions, protocol, group: int, eta: float = 2.0, use_group: bool = True,
                 sigma_over: str = "group") -> dict:
    """R1-Searcher++'s reward terms for N = B * group rollouts, a question's rollouts adjacent.

    Returns {"format", "answer", "group", "correct"}, each (N,); the reward is the sum of the
    first three. `use_group=False` zeroes R_group (the paper's ablation without it);
    `sigma_over` is rewards.group_reward's `over`.
    """
    if len(ro) % group:
        raise ValueError(f"reward_terms: {len(ro)} rollouts do not split into groups of {group}")
    # (N,) 0 or -2; a trajectory that never answered is malformed even if a \boxed{} sits in one of its queries
    fmt = torch.tensor([format_reward(well_formed(r, protocol) and a is not None)
                        for r, a in zip(ro.responses, ro.answers)])
    ans = torch.tensor([cover_exact_match(a, q.answers) for a, q in zip(ro.answers, questions)])  # (N,) 0 or 1
    correct = (fmt == 0) & (ans == 1)  # (N,)
    grp = torch.zeros(len(ro))  # (N,)
    if use_group:
        for s in range(0, len(ro), group):
            grp[s:s + group] = torch.tensor(group_reward(correct[s:s + group].tolist(),
                                                         ro.searches[s:s + group].tolist(), eta, sigma_over))
    return {"format": fmt, "answer": ans, "group": grp, "correct": correct}


# ---------------------------------------------------------------------------- stage 2: memorization


def rewrite_template(protocol, template: str = "") -> str:
    """The rewrite prompt, with {documents} and {question}: templates/<set>_<protocol>_rewrite.txt
    for a template set name (e.g. "toy"), else the paper-style templates/<protocol>_rewrite.txt."""
    path = rewrite_path(protocol.name, template)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: no rewrite prompt for protocol {protocol.name!r}")
    text = path.read_text(encoding="utf-8")
    if "{documents}" not in text or "{question}" not in text:
        raise ValueError(f"{path}: a rewrite prompt needs {{documents}} and {{question}}")
    return text.rstrip("\n") + "\n"


def rewrite_prompt(tokenizer, protocol, template: str, question: str, docs, chat_template: bool = True) -> list[int]:
    """Prompt ids asking to answer `question` from memory, with the passages `docs` (each once, in
    first-seen order) in context."""
    docs = list({h.id or (h.title, h.text): h for h in docs}.values())  # a server may send no ids at all
    text = fill(template, question=protocol.ask(question), documents=protocol.format_passages(docs).rstrip("\n"))
    return encode_text(tokenizer, text, chat_template)


def keep_rewrite(text: str, golds, protocol) -> bool:
    """A rewrite is kept when it answers correctly and well formed, from "memory" alone: at least
    one internal answer, no search call or result, no word giving away that documents were shown."""
    if INTERNAL_OPEN not in text:
        return False
    if protocol.stop[0] in text or protocol.info_open in text or protocol.info_close in text:
        return False
    # a giveaway word inside a whole-word mention of a gold is the answer's own ("Notes from Underground"),
    # not one inside a gold that is part of a word: gold "no" in "notes", "2" in "Doc 2"
    golds_at = [m.span() for g in golds if g.strip()
                for m in re.finditer(rf"(?<!\w){re.escape(g.strip())}(?!\w)", text, re.I)]
    if any(not any(a <= m.start() and m.end() <= b for a, b in golds_at) for m in GIVEAWAY.finditer(text)):
        return False
    action = protocol.parse(text)
    return action.kind == "answer" and is_correct(text, action.content, golds, protocol)


def memorization_batch(sampler, tokenizer, protocol, template: str, ro, questions,
                       chat_template: bool = True) -> tuple[Rollout | None, int]:
    """Internal-only trajectories from the documents of the step's correct rollouts (§4.2.2).

    For each correct rollout that searched, `sampler` (over the frozen stage-1 model) answers
    the rewrite prompt (`template`: its passages, then the question) in one turn. A kept
    answer becomes a trajectory: the plain question prompt (no documents) followed by exactly
    the sampled ids, loss_mask 1 on them. Returns (trajectories or None if none was kept,
    number of rewrites tried).
    """
    rows = [i for i in range(len(ro))
            if ro.docs[i] and is_correct(ro.responses[i], ro.answers[i], questions[i].answers, protocol)]
    if not rows:
        return None, 0
    prompts = [rewrite_prompt(tokenizer, protocol, template, questions[i].question, ro.docs[i], chat_template)
               for i in rows]
    outs = sampler.generate(prompts, stop=protocol.stop)
    keep = [(i, out) for i, out in zip(rows, outs)
            if keep_rewrite(tokenizer.decode(out, skip_special_tokens=False), questions[i].answers, protocol)]
    if not keep:
        return None, len(rows)
    plain = [encode_prompt(tokenizer, protocol, questions[i].question, chat_template) for i, _ in keep]
    resp = [list(out) for _, out in keep]
    answers = [protocol.parse(tokenizer.decode(out, skip_special_tokens=False)).content for out in resp]
    mem = _collate(plain, resp, [[1] * len(r) for r in resp], [0] * len(keep), [1] * len(keep), answers,
                   [[] for _ in keep], tokenizer)
    return mem, len(rows)


def memorization_backward(policy, mem: Rollout | None, rows: list[int], coef: float, micro_batch_size: int,
                          device) -> float | None:
    """Accumulate the gradient of coef * L_M over trajectories `rows` of `mem`; return L_M
    (None when there were no rows to learn from).

    L_M is the mean NLL over all their response tokens (token mean, R1-Searcher++ §4.2.2), from
    the raw logits: it is a likelihood, not the sampling distribution. Micro-batches are
    weighted by their token share, so the sum of their gradients is that of L_M.
    Under torchrun (searchlite/distributed.py) L_M spans every rank's `rows`: the token count is
    summed over ranks and divided by the world size (DDP and FSDP2 average gradients), and a
    rank with fewer micro-batches than another, or no rewrites at all (`mem` None), runs
    zero-weight passes, because every rank must run as many backward passes as the others.
    """
    rows = rows if mem is not None else []
    n_tok = max(1.0, dist.all_sum(float(mem.loss_mask[rows].sum()) if rows else 0.0)) / dist.world()
    size = micro_batch_size or len(rows) or 1
    chunks = [rows[s:s + size] for s in range(0, len(rows), size)]
    passes = dist.all_max(len(chunks))
    if passes == 0:
        return None
    total = 0.0
    for k in range(passes):
        if k < len(chunks):
            chunk = chunks[k]
            width = int(mem.attention_mask[chunk].sum(1).max())
            ids, attn, lm = (x[chunk, :width] for x in (mem.input_ids, mem.attention_mask, mem.loss_mask))
        else:  # a pass with nothing to learn: two tokens, loss mask 0, so a zero gradient
            ids = torch.zeros(1, 2, dtype=torch.long)  # (1, 2)
            attn, lm = torch.ones_like(ids), torch.zeros_like(ids)  # (1, 2)
        weight = float(lm.sum()) / n_tok  # counted on the host
        nll = sft_loss(policy, ids.to(device), lm.to(device), attn.to(device))  # token mean over this micro-batch
        (coef * weight * nll).backward()
        total = total + nll.detach() * weight
    return float(total)


# ---------------------------------------------------------------------------- stage 1: cold start


# The fields that decide what rejection sampling draws: a resumed stage 1 must not change them.
SAMPLING_FIELDS = ("model", "tokenizer", "dtype", "chat_template", "train_data", "seed", "sft_questions", "group",
                   "batch_size", "cold_start_sampler", "protocol", "template", "temperature", "top_p", "max_turns",
                   "max_new_tokens", "max_obs_tokens", "max_len", "retriever", "corpus", "encoder", "pooling",
                   "index", "retriever_url", "query_prefix", "topk", "gen_batch_size", "sampler")  # a resume samples
# on with the same ones; a log from before a field was recorded was sampled with its value here
UNRECORDED = {"query_prefix": "", "sampler": "hf"}
STAGE1_FIELDS = ("out_dir", "resume", "device", *SAMPLING_FIELDS, "sft_rewrites", "sft_epochs",
                 "sft_lr", "sft_batch_size", "micro_batch_size", "weight_decay", "grad_clip",
                 "grad_checkpointing", "master_weights")  # what stage 1 reads
# what a resume may change: memory settings (the sampling log and the SFT state refuse any other change)
RESUME_MAY_CHANGE = ("micro_batch_size", "grad_checkpointing")
STAGE1_HELP = {  # --help for the fields stage 1 reads otherwise than train.py
    "out_dir": "folder for model/ (what stage 2 starts from), rejection_sampling.jsonl, config.json, stage1.json, "
               "trajectories/kept.html and, while SFT runs, sft_state.pt; empty = runs/<preset>",
    "batch_size": "questions per rejection-sampling round (each round is appended to rejection_sampling.jsonl)",
    "group": "trajectories sampled per question; the correct, well-formed ones are kept",
    "micro_batch_size": "trajectories per SFT forward/backward (gradient accumulation within --sft_batch_size; "
                        "at least 1, --sft_batch_size for the whole batch at once)",
    "sampler": "what samples the model's trajectories (--cold_start_sampler policy): hf (transformers generate) | "
               "vllm (an in-process vLLM engine, closed before the SFT; ./setup.sh vllm)",
}


def open_sampling_log(path: Path, fields: dict, resume: bool) -> Path:
    """The rejection-sampling log of `rejection_sample` (data.append_log): started afresh, its
    first line the `fields`, or with `resume` an existing one, checked to hold the same `fields`."""
    if not resume or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        append_log(path, [{"fields": fields}])
        return path
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        head = json.loads(first)["fields"]
    except (KeyError, TypeError, json.JSONDecodeError):
        sys.exit(f"error: {path}:1: not a rejection-sampling log (no fields line); "
                 "rerun without --resume to sample afresh")
    for k, v in fields.items():
        if k not in head and k in UNRECORDED:  # a log from before k was recorded
            head[k] = UNRECORDED[k]
        if k not in head:  # a log from a version that did not record k
            sys.exit(f"error: {path}:1: the log does not record {k}; rerun without --resume to sample afresh")
        if head[k] != v:
            sys.exit(f"error: {path}:1: sampled with {k} = {head.get(k)!r}, this run has {k} = {v!r}; "
                     f"rerun with --{k} {shlex.quote(str(head[k]))}, or without --resume to sample afresh")
    return path


def logged_questions(path: Path, fields: dict) -> int:
    """How many questions a rejection-sampling log holds the samples of (0 without a log), once
    `open_sampling_log` has checked that it was sampled with `fields` (a mismatch exits). Only its
    last whole line is parsed: `rejection_sample` reads the rest (a log can hold GBs of token ids)."""
    if not path.exists():
        return 0
    open_sampling_log(path, fields, resume=True)
    last, last_no = None, 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):  # (read only: a torn last line is cut when sampling appends)
            if n > 1 and line.endswith(b"\n") and line.strip():
                last, last_no = line, n
    return parse_object(last, path, last_no)["next"] if last else 0


def rejection_sample(sampler, retriever, tokenizer, protocol, qa: list, samples: int, batch_size: int,
                     log: Path | None = None, **rollout_kw) -> tuple[Rollout | None, dict, list[str]]:
    """Roll out `samples` trajectories per question (`batch_size` questions a call); keep the
    correct, well-formed ones, each distinct trajectory once (§4.1). Returns (kept or None, counts,
    the question of each kept row).

    With `log` (a JSONL file from `open_sampling_log`), each finished batch is appended as one
    line (its kept rows, counts and the sampler's state), and the batches already there are read
    back instead of sampled again: a stage 1 interrupted after hours of sampling resumes at its
    next batch, with the result of an uninterrupted run."""
    from tqdm import tqdm

    kept, seen = [], set()  # kept: a row (question, prompt and response ids, mask, ...) per distinct trajectory
    n = {"questions": len(qa), "sampled": 0, "well_formed": 0, "correct": 0}
    size = batch_size or len(qa)

    def keep(row: dict) -> bool:
        """Keep `row` unless the same trajectory is kept already; says whether it was kept."""
        key = tuple(row["prompt"] + row["response"])
        if key in seen:
            return False
        seen.add(key)
        kept.append(row)
        return True

    start = 0
    for batch in read_log(log)[1:] if log else []:  # the batches of an interrupted run (line 1: the fields)
        start = batch["next"]
        if sampler is not None:  # (None: every batch is in the log, nothing is sampled)
            sampler.load_state_dict(batch["sampler"])
        for k in ("sampled", "well_formed", "correct"):
            n[k] += batch["counts"][k]
        for row in batch["rows"]:
            keep(row | {"docs": [Hit(**h) for h in row["docs"]]})
    if start:
        print(f"--resume: {log} holds the samples of questions 1 to {start} of {len(qa)}", flush=True)
    for s in tqdm(range(start, len(qa), size), desc="rejection sampling", initial=start // size,
                  total=-(-len(qa) // size)):
        questions = [q for q in qa[s:s + size] for _ in range(samples)]
        ro = rollout(sampler, retriever, tokenizer, protocol, [q.question for q in questions], **rollout_kw)
        counts, rows = {"sampled": 0, "well_formed": 0, "correct": 0}, []
        for i, q in enumerate(questions):
            ok = well_formed(ro.responses[i], protocol)
            right = ok and cover_exact_match(ro.answers[i], q.answers) == 1.0
            counts["sampled"] += 1
            counts["well_formed"] += ok
            counts["correct"] += right
            p, end = int(ro.prompt_len[i]), int(ro.attention_mask[i].sum())
            if right:
                rows.append({"question": q.question, "prompt": ro.input_ids[i, :p].tolist(),
                             "response": ro.input_ids[i, p:end].tolist(), "mask": ro.loss_mask[i, p:end].tolist(),
                             "searches": int(ro.searches[i]), "turns": int(ro.turns[i]), "answer": ro.answers[i],
                             "docs": ro.docs[i]})
        for k, v in counts.items():
            n[k] += v
        rows = [row for row in rows if keep(row)]
        if log:  # one line per batch, on disk before the next batch starts
            batch = {"next": s + size, "counts": counts, "sampler": sampler.state_dict(),
                     "rows": [r | {"docs": [dataclasses.asdict(h) for h in r["docs"]]} for r in rows]}
            append_log(log, [batch])
    n["kept"] = len(kept)
    n["kept_internal"] = sum(r["searches"] == 0 for r in kept)
    n["questions_kept"] = len({tuple(r["prompt"]) for r in kept})
    if not kept:
        return None, n, []
    col = lambda k: [r[k] for r in kept]  # noqa: E731
    return _collate(col("prompt"), col("response"), col("mask"), col("searches"), col("turns"), col("answer"),
                    col("docs"), tokenizer), n, col("question")


def rewrite_demos(kept: Rollout, asked: list[str], tokenizer, protocol, template: str, recall, n: int,
                  seed: int = 0, chat_template: bool = True) -> Rollout | None:
    """Up to `n` demonstrations of the rewrite task for stage 1's SFT data (toy world).

    For kept trajectories that searched (`n` of them, drawn with `seed`), the prompt is the rewrite
    prompt of memorization_batch with their question and passages, and the response is
    `recall(answer)`, the teacher's answer from memory with the trajectory's own (correct)
    answer, every token trained. None when no kept trajectory searched."""
    rows = [i for i in range(len(kept)) if kept.docs[i] and int(kept.searches[i]) > 0]
    random.Random(seed).shuffle(rows)
    rows = rows[:n]
    if not rows:
        return None
    prompts = [rewrite_prompt(tokenizer, protocol, template, asked[i], kept.docs[i], chat_template) for i in rows]
    resp = [tokenizer.encode(recall(kept.answers[i]), add_special_tokens=False) for i in rows]
    return _collate(prompts, resp, [[1] * len(r) for r in resp], [0] * len(rows), [1] * len(rows),
                    [kept.answers[i] for i in rows], [[] for _ in rows], tokenizer)


def join(a: Rollout, b: Rollout | None, tokenizer) -> Rollout:
    """The rows of `a`, then those of `b` (if any), in one batch."""
    if b is None:
        return a
    rows = [(ro, i) for ro in (a, b) for i in range(len(ro))]
    cut = lambda ro, i, lo, hi: ro.input_ids[i, lo:hi].tolist()  # noqa: E731
    ends = [(int(ro.prompt_len[i]), int(ro.attention_mask[i].sum())) for ro, i in rows]
    return _collate([cut(ro, i, 0, p) for (ro, i), (p, _) in zip(rows, ends)],
                    [cut(ro, i, p, e) for (ro, i), (p, e) in zip(rows, ends)],
                    [ro.loss_mask[i, p:e].tolist() for (ro, i), (p, e) in zip(rows, ends)],
                    [int(ro.searches[i]) for ro, i in rows], [int(ro.turns[i]) for ro, i in rows],
                    [ro.answers[i] for ro, i in rows], [ro.docs[i] if ro.docs else [] for ro, i in rows], tokenizer)


# What a stage 1 writes in its out_dir: a fresh one (no --resume) keeps an earlier one's as *.previous
STAGE1_OUTPUTS = ("model", "stage1.json", "rejection_sampling.jsonl", "sft_state.pt", "config.json", "trajectories")


def check_stage1(cfg) -> None:
    """A ConfigError for settings stage 1 cannot run together, before out_dir is locked or anything loads."""
    from .config import ConfigError

    if cfg.sft_rewrites and cfg.cold_start_sampler != "teacher":
        raise ConfigError("--sft_rewrites needs --cold_start_sampler teacher (it writes the demonstrations); "
                          "a prompted instruct model follows the rewrite prompt without them: --sft_rewrites 0")
    if cfg.sampler == "vllm" and cfg.cold_start_sampler == "teacher":
        raise ConfigError("--sampler vllm samples the model (--cold_start_sampler policy); the scripted teacher "
                          "(--cold_start_sampler teacher) writes its trajectories without one")


def stage1(cfg) -> Path:
    """Rejection-sample with `cfg`, SFT `cfg.model` on the kept trajectories, save out_dir/model;
    one stage 1 at a time in out_dir (two would mix their sampling logs and models)."""
    from .models import lock_run

    began = []  # holds True once this stage 1 changes a file in out_dir (an interrupt says so, or not)
    with lock_run(Path(cfg.out_dir)):  # (another run's: a ConfigError, which main reports)
        try:
            return _stage1(cfg, began)
        except KeyboardInterrupt as e:
            e.searchlite_changed_nothing, e.searchlite_out_dir = not began, cfg.out_dir
            raise


def _stage1(cfg, began: list) -> Path:
    from .config import ConfigError, format_config, resolve_path, save_config
    from .data import read_qa
    from .models import GracefulStop, load_policy, pick_device, model_tokenizer, reuse_freed_memory, set_aside
    from .protocol import get_protocol
    from .retrieval import config_retriever
    from .sampler import HFSampler
    from .sft import sft
    from .view import write_html

    out = Path(cfg.out_dir)
    if cfg.resume and (out / "stage1.json").exists():
        done = json.loads((out / "config.json").read_text(encoding="utf-8")) if (out / "config.json").exists() else {}
        changed = [f"{k} = {done[k]!r}, this run has {getattr(cfg, k)!r}" for k in STAGE1_FIELDS
                   if k not in ("out_dir", "resume", "device") and k in done and done[k] != getattr(cfg, k)]
        if changed:  # (bench/r1pp_ablation.sh resumes stage 1, then trains stage 2 on what it finds)
            raise ConfigError(f"--resume: stage 1 in {out} finished with {'; '.join(changed)}; rerun without "
                              "--resume to start over (the finished one is set aside), or with its settings")
        print(f"--resume: stage 1 already finished in {out} ({out / 'model'})", flush=True)
        return out / "model"
    print(f"config:\n{format_config(cfg)}", flush=True)
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    train_qa = read_qa(resolve_path(cfg.train_data))  # data and retriever before the model: a bad line stops it sooner
    qa = list(train_qa)
    random.Random(cfg.seed).shuffle(qa)
    qa = qa[:cfg.sft_questions or len(qa)]
    retriever = config_retriever(cfg)
    log = out / "rejection_sampling.jsonl"  # checked now, before the model loads: one sampled otherwise is refused
    fields = {k: getattr(cfg, k) for k in SAMPLING_FIELDS}
    sampled = logged_questions(log, fields) if cfg.resume else 0
    device = pick_device(cfg.device)
    reuse_freed_memory(device)  # CPU: stop glibc unmapping and re-faulting the big logits blocks every pass
    tokenizer = model_tokenizer(cfg.model, cfg.tokenizer)  # a hub name it cannot load is a ConfigError, in one line
    protocol = get_protocol(cfg.protocol, cfg.template)
    if cfg.cold_start_sampler == "teacher":  # questions without the toy world's hops: a ConfigError, before the model
        from .teacher import Teacher

        sampler = Teacher(tokenizer, protocol, train_qa, seed=cfg.seed)
    model = load_policy(cfg.model, cfg.dtype, device, cfg.grad_checkpointing, master=cfg.master_weights)
    engine = None  # --sampler vllm: the engine, closed once the sampling is done
    if cfg.cold_start_sampler != "teacher":  # the model itself, as train.py samples it
        sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                        seed=cfg.seed, batch_size=cfg.gen_batch_size)
        if cfg.sampler == "vllm" and sampled >= len(qa):  # a resume whose sampling is done starts no engine
            sampler = None
        elif cfg.sampler == "vllm":  # an engine built from --model: nothing to push, the sampled model never changes
            from .vllm_sampler import VLLMSampler

            try:
                sampler = engine = VLLMSampler(cfg.model, cfg.tokenizer or None, dtype=cfg.dtype, **sampling)
            except ImportError as e:  # installed (check_config looked) but it does not import
                sys.exit(f"error: {e}")
        else:
            sampler = HFSampler(model, tokenizer, **sampling)
    # only now that everything has loaded: a stage 1 that stops before this changes no file
    began.append(True)
    if not cfg.resume and (moved := set_aside(out, STAGE1_OUTPUTS)):  # a forgotten --resume loses nothing
        print(f"note: {out} holds an earlier stage 1; this one starts afresh (--resume continues it instead), "
              f"and the earlier one is kept: {', '.join(moved)}", flush=True)
    if cfg.resume and (out / "config.json").exists():  # what --resume continues with (the sampling log and the
        done = json.loads((out / "config.json").read_text(encoding="utf-8"))  # SFT state refuse what they cannot)
        changes = [f"{k}: {done[k]!r} -> {getattr(cfg, k)!r}" for k in RESUME_MAY_CHANGE
                   if k in done and done[k] != getattr(cfg, k)]
        if changes:
            print(f"note: --resume continues with settings of its own: {'; '.join(changes)} (config.json now holds "
                  "them, and a later --resume is checked against them)", flush=True)
    save_config(cfg, out / "config.json")
    t_sample = time.time()
    log = open_sampling_log(log, fields, cfg.resume)
    kept, counts, asked = rejection_sample(sampler, retriever, tokenizer, protocol, qa, cfg.group, cfg.batch_size,
                                           log, max_turns=cfg.max_turns, topk=cfg.topk,
                                           max_obs_tokens=cfg.max_obs_tokens, max_len=cfg.max_len,
                                           chat_template=cfg.chat_template)
    print("rejection sampling: " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    if engine is not None:  # its memory goes to the SFT
        if engine.can_sleep:
            engine.release()  # GPU: the engine's weights and KV cache are freed at once
        engine.close()
    counts["t_sample"] = time.time() - t_sample
    if kept is None:
        sys.exit("error: no sampled trajectory was both correct and well formed, nothing to fine-tune on; "
                 "sample more (--group, --sft_questions) or, in the toy world, --cold_start_sampler teacher")
    if cfg.sft_rewrites:
        demos = rewrite_demos(kept, asked, tokenizer, protocol, rewrite_template(protocol, cfg.template),
                              sampler.recall, cfg.sft_rewrites, cfg.seed, cfg.chat_template)
        counts["rewrite_demos"] = 0 if demos is None else len(demos)
        print(f"rewrite demonstrations: {counts['rewrite_demos']}", flush=True)
        kept = join(kept, demos, tokenizer)
    write_html(out / "trajectories" / "kept.html", kept, tokenizer, [1.0] * len(kept), [[a] for a in kept.answers],
               title="stage 1: kept trajectories", limit=16)
    with GracefulStop() as stop:  # Ctrl-C: the SFT step finishes and its state is saved (also at each epoch's end)
        losses = sft(model, kept.input_ids, kept.loss_mask, attention_mask=kept.attention_mask, epochs=cfg.sft_epochs,
                     lr=cfg.sft_lr, batch_size=cfg.sft_batch_size, micro_batch_size=cfg.micro_batch_size,
                     weight_decay=cfg.weight_decay,
                     grad_clip=cfg.grad_clip, seed=cfg.seed, state_path=out / "sft_state.pt", stop=stop,
                     run={"dtype": cfg.dtype, "master_weights": cfg.master_weights},  # the saved weights' form
                     flags={"lr": "--sft_lr", "batch_size": "--sft_batch_size", "epochs": "--sft_epochs",
                            **{k: f"--{k}" for k in ("seed", "weight_decay", "grad_clip", "dtype", "master_weights")}})
    stop.exit_if_requested(f"stopped after SFT step {len(losses)}, its state saved in {out / 'sft_state.pt'}: "
                           "rerun the same command with --resume to continue")
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    tail = losses[-20:]
    counts |= {"sft_steps": len(losses), "sft_loss": sum(tail) / len(tail), "sft_first_loss": losses[0],
               "seconds": time.time() - t0}
    (out / "stage1.json").write_text(json.dumps(counts, indent=2) + "\n")
    (out / "sft_state.pt").unlink(missing_ok=True)  # the size of the model and its optimizer, now not needed
    print(f"stage 1: sft loss {counts['sft_loss']:.4f} over {len(losses)} steps; wrote {out / 'model'} "
          f"in {counts['seconds']:.0f}s", flush=True)
    return out / "model"


STAGE1_ABOUT = ("R1-Searcher++ stage 1, the SFT cold start: rejection sampling, then SFT on the kept trajectories; "
                "writes out_dir/model.")  # what stage1's --help opens with
USAGE = """usage: python -m searchlite.r1pp stage1 [--preset NAME] [--field value ...]

R1-Searcher++ stage 1, the SFT cold start (see this module's docstring). Reads model,
train_data, the retrieval and rollout fields, group (samples per question), batch_size
(questions per rollout call), cold_start_sampler, sft_questions, sft_epochs, sft_lr, sft_rewrites and
sft_batch_size; writes out_dir/model. Stage 2 starts from it: `python train.py --preset toy-r1pp`
reads runs/toy-r1pp-sft/model, `--preset r1pp-qwen2.5-7b` runs/r1pp-qwen2.5-7b-sft/model; add
`--model OUT_DIR/model` for another out_dir (the preset also sets the protocol and reward).
Each finished batch of sampling is appended to out_dir/rejection_sampling.jsonl: after an
interrupt, the same command with --resume samples only the batches still missing (with
--sampler vllm and none missing, it starts no engine). The SFT saves
its state to out_dir/sft_state.pt at each epoch's end and on Ctrl-C (after the step in hand);
--resume continues it from there.
Each field it reads: python -m searchlite.r1pp stage1 --help (a flag for any other is refused)."""


def main(argv=None) -> None:
    from .config import ConfigError, check_config, parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit(USAGE)
    if argv[0] in ("-h", "--help"):  # asked for: stdout and success, so `| less` and scripts see it
        print(USAGE)
        return
    if argv[0] != "stage1":  # stage 2 is train.py with an r1pp preset
        sys.exit(f"error: unknown command {argv[0]!r}; this module runs stage 1, stage 2 is "
                 f"`python train.py --preset toy-r1pp`\n\n{USAGE}")
    try:
        cfg = parse_args(argv[1:], prog="-m searchlite.r1pp stage1", default_preset="toy-r1pp-sft",
                         reads=STAGE1_FIELDS, helps=STAGE1_HELP, about=STAGE1_ABOUT)
        check_config(cfg, STAGE1_FIELDS)
        check_stage1(cfg)
        stage1(cfg)
    except (ConfigError, DataError) as e:  # a bad flag, or a bad line in the data or the sampling log
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:  # Ctrl-C while sampling, or a second signal during the SFT
        from .models import interrupted_status

        if getattr(e, "searchlite_changed_nothing", False):  # while it loaded: the same command starts it again
            sys.stderr.write(f"\ninterrupted before stage 1 changed any file in {e.searchlite_out_dir}\n")
        else:
            sys.stderr.write("\ninterrupted: rejection_sampling.jsonl keeps each finished sampling batch and "
                             "sft_state.pt the SFT's last save; rerun with --resume to continue\n")
        sys.exit(interrupted_status(e))


if __name__ == "__main__":
    from .config import plain_warnings

    plain_warnings(__file__)
    main()
