"""searchlite/models.py: trained_logprobs against a naive whole-row reference, the frozen reference
and critic copies, gradient checkpointing, the warmup, what a resume reads back (RNG state,
the newer checkpoint), the device names taken and glibc's thresholds set."""

import random

import numpy as np
import pytest
import torch
from conftest import make_byte_tokenizer, make_tiny_llama

from searchlite import models
from searchlite.config import ConfigError
from searchlite.models import (Critic, compute_in, find_checkpoint, frozen_copy, make_optimizer, pick_device,
                               rng_state, set_rng_state, trained_logprobs)

IDS = torch.tensor([[5, 9, 12, 7, 3, 40, 41], [4, 4, 8, 2, 6, 70, 1]])  # (2, 7)


def _naive(model, ids, attn, mask, temperature):
    """log p(ids[:, j] | ids[:, :j]) under logits / T where mask[:, j] (j >= 1), from the whole rows."""
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float() / temperature, -1)
    want = torch.zeros(ids.shape)
    for b in range(ids.shape[0]):
        for j in range(1, ids.shape[1]):
            if mask[b, j]:
                want[b, j] = full[b, j - 1, ids[b, j]]
    return want


def test_trained_logprobs_are_the_marked_tokens_log_probs_under_the_temperature(byte_tokenizer):
    model = make_tiny_llama(byte_tokenizer, seed=2).eval()
    attn = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])  # row 0 left-padded
    mask = torch.tensor([[0, 0, 0, 1, 1, 0, 1], [1, 0, 1, 0, 0, 1, 1]])  # col 0 marked: it has no log-prob
    with torch.no_grad():
        logp, logits, at = trained_logprobs(model, IDS, attn, mask, temperature=0.7)
    want = _naive(model, IDS, attn, mask, 0.7)
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
    assert (logp != 0).sum() == 6  # every marked column but col 0, and nothing else
    assert at[0].tolist() == [0, 0, 0, 1, 1, 1] and at[1].tolist() == [3, 4, 6, 2, 5, 6]
    assert logits.shape == (6, len(byte_tokenizer))
    torch.testing.assert_close(torch.log_softmax(logits.float() / 0.7, -1)[torch.arange(6), IDS[at]], logp[at],
                               atol=1e-5, rtol=0)


def test_trained_logprobs_of_a_bf16_computing_model_are_float32(byte_tokenizer):
    """Under autocast the head's logits are bf16; the log-probs (ratios, KL) must not be rounded to bf16."""
    model = compute_in(make_tiny_llama(byte_tokenizer, seed=2).eval(), "bfloat16")
    mask = torch.ones_like(IDS)
    with torch.no_grad():
        logp, logits, _ = trained_logprobs(model, IDS, torch.ones_like(IDS), mask)
    assert logits.dtype == torch.bfloat16 and logp.dtype == torch.float32
    want = torch.log_softmax(logits.float(), -1)[torch.arange(logits.shape[0]), IDS[:, 1:].reshape(-1)]
    torch.testing.assert_close(logp[:, 1:].reshape(-1), want, atol=1e-6, rtol=0)


