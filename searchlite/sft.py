"""Supervised fine-tuning on trajectories, with retrieved tokens masked out of the loss.

    losses = sft(model, ro.input_ids, ro.loss_mask, epochs=2, lr=3e-3, batch_size=32)

The loss is the mean negative log-likelihood over tokens with `loss_mask == 1` (the tokens
the writer of the trajectory produced), so the model learns to search, read and answer but
never to reproduce retrieved passages (R1-Searcher++ §4.1, its SFT loss masks external
knowledge). Used for the toy world's warm start (searchlite.warmstart) and for R1-Searcher++
stage 1 on rejection-sampled trajectories. Batches are rows of a right-padded (N, T)
tensor, shuffled by a seeded generator, grouped by length within pools of 64 batches (so
little compute goes to padding) and cut to their longest row; `micro_batch_size` splits a
batch into forward/backward passes (gradient accumulation) with the same loss. AdamW; its
learning rate is a linear warm-up times a cosine decay that starts at step 0 (not after the
warm-up): with warm-up 20, a 3,000-step run peaks at 0.9999 x lr, a 40-step run at 0.56 x lr.
Left out on purpose: packing, LoRA (see memory.py).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from tqdm import tqdm

from .config import ConfigError
from .data import write_durably
from .losses import token_logprobs
from .models import autocast, rng_state, set_rng_state


def sft_loss(model, input_ids, loss_mask, attention_mask=None, tokens: float | None = None) -> torch.Tensor:
    """Mean NLL over loss_mask tokens of one batch; input_ids/loss_mask (B, T). `tokens`: divide
    the sum by this count instead (a micro-batch's share of its whole batch's mean)."""
    # the LM head over whole rows (not models.trained_logprobs): the shipped warm start and stage 1
    # were trained so, and skipping the prompt's columns moves their sums by float rounding
    with autocast(model):  # float32 master weights computing in bf16 (models.compute_in); else nothing
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    logp = token_logprobs(logits, input_ids)  # (B, T)
    mask = loss_mask.float()
    return -(logp * mask).sum() / (mask.sum().clamp(min=1.0) if tokens is None else tokens)


def length_batches(lengths: torch.Tensor, batch_size: int, gen: torch.Generator, pool: int = 64) -> list:
    """Shuffled batches of row indices, rows of similar length together (sorted within pools)."""
    order = torch.randperm(len(lengths), generator=gen)
    batches = []
    for s in range(0, len(order), batch_size * pool):
        chunk = order[s:s + batch_size * pool]
        chunk = chunk[torch.argsort(lengths[chunk], stable=True)]
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def sft(model, input_ids, loss_mask, *, attention_mask=None, epochs: int = 1, lr: float = 1e-3,
        batch_size: int = 32, micro_batch_size: int = 0, warmup: int = 20, weight_decay: float = 0.0,
        grad_clip: float = 1.0, seed: int = 0, progress: bool = True, state_path=None, stop=None,
        run: dict | None = None, flags: dict | None = None) -> list[float]:
    """Train `model` in place on the (N, T) rows; returns the loss of every step so far.

    With `state_path`, the training state (weights, optimizer, schedule, step, losses, RNG) is
    saved there at the end of each epoch and when `stop.requested` turns true (a GracefulStop:
    the step finishes, is saved, and sft returns early); a call that finds a state there starts
    after its last step, and ends as an uninterrupted call would. `run`: the caller's settings
    that a resume must share too (flags that change the rows or the result), checked with sft's own;
    `flags`: the caller's flag for each of sft's own settings that it sets otherwise (lr: --sft_lr),
    named where a resume is refused, None for one it derives from a flag in `run`."""
    n = input_ids.shape[0]
    if n == 0:
        raise ValueError("sft: no rows to train on")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():  # a row cut to its batch's width would lose its end
        raise ValueError("sft: rows must be right-padded (attention_mask 1s, then 0s); left-padded rows were given")
    lengths = attention_mask.sum(1)  # (N,)
    device = next(model.parameters()).device
    steps = epochs * math.ceil(n / batch_size)
    # for-loop AdamW (CPU's default; foreach, CUDA's, holds sqrt(v) of every weight at once in its step:
    # 30 GB more for a 7B model, which stage 1 trains in one process)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    rows = hashlib.sha1(input_ids.cpu().numpy().tobytes() + loss_mask.cpu().numpy().tobytes()).hexdigest()[:16]
    settings = dict(rows=n, data=rows, epochs=epochs, lr=lr, batch_size=batch_size, warmup=warmup,  # a resume
                    weight_decay=weight_decay, grad_clip=grad_clip, seed=seed, **(run or {}))  # continues one run
    losses = []
    if state_path is not None and Path(state_path).exists():
        losses = load_state(state_path, model, opt, sched, settings, flags)
    done = len(losses)  # steps taken before a resume
    if done:
        print(f"--resume: {state_path} holds {done} of the {steps} SFT steps", flush=True)
    model.train()
    bar = tqdm(total=steps, initial=done, desc="sft", disable=not progress)
    for epoch in range(epochs):
        batches = length_batches(lengths, batch_size, gen)  # drawn every epoch, also one already done
        for step, rows in enumerate(batches, epoch * len(batches)):
            if step < done:
                continue
            tokens = float(loss_mask[rows].sum().clamp(min=1))  # the batch's: each micro-batch adds its share
            loss = 0.0
            for part in torch.split(rows, micro_batch_size or len(rows)):
                width = int(lengths[part].max())
                part_loss = sft_loss(model, input_ids[part, :width].to(device), loss_mask[part, :width].to(device),
                                     attention_mask[part, :width].to(device), tokens)
                part_loss.backward()
                loss += part_loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if stop is not None and stop.requested:
                break
        if state_path is not None and len(losses) > max(done, epoch * len(batches)):  # it trained this epoch
            save_state(state_path, model, opt, sched, losses, settings)  # at the epoch's end, or where it stopped
        if stop is not None and stop.requested:
            break
    bar.close()
    return losses


def save_state(path, model, opt, sched, losses: list[float], settings: dict) -> None:
    """Everything `sft` needs to continue, written whole over `path` (`write_durably`)."""
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "losses": losses,
             "rng": rng_state(), "settings": settings}
    write_durably(path, lambda f: torch.save(state, f))


def load_state(path, model, opt, sched, settings: dict, flags: dict | None = None) -> list[float]:
    """Restore what `save_state` wrote; a ConfigError if it was saved by an SFT with other settings,
    each named by its flag (`flags`: sft's names to the caller's; the rows' count and hash as such)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    keys = [k for k, v in state["settings"].items() if settings.get(k) != v]
    names = {"rows": None, "data": None} | (flags or {})
    changed = [f"{names.get(k, k)} = {state['settings'][k]}, this one has {settings.get(k)}" for k in keys
               if names.get(k, k) is not None]
    if {"rows", "data"} & set(keys):  # built from other data, or with a flag that shapes the rows
        changed.append("other rows to train on")
    if keys:
        raise ConfigError(f"{path}: saved by a run with {'; '.join(changed) or 'other settings'}; resume with its "
                          "settings, or rerun without --resume to start over")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    set_rng_state(state["rng"])
    return state["losses"]
