"""Losses against naive references and hand numbers; masked tokens get no gradient."""

import math

import pytest
import torch

from searchlite.losses import (
    aggregate,
    kl_penalty,
    masked_entropy,
    picked_logprobs,
    masked_mean,
    masked_whiten,
    policy_loss,
    token_logprobs,
    value_loss,
)

ATOL = 1e-6
f64 = torch.float64


# --- log-probs and entropy ---------------------------------------------------------


def test_token_logprobs_matches_naive():
    gen = torch.Generator().manual_seed(0)
    B, T, V = 3, 7, 11
    logits = torch.randn(B, T, V, generator=gen, dtype=f64)  # (B, T, V)
    ids = torch.randint(0, V, (B, T), generator=gen)  # (B, T)
    logp = token_logprobs(logits, ids)
    ref = torch.zeros(B, T, dtype=f64)
    for b in range(B):
        for t in range(1, T):  # logits at t-1 predict token t
            ref[b, t] = torch.log_softmax(logits[b, t - 1], dim=-1)[ids[b, t]]
    assert logp.shape == (B, T)
    torch.testing.assert_close(logp.double(), ref, atol=ATOL, rtol=0)
    assert torch.all(logp[:, 0] == 0)


def test_token_logprobs_bf16_upcasts():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, 300, generator=gen) * 5).bfloat16()  # (B, T, V)
    ids = torch.randint(0, 300, (2, 5), generator=gen)
    logp = token_logprobs(logits, ids)
    assert logp.dtype == torch.float32
    ref = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp[:, 1:].double(), ref, atol=1e-5, rtol=0)


def test_token_logprobs_bf16_gradient_keeps_no_fp32_copy():
    """With gradients, bf16 rows are upcast again in backward: the same values and gradients as
    the plain path, and no (T, V) fp32 row kept per sequence for logsumexp's backward."""
    from searchlite.losses import _row_logprobs

    gen = torch.Generator().manual_seed(3)
    B, T, V = 3, 6, 500
    base = (torch.randn(B, T, V, generator=gen) * 4).bfloat16()
    ids = torch.randint(0, V, (B, T), generator=gen)
    w = torch.randn(B, T - 1, generator=gen)
    kept = []

    def keep(t):
        kept.append(t.numel() * t.element_size() if t.dtype == torch.float32 else 0)
        return t

    logits = base.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logp = token_logprobs(logits, ids)
    (logp[:, 1:] * w).sum().backward()
    ref_logits = base.clone().requires_grad_()  # the plain path: each row's fp32 copy kept for backward
    ref = torch.stack([_row_logprobs(ref_logits[b, :-1], ids[b, 1:]) for b in range(B)])
    (ref * w).sum().backward()
    assert torch.equal(logp[:, 1:], ref) and torch.equal(logits.grad, ref_logits.grad)
    assert sum(kept) < (T - 1) * V * 4  # less than one fp32 row in all (B rows of it before)


