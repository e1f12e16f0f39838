"""Memory levers (searchlite/memory.py): LoRA's reference is the base model and only adapters
train; AdamW8bit steps and trains; ref_offload scores the same reference; gradient checkpointing
gives the same gradients; bf16 runs end to end."""

import json
import re

import pytest
import torch
from conftest import give_lora_an_effect, make_tiny_llama, pretend_installed

import train
from searchlite.config import Config, ConfigError
from searchlite.losses import token_logprobs
from searchlite.memory import (LoRAReference, add_lora, check_levers, load_merged, make_adamw, on_device,
                               optimizer_state_bytes)

IDS = torch.tensor([[5, 9, 12, 7, 3, 40, 41], [4, 4, 8, 2, 6, 70, 1]])  # (2, 7)
LORA = ["--lora_rank", "4", "--lora_targets", "q_proj,v_proj"]  # a LoRA run of train.py


def logprobs(model, ids=IDS):
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits, ids)  # (B, T)


def run(model, out, steps=1, extra=()):
    """train.main on a tiny model: 2 questions x 2 rollouts, one turn, KL to the reference on."""
    train.main(["--model", model, "--out_dir", str(out), "--algo", "grpo", "--steps", str(steps), "--batch_size", "2",
                "--group", "2", "--max_new_tokens", "6", "--max_turns", "1", "--eval_size", "2", "--lr", "1e-2",
                "--kl_coef", "0.1", "--micro_batch_size", "4", "--log_trajectories_every", "0", "--save_every", "1",
                *extra])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture()
def varied_reward(monkeypatch):
    """Rewards 1, 0, 1, 0, ...: every group is mixed, so advantages (and updates) are not zero."""
    monkeypatch.setattr(train, "compute_rewards", lambda ro, qs: torch.arange(len(ro)).remainder(2).float())


# ---------------------------------------------------------------------------- LoRA


def lora_model(tiny_llama, rank=4):
    return give_lora_an_effect(add_lora(tiny_llama, rank=rank, alpha=8.0, targets="q_proj,v_proj,down_proj"))


def test_lora_reference_is_the_base_model(tiny_llama):
    import copy

    base_model = copy.deepcopy(tiny_llama)  # the model before any adapter exists
    base = logprobs(base_model)
    policy = lora_model(tiny_llama)
    ref = LoRAReference(policy)
    torch.testing.assert_close(logprobs(ref), base, atol=1e-6, rtol=0)
    assert (logprobs(policy) - base).abs().max() > 1e-2  # the adapters change the policy, not the reference
    prompt = IDS[:1, :4]  # greedy generation through the reference follows the base model too
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, want, own = ref.generate(input_ids=prompt, **kw), base_model.generate(input_ids=prompt, **kw), \
            policy.generate(input_ids=prompt, **kw)
    assert torch.equal(got, want) and not torch.equal(own, want)


def test_lora_trains_only_the_adapters(tiny_llama):
    policy = lora_model(tiny_llama)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    policy.train()
    logp = token_logprobs(policy(input_ids=IDS).logits, IDS)  # (2, 7)
    (-logp.mean()).backward()
    with_grad = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert with_grad == trainable
    assert all(policy.get_parameter(n).grad.abs().sum() > 0 for n in with_grad if "lora_A" in n)


def test_merge_names_a_dtype_outside_its_choices_before_reading_the_adapter(tmp_path, capsys):
    """`memory merge --dtype fp8` is a usage error (the choices dropped, the adapter check spoke first,
    and a real adapter met a KeyError; test_memory passed)."""
    from searchlite.memory import main as merge_cli

    with pytest.raises(SystemExit) as e:
        merge_cli(["merge", str(tmp_path), "--out", str(tmp_path / "m"), "--dtype", "fp8"])
    assert e.value.code == 2 and "argument --dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_lora_alpha_sets_the_adapters_scale(tiny_llama):
    """--lora_alpha reaches peft: the adapter's output is scaled by alpha / rank (8 / 4 and 12 / 4
    here: peft's own default alpha is 8, so 8 alone passed with alpha dropped from the LoraConfig).
    The adapter is a causal LM's (its task type dropped, test_memory passed)."""
    import copy

    import peft

    for alpha, scale in ((8.0, 2.0), (12.0, 3.0)):
        policy = add_lora(copy.deepcopy(tiny_llama), rank=4, alpha=alpha, targets="q_proj,v_proj,down_proj")
        assert isinstance(policy, peft.PeftModelForCausalLM) and policy.peft_config["default"].task_type == "CAUSAL_LM"
        layer = policy.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
        assert policy.peft_config["default"].lora_alpha == alpha and layer.scaling["default"] == pytest.approx(scale)


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit"])
def test_the_optimizer_takes_the_weight_decay_given(tiny_llama, kind):
    """torch's AdamW and bitsandbytes' default to 0.01: --weight_decay 0 (the default) must reach them."""
    if kind == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    for wd in (0.0, 0.1):
        opt = make_adamw(tiny_llama.parameters(), kind, lr=1e-3, weight_decay=wd)
        assert {g["weight_decay"] for g in opt.param_groups} == {wd}


