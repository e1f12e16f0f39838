"""Advantages for PPO (GAE), GRPO (group-normalised) and REINFORCE++ (whitened returns).

Pure functions on tensors, all under `torch.no_grad()`. `train.py` calls one of them after
the rewards, with `scores` the (B,) per-trajectory reward and `loss_mask` the (B, T) mask
(1 = token sampled by the policy):

    PPO          adv, ret = gae(ppo_token_rewards(scores, kl, loss_mask, kl_coef),
                                values, loss_mask, gamma, lam, whiten=masked_whiten)
    GRPO         adv = broadcast(group_advantages(scores, group), loss_mask)
    REINFORCE++  adv = reinforce_pp_advantages(scores, kl, loss_mask, kl_coef, gamma)

Time steps are policy tokens only: a prompt, retrieved passage, injected message or pad
token is not a step, so inserting any number of them changes no advantage (Search-R1 §3.1's
loss masking). Every returned (B, T) tensor is 0 where `loss_mask == 0`.

Left out on purpose: verl's UUID-keyed grouping (a question's `group` rollouts are adjacent,
so `scores.view(-1, group)`), RLOO / ReMax / Dr.GRPO variants, and adaptive KL control.

>>> mask = torch.tensor([[1, 1, 0, 1, 0]])          # 3 policy tokens, one retrieved, one pad
>>> place_on_last_token(torch.tensor([2.0]), mask)
tensor([[0., 0., 0., 2., 0.]])
"""

import torch

from searchlite.losses import masked_whiten


@torch.no_grad()
def gae(rewards, values, loss_mask, gamma: float, lam: float, whiten=None):
    """Generalised advantage estimation over policy tokens (Schulman et al. 2016, eq. 16).

    delta_t = r_t + gamma * V(next policy token) - V_t,  A_t = delta_t + gamma * lam * A_next,
    where "next" is the next position with loss_mask == 1 in the same row (V = 0, A = 0
    after the last one). Rewards and values at masked positions are ignored entirely.
    Returns (adv, ret), both (B, T), with ret = adv + values (the lambda-return, the
    critic's target); both are 0 where loss_mask == 0. With `whiten` (`losses.masked_whiten`;
    under torchrun `distributed.masked_whiten`) the advantages, not the returns, are then
    whitened over every policy token of the batch, as verl's `compute_gae_advantage_return`
    does in Search-R1's PPO: the policy's step size no longer depends on the reward's scale.
    (verl whitens over every response token, retrieved ones included, with the n - 1
    variance; here retrieved tokens are no time steps, and the variance is the population's.)

    >>> r = torch.tensor([[0.0, 0.0, 1.0]]); v = torch.tensor([[0.5, 0.5, 0.5]])
    >>> gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)[0]   # = total reward - V_t
    tensor([[0.5000, 0.5000, 0.5000]])
    """
    mask = loss_mask.bool()  # (B, T)
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=values.dtype, device=values.device)  # (B, T)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)  # (B,) V at next policy token
    next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)  # (B,) A at next policy token
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        a = delta + gamma * lam * next_adv  # (B,)
        m = mask[:, t]  # (B,)
        # A masked position is not a step: it writes nothing and carries "next" through.
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
    ret = torch.where(mask, adv + values, torch.zeros_like(adv))  # (B, T)
    return (whiten(adv, loss_mask) if whiten is not None else adv), ret


