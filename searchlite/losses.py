"""Token log-probs, masked reductions, PPO policy / value losses and KL estimators.

Pure functions on tensors. `train.py` gets `logp` from `models.trained_logprobs` (the LM head
run only where a trained token is predicted, `picked_logprobs` of its output) and feeds
`logp`, `old_logp`, `ref_logp`, `adv` and `loss_mask` (all `(B, T)`) to `policy_loss`,
`kl_penalty` and `aggregate`.

Alignment, used everywhere: position t of every `(B, T)` tensor is about token
`input_ids[:, t]`. `logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`, and
`loss_mask[:, t] = 1` when the policy sampled `input_ids[:, t]`. Position 0 has no
prediction (logp 0). So the logits that produce `logp[:, t]` sit at `logits[:, t - 1]`.

All losses use only positions with `loss_mask == 1` (Search-R1 §3.1, retrieved-token
masking): masked entries are selected away with `torch.where`, so whatever sits there
(retrieved text, padding, even inf) changes neither the loss nor any gradient.

Left out on purpose: dual-clip PPO, asymmetric (clip-higher) ranges, the k2 estimator,
entropy bonus weighting and loss scaling across micro-batches (the caller owns those).
`picked_logprobs` and `masked_entropy` take the head's output at the trained positions only
(`models.trained_logprobs`), cheap to train on.

>>> logits = torch.zeros(1, 3, 4)            # uniform over 4 tokens
>>> token_logprobs(logits, torch.tensor([[0, 1, 2]]))
tensor([[ 0.0000, -1.3863, -1.3863]])
"""

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) for every position; position 0 gets 0.

    `logits` (B, T, V) come straight from `model(input_ids)`; `logits[:, t]` predicts
    token t + 1. Computed as gathered logit minus logsumexp, one row at a time in (at least) fp32,
    so peak extra memory is one (T, V) row, never a full (B, T, V) log_softmax copy. With
    gradients, a bf16 row's fp32 copy is made again in backward (torch.utils.checkpoint) instead
    of kept for it: 9.3 GiB for a 3B run's micro-batch of 8 x 2,048 tokens over Qwen's 151,936
    words. fp32 logits need no copy, and the values and gradients are the same either way.
    """
    B, T, _ = logits.shape
    logp = logits.new_zeros(B, T, dtype=torch.promote_types(logits.dtype, torch.float32))  # (B, T)
    recompute = logits.requires_grad and logits.dtype != logp.dtype
    for b in range(B):
        if recompute:
            from torch.utils.checkpoint import checkpoint

            logp[b, 1:] = checkpoint(_row_logprobs, logits[b, :-1], input_ids[b, 1:], use_reentrant=False)
        else:
            logp[b, 1:] = _row_logprobs(logits[b, :-1], input_ids[b, 1:])
    return logp


def _row_logprobs(row: torch.Tensor, target: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of `target` (T-1,) under one row of logits (T-1, V) that predicts tokens 1..T-1,
    divided by `temperature` after the upcast (bf16 logits divided in bf16 lose ~0.04 nats)."""
    row = row.to(torch.promote_types(row.dtype, torch.float32))  # (T-1, V), bf16 in at least fp32
    if temperature != 1.0:
        row = row / temperature
    picked = row.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (T-1,)
    return picked - torch.logsumexp(row, dim=-1)


def picked_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                    chunk: int = 1024) -> torch.Tensor:
    """log p(target[i]) under each row of `logits` (n, V) / `temperature`: the head's output at the
    n positions that predicted a trained token (`models.trained_logprobs`), `chunk` rows at a
    time in (at least) fp32, where the temperature divides them (the sampler's distribution:
    HF and vLLM divide in fp32 too). With gradients, a bf16 chunk's fp32 copy is made again in
    backward, as in `token_logprobs`. With n = 0 the empty result still hangs on the graph, so a
    micro-batch without a trained token backpropagates zeros (DDP and FSDP2 ranks stay in step).

    >>> picked_logprobs(torch.zeros(2, 4), torch.tensor([0, 3]))   # uniform over 4: log 1/4
    tensor([-1.3863, -1.3863])
    """
    recompute = logits.requires_grad and logits.dtype != torch.promote_types(logits.dtype, torch.float32)
    return _by_chunks(_row_logprobs, chunk, recompute, logits, target, temperature=temperature)