def test_an_unknown_optimizer_is_refused_naming_the_valid_ones(tiny_llama):
    """check_config refuses one first; code that calls make_adamw itself gets the same names (without the
    refusal, None came back, and test_memory passed)."""
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgd' \(valid: adamw, adamw8bit\)"):
        make_adamw(tiny_llama.parameters(), "sgd", lr=1e-3, weight_decay=0.0)


def test_a_lora_resume_ends_with_the_adapter_of_an_uninterrupted_run(tiny_model, tmp_path, varied_reward):
    """A LoRA run stopped after step 1 and resumed to step 2 ends with the adapter a 2-step run ends
    with: the resume trains on from the checkpoint's adapter (one started afresh passed the test below)."""
    from safetensors.torch import load_file

    run(tiny_model, tmp_path / "full", steps=2, extra=LORA)
    run(tiny_model, tmp_path / "part", steps=1, extra=LORA)
    run(tiny_model, tmp_path / "part", steps=2, extra=[*LORA, "--resume"])
    full, part = (load_file(tmp_path / r / "checkpoint/policy/adapter_model.safetensors") for r in ("full", "part"))
    assert full.keys() == part.keys() and all(torch.equal(full[k], part[k]) for k in full)


def test_lora_run_saves_the_adapter_resumes_and_evaluates(tiny_model, tmp_path, varied_reward, capsys):
    from safetensors.torch import load_file

    from searchlite.models import load_policy

    out = tmp_path / "lora"
    run(tiny_model, out, steps=1, extra=LORA)
    policy_dir = out / "checkpoint" / "policy"
    assert (policy_dir / "adapter_config.json").is_file() and not (policy_dir / "model.safetensors").exists()
    adapter = load_file(policy_dir / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())  # trained away from zero
    rows = run(tiny_model, out, steps=2, extra=[*LORA, "--resume"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    import evaluate

    assert evaluate.resolve_model(str(out)) == ("hf", str(policy_dir))  # evaluate.py --model RUN finds the adapter
    merged = load_policy(str(policy_dir))  # base + adapter merged: what evaluate.py loads
    assert all(p.requires_grad for p in merged.parameters())  # and what a full-weight run trains, all of it
    base = load_policy(tiny_model)
    assert (logprobs(merged) - logprobs(base)).abs().max() > 0
    with pytest.raises(SystemExit, match="holds a LoRA adapter"):  # resuming it as a full-weight run
        run(tiny_model, out, steps=3, extra=["--resume"])
    with pytest.raises(SystemExit, match="lora_rank = 4, this run has 8"):  # or with another rank: before it loads
        run(tiny_model, out, steps=3, extra=["--lora_rank", "8", "--lora_targets", "q_proj,v_proj", "--resume"])
    from searchlite.memory import main as merge_cli  # python -m searchlite.memory merge: the same merged weights

    capsys.readouterr()
    merge_cli(["merge", str(policy_dir), "--out", str(tmp_path / "merged"), "--dtype", "float32"])
    assert capsys.readouterr().out == f"merged {policy_dir} into {tiny_model} -> {tmp_path / 'merged'}\n"
    assert torch.equal(logprobs(load_policy(str(tmp_path / "merged"))), logprobs(merged))
    from transformers import AutoTokenizer  # and the tokenizer beside them: a folder train.py and evaluate.py load

    assert AutoTokenizer.from_pretrained(tmp_path / "merged").get_vocab() == \
        AutoTokenizer.from_pretrained(policy_dir).get_vocab()
    with pytest.raises(SystemExit, match=f"{tiny_model} holds full weights, not a LoRA adapter"):
        merge_cli(["merge", tiny_model, "--out", str(tmp_path / "not")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=f"^error: {tmp_path / 'empty'} is not a folder with adapter_config.json$"):
        merge_cli(["merge", str(tmp_path / "empty"), "--out", str(tmp_path / "not")])
    with pytest.raises(ConfigError, match="is a LoRA adapter; to train a new adapter on it, merge it first"):
        check_levers(Config(model=str(policy_dir), lora_rank=4))  # a second adapter would name the bare base
    from searchlite.models import Critic  # a PPO critic started from the adapter: the merged model, all trained

    critic = Critic.from_pretrained(str(policy_dir))
    assert all(p.requires_grad for p in critic.parameters())
    with torch.no_grad():
        hidden = critic.backbone(input_ids=IDS).last_hidden_state
        torch.testing.assert_close(hidden, merged.base_model(input_ids=IDS).last_hidden_state, atol=0, rtol=0)


def test_a_misspelt_lora_target_is_named_and_an_empty_list_refused(tiny_llama):
    for empty in ("", " , "):  # (without the refusal, test_memory passed)
        with pytest.raises(ConfigError, match=r"--lora_targets is empty: name modules \(e.g. q_proj,v_proj\) or use "
                                              "all-linear"):
            add_lora(tiny_llama, rank=4, alpha=8.0, targets=empty)
    with pytest.raises(ConfigError, match=r"no module of the model is named 'v_prj' \(its linear layers: down_proj"):
        add_lora(tiny_llama, rank=4, alpha=8.0, targets="q_proj,v_prj")
    for part in ("proj", "q_pro"):  # part of a name is not a module's name
        with pytest.raises(ConfigError, match=f"no module of the model is named '{part}'"):
            add_lora(tiny_llama, rank=4, alpha=8.0, targets=part)
    assert add_lora(tiny_llama, rank=4, alpha=8.0, targets="self_attn.q_proj") is not None  # a dotted suffix


# ---------------------------------------------------------------------------- AdamW8bit


def test_adamw8bit_step_changes_weights_with_8bit_states(tiny_llama):
    before = {n: p.detach().clone() for n, p in tiny_llama.named_parameters()}
    opt = make_adamw(tiny_llama.parameters(), "adamw8bit", lr=1e-3, weight_decay=0.0)
    logp = token_logprobs(tiny_llama(input_ids=IDS).logits, IDS)
    (-logp.mean()).backward()
    opt.step()
    changed = [n for n, p in tiny_llama.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    emb = tiny_llama.get_input_embeddings().weight  # vocab x 64 elements: over 4,096, so quantized
    assert opt.state[emb]["state1"].dtype == torch.uint8
    plain = torch.optim.AdamW(tiny_llama.parameters(), lr=1e-3)
    (-token_logprobs(tiny_llama(input_ids=IDS).logits, IDS).mean()).backward()
    plain.step()
    assert optimizer_state_bytes(opt) < 0.4 * optimizer_state_bytes(plain)


@pytest.mark.parametrize("trial, message", [
    ("raise", r"^bitsandbytes 0\.1 cannot run AdamW8bit on cpu: no cpu kernel\. Install a release with a cpu backend "
              r"\(pip install -U bitsandbytes\) or use --optimizer adamw$"),
    ("still", r"^bitsandbytes 0\.1: an AdamW8bit step on cpu left the weights unchanged; use --optimizer adamw$"),
    ("silent", r"^bitsandbytes 0\.1 cannot run AdamW8bit on cpu: RuntimeError\. Install a release with a cpu "),
    ("moves", None)])
def test_adamw8bit_that_cannot_step_on_this_device_is_refused_before_training(tiny_llama, monkeypatch, trial, message):
    """Older bitsandbytes releases have no CPU kernels: one trial step says so (its error's first
    line) before any model trains, as does a step that moves nothing. A trial that passes is made
    once a device; one that failed, again at each call."""
    import types

    import searchlite.memory as memory

    class AdamW8bit:
        def __init__(self, params, lr, weight_decay=0.0):
            self.params = params

        def step(self):
            trials.append(len(self.params[0]))
            if trial == "raise":
                raise RuntimeError("no cpu kernel\nthe traceback's details")
            if trial == "silent":  # an error with no message: its type is named
                raise RuntimeError()
            if trial == "moves":
                self.params[0].data += 1

    trials = []
    fake = types.SimpleNamespace(__version__="0.1", optim=types.SimpleNamespace(AdamW8bit=AdamW8bit))
    monkeypatch.setattr(memory, "_bitsandbytes", lambda: fake)
    memory._check_8bit_runs.cache_clear()  # a trial of the real one, earlier in this process, is remembered
    try:
        for _ in range(2):
            if message is None:
                assert isinstance(make_adamw(tiny_llama.parameters(), "adamw8bit", lr=1e-3, weight_decay=0.0),
                                  AdamW8bit)
                continue
            with pytest.raises(RuntimeError, match=message):
                make_adamw(tiny_llama.parameters(), "adamw8bit", lr=1e-3, weight_decay=0.0)
    finally:
        memory._check_8bit_runs.cache_clear()
    assert trials == ([4096] if message is None else [4096, 4096])


def test_adamw8bit_state_round_trips(tiny_llama, byte_tokenizer):
    """Saving and loading the 8-bit state (a resume) continues exactly as not stopping would."""
    import copy

    from conftest import make_tiny_llama

    def step(model, opt):
        (-token_logprobs(model(input_ids=IDS).logits, IDS).mean()).backward()
        opt.step()
        opt.zero_grad()

    a = tiny_llama
    opt_a = make_adamw(a.parameters(), "adamw8bit", lr=1e-3, weight_decay=0.0)
    step(a, opt_a)
    b = make_tiny_llama(byte_tokenizer, seed=1)
    b.load_state_dict(a.state_dict())
    opt_b = make_adamw(b.parameters(), "adamw8bit", lr=1e-3, weight_decay=0.0)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    step(a, opt_a)
    step(b, opt_b)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0, msg=n)


def test_a_run_with_adamw8bit_trains(tiny_model, tmp_path, varied_reward):
    from safetensors.torch import load_file

    out = tmp_path / "bnb"
    rows = run(tiny_model, out, steps=2, extra=["--optimizer", "adamw8bit"])
    for r in rows[1:]:
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in ("loss", "kl", "grad_norm"))
    before = load_file(f"{tiny_model}/model.safetensors")
    after = load_file(out / "checkpoint" / "policy" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    state = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)["opt"]["state"]
    assert torch.uint8 in {t.dtype for t in tensors(state)}  # the checkpoint keeps the 8-bit states


def tensors(obj):
    """Every tensor inside nested dicts, lists and tuples."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


# ---------------------------------------------------------------------------- reference offload


def test_ref_offload_gives_the_same_run(tiny_model, tmp_path, varied_reward, monkeypatch):
    """With the reference kept on CPU and moved to the device to score, the run (reference
    log-probs, so KL, so the update) is the one with the reference kept on the device. On a CPU
    machine both runs stay on the CPU, so what --ref_offload changes is checked where train.py
    does it: the reference is scored inside `on_device(ref, device, enabled=True)`, once a step,
    and its weights are in CPU memory after each; without the flag the block is disabled. The reference
    is the policy's copy without the flag, and with it a second load of --model, asked for in CPU
    memory (on a GPU the policy's copy would sit on the device first)."""
    import contextlib

    from safetensors.torch import load_file

    seen = []  # per score_tokens call: (model, whether an enabled on_device block holds it)
    blocks = []  # per on_device call: (model, enabled, devices of its parameters after the block)
    held = []  # the models inside an enabled on_device block right now
    loads = []  # per load_policy call: the device asked for
    real_score, real_on_device, real_load = train.score_tokens, train.on_device, train.load_policy

    def load(path, dtype="float32", device="cpu", *a, **k):
        loads.append(str(device))
        return real_load(path, dtype, device, *a, **k)

    def score(model, *a, **k):
        seen.append((model, any(m is model for m in held)))
        return real_score(model, *a, **k)

    @contextlib.contextmanager
    def recording_on_device(model, device, enabled=True):
        with real_on_device(model, device, enabled):
            held.append(model if enabled else None)
            try:
                yield model
            finally:
                held.pop()
        blocks.append((model, enabled, {p.device.type for p in model.parameters()}))

    monkeypatch.setattr(train, "score_tokens", score)
    monkeypatch.setattr(train, "on_device", recording_on_device)  # train.py's own name for it
    monkeypatch.setattr(train, "load_policy", load)
    two = ["--mini_batch_size", "2"]  # two optimizer steps a batch: the policy is scored too (one_step_on_policy)
    a = run(tiny_model, tmp_path / "on", steps=2, extra=two)
    seen_a, blocks_a, loads_a = seen[:], blocks[:], loads[:]
    seen.clear()
    blocks.clear()
    loads.clear()
    b = run(tiny_model, tmp_path / "off", steps=2, extra=two + ["--ref_offload"])
    keep = lambda r: {k: v for k, v in r.items() if k != "seconds" and not k.startswith("t_")}  # noqa: E731 timings
    assert [keep(r) for r in a] == [keep(r) for r in b]
    assert a[2]["kl"] > 0  # the reference mattered (at step 1 the policy still is the reference)
    wa = load_file(tmp_path / "on" / "checkpoint" / "policy" / "model.safetensors")
    wb = load_file(tmp_path / "off" / "checkpoint" / "policy" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # each step scores the policy (old log-probs), then the reference: a separate model in each run
    (policy_a, _), (ref_a, _) = seen_a[:2]
    (policy_b, _), (ref_b, _) = seen[:2]
    assert [m for m, _ in seen_a] == [policy_a, ref_a] * 2 and [m for m, _ in seen] == [policy_b, ref_b] * 2
    assert len({id(policy_a), id(ref_a), id(policy_b), id(ref_b)}) == 4
    # without the flag: a disabled block; with it: the reference moved for, and scored inside, an enabled one
    assert [(m is ref_a, on) for m, on, _ in blocks_a] == [(True, False)] * 2
    assert not any(inside for _, inside in seen_a)
    assert [(m is ref_b, on, where) for m, on, where in blocks] == [(True, True, {"cpu"})] * 2
    assert [inside for _, inside in seen] == [False, True] * 2  # the reference inside, the policy not
    assert loads_a == ["cpu"] and loads == ["cpu", "cpu"]  # this machine's device, then the reference's CPU


def test_on_device_moves_there_and_back_even_on_error():
    moves = []

    class Recorder(torch.nn.Linear):
        def to(self, *args, **kwargs):
            moves.append(str(args[0]))
            return super().to("cpu")  # CPU-only machine: record where it was sent

    model = Recorder(2, 2)
    with pytest.raises(ValueError, match="raised inside the block"):
        with on_device(model, "cuda:3", enabled=True):
            assert moves == ["cuda:3"]
            raise ValueError("raised inside the block")
    assert moves == ["cuda:3", "cpu"]
    with on_device(model, "cuda:3", enabled=False), on_device(None, "cuda:3", enabled=True):
        pass
    assert moves == ["cuda:3", "cpu"]


# ---------------------------------------------------------------------------- gradient checkpointing, bf16


def test_grad_checkpointing_gives_the_same_gradients(tiny_llama):
    calls = []
    mlp = tiny_llama.model.layers[0].mlp
    run_mlp = mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or run_mlp(*a, **k)  # counts recomputation too

    def grads():
        tiny_llama.zero_grad()
        calls.clear()
        (-token_logprobs(tiny_llama(input_ids=IDS).logits, IDS).mean()).backward()
        return {n: p.grad.clone() for n, p in tiny_llama.named_parameters()}, len(calls)

    tiny_llama.train()
    plain, n_plain = grads()
    tiny_llama.gradient_checkpointing_enable()
    recomputed, n_ckpt = grads()
    assert (n_plain, n_ckpt) == (1, 2)  # the layer really ran again in the backward pass
    for n in plain:
        torch.testing.assert_close(recomputed[n], plain[n], atol=1e-6, rtol=0, msg=n)


@pytest.mark.parametrize("master", [True, False])
def test_bf16_with_grad_checkpointing_runs_ppo_end_to_end(tiny_model, tmp_path, varied_reward, monkeypatch, master):
    """bf16 PPO: float32 master weights by default (the checkpoint holds them), bf16 weights with
    --master_weights false; either way the critic trains in training mode, where transformers'
    gradient checkpointing recomputes (it is off in eval mode, which from_pretrained leaves)."""
    from safetensors.torch import load_file

    modes = []
    real_update = train.update

    def spy(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic=None, *rest):
        modes.append((policy.training, critic.training, critic.backbone.training,
                      critic.backbone.is_gradient_checkpointing))
        return real_update(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, *rest)

    monkeypatch.setattr(train, "update", spy)
    out = tmp_path / "bf16"
    train.main(["--model", tiny_model, "--out_dir", str(out), "--algo", "ppo", "--group", "1", "--steps", "1",
                "--batch_size", "3", "--max_new_tokens", "6", "--max_turns", "1", "--eval_size", "2",
                "--dtype", "bfloat16", "--grad_checkpointing", "--log_trajectories_every", "0",
                "--master_weights", str(master).lower()])
    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert all(torch.isfinite(torch.tensor(float(row[k]))) for k in ("loss", "vf_loss", "grad_norm"))
    held = torch.float32 if master else torch.bfloat16
    for part in ("policy", "critic"):
        weights = load_file(out / "checkpoint" / part / "model.safetensors")
        assert {v.dtype for v in weights.values()} == {held}, part
    assert modes == [(True, True, True, True)]


@pytest.mark.parametrize("master", [True, False])
def test_master_weights_keep_the_updates_bf16_weights_round_away(tiny_model, master):
    """Three AdamW steps at lr 1e-6 (the 3B presets' rate): on float32 master weights every
    weight moves; on bf16 weights (about 1e-4 apart near 0.02) about 2% do, the rest round back.
    Either way the forward passes, training, scoring and sampling, compute in bf16, and a frozen
    copy (the reference) computes as the policy does."""
    from searchlite.models import frozen_copy, load_policy, load_tokenizer, make_optimizer
    from searchlite.sampler import HFSampler
    from searchlite.sft import sft_loss

    policy = load_policy(tiny_model, "bfloat16", master=master)
    assert {p.dtype for p in policy.parameters()} == {torch.float32 if master else torch.bfloat16}
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if "embed" not in n}
    head = []
    hook = policy.get_output_embeddings().register_forward_hook(lambda m, a, out: head.append(out.dtype))
    opt, _ = make_optimizer(policy.parameters(), 1e-6, 0.0, 0)
    for _ in range(3):
        sft_loss(policy, IDS, torch.ones_like(IDS)).backward()
        opt.step()
        opt.zero_grad()
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in policy.named_parameters() if n in before)
    share = moved / sum(t.numel() for t in before.values())
    assert share == 1.0 if master else share < 0.1
    HFSampler(policy, load_tokenizer(tiny_model), max_new_tokens=2).generate([[5, 9, 12]])
    logp = train.score_tokens(policy, make_rollout(IDS), 2, "cpu")
    hook.remove()
    assert set(head) == {torch.bfloat16} and len(head) == 3 + 2 + 1  # SFT, the sampler's 2 tokens, scoring
    assert torch.equal(train.score_tokens(frozen_copy(policy), make_rollout(IDS), 2, "cpu"), logp)


def test_a_frozen_master_weight_copy_casts_its_weights_once_a_generate_call(tiny_model):
    """autocast keeps its bf16 copy of a weight for the whole call only for weights that require
    grad: the reference and R1-Searcher++'s rewriter (frozen float32 copies) were cast again at
    every generated token, four times the weight traffic of bf16 weights. They stay frozen."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from searchlite.models import frozen_copy, load_policy, load_tokenizer
    from searchlite.sampler import HFSampler

    class CountCasts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0].dim() == 2 and kwargs.get("dtype") == torch.bfloat16:
                self.n += 1  # a float32 matrix (a weight) cast to bf16
            return func(*args, **kwargs)

    policy = load_policy(tiny_model, "bfloat16", master=True)
    casts = {}
    for name, model in (("policy", policy), ("frozen", frozen_copy(policy))):
        sampler = HFSampler(model, load_tokenizer(tiny_model), max_new_tokens=12, temperature=1.0)
        with CountCasts() as counter:
            sampler.generate([[5, 9, 12]], greedy=True)
        casts[name] = counter.n
    weights = sum(p.dim() == 2 for p in policy.parameters())  # (the embedding is looked up, not cast)
    assert casts["frozen"] == casts["policy"] <= weights  # once each, not once each of the 12 tokens
    assert not any(p.requires_grad for p in frozen_copy(policy).parameters())


def make_rollout(ids):
    from searchlite.rollout import Rollout

    n, mask = ids.shape[0], torch.ones_like(ids)
    zeros = torch.zeros(n, dtype=torch.long)
    return Rollout(ids, mask, mask, zeros, zeros, zeros, zeros.bool(), [None] * n, [""] * n)


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize("settings, message", [
    ({"optimizer": "adam8"}, "unknown --optimizer 'adam8'"),
    ({"lora_rank": -1}, "lora_rank must be >= 0"),
    ({"lora_rank": 8, "ref_offload": True}, "no separate reference to offload"),
    ({"lora_rank": 8, "lora_targets": " , "}, r"--lora_targets is empty: name modules \(e.g. q_proj,v_proj\)"),
])
def test_bad_lever_settings_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        check_levers(Config(**settings))


@pytest.mark.parametrize("settings, package, message", [
    ({"optimizer": "adamw8bit"}, "bitsandbytes", r"--optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes"),
    ({"lora_rank": 8}, "peft", r"--lora_rank needs peft: pip install peft"),
])
def test_a_lever_whose_package_is_missing_says_what_to_install(settings, package, message, monkeypatch):
    """Without the package (a plain ./setup.sh), the setting is refused before a model loads, naming the install."""
    import importlib.util

    pretend_installed(monkeypatch, **{package: False})
    with pytest.raises(ConfigError, match=message):
        check_levers(Config(**settings))
    monkeypatch.undo()
    if importlib.util.find_spec(package) is not None:  # installed (./setup.sh dev): no error
        check_levers(Config(**settings))


def test_lora_on_tied_embeddings_with_vllm_is_refused_before_any_model_loads(byte_tokenizer, tmp_path):
    """vLLM holds tied embeddings and LM head as one matrix: a LoRA on either was refused only when the
    first weights were pushed, after the models and the engine had loaded. An untied model, other targets,
    the transformers sampler, a hub name (not read here), and a model that cannot be found or whose
    config cannot be read (its load names what is wrong) pass."""
    for tie in (True, False):
        make_tiny_llama(byte_tokenizer, tie=tie).save_pretrained(tmp_path / f"tie{tie}")
    (tmp_path / "unreadable").mkdir()
    (tmp_path / "unreadable" / "config.json").write_text("{not json", encoding="utf-8")
    tied = dict(model=str(tmp_path / "tieTrue"), lora_rank=4, sampler="vllm")
    for targets, named in (("embed_tokens,q_proj", "embed_tokens"), ("q_proj, lm_head", "lm_head"),
                           ("model.embed_tokens", "model.embed_tokens")):
        with pytest.raises(ConfigError, match="^" + re.escape(
                f"--lora_targets {targets} with --sampler vllm: {tmp_path / 'tieTrue'} ties its embeddings and LM "
                f"head, which vLLM holds as one matrix, and a LoRA on {named} makes them two")):
            check_levers(Config(**tied, lora_targets=targets))
    (tmp_path / "stage1" / "model").parent.mkdir()
    (tmp_path / "tieTrue").rename(tmp_path / "stage1" / "model")  # a stage 1's out_dir names the model in it
    with pytest.raises(ConfigError, match="ties its embeddings"):
        check_levers(Config(**{**tied, "model": str(tmp_path / "stage1")}, lora_targets="lm_head"))
    tied["model"] = str(tmp_path / "stage1" / "model")
    for ok in ({"lora_targets": "all-linear"}, {"lora_targets": "q_proj,v_proj"}, {"sampler": "hf"},
               {"model": str(tmp_path / "tieFalse")}, {"model": "Org/some-model"}, {"lora_rank": 0},
               {"model": str(tmp_path / "missing")}, {"model": str(tmp_path / "unreadable")}):
        check_levers(Config(**{**tied, "lora_targets": "embed_tokens", **ok}))


REFAULT_PROBE = """
import resource, sys, torch
from searchlite.models import reuse_freed_memory
if sys.argv[1] == "on":
    assert reuse_freed_memory(torch.device("cpu"))
faults = []
for _ in range(31):  # two 64 MB blocks (a toy micro-batch's logits), freed, and allocated again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)
    y = x * 2
    del x, y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[15])  # the median round: the heap still grows now and then (small blocks land in the gap)
"""


def test_a_cpu_run_reuses_freed_blocks_instead_of_faulting_them_in_again():
    import subprocess
    import sys

    from searchlite.models import reuse_freed_memory

    def faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", REFAULT_PROBE, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    plain = faults("off")
    if plain < 1000:
        pytest.skip(f"this allocator already keeps freed 64 MB blocks ({plain} page faults to reuse two)")
    assert faults("on") < plain / 4  # measured here: 32,770 faults a round without; 0 with (4 of 31 rounds fault)
    assert reuse_freed_memory(torch.device("cuda")) is False  # GPU runs: host memory is left to glibc's defaults


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("targets", ["q_proj,lm_head", "q_proj,embed_tokens", "q_proj,v_proj"])
def test_merging_an_adapter_on_the_embeddings_gives_the_trained_model(tmp_path, byte_tokenizer, targets, tie):
    """With tied embeddings, a LoRA on lm_head (or embed_tokens) trains that use of the shared matrix
    alone; the merged model (what evaluate.py and `memory merge` load) gives the adapter model's
    logits, also after save_pretrained and a reload, instead of changing the other use too. Untied
    embeddings keep their own two matrices, and the merge gives the adapter model's logits too; an
    adapter on neither leaves tied embeddings tied."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    base = make_tiny_llama(byte_tokenizer, hidden=32, layers=1, tie=tie)
    base.save_pretrained(tmp_path / "base")
    lora = add_lora(base, 4, 8.0, targets)
    for name, w in lora.named_parameters():
        if "lora_" in name:  # lora_B and an embedding's lora_embedding_A start at zero: make the adapter matter
            torch.nn.init.normal_(w, std=0.3)
    lora.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = lora(input_ids=ids).logits
        merged = load_merged(tmp_path / "adapter", base=str(tmp_path / "base"))
        assert (want - LlamaForCausalLM.from_pretrained(tmp_path / "base")(input_ids=ids).logits).abs().max() > 0.1
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        assert merged.config.tie_word_embeddings == (tie and targets == "q_proj,v_proj")
        merged.save_pretrained(tmp_path / "merged")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(again(input_ids=ids).logits, want, atol=1e-5, rtol=0)


def saved_adapter(tmp_path, tokenizer, rank=4):
    """lora_model's adapter on a fresh tiny model, saved to tmp_path/adapter: (folder, adapter model)."""
    lora = lora_model(make_tiny_llama(tokenizer), rank)
    lora.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", lora


def test_a_resumed_adapter_trains_its_adapters_only(tmp_path, byte_tokenizer):
    """Continuing from a saved adapter folder: its adapter weights require gradients (and get them), the
    base weights do not."""
    folder, _ = saved_adapter(tmp_path, byte_tokenizer)
    policy = add_lora(make_tiny_llama(byte_tokenizer), rank=4, alpha=8.0, targets="q_proj,v_proj,down_proj",
                      adapter=folder)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and trainable == {n for n, _ in policy.named_parameters() if "lora_" in n}
    policy.train()
    policy(input_ids=IDS).logits.sum().backward()
    assert all(policy.get_parameter(n).grad is not None for n in trainable)


def test_a_saved_adapter_of_another_rank_is_refused(tmp_path, byte_tokenizer):
    """Resuming an adapter of rank 4 with rank 8 asked for is a ConfigError, not a silent rank-4 run."""
    folder, _ = saved_adapter(tmp_path, byte_tokenizer, rank=4)
    with pytest.raises(ConfigError, match="the saved adapter has rank 4, --lora_rank is 8"):
        add_lora(make_tiny_llama(byte_tokenizer), rank=8, alpha=8.0, targets="q_proj,v_proj,down_proj", adapter=folder)


def test_all_linear_adapts_every_linear_layer_but_the_head(tiny_llama):
    """targets="all-linear" (the default --lora_targets) puts an adapter on each of the 7 linear layers of every
    decoder layer (the tiny model has 2) and none on lm_head."""
    policy = add_lora(tiny_llama, rank=4, alpha=8.0, targets="all-linear")
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.named_parameters() if ".lora_A." in n}
    assert len(adapted) == 2 * 7 and not any("lm_head" in n for n in adapted)


