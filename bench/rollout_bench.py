"""Retrieval speed and rollout-loop efficiency, measured in one run.

    python bench/rollout_bench.py                                   # toy world only
    python bench/rollout_bench.py --realqa ../shared/data/realqa    # + BM25 over the real mini corpus

1. BM25 (bm25s) over the real mini-Wikipedia corpus: queries/s for the 500 HotpotQA questions
   in one batched call against 100 of them one at a time, after an untimed warm-up search (when
   --realqa is given: a folder with corpus.jsonl and hotpotqa_500.jsonl; without it, this part
   is skipped).
2. Rollout efficiency: generated tokens/s of a full multi-turn rollout (generate -> parse ->
   retrieve -> append, all turns) divided by tokens/s of one plain generate call on the same
   prompts with the same sampler and model, with no stop strings and `max_new_tokens` chosen
   so that it samples about as many tokens. 1.0 would mean the loop costs nothing beyond
   generation. The two are measured alternately, `--repeats` times each; the median ratio is reported.
   The time inside the sampler's generate calls is also reported: the rest is the loop's own
   cost (parsing, retrieval, tokenising observations, collation); the gap between generate
   time and the plain call is the multi-turn cost inside generation (each turn prefills the
   whole context again, and a turn lasts as long as its longest row).

The goal, 0.85, is not met by HFSampler on the toy model: 0.30-0.39 on 5 Dec (2 CPU cores,
80 trajectories), 98% of the loop's time inside generate. On the toy model, 20 tokens for 8
rows took 0.058 s against 0.26 s for 80 (2.2 times the cost a row), so the later turns, which
run only the rows still searching, each after a prefill of their whole context (a quarter of
the loop's time in one profile), cost far more a token than the plain call's one batch of 80.
bench/sampler_bench.py measures the vLLM sampler against HFSampler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from searchlite.config import HelpFormatter, at_least

REALQA_FILES = ("corpus.jsonl", "hotpotqa_500.jsonl")  # what --realqa's folder must hold


def bm25_speed(realqa: Path) -> None:
    from searchlite.data import read_qa
    from searchlite.retrieval import build_retriever

    t0 = time.perf_counter()
    retriever = build_retriever("bm25", str(realqa / "corpus.jsonl"))
    build = time.perf_counter() - t0
    questions = [q.question for q in read_qa(realqa / "hotpotqa_500.jsonl")]
    retriever.search(questions[:1], 3)  # untimed warm-up: first-call costs would fall on the batched timing
    t0 = time.perf_counter()
    retriever.search(questions, 3)
    batched = len(questions) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for q in questions[:100]:
        retriever.search([q], 3)
    single = len(questions[:100]) / (time.perf_counter() - t0)
    print(f"bm25s on {realqa / 'corpus.jsonl'}: index build {build:.2f}s; HotpotQA-500 top-3: batched "
          f"{batched / single:.1f}x the queries/s of one at a time ({batched:,.0f} vs {single:,.0f} queries/s)")


def rollout_efficiency(model_path: str, n: int, repeats: int, seed: int) -> None:
    from searchlite.config import resolve_path
    from searchlite.data import read_qa
    from searchlite.models import load_policy, load_tokenizer
    from searchlite.protocol import get_protocol
    from searchlite.retrieval import build_retriever
    from searchlite.rollout import encode_prompt, rollout
    from searchlite.sampler import HFSampler

    tok, model = load_tokenizer(model_path), load_policy(model_path)
    qa = read_qa(resolve_path("toy/train.jsonl"))[:n]
    retriever = build_retriever("bm25", resolve_path("toy/corpus.jsonl"))
    protocol = get_protocol("search_r1", "toy")
    questions = [q.question for q in qa]
    prompts = [encode_prompt(tok, protocol, q) for q in questions]
    class Timed(HFSampler):
        """HFSampler that adds up the wall time spent inside generate."""
        spent = 0.0

        def generate(self, prompts, **kw):
            t = time.perf_counter()
            try:
                return super().generate(prompts, **kw)
            finally:
                self.spent += time.perf_counter() - t

    ratios = []
    for r in range(repeats + 1):  # the first round warms up and is not counted
        sampler = Timed(model, tok, max_new_tokens=64, seed=seed + r)
        t0 = time.perf_counter()
        ro = rollout(sampler, retriever, tok, protocol, questions, max_turns=4, topk=3)
        t_roll = time.perf_counter() - t0
        t_gen = sampler.spent
        n_roll = int(ro.loss_mask.sum())  # tokens the policy sampled, over all turns
        per_row = max(1, round(n_roll / len(questions)))  # --n is capped at the training set's size
        t0 = time.perf_counter()
        outs = sampler.generate(prompts, stop=(), max_new_tokens=per_row)
        t_plain = time.perf_counter() - t0
        n_plain = sum(len(o) for o in outs)
        ratio = (n_roll / t_roll) / (n_plain / t_plain)
        if r == 0:
            continue
        ratios.append(ratio)
        print(f"  repeat {r}: rollout {n_roll} tokens in {t_roll:.2f}s ({n_roll / t_roll:,.0f} tok/s, "
              f"{ro.turns.float().mean():.2f} turns, {ro.searches.float().mean():.2f} searches; "
              f"{t_gen / t_roll:.0%} of it inside generate); plain generate {n_plain} tokens in {t_plain:.2f}s "
              f"({n_plain / t_plain:,.0f} tok/s); ratio {ratio:.3f}")
    median = statistics.median(ratios)
    print(f"rollout efficiency (multi-turn tok/s / plain generate tok/s), {len(questions)} trajectories, "
          f"{model_path}: median {median:.3f} over {repeats} repeats (goal >= 0.85: "
          f"{'met' if median >= 0.85 else 'not met'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--realqa", default=None,
                    help="folder with corpus.jsonl and hotpotqa_500.jsonl (omit it to skip the BM25 part)")
    ap.add_argument("--model", default="toy/model", help="policy folder (default: the toy warm start)")
    ap.add_argument("--n", type=int, default=80,
                    help="trajectories per rollout: the first N toy training questions (all, if fewer), one each "
                         "(default 80)")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="measurements of each (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = ap.parse_args()
    if args.realqa:  # check before any work: a missing file is a one-line error, not a traceback
        for name in REALQA_FILES:
            if not (Path(args.realqa) / name).is_file():
                print(f"rollout_bench: --realqa {args.realqa}: no {Path(args.realqa) / name}; give the folder with "
                      f"{' and '.join(REALQA_FILES)}, or omit --realqa to measure the toy rollout only",
                      file=sys.stderr)
                sys.exit(2)
    torch.manual_seed(args.seed)
    if args.realqa:
        bm25_speed(Path(args.realqa))
    rollout_efficiency(args.model, args.n, args.repeats, args.seed)


if __name__ == "__main__":
    main()
