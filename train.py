"""Train a policy to reason and search with RL: PPO, GRPO or REINFORCE++.

    python train.py --algo grpo --group 5            # the embedded toy world, on a CPU
    python train.py --preset toy-ppo                 # presets live in configs.toml
    python train.py --preset toy-r1pp                # R1-Searcher++ stage 2 (stage 1: searchlite/r1pp.py)
    python train.py --help                           # every setting, with its meaning
    torchrun --nproc_per_node 8 train.py --preset P  # several processes: searchlite/distributed.py

The loop, top to bottom: config -> data and retriever -> models -> for each step: sample questions -> rollouts
(Search-R1's Algorithm 1, a question's `group` samples adjacent) -> rewards (exact match,
or R1-Searcher++'s format + cover-EM + group reward) -> memorization data (R1-Searcher++,
when mem_coef > 0) -> old / reference log-probs (and values) -> advantages -> `ppo_epochs`
over mini-batches -> log -> checkpoint. The three algorithms differ only where marked
`if cfg.algo == ...`. All math lives in searchlite/advantages.py and searchlite/losses.py;
what R1-Searcher++ adds, in searchlite/r1pp.py. Under torchrun each rank runs this loop on its
share of the questions; the few lines marked `dist.` split, reduce and gather (how and why:
searchlite/distributed.py), and rank 0 alone prints and writes files.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from searchlite import distributed as dist
from searchlite.advantages import broadcast, gae, group_advantages, ppo_token_rewards, reinforce_pp_advantages
from searchlite.config import (ConfigError, check_config, format_config, parse_args, plain_warnings, resolve_path,
                               save_config, to_dict)
from searchlite.data import DataError, json_line, read_log, read_qa, write_jsonl
from searchlite.evaluation import score_qa, summarize
from searchlite.losses import aggregate, kl_penalty, masked_entropy, policy_loss, value_loss
from searchlite.memory import LoRAReference, add_lora, check_levers, lora_target_names, on_device
from searchlite.model_spec import weights_digest
from searchlite.models import (Critic, GracefulStop, find_checkpoint, frozen_copy, interrupted_status, load_policy,
                               load_trainer_state, lock_run, make_optimizer, model_tokenizer, pick_device,
                               reuse_freed_memory, rng_state, save_checkpoint, set_aside, set_rng_state,
                               trained_logprobs)
from searchlite.protocol import get_protocol
from searchlite.r1pp import memorization_backward, memorization_batch, reward_terms, rewrite_template
from searchlite.retrieval import config_retriever
from searchlite.rewards import exact_match
from searchlite.rollout import rollout
from searchlite.sampler import HFSampler
from searchlite.vllm_sampler import SharedVLLMSampler, VLLMSampler


def micro_batches(n: int, size: int, lengths=None, max_tokens: int = 0):
    """Row index lists of at most `size` rows covering range(n). With `lengths` (n,) the rows go
    shortest first: a micro-batch is cut to its longest row (`trim`), so rows of like length
    together carry little padding (a toy step's forward passes ran 2.6x the real tokens, 1.5x so).
    With `max_tokens` too, a micro-batch also holds at most that many tokens, padding included
    (rows x its longest row; a longer row goes alone), so short rows go many to a pass and long
    ones few (verl's dynamic batch size)."""
    size = size or n
    if lengths is None:
        return [list(range(s, min(s + size, n))) for s in range(0, n, size)]
    lengths = torch.as_tensor(lengths)
    out = []
    for i in torch.argsort(lengths, stable=True).tolist():  # shortest first: the new row is the longest
        if not out or len(out[-1]) == size or max_tokens and (len(out[-1]) + 1) * int(lengths[i]) > max_tokens:
            out.append([])
        out[-1].append(i)
    return out


def passes(n: int, size: int, lengths, max_tokens: int = 0) -> list:
    """`micro_batches` of this rank's rows, as many on every rank: under torchrun each forward and
    backward is a collective (DDP, FSDP2), so a rank whose token budget made fewer micro-batches
    than another's splits its largest ones in two until it has as many."""
    out = micro_batches(n, size, lengths, max_tokens)
    if not max_tokens:
        return out  # rows alone: every rank holds as many rows, so as many micro-batches
    want = dist.all_max(len(out))
    while len(out) < want:  # want <= n rows, so some micro-batch has two rows or more
        big = max(range(len(out)), key=lambda i: len(out[i]))
        rows = out.pop(big)
        out[big:big] = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    return out


def trim(ro, rows):
    """input_ids, attention_mask, loss_mask of `rows`, cut to their longest real length."""
    width = int(ro.attention_mask[rows].sum(1).max())
    return ro.input_ids[rows, :width], ro.attention_mask[rows, :width], ro.loss_mask[rows, :width]


def mini_batches(cfg, n: int) -> list:
    """Row index lists of the optimizer steps over this rank's `n` rollouts (mini_batch_size counts
    all ranks' rows; 0 = the whole batch in one step)."""
    return micro_batches(n, cfg.mini_batch_size // dist.world())


def one_step_on_policy(cfg, n: int) -> bool:
    """GRPO that takes one optimizer step a batch (one epoch, one mini-batch): the policy it updates
    is the one that sampled, so the update's own forward gives the old log-probs (the ratio is 1,
    as in verl's on-policy case) and a scoring pass over the batch is saved. PPO and REINFORCE++
    need them before the update: their KL penalty is in the reward."""
    return cfg.algo == "grpo" and cfg.ppo_epochs == 1 and len(mini_batches(cfg, n)) == 1


@torch.no_grad()
def score_tokens(model, ro, size: int, device, values: bool = False, temperature: float = 1.0,
                 max_tokens: int = 0) -> torch.Tensor:
    """Per-token log-probs (or critic values) of every rollout row, (N, T), in micro-batches.
    Log-probs are those of the distribution the sampler drew from: logits / `temperature`, at the
    loss_mask tokens (0 elsewhere: no loss reads them, `trained_logprobs`). Micro-batches: `size`
    rows and `max_tokens` tokens at most."""
    out = torch.zeros(ro.input_ids.shape, dtype=torch.float32)  # (N, T)
    for rows in passes(len(ro), size, ro.attention_mask.sum(1), max_tokens):
        ids, attn, lm = trim(ro, rows)
        ids, attn = ids.to(device), attn.to(device)
        if values:
            v = model(ids, attn)  # (b, t) value of the state after each token
            out[rows, 1:ids.shape[1]] = v[:, :-1].cpu()  # aligned with logp: V(prefix before token t)
        else:
            out[rows, :ids.shape[1]] = trained_logprobs(model, ids, attn, lm, temperature)[0].cpu()
    return out


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def batch_questions(qa: list, step: int, batch_size: int, seed: int) -> list:
    """The questions of `step`: epochs are seeded permutations, so any step is recomputable (exact resume)."""
    ks = range(step * batch_size, (step + 1) * batch_size)
    return [qa[epoch_order(len(qa), seed, k // len(qa))[k % len(qa)]] for k in ks]


# Settings a resumed run must share with its checkpoint: the optimizer, schedule and LoRA adapter
# restored from it keep their own, so a change would be ignored, and the data order follows the seed
# and batch_size (step k's questions start at k x batch_size: another size would skip or repeat some).
RESUME_FIXED = ("algo", "seed", "batch_size", "optimizer", "lr", "weight_decay", "warmup_steps")
RESUME_FIXED_PPO = ("critic_lr", "critic_warmup_steps")  # only a critic's optimizer keeps these
RESUME_FIXED_LORA = ("lora_rank", "lora_alpha", "lora_targets")  # only an adapter keeps these


RESUME_FREE = ("resume", "steps", "out_dir")  # expected to differ on a resume: not worth a note


def check_resume(cfg, digest: dict | None = None) -> list[str]:
    """A ConfigError if --resume would continue a checkpoint trained with other RESUME_FIXED settings,
    or from a --model whose weights changed since (`digest`: model_spec.weights_digest); else the
    other settings this run changes, "name: old -> new", for a note (they apply from here on)."""
    ckpt = find_checkpoint(cfg.out_dir) if cfg.resume else None
    if ckpt is None:
        return []
    try:
        state = load_trainer_state(ckpt, mmap=True)
    except (RuntimeError, EOFError, OSError) as e:  # a file damaged outside (saves are whole or not at all)
        raise ConfigError(f"--resume: {ckpt / 'trainer.pt'} cannot be read ({str(e).splitlines()[0]}); resume "
                          "from a copy of the folder, or rerun without --resume to start over") from None
    for part in ("policy", "critic") if (ckpt / "critic").exists() else ("policy",):
        if not any((ckpt / part).glob("*.safetensors")):  # deleted or lost outside: was transformers' traceback
            raise ConfigError(f"--resume: {ckpt / part} holds no weights (no *.safetensors file); resume from a copy "
                              "of the folder, or rerun without --resume to start over")
    saved = state["config"]
    if "master_weights" not in saved and saved.get("dtype") != "float32":  # saved before the field: bf16 weights
        saved = {**saved, "master_weights": False}  # so a resume names the change (twice the weight memory)
    keys = RESUME_FIXED + RESUME_FIXED_PPO * (cfg.algo == "ppo") + RESUME_FIXED_LORA * bool(cfg.lora_rank)
    norm = lambda k, v: sorted(lora_target_names(v)) if k == "lora_targets" else v  # noqa: E731
    changed = [f"{k} = {saved[k]!r}, this run has {getattr(cfg, k)!r}" for k in keys
               if k in saved and norm(k, saved[k]) != norm(k, getattr(cfg, k))]
    if changed:
        raise ConfigError(f"--resume: {ckpt} was trained with {'; '.join(changed)}; its optimizer, schedule, "
                          "adapter and data order keep the checkpoint's, so resume with those settings, or start a "
                          "new --out_dir")
    before = state.get("model_digest")
    if before is not None and digest is not None and before != digest and saved.get("model") == cfg.model:
        files = sorted(n for n in before.keys() | digest.keys() if before.get(n) != digest.get(n))
        raise ConfigError(f"--resume: --model {cfg.model} is not the model {ckpt}'s run started from (changed since: "
                          f"{', '.join(files)}); the KL reference, a LoRA's base and R1-Searcher++'s rewrite model "
                          "come from it. Put that model back (a rerun of stage 1 keeps it as model.previous), or "
                          "start a new --out_dir")
    return [f"{k}: {saved[k]!r} -> {v!r}" for k, v in to_dict(cfg).items()
            if k in saved and k not in RESUME_FREE + keys and saved[k] != v]


PREVIOUS_RUN = ("config.json", "metrics.jsonl", "eval", "trajectories")  # with the checkpoint: set aside


def compute_rewards(ro, questions) -> torch.Tensor:
    """Search-R1's outcome reward: exact match of the final answer, nothing for format. (N,)"""
    return torch.tensor([exact_match(a, q.answers) for a, q in zip(ro.answers, questions)])


def check_finite(step: int, **values) -> None:
    """A FloatingPointError naming the first of `values` (numbers, tensors or lists of 0-d tensors)
    that holds a NaN or an infinity. Under torchrun every rank raises when one does (a collective,
    so every rank calls it at the same points): a rank that went on alone would wait in the next
    collective for one that has stopped."""
    bad = None
    for name, v in values.items():
        if isinstance(v, list) and not v:
            continue
        v = torch.stack(v) if isinstance(v, list) else torch.as_tensor(v)
        if not torch.isfinite(v).all():
            bad = f"{name} is not finite ({v.flatten()[:4].tolist()}...)"
            break
    if dist.all_max(bad is not None):
        raise FloatingPointError(f"step {step}: {bad or 'another process found a value that is not finite'}; "
                                 "the last good checkpoint is kept, nothing was saved for this step")


def update(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic=None, critic_opt=None,
           old_values=None, ret=None, mem=None) -> dict:
    """`ppo_epochs` passes of clipped policy loss (+ value loss) over mini-batches of the rollout.

    Each mini-batch is one optimizer step; its micro-batches accumulate gradients, weighted so
    their sum equals the mini-batch loss (memory does not grow with the batch). With `mem`
    (R1-Searcher++'s rewritten trajectories) and mem_coef > 0, each step also takes
    mem_coef * L_M over its share of them. `old_logp` None (`one_step_on_policy`) takes the old
    log-probs from each micro-batch's own forward, `ref_logp` None (no reference) the same for the
    KL. Returns lists of per-micro-batch statistics. Under torchrun `ro` is this rank's share
    and `policy` / `critic` the DDP or FSDP2 modules: a mini-batch is every rank's share of it,
    and the losses are normalised over all of them.
    """
    # statistics stay on the device (0-d tensors) until the end: a .item() per micro-batch would make
    # the host wait for the device each time; the host waits once an optimizer step, for the checks
    stats = {"loss": [], "kl": [], "clipfrac": [], "entropy": [], "vf_loss": [], "grad_norm": [], "mem_loss": []}
    minis = mini_batches(cfg, len(ro))
    use_mem = cfg.mem_coef > 0 and dist.all_max(int(mem is not None)) > 0  # torchrun: some rank has rewrites
    n_mem = len(mem) if mem is not None else 0
    mem_shares = [t.tolist() for t in torch.tensor_split(torch.arange(n_mem), len(minis))] if use_mem else []
    # what the loss averages over: policy tokens (token_mean) or sequences with one (seq_mean_token_mean)
    units = (lambda m: m.sum()) if cfg.loss_agg == "token_mean" else (lambda m: m.any(1).sum())  # noqa: E731
    for _ in range(cfg.ppo_epochs):
        for j, mini in enumerate(minis):
            # the mean over every rank's share of the mini-batch: DDP / FSDP2 average the ranks'
            # gradients, so each rank divides by all ranks' count over the world size
            n_units = max(1.0, dist.all_sum(float(units(ro.loss_mask[mini])))) / dist.world()
            losses, vfs = [], []  # this mini-batch's weighted losses, checked before its optimizer step
            for rows in passes(len(mini), cfg.micro_batch_size, ro.attention_mask[mini].sum(1), cfg.micro_batch_tokens):
                rows = [mini[r] for r in rows]
                ids, attn, lm = trim(ro, rows)
                t = ids.shape[1]
                ids, attn = ids.to(device), attn.to(device)
                # logits (n, V) only where the n trained tokens were drawn, `at` their places in (b, t)
                logp, logits, at = trained_logprobs(policy, ids, attn, lm, cfg.temperature)  # logp (b, t)
                lm = lm.float().to(device)
                # micro-batch losses are weighted so their sum is the mini-batch's loss
                weight = float(units(ro.loss_mask[rows])) / n_units  # counted on the host: no wait
                # old_logp None: one step on-policy (one_step_on_policy), the sampling policy is this one
                old = logp.detach() if old_logp is None else old_logp[rows, :t].to(device)
                pg, clipfrac = policy_loss(logp, old, adv[rows, :t].to(device), lm, cfg.clip_eps, cfg.loss_agg)
                # mean entropy of the policy tokens; with entropy_coef, a bonus that keeps sampling varied
                ent = aggregate(masked_entropy(logits if cfg.entropy_coef else logits.detach(), at, lm.shape,
                                               cfg.temperature), lm, cfg.loss_agg)
                loss = pg - cfg.entropy_coef * ent if cfg.entropy_coef else pg
                ref = logp.detach() if ref_logp is None else ref_logp[rows, :t].to(device)  # None: no reference
                kl = aggregate(kl_penalty(logp, ref, cfg.kl_kind), lm, cfg.loss_agg)
                if cfg.algo == "grpo" and cfg.kl_coef > 0:
                    loss = loss + cfg.kl_coef * kl  # GRPO: KL in the loss (k3), not in the reward
                (loss * weight).backward()  # a non-finite loss is caught before the optimizer step
                losses.append(loss.detach() * weight)
                stats["kl"].append(kl.detach() * weight)
                stats["clipfrac"].append(clipfrac * weight)
                stats["entropy"].append(ent.detach() * weight)
                if critic is not None:
                    values = critic(ids, attn)  # (b, t)
                    values = torch.cat([values.new_zeros(len(rows), 1), values[:, :-1]], 1)  # aligned with logp
                    vf, _ = value_loss(values, old_values[rows, :t].to(device), ret[rows, :t].to(device), lm,
                                       cfg.value_clip_eps, cfg.loss_agg)
                    (vf * weight).backward()
                    vfs.append(vf.detach() * weight)
            if use_mem:  # R1-Searcher++ §4.2.2: + mu * L_M (searchlite/r1pp.py)
                lm_loss = memorization_backward(policy, mem, mem_shares[j], cfg.mem_coef, cfg.micro_batch_size, device)
                if lm_loss is not None:  # None: no rewrite in this mini-batch (on any rank)
                    check_finite(step + 1, mem_loss=lm_loss)
                    stats["mem_loss"].append(lm_loss)
            check_finite(step + 1, loss=losses, value_loss=vfs)
            stats["loss"] += losses
            stats["vf_loss"] += vfs
            stats["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)))
            check_finite(step + 1, grad_norm=stats["grad_norm"][-1])
            opt.step()
            opt.zero_grad(set_to_none=True)
            if critic is not None:
                torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.grad_clip)
                critic_opt.step()
                critic_opt.zero_grad(set_to_none=True)
    return {k: torch.stack(v).tolist() if v and torch.is_tensor(v[0]) else v for k, v in stats.items()}


KEPT = "the last checkpoint, if there is one, is intact (--resume continues from it); nothing after it was saved"


def main(argv=None) -> None:
    with contextlib.ExitStack() as held:  # out_dir's lock, let go however the run ends (tests call main again)
        try:
            train(argv, held)
        except DataError as e:  # a corpus line first read by a search mid-run (a lazy corpus checks a sample at load)
            sys.exit(f"error: {e}\n{KEPT}")


def train(argv, held: contextlib.ExitStack) -> None:
    # ------------------------------------------------------------------ config
    try:
        cfg = parse_args(argv, about=__doc__.split("\n\n")[0])
        check_config(cfg)  # choices, counts, files and prompts, before anything is loaded
        check_levers(cfg)  # optimizer, LoRA and offload settings that cannot work (searchlite/memory.py)
        model_digest = weights_digest(cfg.model)  # the starting model's weights, kept in each checkpoint
        changes = check_resume(cfg, model_digest)  # --resume with a setting that the checkpoint's own would override
    except ConfigError as e:
        sys.exit(f"error: {e}")
    out = Path(cfg.out_dir)
    device = dist.init(pick_device(cfg.device))  # torchrun: join the process group; on GPU, cuda:LOCAL_RANK
    reuse_freed_memory(device)  # CPU: stop glibc unmapping and re-faulting the big logits blocks every pass
    try:
        dist.check_settings(cfg.batch_size, cfg.mini_batch_size, cfg.parallel, cfg.lora_rank, cfg.optimizer)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if dist.is_main():  # one run at a time in out_dir: two would mix their checkpoints and logs
        try:
            held.enter_context(lock_run(out))
        except ConfigError as e:
            sys.exit(f"error: {e}")
    found = find_checkpoint(out)
    # an earlier run's log with no checkpoint (stopped before its first save, or --steps 0): set aside, as one with it
    log_only = found is None and (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0 \
        and not (out / "checkpoint.previous").exists()  # (an earlier run set aside with its model: that set stays)
    earlier = found is not None and not cfg.resume or log_only  # an earlier run this one sets aside after step 0
    logged = []  # the rows a resume keeps (those up to its checkpoint), read now: a damaged line is named
    if cfg.resume and found and dist.is_main() and (out / "metrics.jsonl").exists():  # before the models load
        try:
            logged = read_log(out / "metrics.jsonl", cut=False)  # (a torn last line goes when it is rewritten)
        except DataError as e:
            sys.exit(f"error: {e}")
    if dist.is_main():  # under torchrun, rank 0 prints and writes every file
        print(f"config:\n{format_config(cfg)}", flush=True)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # ------------------------------------------------------------------ data, retriever, models
    # data and retriever first: a bad line (its file, line and field) or a retrieval server that does not
    # answer stops the run in seconds, not after a 3B model has loaded
    try:
        # a training set may repeat an id (merged from two); the test set's records are keyed by id, as evaluate.py's
        train_qa, test_qa = read_qa(resolve_path(cfg.train_data)), read_qa(resolve_path(cfg.test_data), unique_ids=True)
        for name, qa in (("train_data", train_qa), ("test_data", test_qa)):
            if not qa:
                raise DataError(f"--{name} {getattr(cfg, name)}: no questions in the file")
        retriever = config_retriever(cfg)
    except (DataError, ConfigError) as e:
        sys.exit(f"error: {e}")
    if cfg.eval_size:
        test_qa = test_qa[:cfg.eval_size]
    ckpt = found if cfg.resume else None  # resume: weights from the checkpoint, the rest below
    try:  # the first to reach the hub: a name it does not know (or no network) stops here, in one line
        tokenizer = model_tokenizer(cfg.model, cfg.tokenizer)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    # --master_weights: the weights that train in full (the policy without LoRA, the critic, and the reference,
    # which so computes as the policy does) are held in float32 and compute in --dtype (models.compute_in)
    master = cfg.master_weights and not cfg.lora_rank  # LoRA: a frozen base in --dtype, float32 adapters (peft)
    if cfg.lora_rank:  # the base model + a LoRA adapter: a new one, or the checkpoint's on resume
        policy = add_lora(load_policy(cfg.model, cfg.dtype, device, cfg.grad_checkpointing), cfg.lora_rank,
                          cfg.lora_alpha, cfg.lora_targets, adapter=ckpt / "policy" if ckpt else None)
    else:
        policy = load_policy(str(ckpt / "policy") if ckpt else cfg.model, cfg.dtype, device, cfg.grad_checkpointing,
                             master)
    ref = None
    if cfg.kl_coef > 0:  # the reference is always the starting model, also after a resume
        if cfg.lora_rank:  # the base model is the policy with its adapters disabled: no second copy
            ref = LoRAReference(policy)
        elif cfg.ref_offload:  # kept in CPU memory; it visits the device only to score
            ref = frozen_copy(load_policy(cfg.model, cfg.dtype, "cpu", master=master))
        else:
            ref = frozen_copy(load_policy(cfg.model, cfg.dtype, device, master=master) if ckpt else policy)
    critic = None
    if cfg.algo == "ppo":
        critic = Critic.from_pretrained(str(ckpt / "critic") if ckpt else cfg.model, cfg.dtype, device,
                                        cfg.grad_checkpointing, cfg.master_weights)
    # torchrun (searchlite/distributed.py): FSDP2 shards policy, critic and reference in place; DDP wraps
    # the trained models. update() trains through train_policy / train_critic; the rest uses the modules.
    parallel = dist.choose_parallel(policy, cfg.parallel)
    try:  # again, now that "auto" is resolved
        dist.check_settings(cfg.batch_size, cfg.mini_batch_size, parallel, cfg.lora_rank, cfg.optimizer)
    except ValueError as e:
        sys.exit(f"error: {e}")
    train_policy, train_critic = dist.wrap_model(policy, parallel, device), dist.wrap_model(critic, parallel, device)
    if ref is not None and not cfg.lora_rank:  # a LoRA reference is the policy itself
        dist.wrap_model(ref, parallel, device, offload=cfg.ref_offload)  # FSDP2 + ref_offload: shards kept on CPU
    opt, sched = make_optimizer(policy.parameters(), cfg.lr, cfg.weight_decay, cfg.warmup_steps, cfg.optimizer)
    critic_opt = critic_sched = None
    if critic is not None:
        critic_opt, critic_sched = make_optimizer(critic.parameters(), cfg.critic_lr, cfg.weight_decay,
                                                  cfg.critic_warmup_steps, cfg.optimizer)
    protocol = get_protocol(cfg.protocol, cfg.template)
    # each rank samples its own stream (rank 0's is cfg.seed), in numpy's seed range (vLLM seeds numpy with it)
    rank_seed = (cfg.seed + 1_000_003 * dist.rank()) % 2**32
    sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=rank_seed,
                    batch_size=cfg.gen_batch_size)
    if cfg.sampler == "hf":
        sampler = HFSampler(policy, tokenizer, **sampling)
    else:  # vLLM in this process, built from the starting model, then given the policy's weights
        try:
            sampler = VLLMSampler(cfg.model, cfg.tokenizer or None, dtype=cfg.dtype, **sampling)
        except ImportError as e:  # installed (check_config looked) but it does not import
            sys.exit(f"error: {e}")
        sampler.push_weights(policy)  # a resumed or LoRA policy is not cfg.model's weights (FSDP2: gathered per tensor)
    generator = policy if cfg.sampler == "hf" else None  # the module generation runs: vLLM holds its own copy
    rollout_kw = dict(max_turns=cfg.max_turns, topk=cfg.topk, max_obs_tokens=cfg.max_obs_tokens, max_len=cfg.max_len,
                      chat_template=cfg.chat_template)
    rewriter = None  # R1-Searcher++'s rewrite model: the starting (stage-1) policy, frozen (the reference if kept)
    if cfg.mem_coef > 0:
        fresh = ckpt or dist.is_sharded(policy)  # (a sharded policy cannot be copied)
        # without a reference it only samples: held in --dtype (no float32 copy on every rank), fresh or copied alike
        frozen = ref if ref is not None else frozen_copy(load_policy(cfg.model, cfg.dtype, device) if fresh else policy,
                                                         cfg.dtype)
        rewrite_seed = (cfg.seed + 1_000_003 * (dist.world() + dist.rank())) % 2**32  # past every rank's sampler's
        if cfg.sampler == "hf":
            rewriter = HFSampler(frozen, tokenizer, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                 top_p=cfg.top_p, seed=rewrite_seed, batch_size=cfg.gen_batch_size)
        else:  # the policy's engine, given the frozen weights for each step's rewrites: no second engine
            rewriter = SharedVLLMSampler(sampler, frozen, rewrite_seed)
        rewrite_prompt = rewrite_template(protocol, cfg.template)

    def evaluate(step: int) -> tuple[dict, list[dict]]:
        """Held-out EM and searches by question type, and each question's record (rank 0 saves them)."""
        with dist.gathered(generator):  # torchrun: each rank answers its share of the test questions
            _, records = score_qa(sampler, retriever, tokenizer, protocol, dist.shard(test_qa, even=False),
                                  batch_size=64, progress=dist.is_main(), **rollout_kw)
        records = [r for part in dist.gather_objects(records) for r in part]
        metrics = summarize(records)
        line = "  ".join(f"{k}: em {v['em']:.3f} searches {v['searches']:.2f}" for k, v in metrics.items())
        if dist.is_main():
            print(f"eval step {step}  {line}", flush=True)
        return metrics, records

    def save_eval(step: int, records: list[dict]) -> None:
        if dist.is_main():
            write_jsonl(out / "eval" / f"step_{step:06d}.jsonl", records)  # each answer, trajectory and passage

    start = 0
    if ckpt is not None:
        state = load_trainer_state(ckpt, mmap=True)  # each rank reads what it uses, not a copy of it all
        dist.load_optimizer_state(policy, opt, state["opt"])
        sched.load_state_dict(state["sched"])
        if critic is not None:
            dist.load_optimizer_state(critic, critic_opt, state["critic_opt"])
            critic_sched.load_state_dict(state["critic_sched"])
        sampler.load_state_dict(dist.this_rank(state["sampler"]))  # per-rank states: see the checkpoint below
        if rewriter is not None and "rewriter" in state:  # (a run resumed with --mem_coef newly on: a new one)
            rewriter.load_state_dict(dist.this_rank(state["rewriter"]))
        set_rng_state(dist.this_rank(state["rng"]))
        start = state["step"]
        if dist.is_main():
            print(f"resumed from {ckpt} at step {start}", flush=True)
            if changes:  # config.json now holds this run's settings; the checkpoint keeps the earlier steps'
                print(f"note: from step {start + 1} on, this run changes the checkpoint's settings: "
                      f"{'; '.join(changes)}", flush=True)
            if start >= cfg.steps:
                print(f"the checkpoint is already at step {start} of --steps {cfg.steps}: nothing to train "
                      "(a larger --steps trains on)", flush=True)
    elif cfg.resume and dist.is_main():
        aside = " (checkpoint.previous holds the run a fresh start set aside: to continue it, rename it and its " \
                "*.previous files back)" if (out / "checkpoint.previous").is_dir() else ""
        print(f"--resume: no checkpoint in {out}, starting fresh{aside}", flush=True)
    if earlier and dist.is_main():  # (a forgotten --resume): said before step 0's evaluation
        what = "a checkpoint" if found else "the metrics.jsonl, with no checkpoint,"
        print(f"note: {out} holds {what} of an earlier run; this run starts fresh"
              + " (--resume continues it instead)" * bool(found) + " and sets the earlier run aside after its step-0 "
              "evaluation (a Ctrl-C before then changes no file)", flush=True)
    first_eval = evaluate(0) if start == 0 else None  # before any file changes, as the note says
    if dist.is_main():  # only now that everything has loaded and step 0 is scored: a run stopped before changes no file
        if earlier:  # the earlier run is kept as *.previous, not replaced
            moved = set_aside(out, ((found.name,) if found else ()) + PREVIOUS_RUN)
            shutil.rmtree(out / "checkpoint.old", ignore_errors=True)  # an older copy that a save left behind
            print(f"note: the earlier run is kept: {', '.join(moved)}", flush=True)
        if start < cfg.steps or not start:  # a resume with nothing to train leaves the run's settings as they were
            save_config(cfg, out / "config.json")
        # metrics.jsonl holds this run alone: a resumed run keeps the rows up to its checkpoint
        write_jsonl(out / "metrics.jsonl", [r for r in logged if r["step"] <= start] if start else [])
        for path in [*out.glob("eval/step_*.jsonl"), *out.glob("trajectories/step*.html")]:  # and so do these:
            if (m := re.match(r"step_?(\d+)", path.name)) and int(m[1]) > start:  # past it: another run's policy
                path.unlink()
    metrics_file = open(out / "metrics.jsonl", "a") if dist.is_main() else None
    if first_eval is not None:
        save_eval(0, first_eval[1])
        if dist.is_main():
            metrics_file.write(json_line({"step": 0, **{f"eval/{k}": v for k, v in first_eval[0].items()}}))
            metrics_file.flush()

    # Ctrl-C: the step finishes, is checkpointed, and the run stops (a second Ctrl-C: at once)
    with GracefulStop(announce=dist.is_main()) as stop:
        for step in range(start, cfg.steps):
            t0 = time.time()
            # -------------------------------------------------------------- rollouts
            # torchrun: each rank rolls out its share of the questions, a question's group whole on one rank
            questions = [q for q in dist.shard(batch_questions(train_qa, step, cfg.batch_size, cfg.seed))
                         for _ in range(cfg.group)]
            policy.eval()
            if critic is not None:
                critic.eval()
            with dist.gathered(generator):
                ro = rollout(sampler, retriever, tokenizer, protocol, [q.question for q in questions],
                             mask_retrieved=cfg.mask_retrieved, progress=dist.is_main(), **rollout_kw)
            t_rollout = time.time() - t0
            sampler.release()  # vLLM frees its KV cache while the trainer works (GPU sleep mode); HFSampler: nothing

            # -------------------------------------------------------------- rewards
            em = compute_rewards(ro, questions)  # (N,) exact match: Search-R1's reward, and logged for every run
            terms = {}
            if cfg.reward == "r1pp":  # R1-Searcher++ §4.2.1: R_format (0 / -2) + R_answer (cover-EM) + R_group
                terms = reward_terms(ro, questions, protocol, cfg.group, cfg.eta, cfg.group_reward,
                                     cfg.group_sigma)  # each (N,)
                scores = terms["format"] + terms["answer"] + terms["group"]  # (N,)
            else:
                scores = em
            check_finite(step + 1, reward=scores)

            # -------------------------------------------------------------- memorization data (R1-Searcher++ §4.2.2)
            mem, mem_tried = None, 0  # internal-only rewrites of what the correct rollouts retrieved
            t2 = time.time()
            if rewriter is not None:  # (vLLM pushes a sharded model tensor by tensor: nothing to gather first)
                with dist.gathered(rewriter.model if cfg.sampler == "hf" else None), \
                        on_device(rewriter.model, device, cfg.ref_offload):
                    rewriter.push_weights(rewriter.model)  # vLLM: into the policy's engine, until the next push
                    mem, mem_tried = memorization_batch(rewriter, tokenizer, protocol, rewrite_prompt, ro, questions,
                                                        cfg.chat_template)
                    rewriter.release()
            t_rewrite = time.time() - t2

            # -------------------------------------------------------------- old / reference log-probs, values
            mask = ro.loss_mask.float()  # (N, T)
            old_logp = (None if one_step_on_policy(cfg, len(ro))  # GRPO's single step takes them from its forward
                        else score_tokens(policy, ro, cfg.micro_batch_size, device, temperature=cfg.temperature,
                                          max_tokens=cfg.micro_batch_tokens))
            with on_device(ref, device, cfg.ref_offload):  # ref_offload: the reference visits the device to score
                ref_logp = (score_tokens(ref, ro, cfg.micro_batch_size, device, temperature=cfg.temperature,
                                         max_tokens=cfg.micro_batch_tokens)
                            if ref is not None else old_logp)  # (N, T); None: GRPO's single step, no reference
            dist.release(ref)  # FSDP2: the root's gathered weights, which only a backward would free

            # -------------------------------------------------------------- advantages
            old_values = ret = None  # PPO only
            if cfg.algo in ("ppo", "reinforce_pp"):  # per-token KL of the sampled tokens, for the reward
                kl_tok = kl_penalty(old_logp, ref_logp, "k1") * mask  # (N, T)
            if cfg.algo == "ppo":
                old_values = score_tokens(critic, ro, cfg.micro_batch_size, device, values=True,
                                          max_tokens=cfg.micro_batch_tokens)  # (N, T)
                rewards = ppo_token_rewards(scores, kl_tok, mask, cfg.kl_coef)  # (N, T) KL in the reward
                adv, ret = gae(rewards, old_values, mask, cfg.gamma, cfg.lam, whiten=dist.masked_whiten)  # (N, T)
            elif cfg.algo == "grpo":  # torchrun: all ranks' scores, as group = 1's baseline is the whole batch's mean
                adv = broadcast(dist.local_rows(group_advantages(dist.gather_rows(scores), cfg.group)), mask)  # (N, T)
            elif cfg.algo == "reinforce_pp":
                adv = reinforce_pp_advantages(scores, kl_tok, mask, cfg.kl_coef, cfg.gamma, whiten=dist.masked_whiten)
            else:
                sys.exit(f"error: unknown --algo {cfg.algo!r} (valid: grpo, ppo, reinforce_pp)")

            # -------------------------------------------------------------- update
            policy.train()  # and the critic: transformers recomputes (--grad_checkpointing) only in training mode
            if critic is not None:
                critic.train()
            stats = update(cfg, step, train_policy, opt, ro, old_logp, ref_logp, adv, device, train_critic, critic_opt,
                           old_values, ret, mem)
            lr = sched.get_last_lr()[0]  # the rate this step trained at (warm-up: before the schedule moves on)
            sched.step()
            if critic is not None:
                critic_sched.step()
            t1 = time.time()
            sampler.push_weights(policy)  # vLLM: copy the new weights in; HFSampler generates with policy itself
            t_push = time.time() - t1

            # -------------------------------------------------------------- log
            # means over all ranks' trajectories; rank-summed loss statistics (normalised as in update())
            n_mini = len(stats["grad_norm"])  # optimizer steps
            row = {
                "step": step + 1, "reward": dist.mean(scores), "em": dist.mean(em),
                **{f"r_{k}": dist.mean(v) for k, v in terms.items()},
                "searches": dist.mean(ro.searches), "turns": dist.mean(ro.turns), "answered": dist.mean(ro.answered),
                "response_len": dist.mean(ro.loss_mask.sum(1)),
                **{k: dist.all_mean(sum(v)) / n_mini for k, v in stats.items()
                   if v and k not in ("grad_norm", "mem_loss")},
                "grad_norm": float(np.mean(stats["grad_norm"])), "lr": lr,
                "t_rollout": t_rollout, "t_push": t_push, "seconds": time.time() - t0,
            }
            if rewriter is not None:
                n_kept = len(mem) if mem is not None else 0
                row |= {"mem_tried": int(dist.all_sum(mem_tried)), "mem_kept": int(dist.all_sum(n_kept)),
                        "mem_loss": dist.all_mean(float(np.mean(stats["mem_loss"]))) if stats["mem_loss"] else None,
                        "t_rewrite": t_rewrite}  # seconds the rewrites took (vLLM: the push of the frozen model too)
            if dist.is_main():  # the step's line, then its evaluation's
                print(f"step {step + 1:4d} | reward {row['reward']:.3f} | em {row['em']:.3f} "
                      f"| searches {row['searches']:.2f} | turns {row['turns']:.2f} | len {row['response_len']:5.1f} "
                      f"| kl {row['kl']:.4f} | clip {row['clipfrac']:.3f} | ent {row['entropy']:.3f} "
                      f"| lr {row['lr']:.2e} "
                      f"| {row['seconds']:.1f}s", flush=True)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                scores_by_type, records = evaluate(step + 1)
                save_eval(step + 1, records)
                row.update({f"eval/{k}": v for k, v in scores_by_type.items()})
            if dist.is_main():
                metrics_file.write(json_line(row))
                metrics_file.flush()
            if cfg.log_trajectories_every and (step + 1) % cfg.log_trajectories_every == 0 and dist.is_main():
                from searchlite.view import write_html

                write_html(out / "trajectories" / f"step{step + 1:05d}.html", ro, tokenizer, scores.tolist(),
                           [q.answers for q in questions], title=f"step {step + 1}", limit=8)
                if mem is not None:
                    write_html(out / "trajectories" / f"step{step + 1:05d}-memorization.html", mem, tokenizer,
                               [1.0] * len(mem), [[a] for a in mem.answers], title=f"step {step + 1}: rewrites",
                               limit=8)

            # -------------------------------------------------------------- checkpoint
            # torchrun: a signal to any rank stops every rank after the same step (a preempted node's alone)
            signum = dist.all_max(stop.signum)
            stopping = signum > 0
            if cfg.save_every and (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or stopping:
                # torchrun: every rank takes part (FSDP2 gathers optimizer state and weights; sampler and RNG
                # states differ per rank, so rank 0 keeps each rank's), rank 0 writes
                state = {"step": step + 1, "opt": dist.optimizer_state(policy, opt), "sched": sched.state_dict(),
                         "rng": dist.per_rank(rng_state()), "sampler": dist.per_rank(sampler.state_dict()),
                         "config": to_dict(cfg), "model_digest": model_digest}
                if critic is not None:
                    state |= {"critic_opt": dist.optimizer_state(critic, critic_opt),
                              "critic_sched": critic_sched.state_dict()}
                if rewriter is not None:
                    state["rewriter"] = dist.per_rank(rewriter.state_dict())
                policy_weights, critic_weights = dist.full_state_dict(policy), dist.full_state_dict(critic)
                if dist.is_main():
                    save_checkpoint(out, policy, tokenizer, state, critic, policy_weights, critic_weights)
                dist.barrier()
            if stopping:
                if dist.is_main():
                    elsewhere = "" if stop.requested else f" (another process got {signal.Signals(signum).name})"
                    print(f"stopped after step {step + 1}{elsewhere}, checkpoint saved: rerun with --resume to "
                          "continue", flush=True)
                stop.adopt(signum)  # a rank the signal did not reach ends as the one it reached: no "done", 128 + it
                break
    if dist.is_main():
        metrics_file.close()
        if not stop.requested and find_checkpoint(out) is None:  # --steps 0: an evaluation only
            print(f"done: nothing trained, so no model saved; {out / 'metrics.jsonl'} and {out / 'eval'} hold the "
                  f"step-0 evaluation of {cfg.model}", flush=True)
        elif not stop.requested:
            print(f"done: {out / 'checkpoint' / 'policy'} holds the step-{max(start, cfg.steps)} model, "
                  f"{out / 'metrics.jsonl'} its log (python evaluate.py --model {out})", flush=True)
    sampler.close()  # vLLM: the engine shuts down before the process group it uses is destroyed
    dist.close()
    stop.exit_if_requested()  # 130 after Ctrl-C: a script running train.py stops too


if __name__ == "__main__":
    plain_warnings(__file__)
    try:
        main()
    except KeyboardInterrupt as e:  # Ctrl-C before the training loop, or a second signal inside it
        sys.stderr.write(f"\ninterrupted: {KEPT}\n")
        sys.exit(interrupted_status(e))  # 130, or 143 after a second SIGTERM