def test_a_new_adapter_has_no_dropout(tiny_llama):
    """In training mode the LoRA policy is deterministic: two forward passes give the same logits, as the
    old-policy and current-policy log-probs of a PPO step must."""
    policy = lora_model(tiny_llama).train()
    with torch.no_grad():
        torch.testing.assert_close(policy(input_ids=IDS).logits, policy(input_ids=IDS).logits, atol=0, rtol=0)


def test_merging_onto_a_given_base_uses_that_base_in_the_dtype_asked(tmp_path, byte_tokenizer):
    """load_merged(adapter, base=B) loads B even when the adapter's config names another base model, and
    dtype=bfloat16 (`memory merge --dtype bfloat16`) gives bfloat16 weights."""
    make_tiny_llama(byte_tokenizer).save_pretrained(tmp_path / "base")
    folder, lora = saved_adapter(tmp_path, byte_tokenizer)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "moved-away")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with torch.no_grad():
        merged = load_merged(folder, base=str(tmp_path / "base"))
        torch.testing.assert_close(merged(input_ids=IDS).logits, lora(input_ids=IDS).logits, atol=1e-5, rtol=0)
    merged = load_merged(folder, dtype=torch.bfloat16, base=str(tmp_path / "base"))
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}


def test_merge_without_out_or_with_no_command_is_a_usage_error_before_anything_loads(tmp_path, byte_tokenizer,
                                                                                      monkeypatch, capsys):
    """`memory merge ADAPTER` with no --out would load and merge the model, then fail to save it."""
    import searchlite.memory
    from searchlite.memory import main as merge_cli

    folder, _ = saved_adapter(tmp_path, byte_tokenizer)
    monkeypatch.setattr(searchlite.memory, "load_merged", lambda *a: pytest.fail("the model was loaded"))
    for argv, missing in (([], ""), (["merge", str(folder)], "--out")):
        with pytest.raises(SystemExit) as stop:
            merge_cli(argv)
        assert stop.value.code == 2 and "the following arguments are required: " + missing in capsys.readouterr().err