@pytest.mark.parametrize("dtype, passes", [(torch.bfloat16, 2), (torch.float32, 1)])
def test_only_bf16_logprobs_are_computed_again_in_backward(monkeypatch, dtype, passes):
    """With gradients, a bf16 row's (or chunk's) fp32 copy is made again in backward instead of
    kept (torch.utils.checkpoint: two passes of the log-softmax); fp32 logits need no copy, so
    they take one pass: per row in token_logprobs, per chunk in picked_logprobs, the update's path."""
    from searchlite import losses

    real, calls = losses._row_logprobs, []
    monkeypatch.setattr(losses, "_row_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 5, 40, generator=gen) * 3).to(dtype).requires_grad_()  # (B, T, V)
    token_logprobs(logits, torch.randint(0, 40, (2, 5), generator=gen))[:, 1:].sum().backward()
    assert len(calls) == 2 * passes and logits.grad.abs().sum() > 0
    calls.clear()
    rows = (torch.randn(10, 40, generator=gen) * 3).to(dtype).requires_grad_()  # (n, V): chunks of 4, 4, 2
    picked_logprobs(rows, torch.randint(0, 40, (10,), generator=gen), chunk=4).sum().backward()
    assert len(calls) == 3 * passes and rows.grad.abs().sum() > 0
    calls.clear()
    picked_logprobs(rows.detach(), torch.zeros(10, dtype=torch.long), chunk=4)  # no gradient: one pass
    assert len(calls) == 3


def entropy_at_mask(logits, mask, chunk: int = 1024):
    """masked_entropy from whole rows' logits (B, T, V), picked where a masked token is predicted
    as `models.trained_logprobs` picks them."""
    b, t = mask[:, 1:].nonzero(as_tuple=True)  # token t + 1 was drawn from logits[:, t]
    return masked_entropy(logits[b, t], (b, t + 1), mask.shape, chunk=chunk)


def test_picked_logprobs_match_token_logprobs_with_their_gradient():
    """On the picked positions, values and gradients equal token_logprobs' over whole rows, in
    fp64 and in bf16 (whose chunks are upcast again in backward), also over several chunks."""
    gen = torch.Generator().manual_seed(4)
    B, T, V = 3, 7, 50
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.rand(B, T, generator=gen) < 0.6).int()
    mask[:, 0] = 0
    b, t = mask[:, 1:].nonzero(as_tuple=True)
    w = torch.randn(len(b), generator=gen, dtype=f64)
    for dtype in (f64, torch.bfloat16):
        base = (torch.randn(B, T, V, generator=gen, dtype=f64) * 3).to(dtype)
        whole, picked = base.clone().requires_grad_(), base.clone().requires_grad_()
        want = token_logprobs(whole, ids)[b, t + 1]
        got = picked_logprobs(picked[b, t], ids[b, t + 1], chunk=4)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        (want * w.to(want.dtype)).sum().backward()
        (got * w.to(got.dtype)).sum().backward()
        torch.testing.assert_close(picked.grad, whole.grad, atol=ATOL, rtol=0)
        assert whole.grad.abs().sum() > 0
    assert picked_logprobs(torch.zeros(0, V), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_temperature_divides_bf16_logits_after_the_upcast():
    """log-probs and entropy at temperature 0.7 of bf16 logits are those of their fp32 values / 0.7
    (as HF and vLLM sample), not of the logits divided in bf16 (~0.04 nats off on average)."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(64, 300, generator=gen) * 4 + 10).bfloat16()  # (n, V), around 10 as a model's
    target = torch.randint(0, 300, (64,), generator=gen)
    exact = logits.double() / 0.7
    want = exact.gather(1, target[:, None])[:, 0] - exact.logsumexp(1)
    torch.testing.assert_close(picked_logprobs(logits, target, 0.7).double(), want, atol=1e-5, rtol=0)
    in_bf16 = picked_logprobs(logits / 0.7, target).double()
    assert (in_bf16 - want).abs().mean() > 1e-3  # the bf16 division this avoids
    rows = torch.arange(64)
    ent = masked_entropy(logits, (rows, torch.zeros(64, dtype=torch.long)), (64, 1), 0.7)[:, 0]
    torch.testing.assert_close(ent.double(), torch.distributions.Categorical(logits=exact).entropy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1024, 3, 2])  # 10 positions: one chunk; 3, 3, 3, 1; five of 2
def test_entropy_matches_categorical(chunk):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 9, generator=gen, dtype=f64) * 3  # (B, T, V), no grad: the plain chunked path
    ent = entropy_at_mask(logits, torch.ones(2, 6), chunk=chunk)
    ref = torch.distributions.Categorical(logits=logits[:, :-1]).entropy()  # (B, T-1)
    torch.testing.assert_close(ent[:, 1:].double(), ref, atol=ATOL, rtol=0)
    assert torch.all(ent[:, 0] == 0)


def test_masked_entropy_is_the_entropy_at_the_mask_with_its_gradient():
    """Values and gradients equal torch's Categorical entropy times the mask, also when the
    positions are split over several checkpointed chunks (chunk=4 of 6 positions)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 6, 9, generator=gen, dtype=f64) * 3).requires_grad_()  # (B, T, V)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 0, 1, 1, 0]], dtype=f64)  # 6 policy tokens
    full = torch.distributions.Categorical(logits=logits[:, :-1]).entropy()  # (B, T-1)
    want = torch.cat([torch.zeros(2, 1, dtype=f64), full], 1) * mask
    got = entropy_at_mask(logits, mask, chunk=4)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    weights = torch.randn(2, 6, generator=gen, dtype=f64)
    g_want, = torch.autograd.grad((want * weights).sum(), logits)
    g_got, = torch.autograd.grad((got * weights).sum(), logits)
    torch.testing.assert_close(g_got, g_want, atol=ATOL, rtol=0)
    # logits[0, 0] predicts token 1, masked out: no gradient; logits[0, 2] predicts token 3, a policy token
    assert g_got[0, 0].abs().sum() == 0 and g_got[0, 2].abs().sum() > 0
    assert entropy_at_mask(logits.detach(), torch.zeros(2, 6)).abs().sum() == 0


