"""Update throughput: train.py's update against a bare forward/backward/step loop, one run.

    python bench/update_bench.py                      # the toy warm start, 16 questions x 5

Settings are train.py's [toy] preset (configs.toml; what `python train.py` runs with):
micro-batches of 10 trajectories, 64 new tokens a turn, sampling and log-probs at temperature
0.7. Only the learning rate differs, 1e-5 instead of 3e-4: its value does not change the cost,
and a small one keeps the 2 x (repeats + 1) steps on random advantages from moving the model far.

Rolls out one GRPO batch with the warm-start policy, then times, alternately and
`--repeats` times each, (a) `train.update` (clipped policy loss + KL, micro-batches,
gradient clipping, statistics) and (b) a bare loop over the same micro-batches of the same
model: forward (the LM head where policy tokens are predicted, `models.trained_logprobs`, as update's),
masked token NLL, backward, AdamW step. Reports policy tokens/s of each and
their ratio (goal >= 0.9), medians over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # train.py lives at the repo root
import train  # noqa: E402
from searchlite.advantages import broadcast  # noqa: E402
from searchlite.config import HelpFormatter, at_least, parse_args, resolve_path  # noqa: E402
from searchlite.data import read_qa  # noqa: E402
from searchlite.models import load_policy, load_tokenizer, trained_logprobs  # noqa: E402
from searchlite.protocol import get_protocol  # noqa: E402
from searchlite.retrieval import build_retriever  # noqa: E402
from searchlite.rollout import rollout  # noqa: E402
from searchlite.sampler import HFSampler  # noqa: E402


def bare_step(policy, opt, ro, size: int) -> None:
    n_tok = float(ro.loss_mask.sum())
    for rows in train.micro_batches(len(ro), size, ro.attention_mask.sum(1)):  # as train.update groups them
        ids, attn, lm = train.trim(ro, rows)
        logp = trained_logprobs(policy, ids, attn, lm)[0]  # (b, t), the LM head where trained tokens are drawn
        (-(logp * lm).sum() / n_tok).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--model", default="toy/model", help="policy folder (default: the toy warm start)")
    ap.add_argument("--questions", type=int, default=16, help="questions in the batch (default 16)")
    ap.add_argument("--group", type=int, default=5, help="rollouts per question (default 5)")
    ap.add_argument("--repeats", type=at_least(1), default=5, help="timings of each (default 5)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = parse_args(["--preset", "toy", "--group", str(args.group), "--batch_size", str(args.questions),
                      "--lr", "1e-5"], prog="bench/update_bench.py")
    tok, policy = load_tokenizer(args.model), load_policy(args.model)
    qa = read_qa(resolve_path(cfg.train_data))[:args.questions]
    questions = [q.question for q in qa for _ in range(args.group)]
    sampler = HFSampler(policy, tok, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    retriever, protocol = build_retriever("bm25", resolve_path(cfg.corpus)), get_protocol(cfg.protocol, cfg.template)
    ro = rollout(sampler, retriever, tok, protocol, questions, max_turns=cfg.max_turns, topk=cfg.topk,
                 max_obs_tokens=cfg.max_obs_tokens, max_len=cfg.max_len, chat_template=cfg.chat_template)  # as train.py
    old_logp = train.score_tokens(policy, ro, cfg.micro_batch_size, "cpu", temperature=cfg.temperature)  # (N, T)
    adv = broadcast(torch.randn(len(ro)), ro.loss_mask.float())  # (N, T) values do not change the cost
    n_tok = int(ro.loss_mask.sum())
    columns = sum(len(rows) * train.trim(ro, rows)[0].shape[1]
                  for rows in train.micro_batches(len(ro), cfg.micro_batch_size, ro.attention_mask.sum(1)))
    print(f"batch: {len(ro)} trajectories, {int(ro.attention_mask.sum())} tokens, {n_tok} policy tokens, "
          f"micro-batches of {cfg.micro_batch_size} ([toy] preset, temperature {cfg.temperature}); the LM head "
          f"runs on the {n_tok} positions that predict a policy token, {n_tok / columns:.0%} of the micro-batches' "
          f"{columns} columns")
    opt_a, _ = train.make_optimizer(policy.parameters(), cfg.lr, 0.0, 0)
    opt_b = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    t_update, t_bare = [], []
    policy.train()
    for r in range(args.repeats + 1):  # the first round warms up and is not counted
        t0 = time.perf_counter()
        train.update(cfg, 0, policy, opt_a, ro, old_logp, old_logp, adv, "cpu")
        t1 = time.perf_counter()
        bare_step(policy, opt_b, ro, cfg.micro_batch_size)
        t2 = time.perf_counter()
        if r:
            t_update.append(t1 - t0)
            t_bare.append(t2 - t1)
    u, b = statistics.median(t_update), statistics.median(t_bare)
    print(f"train.update: {n_tok / u:,.0f} policy tokens/s ({u:.2f}s); bare loop: {n_tok / b:,.0f} policy tokens/s "
          f"({b:.2f}s); ratio {b / u:.3f} (goal >= 0.9), medians of {args.repeats}")


if __name__ == "__main__":
    main()