def test_frozen_copy_is_in_eval_mode_and_held_in_the_dtype_asked(byte_tokenizer):
    model = make_tiny_llama(byte_tokenizer, seed=2).train()
    ref = frozen_copy(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    half = frozen_copy(compute_in(model, "bfloat16"), "bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and half.searchlite_compute_dtype is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the policy is left as it was


def test_a_new_critic_values_zero_and_a_saved_one_reloads_its_head(byte_tokenizer, tmp_path):
    backbone = make_tiny_llama(byte_tokenizer, seed=2).model
    critic = Critic(backbone)
    attn = torch.ones_like(IDS)
    with torch.no_grad():
        assert torch.equal(critic(IDS, attn), torch.zeros(IDS.shape))
        critic.value_head.weight.normal_()
        critic.value_head.bias.fill_(0.5)
        values = critic(IDS, attn)
    critic.save_pretrained(tmp_path / "critic")
    again = Critic.from_pretrained(str(tmp_path / "critic"))
    with torch.no_grad():
        torch.testing.assert_close(again(IDS, attn), values, atol=1e-6, rtol=0)
    # weights given apart from the module (FSDP2's gathered ones under torchrun) are the ones saved, the
    # backbone's too (without them passed on to its save_pretrained, test_models and test_distributed passed)
    given = {k: v + 1 for k, v in critic.state_dict().items()}
    critic.save_pretrained(tmp_path / "given", state_dict=given)
    from_given = Critic.from_pretrained(str(tmp_path / "given"))
    assert torch.equal(from_given.value_head.bias, critic.value_head.bias + 1)
    for name, weight in from_given.backbone.state_dict().items():
        assert torch.equal(weight, critic.backbone.state_dict()[name] + 1), name
    half = compute_in(Critic(backbone), "bfloat16")
    assert half(IDS, attn).dtype == torch.float32


def test_a_checkpoint_saves_the_weights_given_apart_from_the_modules(byte_tokenizer, tmp_path):
    """Under torchrun, FSDP2 shards the policy and the critic and distributed.py gathers their full
    weights to rank 0: save_checkpoint writes those in place of the modules' own (the critic's
    dropped, test_distributed passed)."""
    from transformers import AutoModelForCausalLM

    policy, critic = make_tiny_llama(byte_tokenizer, seed=3), Critic(make_tiny_llama(byte_tokenizer, seed=4).model)
    policy_weights = {k: v + 1 for k, v in policy.state_dict().items()}
    critic_weights = {k: v + 2 for k, v in critic.state_dict().items()}
    want = [dict(policy_weights), dict(critic_weights)]  # (transformers' save_pretrained empties its dict)
    ckpt = models.save_checkpoint(tmp_path, policy, byte_tokenizer, {"step": 1}, critic=critic,
                                  policy_weights=policy_weights, critic_weights=critic_weights)
    for saved, given in zip((AutoModelForCausalLM.from_pretrained(ckpt / "policy"),
                             Critic.from_pretrained(str(ckpt / "critic"))), want):
        assert saved.state_dict().keys() == given.keys()
        assert all(torch.equal(w, given[k]) for k, w in saved.state_dict().items())


def test_a_critic_with_master_weights_holds_float32_and_computes_in_the_dtype_asked(byte_tokenizer, tmp_path):
    """As load_policy's: --master_weights keeps the critic's weights in float32, marked to compute
    in --dtype; without it they are held in --dtype, with no mark."""
    make_tiny_llama(byte_tokenizer, seed=2).save_pretrained(tmp_path)
    master = Critic.from_pretrained(str(tmp_path), "bfloat16", master=True)
    plain = Critic.from_pretrained(str(tmp_path), "bfloat16")
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    assert master.searchlite_compute_dtype == torch.bfloat16
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    assert getattr(plain, "searchlite_compute_dtype", None) is None


def test_a_tokenizer_read_from_a_converted_folder_that_fails_names_that_folder(tmp_path):
    """A GGUF file's tokenizer is read from the folder it was converted into: an error names both."""
    folder = tmp_path / "converted"
    folder.mkdir()
    with pytest.raises(ConfigError) as e:
        models.model_tokenizer("m.gguf", "", str(folder))
    assert str(e.value).startswith(f"--model m.gguf: could not load its tokenizer from {folder}: ")


def test_load_tokenizer_pads_on_the_left_with_eos_where_the_tokenizer_names_no_pad_token(tmp_path):
    """A base model's tokenizer often has no pad token; batched prompts for generation pad on the left."""
    tok = make_byte_tokenizer()
    tok.pad_token, tok.padding_side = None, "right"
    tok.save_pretrained(tmp_path / "plain")
    loaded = models.load_tokenizer(str(tmp_path / "plain"))
    assert (loaded.pad_token, loaded.padding_side) == ("<|endoftext|>", "left")
    tok.pad_token = "<|pad|>"
    tok.save_pretrained(tmp_path / "own")
    assert models.load_tokenizer(str(tmp_path / "own")).pad_token == "<|pad|>"  # its own is kept


def test_the_policy_and_the_critic_checkpoint_gradients_when_asked(tiny_model):
    from searchlite.models import load_policy

    policy = load_policy(tiny_model, grad_checkpointing=True)
    # and builds no KV cache in its training forwards, which transformers would drop with a warning
    assert policy.is_gradient_checkpointing and policy.config.use_cache is False
    assert not load_policy(tiny_model).is_gradient_checkpointing
    assert Critic.from_pretrained(tiny_model, grad_checkpointing=True).backbone.is_gradient_checkpointing
    assert not Critic.from_pretrained(tiny_model).backbone.is_gradient_checkpointing


def test_warmup_starts_at_one_step_of_the_ramp(byte_tokenizer):
    model = make_tiny_llama(byte_tokenizer, seed=2)
    opt, sched = make_optimizer(model.parameters(), 1e-3, 0.0, 4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rel=1e-12)
    opt, sched = make_optimizer(model.parameters(), 1e-3, 0.0, 0)  # no warm-up (the default): the full rate at once
    lrs = []
    for _ in range(2):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1e-3, 1e-3], rel=1e-12)  # from the first step on