# --- masked reductions and aggregation ---------------------------------------------


def test_masked_mean_and_whiten_hand():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 8.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_mean(x, m).item() == pytest.approx(15 / 4, abs=ATOL)  # junk never leaks in
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 6.0]), atol=ATOL, rtol=0)
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0
    w = masked_whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(w, torch.tensor([[-1.0, 1.0, 0.0]]), atol=ATOL, rtol=0)
    # a variance other than 1, over both rows: mean 4 of 0, 8, 2, 6; variance (16 + 16 + 4 + 4) / 4 = 10
    w = masked_whiten(torch.tensor([[0.0, 8.0, 99.0], [2.0, 6.0, -5.0]]), torch.tensor([[1, 1, 0], [1, 1, 0]]))
    s = 10 ** 0.5
    torch.testing.assert_close(w, torch.tensor([[-4 / s, 4 / s, 0.0], [-2 / s, 2 / s, 0.0]]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("x, mask", [
    ([[3.0, 7.0, float("nan")], [1.0, 2.0, 3.0]], [[0, 1, 0], [0, 0, 0]]),  # one masked entry: x - mean = 0, var 0
    ([[2.5, 2.5, -9.0], [2.5, float("inf"), 2.5]], [[1, 1, 0], [1, 0, 1]]),  # all equal: var 0
    ([[-2.0, -2.0, -2.0], [-2.0, -2.0, -2.0]], [[1, 1, 1], [1, 1, 1]]),  # R_format's -2 everywhere
    ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [[0, 0, 0], [0, 0, 0]]),  # nothing masked
])
def test_masked_whiten_with_zero_variance_is_zero(x, mask):
    """(x - mean) / sqrt(var + eps) with var = 0: every masked entry equals the mean, so 0
    everywhere, not 0 / 0; eps keeps it finite. (Values exact in binary: see the next test.)"""
    assert torch.equal(masked_whiten(torch.tensor(x), torch.tensor(mask)), torch.zeros(2, 3))


@pytest.mark.parametrize("value, n", [(0.1, 7), (0.7, 11), (100.1, 11), (10.3, 4096)])
def test_masked_whiten_of_equal_inexact_values_is_zero(value, n):
    """Equal values not exact in binary: a float32 mean misses them by an ulp, and / sqrt(0 + 1e-8)
    made that -7.45e-5 (0.1 x 7) to 0.15 (100.1 x 11) on every entry, where the formula gives 0."""
    assert torch.equal(masked_whiten(torch.full((1, n), value), torch.ones(1, n)), torch.zeros(1, n))


def test_aggregate_modes_unequal_lengths():
    # Sequences with 4, 2 and 1 policy tokens; 99s are masked junk.
    loss = torch.tensor([[1.0, 2, 3, 4], [10, 20, 99, 99], [7, 99, 99, 99]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    # token_mean: (1+2+3+4 + 10+20 + 7) / 7 = 47/7
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(47 / 7, abs=ATOL)
    # seq_mean_token_mean: (2.5 + 15 + 7) / 3 = 24.5/3
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(24.5 / 3, abs=ATOL)


def test_aggregate_skips_sequences_without_policy_tokens():
    loss = torch.tensor([[2.0, 4.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(3.0, abs=ATOL)
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(3.0, abs=ATOL)


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="unknown aggregation mode 'token-mean'"):
        aggregate(torch.zeros(1, 2), torch.ones(1, 2), "token-mean")


# --- policy loss -------------------------------------------------------------------


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(3, 8, generator=gen, dtype=f64)
    adv = torch.randn(3, 8, generator=gen, dtype=f64)
    mask = torch.tensor([[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 1, 0, 0]])
    loss, clipfrac = policy_loss(logp, logp.clone(), adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-masked_mean(adv, mask).item(), abs=ATOL)
    assert clipfrac.item() == 0.0


def test_policy_loss_hand_clipping():
    # clip_eps 0.2. (ratio, A) -> -min(ratio A, clip(ratio) A):
    #   (1.5, +1) -> -1.2 clipped   (1.5, -1) -> 1.5     (0.5, +1) -> -0.5   (0.5, -1) -> 0.8 clipped
    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5]], dtype=f64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=f64)
    old = torch.zeros(1, 4, dtype=f64)
    loss, clipfrac = policy_loss(ratio.log(), old, adv, torch.ones(1, 4), clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4, abs=ATOL)
    assert clipfrac.item() == pytest.approx(0.5, abs=ATOL)


@pytest.mark.parametrize("clip_eps", [0.2, 0.1])
@pytest.mark.parametrize(
    "a, side, inside, clipped",
    [
        # A > 0: the clipped side is ratio > 1 + eps.
        (1.0, +1, True, False),
        (1.0, +1, False, True),
        (1.0, -1, False, False),  # A > 0 and ratio < 1 - eps: PPO does not clip that side
        # A < 0: the clipped side is ratio < 1 - eps.
        (-1.0, -1, True, False),
        (-1.0, -1, False, True),
        (-1.0, +1, False, False),
    ],
)
def test_clipping_starts_exactly_at_boundary(clip_eps, a, side, inside, clipped):
    delta = 1e-6
    boundary = 1.0 + side * clip_eps
    ratio = boundary - side * delta if inside else boundary + side * delta
    logp = torch.tensor([[math.log(ratio)]], dtype=f64, requires_grad=True)
    loss, clipfrac = policy_loss(logp, torch.zeros(1, 1, dtype=f64), torch.tensor([[a]], dtype=f64),
                                 torch.ones(1, 1), clip_eps=clip_eps)
    loss.backward()
    if clipped:
        assert logp.grad.item() == 0.0
        assert clipfrac.item() == 1.0
    else:
        # d/dlogp of -ratio * A is -ratio * A
        assert logp.grad.item() == pytest.approx(-ratio * a, abs=ATOL)
        assert clipfrac.item() == 0.0


def _logit_mask(loss_mask):
    """Which logits positions feed a policy token: logits[:, t-1] predicts token t."""
    lm = torch.zeros_like(loss_mask, dtype=torch.bool)  # (B, T)
    lm[:, :-1] = loss_mask[:, 1:].bool()
    return lm


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_masked_positions_get_no_gradient(mode):
    gen = torch.Generator().manual_seed(4)
    B, T, V = 3, 9, 6
    ids = torch.randint(0, V, (B, T), generator=gen)  # (B, T)
    loss_mask = torch.tensor([
        [0, 0, 1, 1, 0, 0, 1, 1, 0],  # prompt, policy, retrieved, policy, pad
        [0, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 1, 0, 1, 0, 0, 0],
    ])
    base = torch.randn(B, T, V, generator=gen, dtype=f64)  # (B, T, V)
    old_logp = token_logprobs(base, ids) + 0.3 * torch.randn(B, T, generator=gen, dtype=f64)
    ref_logp = token_logprobs(base, ids) + 0.3 * torch.randn(B, T, generator=gen, dtype=f64)
    adv = torch.randn(B, T, generator=gen, dtype=f64)
    # Junk where the mask is 0, as a careless rollout might leave it: must not matter.
    off = ~loss_mask.bool()
    old_logp[off], ref_logp[off], adv[off] = -1e4, float("inf"), float("nan")

    def run(logits):
        logits = logits.clone().requires_grad_(True)
        logp = token_logprobs(logits, ids)
        pg, _ = policy_loss(logp, old_logp, adv, loss_mask, clip_eps=0.2, mode=mode)
        kl = aggregate(kl_penalty(logp, ref_logp, "k3"), loss_mask, mode)
        ent = aggregate(entropy_at_mask(logits, loss_mask), loss_mask, mode)
        loss = pg + 0.1 * kl - 0.01 * ent
        loss.backward()
        return loss.detach(), logits.grad

    loss1, grad1 = run(base)
    feeds = _logit_mask(loss_mask)  # (B, T)
    assert torch.isfinite(loss1)
    assert torch.all(grad1[~feeds] == 0)  # exactly zero where no policy token is predicted
    assert torch.all(grad1[feeds].abs().sum(-1) > 0)
    perturbed = base.clone()
    perturbed[~feeds] += 100 * torch.randn(int((~feeds).sum()), V, generator=gen, dtype=f64)
    loss2, grad2 = run(perturbed)
    assert torch.equal(loss1, loss2)
    assert torch.equal(grad1[feeds], grad2[feeds])
    assert torch.all(grad2[~feeds] == 0)


# --- value loss --------------------------------------------------------------------


def test_value_loss_hand():
    # clip_eps 0.2:
    #   v 1.0, old 0.5, R 2: clip(v) 0.7; (1-2)^2 = 1 < (0.7-2)^2 = 1.69 -> 0.845, clipped
    #   v 0.6, old 0.5, R 0: clip(v) 0.6; 0.36 both -> 0.18
    #   v 0.0, old 0.5, R 1: clip(v) 0.3; 1 > 0.49 -> 0.5
    #   last token masked (junk target)
    v = torch.tensor([[1.0, 0.6, 0.0, 3.0]], dtype=f64)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=f64)
    ret = torch.tensor([[2.0, 0.0, 1.0, float("inf")]], dtype=f64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac = value_loss(v, old, ret, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx((0.845 + 0.18 + 0.5) / 3, abs=ATOL)
    assert clipfrac.item() == pytest.approx(1 / 3, abs=ATOL)


def test_value_loss_gradient_masked_and_clipped():
    v = torch.tensor([[1.0, 0.6, 3.0]], dtype=f64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.0]], dtype=f64)
    ret = torch.tensor([[2.0, 0.0, float("nan")]], dtype=f64)
    loss, _ = value_loss(v, old, ret, torch.tensor([[1, 1, 0]]), clip_eps=0.2)
    loss.backward()
    # token 0 is clipped (gradient 0); token 1: d/dv 0.5 (v-R)^2 / 2 = (0.6 - 0) / 2 = 0.3
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.3, 0.0]], dtype=f64), atol=ATOL, rtol=0)


