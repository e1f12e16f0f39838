"""Supervised fine-tuning on trajectories, with retrieved tokens masked out of the loss.

    losses = sft(model, ro.input_ids, ro.loss_mask, epochs=2, lr=3e-3, batch_size=32)

The loss is the mean negative log-likelihood over tokens with `loss_mask == 1` (the tokens
the writer of the trajectory produced), so the model learns to search, read and answer but
never to reproduce retrieved passages (R1-Searcher++ §4.1, its SFT loss masks external
knowledge). Used for the toy world's warm start (searchlite.warmstart) and for R1-Searcher++
stage 1 on rejection-sampled trajectories. Batches are rows of a right-padded (N, T)
tensor, shuffled by a seeded generator, grouped by length within pools of 64 batches (so
little compute goes to padding) and cut to their longest row. AdamW with linear
warm-up and cosine decay. Left out on purpose: packing, LoRA (see models.py).
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from .losses import token_logprobs


def sft_loss(model, input_ids, loss_mask, attention_mask=None) -> torch.Tensor:
    """Mean NLL over loss_mask tokens of one batch; input_ids/loss_mask (B, T)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    logp = token_logprobs(logits, input_ids)  # (B, T)
    mask = loss_mask.float()
    return -(logp * mask).sum() / mask.sum().clamp(min=1.0)


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
        batch_size: int = 32, warmup: int = 20, weight_decay: float = 0.0, grad_clip: float = 1.0, seed: int = 0,
        progress: bool = True) -> list[float]:
    """Train `model` in place on the (N, T) rows; returns the loss of every step."""
    n = input_ids.shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    lengths = attention_mask.sum(1)  # (N,)
    device = next(model.parameters()).device
    steps = epochs * math.ceil(n / batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    bar = tqdm(total=steps, desc="sft", disable=not progress)
    for _ in range(epochs):
        for rows in length_batches(lengths, batch_size, gen):
            width = int(lengths[rows].max())
            ids = input_ids[rows, :width].to(device)
            loss = sft_loss(model, ids, loss_mask[rows, :width].to(device), attention_mask[rows, :width].to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    return losses