@torch.no_grad()
def group_advantages(scores, group: int, eps: float = 1e-6, norm_std: bool = True):
    """GRPO outcome advantage (DeepSeekMath §4.1.2; Search-R1 §3.1), one per trajectory.

    `scores` (N,) with N = B * group and each question's rollouts adjacent, so row i of
    `scores.view(-1, group)` is question i. adv = (r - mean_g) / (std_g + eps), with the
    unbiased std (torch.std's default), as verl's GRPO does; `norm_std=False` drops the
    division (Dr.GRPO). A group whose rewards are all equal gets exactly 0, not a
    rounding residue. `group == 1` is REINFORCE with a batch-mean baseline,
    adv = r - mean(r) over the batch, no std division (Search-R1 Table 8; verl's GRPO gives a
    group of one no baseline at all, adv = r).
    Returns (N,); spread it to tokens with `broadcast`.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), group=3)
    tensor([ 1.1547, -0.5773, -0.5773, -1.1547,  0.5773,  0.5773])
    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group=1)
    tensor([ 0.5000, -0.5000, -0.5000,  0.5000])
    """
    if group < 1 or scores.numel() % group:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group}")
    if group == 1:
        g = scores.view(1, -1)  # (1, N): the whole batch is the baseline's group
    else:
        g = scores.view(-1, group)  # (B, group)
    adv = g - g.mean(dim=1, keepdim=True)  # (B, group)
    if group > 1 and norm_std:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    # mean() of equal floats can miss them in the last bit, and std is then ~1e-8, so the
    # quotient is not small (seven rewards of 0.7 in fp32 give 0.056 each): force zeros.
    same = (g == g[:, :1]).all(dim=1, keepdim=True)  # (B, 1)
    adv = torch.where(same, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def broadcast(adv_seq, loss_mask):
    """Spread a (B,) per-trajectory advantage to its policy tokens: (B, T), 0 elsewhere.

    >>> broadcast(torch.tensor([2.0, -1.0]), torch.tensor([[1, 0, 1], [0, 1, 1]]))
    tensor([[ 2.,  0.,  2.],
            [ 0., -1., -1.]])
    """
    adv = adv_seq.unsqueeze(1).expand(loss_mask.shape)  # (B, T)
    return torch.where(loss_mask.bool(), adv, torch.zeros_like(adv))


def place_on_last_token(scores, loss_mask):
    """A (B, T) tensor with scores[b] on row b's last policy token and 0 elsewhere.

    The last policy token is the last position with loss_mask == 1 (the `</answer>` or
    EOS the policy wrote), not the last non-pad token, which may be injected text. A row
    without policy tokens gets nothing.
    """
    mask = loss_mask.bool()  # (B, T)
    B, T = mask.shape
    pos = torch.arange(T, device=mask.device).expand(B, T)  # (B, T)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(dim=1).values  # (B,)
    out = torch.zeros(B, T, dtype=scores.dtype, device=scores.device)  # (B, T)
    has = last >= 0  # (B,)
    out[has, last[has]] = scores[has]
    return out


def ppo_token_rewards(scores, kl, loss_mask, kl_coef: float):
    """Per-token PPO reward: -kl_coef * kl_t on policy tokens + the score on the last one.

    Search-R1's PPO keeps the KL to the reference in the reward (k1, `kl` from
    `losses.kl_penalty(old_logp, ref_logp, "k1")`), as in InstructGPT / verl.
    `scores` (B,), `kl` and `loss_mask` (B, T) -> (B, T).

    >>> ppo_token_rewards(torch.tensor([1.0]), torch.tensor([[2.0, 5.0, 4.0]]),
    ...                   torch.tensor([[1, 0, 1]]), kl_coef=0.1)
    tensor([[-0.2000,  0.0000,  0.6000]])
    """
    mask = loss_mask.bool()  # (B, T)
    penalty = torch.where(mask, -kl_coef * kl, torch.zeros_like(kl))  # (B, T)
    return penalty + place_on_last_token(scores, loss_mask)


@torch.no_grad()
def reinforce_pp_advantages(scores, kl, loss_mask, kl_coef: float, gamma: float = 1.0, eps: float = 1e-8,
                            whiten=masked_whiten):
    """REINFORCE++ advantages (R1-Searcher++ eq. 1-2; OpenRLHF), (B, T).

    r_t = -kl_coef * kl_t on policy tokens, plus the trajectory's score (B,) on its last
    policy token (eq. 1); G_t = r_t + gamma * G_next, the return-to-go over policy tokens
    only; then whitened over every policy token of the whole batch (eq. 2): masked mean
    and population std, as OpenRLHF does. No critic, no group baseline. `whiten` is
    `losses.masked_whiten`; under torchrun, `distributed.masked_whiten`, whose mean and std
    span the tokens of every rank's share of the batch.
    """
    rewards = ppo_token_rewards(scores, kl, loss_mask, kl_coef)  # (B, T)
    # With V = 0 and lam = 1, GAE's advantage is exactly the masked return-to-go.
    ret, _ = gae(rewards, torch.zeros_like(rewards), loss_mask, gamma=gamma, lam=1.0)  # (B, T)
    return whiten(ret, loss_mask, eps=eps)