# --- KL estimators -----------------------------------------------------------------


def test_kl_elementwise_hand():
    logp = torch.tensor([0.0, -1.0, -2.0], dtype=f64)
    ref = torch.tensor([-1.0, 0.0, -2.0], dtype=f64)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, -1.0, 0.0], dtype=f64))
    # k3 = e^{lr} - lr - 1 with lr = ref - logp: lr = -1 -> e^-1, lr = 1 -> e - 2, lr = 0 -> 0
    expected = torch.tensor([math.exp(-1), math.e - 2, 0.0], dtype=f64)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), expected, atol=ATOL, rtol=0)


def test_kl_estimators_are_unbiased_under_p():
    # Exact expectation over every outcome of a categorical p: E_p[k1] = E_p[k3] = KL(p||q).
    gen = torch.Generator().manual_seed(5)
    logp = torch.log_softmax(torch.randn(7, generator=gen, dtype=f64), -1)  # (V,)
    logq = torch.log_softmax(torch.randn(7, generator=gen, dtype=f64), -1)  # (V,)
    kl = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=logp), torch.distributions.Categorical(logits=logq)
    )
    p = logp.exp()
    assert (p * kl_penalty(logp, logq, "k1")).sum().item() == pytest.approx(kl.item(), abs=ATOL)
    assert (p * kl_penalty(logp, logq, "k3")).sum().item() == pytest.approx(kl.item(), abs=ATOL)
    assert torch.all(kl_penalty(logp, logq, "k3") >= 0)