def test_rng_state_round_trips():
    torch.manual_seed(9)
    state = rng_state()
    a = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(state)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_a_gpu_runs_rng_state_resumes_on_a_machine_without_one(monkeypatch):
    """Its CUDA generators' states are left unset; the others are restored."""
    torch.manual_seed(9)
    state = {**rng_state(), "cuda": [torch.zeros(16, dtype=torch.uint8)]}
    a = torch.rand(3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("set a CUDA RNG state"))
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def test_the_newer_checkpoint_is_resumed_when_both_exist(tmp_path):
    for name in ("checkpoint.old", "checkpoint"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer.pt").write_bytes(b"x")
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoint"


def test_a_frozen_master_weight_copy_stays_frozen_after_it_samples_and_scores(byte_tokenizer):
    """autocast marks a frozen copy's weights as requiring grad for a no_grad block; they must be
    frozen again after it (the reference would otherwise build graphs and carry grads)."""
    from searchlite.sampler import HFSampler

    ref = frozen_copy(compute_in(make_tiny_llama(byte_tokenizer, seed=2), "bfloat16"))
    HFSampler(ref, byte_tokenizer, max_new_tokens=2).generate([[5, 9, 12]], greedy=True)
    with torch.no_grad():
        trained_logprobs(ref, IDS, torch.ones_like(IDS), torch.ones_like(IDS))
    assert not any(p.requires_grad for p in ref.parameters())


@pytest.mark.parametrize("gpu", [False, True])
def test_pick_device_takes_cpu_always_and_cuda_only_where_torch_sees_a_gpu(monkeypatch, gpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cuda" if gpu else "cpu")
    for name in ("cuda", "cuda:1"):
        if gpu:
            assert pick_device(name) == torch.device(name)
        else:
            with pytest.raises(ConfigError, match=f"^--device {name}: torch .* sees no CUDA GPU here; use --device"):
                pick_device(name)
    with pytest.raises(ConfigError, match=r"^--device 'gpu': not one of auto, cpu, cuda, cuda:N$"):
        pick_device("gpu")


def test_reuse_freed_memory_raises_both_glibc_thresholds(monkeypatch):
    """M_MMAP_THRESHOLD is -3 and M_TRIM_THRESHOLD -1 in glibc's malloc.h; both are set, to 1 GiB."""
    calls = []

    class LibC:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(models.ctypes, "CDLL", lambda name: LibC())
    assert models.reuse_freed_memory(torch.device("cpu")) is True
    assert calls == [(-3, 2**30), (-1, 2**30)]
    assert models.reuse_freed_memory(torch.device("cuda")) is False and len(calls) == 2
