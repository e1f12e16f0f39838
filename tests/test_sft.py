"""SFT: the masked NLL against a naive loop, every row once an epoch, and an interrupted run
that resumes to the same weights as an uninterrupted one."""

import pytest
import torch
from conftest import make_tiny_llama

from searchlite.sft import length_batches, sft, sft_loss


def rows(tokenizer, n=10, width=12, seed=0):
    """(N, T) random ids, right-padded to random lengths; loss_mask 1 on a random half of the real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tokenizer), (n, width), generator=g)
    lengths = torch.randint(4, width + 1, (n,), generator=g)
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    mask = (torch.rand(n, width, generator=g) < 0.5).long() * attention
    mask[:, 0] = 0  # the first token has no prediction
    return ids * attention, mask, attention


def test_sft_loss_is_the_mean_nll_of_the_masked_in_tokens(byte_tokenizer):
    model = make_tiny_llama(byte_tokenizer)
    ids, mask, attention = rows(byte_tokenizer, n=3)
    got = sft_loss(model, ids, mask, attention)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if mask[b, t]:
                total -= torch.log_softmax(logits[b, t - 1].double(), -1)[ids[b, t]].item()
                count += 1
    assert abs(got.item() - total / count) < 1e-5


def test_every_row_is_in_one_batch_an_epoch():
    lengths = torch.randint(1, 50, (203,), generator=torch.Generator().manual_seed(0))
    batches = length_batches(lengths, 8, torch.Generator().manual_seed(1), pool=4)
    assert sorted(torch.cat(batches).tolist()) == list(range(203)) and len(batches) == 26
    # rows of like length share a batch, but the batches come in a shuffled order, not shortest first
    assert sum(int(lengths[b].max() - lengths[b].min()) for b in batches) < 26 * 49 / 4
    for drawn in (batches, length_batches(lengths, 8, torch.Generator().manual_seed(1))):  # 4 pools; one pool
        longest = [int(lengths[b].max()) for b in drawn]
        assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_each_epoch_draws_another_batch_order_and_the_lr_follows_the_documented_schedule(byte_tokenizer,
                                                                                         monkeypatch):
    """warm-up 20 times a cosine from step 0 over every step, ceil(rows / batch) a step an epoch: a
    40-step run peaks at 0.56 x lr (the docstring), its first step trains at lr / 20 and its last
    above 0; and each epoch shuffles the rows anew."""
    import math

    import searchlite.sft as sft_module

    lrs, orders, real_step, real_batches = [], [], torch.optim.AdamW.step, sft_module.length_batches

    def step(self, *a, **kw):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **kw)

    def batches(*a, **kw):
        drawn = real_batches(*a, **kw)
        orders.append([b.tolist() for b in drawn])
        return drawn

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(sft_module, "length_batches", batches)
    ids, mask, attention = rows(byte_tokenizer, n=39)  # 39 rows of 4: 10 steps an epoch, the last of 3 rows
    sft(make_tiny_llama(byte_tokenizer), ids, mask, attention_mask=attention, epochs=4, lr=0.5, batch_size=4,
        progress=False)
    want = [0.5 * min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / 40)) for s in range(40)]
    assert lrs == pytest.approx(want, rel=1e-12) and max(lrs) == pytest.approx(0.5 * 0.556, abs=1e-3)
    assert lrs[0] == pytest.approx(0.5 / 20) and lrs[-1] > 0
    assert len(orders) == 4 and orders[0] != orders[1]
    lrs.clear()  # warmup 0: none, the cosine from the first step
    sft(make_tiny_llama(byte_tokenizer), ids, mask, attention_mask=attention, lr=0.5, batch_size=4, warmup=0,
        progress=False)
    assert lrs == pytest.approx([0.5 * 0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(10)], rel=1e-12)


def test_weight_decay_reaches_the_optimizer(byte_tokenizer):
    """AdamW's own default is 0.01: sft's 0.0, its default (the warm start's), must be passed on, and
    so must another value."""
    ids, mask, attention = rows(byte_tokenizer, n=4)
    trained = []
    for decay in ({}, {"weight_decay": 0.0}, {"weight_decay": 0.5}):
        model = make_tiny_llama(byte_tokenizer)
        sft(model, ids, mask, attention_mask=attention, lr=1e-2, batch_size=2, progress=False, **decay)
        trained.append(model.state_dict())
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert same(trained[0], trained[1]) and not same(trained[0], trained[2])


def test_a_model_handed_over_in_eval_mode_trains_in_training_mode(byte_tokenizer):
    """from_pretrained and sampling leave a model in eval mode, where transformers skips the
    recompute of --grad_checkpointing: sft switches it to training mode, so each layer runs twice a
    step (the forward, then the recompute in the backward)."""
    model = make_tiny_llama(byte_tokenizer)
    model.gradient_checkpointing_enable()
    model.eval()
    layer, seen = model.model.layers[0], []
    forward = layer.forward
    layer.forward = lambda *a, **kw: seen.append(layer.training) or forward(*a, **kw)
    ids, mask, attention = rows(byte_tokenizer, n=4)
    sft(model, ids, mask, attention_mask=attention, lr=1e-2, batch_size=4, progress=False)  # one step
    assert seen == [True, True] and model.training


def test_an_interrupted_sft_resumes_to_the_weights_of_an_uninterrupted_one(byte_tokenizer, tmp_path, monkeypatch,
                                                                          capsys):
    from types import SimpleNamespace

    import searchlite.sft

    def dropping(model):  # attention dropout draws from torch's RNG, which the saved state carries on
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.2
        return model

    ids, mask, attention = rows(byte_tokenizer, n=10)
    kw = dict(attention_mask=attention, epochs=2, lr=1e-2, batch_size=3, warmup=2, seed=5, progress=False)
    whole = dropping(make_tiny_llama(byte_tokenizer))
    expected = sft(whole, ids, mask, **kw)  # 2 epochs x 4 batches
    assert len(expected) == 8
    stop, calls = SimpleNamespace(requested=False), []  # a GracefulStop whose Ctrl-C comes during step 6

    def loss_and_ctrl_c(*args):
        calls.append(1)
        stop.requested = len(calls) == 6
        return sft_loss(*args)

    monkeypatch.setattr(searchlite.sft, "sft_loss", loss_and_ctrl_c)
    state = tmp_path / "sft_state.pt"
    part = dropping(make_tiny_llama(byte_tokenizer))
    assert sft(part, ids, mask, state_path=state, stop=stop, **kw) == expected[:6]  # step 6 finishes, then stops
    assert capsys.readouterr().out == ""  # a fresh start says nothing of a resume
    calls.clear()
    resumed = dropping(make_tiny_llama(byte_tokenizer))  # a new process: the starting weights, then the saved state
    assert sft(resumed, ids, mask, state_path=state, **kw) == expected and len(calls) == 2  # steps 7 and 8 only
    assert capsys.readouterr().out == f"--resume: {state} holds 6 of the 8 SFT steps\n"
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))


def test_the_progress_bar_counts_steps_from_where_a_resumed_run_starts(byte_tokenizer, tmp_path, monkeypatch):
    """One bar over every step, started at the steps a resumed run already took, a tick and the
    step's loss after each step, closed at the end; hidden (disable) without `progress`."""
    from types import SimpleNamespace

    import searchlite.sft
    from conftest import recording_bars

    bars = recording_bars(monkeypatch, searchlite.sft)
    ids, mask, attention = rows(byte_tokenizer, n=4)
    kw = dict(attention_mask=attention, epochs=2, lr=1e-2, batch_size=2, state_path=tmp_path / "s.pt")
    stop = SimpleNamespace(requested=True)  # a Ctrl-C during the first step: it finishes, and the run stops
    first = sft(make_tiny_llama(byte_tokenizer), ids, mask, stop=stop, progress=False, **kw)
    losses = sft(make_tiny_llama(byte_tokenizer), ids, mask, **kw)  # the other 3 of 2 epochs x 2 batches
    assert len(first) == 1 and len(losses) == 4 and [(b.kw, b.ticks, b.closed) for b in bars] == [
        (dict(total=4, initial=0, desc="sft", disable=True), 1, True),
        (dict(total=4, initial=1, desc="sft", disable=False), 3, True)]
    assert bars[1].postfixes == [{"loss": f"{x:.3f}"} for x in losses[1:]]


def test_a_state_saved_with_other_settings_is_refused(byte_tokenizer, tmp_path):
    from searchlite.config import ConfigError

    ids, mask, attention = rows(byte_tokenizer, n=4)
    kw = dict(attention_mask=attention, batch_size=2, progress=False, state_path=tmp_path / "s.pt")
    sft(make_tiny_llama(byte_tokenizer), ids, mask, lr=1e-2, **kw)
    with pytest.raises(ConfigError, match=r"s.pt: saved by a run with lr = 0.01, this one has 0.001; resume with"):
        sft(make_tiny_llama(byte_tokenizer), ids, mask, lr=1e-3, **kw)
    other = ids.clone()
    other[0, 1] += 1  # the same number of rows, other data
    with pytest.raises(ConfigError, match=r"s.pt: saved by a run with other rows to train on; resume with"):
        sft(make_tiny_llama(byte_tokenizer), other, mask, lr=1e-2, **kw)
    other_mask = mask.clone()
    other_mask[0, 2] = 1 - other_mask[0, 2]  # the same tokens, another one trained on
    with pytest.raises(ConfigError, match=r"s.pt: saved by a run with other rows to train on; resume with"):
        sft(make_tiny_llama(byte_tokenizer), ids, other_mask, lr=1e-2, **kw)
    # named by the caller's flags: stage 1's --sft_batch_size, not its --batch_size (questions a sampling round)
    with pytest.raises(ConfigError, match=r"with --sft_lr = 0.01, this one has 0.001; resume with"):
        sft(make_tiny_llama(byte_tokenizer), ids, mask, lr=1e-3, **kw, flags={"lr": "--sft_lr"})
    kw |= dict(state_path=tmp_path / "warm.pt", flags={"seed": None})  # warmstart: phase k's seed is --seed + k
    sft(make_tiny_llama(byte_tokenizer), ids, mask, seed=1, run={"--seed": 0}, **kw)
    with pytest.raises(ConfigError, match=r"warm.pt: saved by a run with --seed = 0, this one has 1; resume with"):
        sft(make_tiny_llama(byte_tokenizer), ids, mask, seed=2, run={"--seed": 1}, **kw)


@pytest.mark.parametrize("setting, saved, now", [("epochs", 1, 2), ("batch_size", 2, 4), ("warmup", 20, 5),
                                                 ("weight_decay", 0.0, 0.1), ("grad_clip", 1.0, 0.5), ("seed", 0, 1)])
def test_a_state_saved_with_another_schedule_or_optimizer_setting_is_refused(byte_tokenizer, tmp_path, setting, saved,
                                                                              now):
    """Each setting that shapes the steps is in the saved state's settings, so a resume with
    another is refused (left out of them, any of these passed the test above)."""
    from searchlite.config import ConfigError

    ids, mask, attention = rows(byte_tokenizer, n=4)
    kw = dict(attention_mask=attention, batch_size=2, progress=False, state_path=tmp_path / "s.pt")
    sft(make_tiny_llama(byte_tokenizer), ids, mask, **(kw | {setting: saved}))
    with pytest.raises(ConfigError, match=rf"s.pt: saved by a run with {setting} = {saved}, this one has {now}; "):
        sft(make_tiny_llama(byte_tokenizer), ids, mask, **(kw | {setting: now}))


def test_micro_batches_give_the_whole_batch_gradient(byte_tokenizer, monkeypatch):
    """micro_batch_size splits each SFT step into forward/backward passes; each adds its tokens'
    share of the whole batch's mean NLL, so every step's loss and gradient are the ones without it,
    and the loss it reports is that mean."""
    from conftest import make_tiny_llama

    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5, 6, 2]
    ids = torch.zeros(5, 7, dtype=torch.long)
    attn, mask = torch.zeros(5, 7, dtype=torch.long), torch.zeros(5, 7, dtype=torch.long)
    for i, k in enumerate(lengths):  # right-padded rows, the first token of each (the prompt) untrained
        ids[i, :k] = torch.randint(3, 200, (k,), generator=g)
        attn[i, :k], mask[i, 1:k] = 1, 1
    import searchlite.sft as sft_module

    real_clip, real_loss = torch.nn.utils.clip_grad_norm_, sft_module.sft_loss
    runs = []
    for micro in (0, 2):
        grads, passes, norms = [], [], []  # each step's gradient, as the optimizer gets it; rows per forward pass
        monkeypatch.setattr(sft_module, "sft_loss", lambda m, ids, *a: passes.append(len(ids)) or real_loss(m, ids, *a))

        def clip(params, max_norm, *a, **k):
            params = list(params)
            grads.append([p.grad.clone() for p in params])
            norms.append(max_norm)
            return real_clip(params, max_norm, *a, **k)

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
        model = make_tiny_llama(byte_tokenizer, seed=3)
        losses = sft(model, ids, mask, attention_mask=attn, epochs=2, lr=0.0, batch_size=5, micro_batch_size=micro,
                     warmup=1, progress=False)  # lr 0: both runs take their steps from the same weights
        assert passes == ([5, 5] if micro == 0 else [2, 2, 1] * 2) and norms == [1.0, 1.0]  # the default clip
        runs.append((losses, grads))
    (l0, g0), (l2, g2) = runs
    assert len(l0) == len(g0) == 2 and l0 == pytest.approx(l2, rel=1e-6)
    mean_nll = real_loss(make_tiny_llama(byte_tokenizer, seed=3), ids, mask, attn).item()  # the weights lr 0 kept
    assert l0 == pytest.approx([mean_nll] * 2, rel=1e-6)  # each step's reported loss: its batch's mean NLL
    for step0, step2 in zip(g0, g2):
        for a, b in zip(step0, step2):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_left_padded_rows_are_refused(byte_tokenizer):
    """sft cuts each batch to its longest row from the left: a left-padded row would lose its end."""
    from conftest import make_tiny_llama

    ids = torch.tensor([[0, 0, 5, 6, 7, 8]])
    for attention in ([[0, 0, 1, 1, 1, 1]], [[1, 1, 0, 1, 1, 1]]):  # padded on the left, or inside the row
        with pytest.raises(ValueError, match="right-padded"):
            sft(make_tiny_llama(byte_tokenizer), ids, torch.tensor(attention), attention_mask=torch.tensor(attention),
                progress=False)