def test_k3_clamps():
    logp = torch.zeros(5, dtype=f64)
    # lr = ref - logp: 2 -> e^2 - 3 = 4.389 (inside); 3 -> e^3 - 4 = 16.1 -> 10;
    # 30 -> clamped to 20 first -> 10; -30 -> e^-20 + 19 -> 10; -5 -> e^-5 + 4 = 4.0067
    ref = torch.tensor([2.0, 3.0, 30.0, -30.0, -5.0], dtype=f64)
    expected = torch.tensor([math.exp(2) - 3, 10.0, 10.0, 10.0, math.exp(-5) + 4], dtype=f64)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), expected, atol=ATOL, rtol=0)


def test_k3_gradient_stays_finite_at_extreme_log_ratio():
    # fp32 exp(200) = inf; without the pre-exp clamp the backward is 0 * inf = NaN.
    logp = torch.tensor([-200.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.0, -200.0])
    out = kl_penalty(logp, ref, "k3")
    out.sum().backward()
    assert torch.equal(out.detach(), torch.tensor([10.0, 10.0]))
    assert torch.equal(logp.grad, torch.zeros(2))


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="unknown KL estimator 'low_var_kl'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "low_var_kl")


def test_masked_mean_along_a_dim_gives_zero_for_an_empty_row():
    """masked_mean(dim=-1) of a row with no masked entry is 0 (not NaN), the others their own mean."""
    x = torch.tensor([[1.0, 2.0, 6.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 1]])
    got = masked_mean(x, mask, dim=-1)
    assert torch.equal(got, torch.tensor([1.5, 0.0, 9.0]))