def masked_entropy(logits: torch.Tensor, at: tuple, shape, temperature: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """Entropy of the distribution that drew each trained token, (B, T) = `shape`, 0 elsewhere.
    `logits` (n, V) are the head's output at the n positions that predicted them and `at` =
    (rows, cols) the tokens' places (`models.trained_logprobs`): with z_i = logits[i] /
    `temperature`, ent[rows[i], cols[i]] = logsumexp(z_i) - sum_v softmax(z_i)_v z_{i,v}, in (at
    least) fp32. With gradients (an entropy bonus), each `chunk` is computed again in backward
    (torch.utils.checkpoint), so what is kept for backward is the logits alone, not two fp32
    copies of every distribution (18.5 GiB for a 3B run's micro-batch of 8 x 2,048 tokens over
    Qwen's 151,936 words).

    >>> masked_entropy(torch.zeros(1, 4), (torch.tensor([0]), torch.tensor([2])), (1, 3))  # uniform: log 4
    tensor([[0.0000, 0.0000, 1.3863]])
    """
    ent = torch.zeros(shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    return ent.index_put(at, _by_chunks(_entropy_rows, chunk, logits.requires_grad, logits, temperature=temperature))


def _by_chunks(fn, chunk: int, recompute: bool, *rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """fn(rows[i:i + chunk] of each of `rows`, temperature), concatenated; with `recompute`, each chunk is
    computed again in backward (torch.utils.checkpoint) instead of keeping its fp32 copies. With no row
    it runs once on the empty ones, so the result still hangs on the graph."""
    from torch.utils.checkpoint import checkpoint

    parts = []
    for i in range(0, max(1, len(rows[0])), chunk):
        args = [r[i:i + chunk] for r in rows]
        parts.append(checkpoint(fn, *args, temperature, use_reentrant=False) if recompute else fn(*args, temperature))
    return torch.cat(parts)


def _entropy_rows(z: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # (n, V), bf16 in at least fp32
    if temperature != 1.0:
        z = z / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over entries where the 0/1 `mask` is set; an empty mask gives 0.

    >>> masked_mean(torch.tensor([1.0, 2.0, 100.0]), torch.tensor([1, 1, 0]))
    tensor(1.5000)
    """
    m = mask.bool()  # same shape as x
    # where, not x * m: a NaN/inf at a masked position must not leak in (0 * inf = NaN).
    picked = torch.where(m, x, torch.zeros_like(x))  # same shape as x
    if dim is None:
        return picked.sum() / m.sum().clamp(min=1)
    return picked.sum(dim) / m.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries; 0 where mask == 0.

    mean and (population) variance are over every masked entry of the whole tensor, as
    OpenRLHF whitens REINFORCE++ advantages (R1-Searcher++ eq. 2).

    >>> masked_whiten(torch.tensor([[1.0, 5.0, 7.0]]), torch.tensor([[1, 1, 0]]))  # mean 3, variance 4
    tensor([[-1.,  1.,  0.]])
    """
    xd = x.double()  # in float32 the mean of equal values can miss them by an ulp, which / sqrt(eps) magnifies
    mean = masked_mean(xd, mask)  # ()
    var = masked_mean((xd - mean) ** 2, mask)  # ()
    out = ((xd - mean) * torch.rsqrt(var + eps)).to(x.dtype)  # same shape as x
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def aggregate(loss_tok: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar over policy tokens.

    "token_mean": sum(l * m) / sum(m) over the whole batch — every token weighs the same
    (Search-R1 / verl default; train.update keeps it exact over a mini-batch's micro-batches,
    where verl averages their means). "seq_mean_token_mean": mean over sequences of each
    sequence's token mean — every sequence weighs the same (R1-Searcher++ / OpenRLHF);
    sequences without any policy token are left out of that mean.

    >>> l = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> aggregate(l, m, "token_mean"), aggregate(l, m, "seq_mean_token_mean")
    (tensor(1.7500), tensor(2.5000))
    """
    if mode == "token_mean":
        return masked_mean(loss_tok, loss_mask)
    if mode == "seq_mean_token_mean":
        per_seq = masked_mean(loss_tok, loss_mask, dim=-1)  # (B,)
        has_tokens = loss_mask.bool().any(dim=-1)  # (B,)
        return masked_mean(per_seq, has_tokens)
    raise ValueError(f"unknown aggregation mode {mode!r}: use 'token_mean' or 'seq_mean_token_mean'")


def policy_loss(logp, old_logp, adv, loss_mask, clip_eps: float, mode: str = "token_mean"):
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), negated to minimise.

    loss_t = -min(ratio_t * A_t, clip(ratio_t, 1 - clip_eps, 1 + clip_eps) * A_t) with
    ratio_t = exp(logp_t - old_logp_t). Returns (loss, clipfrac): clipfrac is the fraction
    of policy tokens where the clipped term is the smaller one, i.e. gets no gradient, averaged as
    the loss is (`mode`), so train.update's micro-batch weights sum it to the mini-batch's.
    All inputs (B, T); `adv` is already broadcast to tokens.

    >>> z = torch.zeros(1, 3)
    >>> policy_loss(z, z, torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]), 0.2)
    (tensor(-1.5000), tensor(0.))
    """
    m = loss_mask.bool()  # (B, T)
    # Neutralise masked positions before exp: a pad filler in old_logp would give
    # ratio = inf there, and 0 * inf = NaN in the backward pass, straight into the model.
    log_ratio = torch.where(m, logp - old_logp, torch.zeros_like(logp))  # (B, T)
    adv = torch.where(m, adv, torch.zeros_like(adv))  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    surr = ratio * adv  # (B, T)
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv  # (B, T)
    loss_tok = -torch.minimum(surr, surr_clipped)  # (B, T)
    clipfrac = aggregate((surr_clipped < surr).float(), loss_mask, mode)
    return aggregate(loss_tok, loss_mask, mode), clipfrac.detach()


def value_loss(values, old_values, ret, loss_mask, clip_eps: float, mode: str = "token_mean"):
    """Clipped value loss, 0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2).

    As in OpenAI baselines' PPO2 and verl's `compute_value_loss`: the critic may not move
    more than `clip_eps` from the values it had at rollout time without paying for it.
    Returns (loss, clipfrac); all inputs (B, T).

    >>> v = torch.tensor([[1.0, 0.0]]); m = torch.ones(1, 2)
    >>> value_loss(v, v, torch.tensor([[3.0, 0.0]]), m, 0.2)
    (tensor(1.), tensor(0.))
    """
    m = loss_mask.bool()  # (B, T)
    # Same reason as in policy_loss: garbage targets at masked positions must not reach
    # the backward pass (0 * inf = NaN).
    ret = torch.where(m, ret, torch.zeros_like(ret))  # (B, T)
    old_values = torch.where(m, old_values, torch.zeros_like(old_values))  # (B, T)
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)  # (B, T)
    err = (values - ret) ** 2  # (B, T)
    err_clipped = (v_clipped - ret) ** 2  # (B, T)
    loss_tok = 0.5 * torch.maximum(err, err_clipped)  # (B, T)
    clipfrac = masked_mean((err_clipped > err).float(), loss_mask)
    return aggregate(loss_tok, loss_mask, mode), clipfrac.detach()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs, (B, T).

    Estimators from http://joschu.net/blog/kl-approx.html, with x ~ pi and
    log r = ref_logp - logp:
      "k1": -log r = logp - ref_logp. Unbiased, high variance, can be negative. Search-R1's
            PPO folds it into the per-token reward.
      "k3": r - log r - 1 >= 0. Unbiased, low variance; verl's "low_var_kl", used in the
            GRPO loss. As verl does, log r is clamped to [-20, 20] before exp (exp(20) is
            finite in fp32 and bf16, so no inf and no NaN gradient), and the result is
            clamped to [-10, 10].

    >>> kl_penalty(torch.tensor([0.0]), torch.tensor([-1.0]), "k1")
    tensor([1.])
    >>> kl_penalty(torch.tensor([0.0]), torch.tensor([0.0]), "k3")
    tensor([0.])
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k3":
        log_ratio = torch.clamp(ref_logp - logp, -20.0, 20.0)  # (B, T)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}: use 'k1' or 'k3'")
