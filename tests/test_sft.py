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


def test_an_interrupted_sft_resumes_to_the_weights_of_an_uninterrupted_one(byte_tokenizer, tmp_path, monkeypatch):
    from types import SimpleNamespace

    import searchlite.sft

    ids, mask, attention = rows(byte_tokenizer, n=10)
    kw = dict(attention_mask=attention, epochs=2, lr=1e-2, batch_size=3, warmup=2, seed=5, progress=False)
    whole = make_tiny_llama(byte_tokenizer)
    expected = sft(whole, ids, mask, **kw)  # 2 epochs x 4 batches
    assert len(expected) == 8
    stop, calls = SimpleNamespace(requested=False), []  # a GracefulStop whose Ctrl-C comes during step 6

    def loss_and_ctrl_c(*args):
        calls.append(1)
        stop.requested = len(calls) == 6
        return sft_loss(*args)

    monkeypatch.setattr(searchlite.sft, "sft_loss", loss_and_ctrl_c)
    state = tmp_path / "sft_state.pt"
    part = make_tiny_llama(byte_tokenizer)
    assert sft(part, ids, mask, state_path=state, stop=stop, **kw) == expected[:6]  # step 6 finishes, then stops
    calls.clear()
    resumed = make_tiny_llama(byte_tokenizer)  # a new process: the starting weights, then the saved state
    assert sft(resumed, ids, mask, state_path=state, **kw) == expected and len(calls) == 2  # steps 7 and 8 only
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))


def test_a_state_saved_with_other_settings_is_refused(byte_tokenizer, tmp_path):
    from searchlite.config import ConfigError

    ids, mask, attention = rows(byte_tokenizer, n=4)
    kw = dict(attention_mask=attention, batch_size=2, progress=False, state_path=tmp_path / "s.pt")
    sft(make_tiny_llama(byte_tokenizer), ids, mask, lr=1e-2, **kw)
    with pytest.raises(ConfigError, match=r"s.pt: saved by a run with lr = 0.01, this one has lr = 0.001; resume with"):
        sft(make_tiny_llama(byte_tokenizer), ids, mask, lr=1e-3, **kw)