def test_no_rows_are_refused_by_name(byte_tokenizer):
    """Zero rows failed in the learning-rate schedule, with a ZeroDivisionError."""
    from conftest import make_tiny_llama

    ids = torch.zeros((0, 6), dtype=torch.long)
    with pytest.raises(ValueError, match="^sft: no rows to train on$"):
        sft(make_tiny_llama(byte_tokenizer), ids, ids, progress=False)


def test_sft_without_an_attention_mask_attends_to_every_token(byte_tokenizer):
    """As the module docstring calls it: no attention_mask is a mask of ones, the same losses."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])  # (2, 5)
    lm = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])  # (2, 5)
    run = dict(epochs=2, lr=1e-3, batch_size=2, warmup=0, progress=False)
    without = sft(make_tiny_llama(byte_tokenizer), ids, lm, **run)
    assert without == sft(make_tiny_llama(byte_tokenizer), ids, lm, attention_mask=torch.ones_like(ids), **run)


def test_sft_loss_over_no_trained_token_is_zero_with_a_zero_gradient(byte_tokenizer):
    """memorization_backward's padding passes (a rank with fewer rewrites, under torchrun) have
    loss_mask 0 everywhere: their loss must be 0 and their gradient 0, not NaN."""
    model = make_tiny_llama(byte_tokenizer)
    ids = torch.tensor([[5, 6, 7, 8]])
    loss = sft_loss(model, ids, torch.zeros_like(ids), torch.ones_like(ids))
    (0.0 * loss).backward()
    assert loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters() if p.grad is not None)


def test_pools_are_random_rows_not_index_ranges():
    """All rows of one length, pool 1 (no length sorting to speak of): each batch is a chunk of
    the seeded permutation torch.randperm(n, gen), not rows 0-1, 2-3, ... (the stage-1 rows are
    in question order, so index-range pools would never mix early and late questions)."""
    lengths = torch.full((8,), 5)
    for seed in range(3):
        batches = length_batches(lengths, 2, torch.Generator().manual_seed(seed), pool=1)
        got = {tuple(sorted(b.tolist())) for b in batches}
        order = torch.randperm(8, generator=torch.Generator().manual_seed(seed)).tolist()
        want = {tuple(sorted(order[i:i + 2])) for i in range(0, 8, 2)}
        assert got == want, seed
        assert got != {(0, 1), (2, 3), (4, 5), (6, 7)}, seed


def test_the_seed_orders_the_sft_batches(byte_tokenizer, monkeypatch):
    """sft(seed=s) draws its batches from torch.Generator().manual_seed(s): another seed, another order."""
    import searchlite.sft as sft_module

    drawn, real = [], sft_module.length_batches

    def spy(*a, **k):
        batches = real(*a, **k)
        drawn.append([b.tolist() for b in batches])
        return batches

    monkeypatch.setattr(sft_module, "length_batches", spy)
    ids, mask, attention = rows(byte_tokenizer, n=8)
    for seed in (0, 1):
        sft(make_tiny_llama(byte_tokenizer), ids, mask, attention_mask=attention, lr=0.0, batch_size=2, seed=seed,
            progress=False)
    want = [[b.tolist() for b in real(attention.sum(1), 2, torch.Generator().manual_seed(s))] for s in (0, 1)]
    assert drawn == want and want[0] != want[1]