def test_policy_loss_clipfrac_follows_the_sequence_mean_mode():
    """With "seq_mean_token_mean" both the loss and the clip fraction weigh every sequence the same:
    row 0 has 1 of 3 tokens clipped (ratio 1.5 > 1.2 with A > 0), row 1 its only token, so the clip
    fraction is (1/3 + 1) / 2, not the token mean 2/4."""
    logp = torch.tensor([[math.log(1.5), 0.0, 0.0], [math.log(1.5), 0.0, 0.0]])
    old = torch.zeros(2, 3)
    adv = torch.ones(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, clipfrac = policy_loss(logp, old, adv, mask, 0.2, mode="seq_mean_token_mean")
    assert abs(clipfrac.item() - (1 / 3 + 1.0) / 2) < 1e-6
    assert abs(loss.item() - (-(1.2 + 1.0 + 1.0) / 3 - 1.2) / 2) < 1e-6
    loss_t, clipfrac_t = policy_loss(logp, old, adv, mask, 0.2, mode="token_mean")
    assert abs(clipfrac_t.item() - 0.5) < 1e-6
    assert abs(loss_t.item() - (-(1.2 + 1.0 + 1.0 + 1.2) / 4)) < 1e-6


def test_value_loss_clips_a_value_that_moved_down():
    """A value that fell from 1.0 to 0.0 is clipped to old - eps = 0.8: with return 0 the clipped
    error 0.64 is the larger, loss 0.5 * 0.64; a value that rose from 0 to 1 with return 0 is
    clipped to 0.2 and pays the unclipped error 1. Token mean (0.32 + 0.5) / 2."""
    values = torch.tensor([[0.0, 1.0]])
    old = torch.tensor([[1.0, 0.0]])
    ret = torch.zeros(1, 2)
    loss, clipfrac = value_loss(values, old, ret, torch.ones(1, 2), 0.2)
    assert abs(loss.item() - (0.5 * 0.64 + 0.5 * 1.0) / 2) < 1e-6
    assert abs(clipfrac.item() - 0.5) < 1e-6
