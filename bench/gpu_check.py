"""One GRPO step of a randomly initialised Qwen2.5-3B-shaped model on one GPU: prints rollout
tokens/s, update tokens/s and peak GPU memory.

    bash bench/gpu_check.sh                 # on a GPU machine: the 3B shape in bf16 (< 8 minutes on one H200)
    python bench/gpu_check.py --tiny        # the same code path with a tiny model, on CPU (the tests run this)

Self-contained: it needs torch and transformers only (no vLLM, no weights, no network). The toy
world supplies questions, corpus and tokenizer; retrieval is BM25 over the toy corpus, or a plain
word-overlap search where bm25s is not installed. The model has Qwen2.5-3B's shape (hidden 2048,
36 layers, 16 heads, 2 KV heads, MLP 11008, tied embeddings) and its vocabulary of 151,936 ids;
sampling is restricted to the toy tokenizer's 2,400 ids (`generation_config.suppress_tokens`),
while scoring and the update compute full-vocabulary logits as a real 3B model does.

The step is train.py's: HFSampler rollout (Search-R1's loop, gradient checkpointing on) ->
reference log-probs (and old ones only where train.py scores them: GRPO's single on-policy step
takes them from the update's own forward) -> group advantages -> `train.update` (clipped loss +
k3 KL, one AdamW step over micro-batches). A random model never answers right, so the rewards
are set to 0, 1, 0, 1, ... within each group: the update is a real one, not a zero-advantage
no-op. It also checks that the reference scored after a CPU round trip (`--ref_offload`'s path)
gives the same log-probs as on the device (on a GPU: on CPU nothing moves, and it says so).
Tokens/s: rollout = tokens the policy sampled / rollout seconds (generation and retrieval);
update = trajectory tokens (prompt, sampled and retrieved) through forward + backward / update
seconds.

A smoke test, not a benchmark: it shows that the step runs, is finite and fits in memory. Its
tokens/s come from a single step each, and the update's from the first one, which also pays
one-time costs (AdamW allocating its states, first kernel launches and allocator growth), so
they understate steady-state speed; train.py's metrics.jsonl has the per-step times of a run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # train.py and searchlite live at the repo root

QWEN25_3B = dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                 rms_norm_eps=1e-6, max_position_embeddings=32768)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=3000, tie_word_embeddings=True, max_position_embeddings=4096)


def parse(argv=None) -> argparse.Namespace:
    from searchlite.config import HelpFormatter, at_least

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen2 on CPU (or --device): the testable path")
    ap.add_argument("--device", default="", help="default: cuda:$LOCAL_RANK (0), or cpu with --tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype the policy and the reference compute in; their weights are float32 (train.py's "
                         "--master_weights) unless --bf16_weights")
    ap.add_argument("--bf16_weights", action="store_true",
                    help="hold the weights themselves in --dtype (train.py's --master_weights false)")
    # None: not given, so the default below (--tiny's or the full one); a flag given always wins
    ap.add_argument("--questions", type=int, default=None, help="toy questions in the batch (default 8; --tiny: 2)")
    ap.add_argument("--group", type=at_least(2), default=None,
                    help="rollouts per question, at least 2: a group of 1 has zero advantages (default 5; --tiny: 2)")
    ap.add_argument("--max_new_tokens", type=int, default=None,
                    help="tokens sampled per turn (default 128; --tiny: 8)")
    ap.add_argument("--max_turns", type=int, default=2, help="search turns before the forced answer (default 2)")
    ap.add_argument("--micro_batch_size", type=int, default=8, help="trajectories per forward/backward (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random model's weights and of the sampling")
    args = ap.parse_args(argv)
    for name, full, tiny in (("questions", 8, 2), ("group", 5, 2), ("max_new_tokens", 128, 8)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    return args


def pick_device(args) -> torch.device:
    if args.device:
        device = torch.device(args.device)
    elif args.tiny:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"error: no CUDA device is visible to torch {torch.__version__} (CUDA build: "
                     f"{torch.version.cuda or 'none'}); use --tiny for the CPU path")
        if device.index is None:  # no --device, or --device cuda: this rank's GPU (set_device needs an index)
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)} ({device}), "
              f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB", flush=True)
    return device


class WordOverlapRetriever:
    """Stand-in for BM25 where bm25s is not installed: ranks passages by shared lowercase words."""

    def __init__(self, passages):
        self.passages = list(passages)
        self.words = [set(re.findall(r"\w+", f"{p.title} {p.text}".lower())) for p in self.passages]

    def search(self, queries: list[str], k: int):
        from searchlite.retrieval import Hit

        out = []
        for q in queries:
            terms = set(re.findall(r"\w+", q.lower()))
            scores = [len(terms & w) for w in self.words]
            top = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
            out.append([Hit(self.passages[i].id, self.passages[i].title, self.passages[i].text, float(scores[i]))
                        for i in top])
        return out


def toy_retriever(corpus: str):
    from searchlite.retrieval import build_retriever

    try:
        return build_retriever("bm25", corpus), "bm25"
    except ImportError as e:
        from searchlite.data import read_corpus

        print(f"note: BM25 unavailable ({e}); using a word-overlap search over the toy corpus", flush=True)
        return WordOverlapRetriever(read_corpus(corpus)), "word overlap"


def random_qwen(shape: dict, tokenizer, dtype: torch.dtype, device: torch.device):
    """A randomly initialised Qwen2 of `shape`, created in `dtype` directly on `device`, sampling
    only ids the tokenizer has."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=None)
    if cfg.vocab_size < len(tokenizer):
        raise ValueError(f"model vocabulary {cfg.vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.suppress_tokens = list(range(len(tokenizer), cfg.vocab_size))  # ids without text
    return model


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def main(argv=None) -> dict:
    import transformers

    args = parse(argv)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), "
          f"transformers {transformers.__version__}", flush=True)
    device = pick_device(args)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)

    import train
    from searchlite.advantages import broadcast, group_advantages
    from searchlite.config import Config, resolve_path
    from searchlite.data import read_qa
    from searchlite.memory import on_device
    from searchlite.models import compute_in, frozen_copy, load_tokenizer, make_optimizer
    from searchlite.protocol import get_protocol
    from searchlite.rollout import rollout
    from searchlite.sampler import HFSampler

    # ------------------------------------------------------------------ model, world
    cfg = Config(algo="grpo", group=args.group, batch_size=args.questions, micro_batch_size=args.micro_batch_size,
                 max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, lr=1e-6, kl_coef=0.001,
                 temperature=1.0, template="toy", dtype=args.dtype, grad_checkpointing=True, seed=args.seed)
    tokenizer = load_tokenizer(cfg.model)
    t0 = sync(device)
    policy = random_qwen(TINY if args.tiny else QWEN25_3B, tokenizer, dtype if args.bf16_weights else torch.float32,
                         device)
    if not args.bf16_weights:
        compute_in(policy, args.dtype)  # float32 master weights computing in --dtype, as train.py keeps them
    policy.gradient_checkpointing_enable()
    policy.config.use_cache = False  # as models.load_policy does; generate still caches (generation_config)
    n_params = sum(p.numel() for p in policy.parameters())
    ref = frozen_copy(policy)
    opt, _ = make_optimizer(policy.parameters(), cfg.lr, cfg.weight_decay, 0, cfg.optimizer)
    held = args.dtype if args.bf16_weights else f"float32 computing in {args.dtype}"
    print(f"model: random Qwen2, {n_params / 1e6:,.1f}M parameters in {held}, gradient checkpointing, "
          f"built in {sync(device) - t0:.1f}s", flush=True)
    retriever, how = toy_retriever(resolve_path(cfg.corpus))
    protocol = get_protocol(cfg.protocol, cfg.template)
    qa = read_qa(resolve_path(cfg.train_data))[:args.questions]
    questions = [q for q in qa for _ in range(args.group)]  # a question's group adjacent
    sampler = HFSampler(policy, tokenizer, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                        seed=cfg.seed)
    sampler.generate([tokenizer("warm up")["input_ids"]], max_new_tokens=2)  # CUDA context, kernels: not timed

    # ------------------------------------------------------------------ rollout
    policy.eval()
    t0 = sync(device)
    ro = rollout(sampler, retriever, tokenizer, protocol, [q.question for q in questions], max_turns=cfg.max_turns,
                 topk=cfg.topk, max_obs_tokens=cfg.max_obs_tokens, max_len=cfg.max_len, chat_template=cfg.chat_template)
    t_rollout = sync(device) - t0
    sampled = int(ro.loss_mask.sum())
    if int(ro.input_ids.max()) >= len(tokenizer):
        raise RuntimeError("the sampler produced ids the tokenizer does not have: suppress_tokens was ignored")
    print(f"rollout: {len(ro)} trajectories ({len(qa)} questions x {args.group}), {sampled} sampled tokens, "
          f"{int(ro.attention_mask.sum())} in all, {float(ro.searches.float().mean()):.2f} searches each "
          f"({how}), {t_rollout:.1f}s", flush=True)

    # ------------------------------------------------------------------ old / reference log-probs
    t0 = sync(device)
    on_policy = train.one_step_on_policy(cfg, len(ro))  # as train.py: no scoring pass for the old log-probs
    score = dict(size=cfg.micro_batch_size, device=device, temperature=cfg.temperature,
                 max_tokens=cfg.micro_batch_tokens)  # as train.py scores
    old_logp = None if on_policy else train.score_tokens(policy, ro, **score)  # (N, T)
    ref_logp = train.score_tokens(ref, ro, **score)  # (N, T)
    t_score = sync(device) - t0
    print(f"scoring: {'reference' if on_policy else 'old + reference'} log-probs, {t_score:.1f}s", flush=True)

    # ------------------------------------------------------------------ advantages, update
    rewards = torch.arange(len(ro)).remainder(2).float()  # (N,) 0, 1, 0, 1: mixed groups (see docstring)
    adv = broadcast(group_advantages(rewards, args.group), ro.loss_mask.float())  # (N, T)
    policy.train()
    t0 = sync(device)
    stats = train.update(cfg, 0, policy, opt, ro, old_logp, ref_logp, adv, device)
    t_update = sync(device) - t0
    update_tokens = int(ro.attention_mask.sum()) * cfg.ppo_epochs
    loss, grad_norm = sum(stats["loss"]), stats["grad_norm"][-1]
    if not (math.isfinite(loss) and math.isfinite(grad_norm) and grad_norm > 0):
        raise FloatingPointError(f"update: loss {loss}, grad norm {grad_norm}")
    print(f"update: loss {loss:.4f}, grad norm {grad_norm:.3f}, {update_tokens} tokens, {t_update:.1f}s", flush=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

    # ------------------------------------------------------------------ reference offload
    if device.type == "cpu":
        print("reference offload: not checked on CPU (the reference is there already: nothing moves)")
    else:
        ref.to("cpu")  # --ref_offload's path: kept in CPU memory, moved to the device only to score
        t0 = sync(device)
        with on_device(ref, device, enabled=True):
            offloaded = train.score_tokens(ref, ro, **score)  # (N, T)
        t_offload = sync(device) - t0
        diff = float((offloaded - ref_logp).abs().max())
        if diff > 0:
            raise RuntimeError(f"the reference scored after a CPU round trip differs (max |diff| {diff:.3g})")
        print(f"reference offload: identical log-probs after a CPU round trip ({t_offload:.1f}s with the moves)")

    result = {"params_b": n_params / 1e9, "trajectories": len(ro), "sampled_tokens": sampled,
              "update_tokens": update_tokens, "rollout_tok_s": sampled / t_rollout,
              "update_tok_s": update_tokens / t_update, "loss": loss, "peak_gib": peak}
    print(f"rollout tokens/s: {result['rollout_tok_s']:,.0f}")
    print(f"update tokens/s:  {result['update_tok_s']:,.0f}")
    print("(smoke-test figures from a single step each, the update's the cold first one: not a benchmark)")
    if peak is not None:
        print(f"peak GPU memory:  {peak:.1f} GiB allocated over rollout, scoring and update (policy, gradients, "
              f"AdamW states, reference, activations); {torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB "
              "reserved")
    print("result: " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
