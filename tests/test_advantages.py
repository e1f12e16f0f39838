"""Advantages against hand-derived values and naive per-row reference loops."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchlite.advantages import (
    broadcast,
    gae,
    group_advantages,
    place_on_last_token,
    ppo_token_rewards,
    reinforce_pp_advantages,
)
from searchlite.losses import masked_whiten

ATOL = 1e-6
f64 = torch.float64


def naive_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE on each row's policy tokens only, scattered back to (B, T)."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=f64)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        r = [float(rewards[b, t]) for t in idx]
        v = [float(values[b, t]) for t in idx] + [0.0]
        a_next = 0.0
        for k in reversed(range(len(idx))):
            delta = r[k] + gamma * v[k + 1] - v[k]
            a_next = delta + gamma * lam * a_next
            adv[b, idx[k]] = a_next
    return adv


def random_batch(gen, B=3, T=12, p_mask=0.6):
    rewards = torch.randn(B, T, generator=gen, dtype=f64)  # (B, T)
    values = torch.randn(B, T, generator=gen, dtype=f64)  # (B, T)
    mask = (torch.rand(B, T, generator=gen) < p_mask).to(f64)  # (B, T)
    return rewards, values, mask


# --- GAE ---------------------------------------------------------------------------


def test_gae_hand_gamma_lam_one():
    # r = [0, 0, 1], V = [0.2, 0.5, 0.9]; with gamma = lam = 1, A_t = sum_{k>=t} r_k - V_t
    # = [0.8, 0.5, 0.1], and ret = A + V = [1, 1, 1].
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=f64)
    v = torch.tensor([[0.2, 0.5, 0.9]], dtype=f64)
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.5, 0.1]], dtype=f64), atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]], dtype=f64), atol=ATOL, rtol=0)


def test_gae_hand_discounted():
    # gamma = 0.9, lam = 0.8 (gamma*lam = 0.72), r = [0, 0.5, 1], V = [0.2, 0.5, 0.9]:
    #   delta_2 = 1   + 0.9*0   - 0.9 = 0.1   A_2 = 0.1
    #   delta_1 = 0.5 + 0.9*0.9 - 0.5 = 0.81  A_1 = 0.81 + 0.72*0.1   = 0.882
    #   delta_0 = 0   + 0.9*0.5 - 0.2 = 0.25  A_0 = 0.25 + 0.72*0.882 = 0.88504
    #   ret = A + V = [1.08504, 1.382, 1.0]
    r = torch.tensor([[0.0, 0.5, 1.0]], dtype=f64)
    v = torch.tensor([[0.2, 0.5, 0.9]], dtype=f64)
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.88504, 0.882, 0.1]], dtype=f64), atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.08504, 1.382, 1.0]], dtype=f64), atol=ATOL, rtol=0)


def test_gae_hand_with_retrieved_tokens():
    # The discounted case again, with a 2-token retrieved block between policy tokens 0
    # and 1 and a pad at the end, carrying junk rewards and values: same numbers.
    r = torch.tensor([[0.0, 7.0, -3.0, 0.5, 1.0, 9.0]], dtype=f64)
    v = torch.tensor([[0.2, 5.0, -5.0, 0.5, 0.9, 4.0]], dtype=f64)
    m = torch.tensor([[1, 0, 0, 1, 1, 0]])
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    torch.testing.assert_close(
        adv, torch.tensor([[0.88504, 0, 0, 0.882, 0.1, 0]], dtype=f64), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        ret, torch.tensor([[1.08504, 0, 0, 1.382, 1.0, 0]], dtype=f64), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.95), (0.0, 0.5), (1.0, 0.0)])
@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_naive_loop(gamma, lam, seed):
    gen = torch.Generator().manual_seed(seed)
    r, v, m = random_batch(gen, B=4, T=15)
    adv, ret = gae(r, v, m, gamma, lam)
    ref = naive_gae(r, v, m, gamma, lam)
    torch.testing.assert_close(adv, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, (ref + v) * m, atol=ATOL, rtol=0)
    assert torch.all(adv[m == 0] == 0) and torch.all(ret[m == 0] == 0)


@pytest.mark.parametrize("seed", range(3))
def test_gae_whitens_the_advantages_not_the_returns(seed):
    """Whitened advantages over every policy token of the batch, the critic's target left as it
    was, as verl's compute_gae_advantage_return does in Search-R1's PPO (which also counts the
    retrieved tokens and takes the n - 1 variance)."""
    gen = torch.Generator().manual_seed(seed)
    r, v, m = random_batch(gen, B=4, T=15)
    adv, ret = gae(r, v, m, 0.9, 0.8, whiten=masked_whiten)
    ref = naive_gae(r, v, m, 0.9, 0.8)
    on = m.bool()
    mean, std = ref[on].mean(), ref[on].std(unbiased=False)  # population std over the batch's policy tokens
    torch.testing.assert_close(adv[on], (ref[on] - mean) / std, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, (ref + v) * m, atol=ATOL, rtol=0)
    assert torch.all(adv[~on] == 0)
    assert abs(float(adv[on].mean())) < 1e-9 and abs(float(adv[on].std(unbiased=False)) - 1) < 1e-6


@given(
    n_policy=st.integers(1, 8),
    inserts=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 4)), max_size=4),
    seed=st.integers(0, 2**31 - 1),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
@settings(max_examples=100, deadline=None)
def test_gae_inserting_masked_tokens_changes_nothing(n_policy, inserts, seed, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(n_policy, generator=gen, dtype=f64)  # (n,) policy tokens only
    v = torch.randn(n_policy, generator=gen, dtype=f64)  # (n,)
    adv0, ret0 = gae(r[None], v[None], torch.ones(1, n_policy), gamma, lam)
    # Build a longer row: masked blocks with junk rewards/values inserted anywhere.
    rows_r, rows_v, rows_m = list(r), list(v), [1.0] * n_policy
    for where, length in inserts:
        at = where % (len(rows_m) + 1)
        junk = (torch.randn(2, length, generator=gen, dtype=f64) * 100).tolist()
        rows_r[at:at] = junk[0]
        rows_v[at:at] = junk[1]
        rows_m[at:at] = [0.0] * length
    m = torch.tensor([rows_m], dtype=f64)
    adv, ret = gae(torch.tensor([rows_r], dtype=f64), torch.tensor([rows_v], dtype=f64), m, gamma, lam)
    keep = m[0].bool()
    assert torch.equal(adv[0, keep], adv0[0])  # bit-for-bit: masked tokens are not steps
    assert torch.equal(ret[0, keep], ret0[0])
    assert torch.all(adv[0, ~keep] == 0) and torch.all(ret[0, ~keep] == 0)


def test_gae_row_without_policy_tokens_is_zero():
    r = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=f64)
    v = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=f64)
    m = torch.tensor([[0, 0], [0, 1]])
    adv, ret = gae(r, v, m, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0], [0.0, 3.5]], dtype=f64), atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.0], [0.0, 4.0]], dtype=f64), atol=ATOL, rtol=0)


# --- group (GRPO) advantages -------------------------------------------------------


@pytest.mark.parametrize("value", [0.1, 0.3, 1 / 3, 0.7, -2.2, 1e-3, 0.0, 1.0])
@pytest.mark.parametrize("group", [2, 3, 5, 7])
def test_group_identical_rewards_give_exact_zero(value, group):
    scores = torch.cat([torch.full((group,), value), torch.tensor([0.0] * (group - 1) + [1.0])])
    adv = group_advantages(scores, group)
    assert torch.equal(adv[:group], torch.zeros(group))  # exactly 0, not 1e-9
    assert adv[group:].abs().sum() > 0  # the other group still carries signal
    assert torch.equal(group_advantages(torch.full((group,), value), group, norm_std=False), torch.zeros(group))


def test_group_hand_case_unbiased_std():
    # group [1, 0, 0]: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    # (population std would be sqrt(2/9): a different answer, 1.414 instead of 1.155).
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=f64)  # 2 questions, adjacent
    adv = group_advantages(scores, group=3)
    s = math.sqrt(1 / 3) + 1e-6
    expected = torch.tensor([2 / 3 / s, -1 / 3 / s, -1 / 3 / s, 1 / 3 / s, 1 / 3 / s, -2 / 3 / s], dtype=f64)
    torch.testing.assert_close(adv, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(adv[0], torch.tensor(2 / math.sqrt(3), dtype=f64), atol=1e-5, rtol=0)


def test_group_of_two_hand_case():
    # group [1, 0] (the smallest group, the test runs' --group 2): mean 1/2, unbiased std sqrt(2 (1/2)^2 / 1)
    # = 1/sqrt(2), so +-(1/2) / (1/sqrt(2)) = +-1/sqrt(2); [3, 3] is one value, 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=f64), group=2)
    s = 1 / math.sqrt(2) + 1e-6
    torch.testing.assert_close(adv, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0], dtype=f64), atol=ATOL, rtol=0)


def test_group_no_std():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=f64), 3, norm_std=False)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3], dtype=f64)
    torch.testing.assert_close(adv, expected, atol=ATOL, rtol=0)


def test_group_one_is_batch_mean_baseline():
    # REINFORCE (Search-R1 Table 8): r - mean(r) = r - 0.6, no std division.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=f64), group=1)
    torch.testing.assert_close(adv, torch.tensor([0.4, -0.6, -0.6, 0.4, 0.4], dtype=f64), atol=ATOL, rtol=0)
    assert torch.equal(group_advantages(torch.full((4,), 0.3), group=1), torch.zeros(4))


def test_group_bad_size():
    with pytest.raises(ValueError, match="5 scores do not split into groups of 2"):
        group_advantages(torch.zeros(5), group=2)
    with pytest.raises(ValueError, match="4 scores do not split into groups of 0"):
        group_advantages(torch.zeros(4), group=0)


def test_broadcast_and_place_on_last_token():
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    adv = broadcast(torch.tensor([2.0, -1.0, 5.0]), mask)
    torch.testing.assert_close(adv, torch.tensor([[2.0, 2, 0, 2, 0, 0], [0, -1, -1, -1, -1, 0], [0.0] * 6]))
    placed = place_on_last_token(torch.tensor([2.0, -1.0, 5.0]), mask)
    expected = torch.zeros(3, 6)
    expected[0, 3], expected[1, 4] = 2.0, -1.0  # last policy token, not last non-pad; row 2 empty
    assert torch.equal(placed, expected)


def test_ppo_token_rewards_hand():
    # kl_coef 0.1: -0.1*kl on policy tokens, +score on the last policy token (index 3).
    kl = torch.tensor([[2.0, 5.0, 1.0, 4.0, 8.0]])
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    got = ppo_token_rewards(torch.tensor([1.0]), kl, mask, kl_coef=0.1)
    torch.testing.assert_close(got, torch.tensor([[-0.2, 0.0, -0.1, 0.6, 0.0]]), atol=ATOL, rtol=0)


# --- REINFORCE++ -----------------------------------------------------------------


def naive_reinforce_pp(scores, kl, mask, kl_coef, gamma, eps=1e-8):
    B, T = mask.shape
    returns = torch.zeros(B, T, dtype=f64)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        r = [-kl_coef * float(kl[b, t]) for t in idx]
        if idx:
            r[-1] += float(scores[b])
        g = 0.0
        for k in reversed(range(len(idx))):
            g = r[k] + gamma * g
            returns[b, idx[k]] = g
    vals = returns[mask.bool()]
    mean = vals.mean()
    var = ((vals - mean) ** 2).mean()  # population variance, as OpenRLHF
    return torch.where(mask.bool(), (returns - mean) / torch.sqrt(var + eps), torch.zeros_like(returns))


def test_reinforce_pp_hand():
    # kl = 0, gamma = 1: returns over policy tokens are [1, 1 | 0]: mean 2/3, pop. var 2/9,
    # so the whitened advantages are [1/sqrt2, 1/sqrt2, -sqrt2] (up to eps).
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0], dtype=f64), torch.zeros(2, 3, dtype=f64), mask, 0.1)
    h = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[h, h, 0.0], [-2 * h, 0, 0]], dtype=f64), atol=ATOL, rtol=0)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seed", range(5))
def test_reinforce_pp_matches_naive_and_is_whitened(gamma, seed):
    gen = torch.Generator().manual_seed(seed)
    B, T = 6, 20
    scores = torch.randint(0, 2, (B,), generator=gen).to(f64)  # (B,)
    kl = torch.randn(B, T, generator=gen, dtype=f64).abs()  # (B, T)
    mask = (torch.rand(B, T, generator=gen) < 0.7).to(f64)  # (B, T)
    mask[:, 0] = 1  # every row has a policy token
    adv = reinforce_pp_advantages(scores, kl, mask, kl_coef=0.05, gamma=gamma)
    torch.testing.assert_close(adv, naive_reinforce_pp(scores, kl, mask, 0.05, gamma), atol=ATOL, rtol=0)
    vals = adv[mask.bool()]
    assert abs(vals.mean().item()) < ATOL
    assert abs(vals.std(unbiased=False).item() - 1.0) < ATOL
    assert torch.all(adv[mask == 0] == 0)


def test_place_on_last_token_at_position_zero():
    """A row whose only policy token sits at position 0 still gets its score there; a row without
    policy tokens gets nothing, and other rows are unaffected."""
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [0, 1, 1]])
    got = place_on_last_token(torch.tensor([2.0, 5.0, -1.0]), mask)
    assert torch.equal(got, torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -1.0]]))


def test_ppo_token_rewards_with_a_first_position_policy_token():
    """The per-token PPO reward of a one-token trajectory at position 0 is -kl_coef * kl + score."""
    got = ppo_token_rewards(torch.tensor([1.0]), torch.tensor([[0.5, 9.0]]), torch.tensor([[1, 0]]), kl_coef=0.2)
    assert torch.allclose(got, torch.tensor([[0.9, 0.0]]), atol=1e-6, rtol=0)