def test_an_adapter_whose_base_model_is_gone_names_it_and_how_to_pass_another(tmp_path, byte_tokenizer):
    """The base an adapter names has moved: load_merged says which, and `memory merge` gives the same
    message as a one-line error, not a traceback."""
    from searchlite.memory import main as merge_cli

    folder, _ = saved_adapter(tmp_path, byte_tokenizer)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "moved-away")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    message = (re.escape(f"{folder} is a LoRA adapter whose base model '{tmp_path / 'moved-away'}' cannot be loaded (")
               + ".+" + re.escape(f"); pass the base with `python -m searchlite.memory merge {folder} --base PATH "
                                  "--out DIR`") + "$")
    with pytest.raises(OSError, match="^" + message):
        load_merged(folder)
    with pytest.raises(SystemExit, match="^error: " + message):
        merge_cli(["merge", str(folder), "--out", str(tmp_path / "merged")])
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("saved, rank", [("full", 4), ("adapter", 0)])
def test_resume_with_the_other_kind_of_checkpoint_is_a_config_error(tmp_path, saved, rank):
    """--resume whose checkpoint holds full weights with --lora_rank > 0, or an adapter with --lora_rank 0, is
    refused before any model is loaded, naming what it holds; a fresh run there (it sets the old one aside)
    is not."""
    policy = tmp_path / "checkpoint" / "policy"
    policy.mkdir(parents=True)
    (tmp_path / "checkpoint" / "trainer.pt").write_bytes(b"")
    (policy / ("config.json" if saved == "full" else "adapter_config.json")).write_text("{}")
    held = "full weights" if saved == "full" else "a LoRA adapter"
    with pytest.raises(ConfigError, match=f"holds {held} but --lora_rank is {rank}; resume with the run's own"):
        check_levers(Config(out_dir=str(tmp_path), resume=True, lora_rank=rank))
    check_levers(Config(out_dir=str(tmp_path), resume=True, lora_rank=4 if saved == "adapter" else 0))
    check_levers(Config(out_dir=str(tmp_path), resume=False, lora_rank=rank))
