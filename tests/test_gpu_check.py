"""bench/gpu_check.py's code path on CPU (--tiny): the one GPU check runs the same steps."""

import contextlib
import io
import math
import re
import sys
from types import SimpleNamespace

import pytest
import torch
import train
from conftest import load_bench

from searchlite import advantages, rollout, sampler
from searchlite.config import TOY_DIR
from searchlite.data import Passage
from searchlite.models import load_tokenizer


@pytest.fixture(scope="module")
def gpu_check():
    return load_bench("gpu_check")


def test_tiny_grpo_step_reports_throughput(gpu_check, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bm25s", None)  # as on a GPU machine with torch + transformers only
    result = gpu_check.main(["--tiny"])
    out = capsys.readouterr().out
    assert result["trajectories"] == 4 and result["sampled_tokens"] > 0
    assert all(math.isfinite(result[k]) and result[k] > 0 for k in ("rollout_tok_s", "update_tok_s"))
    assert "word-overlap search" in out and "reference offload: not checked on CPU" in out
    assert "scoring: reference log-probs" in out  # GRPO's one on-policy step, as train.py: no old-log-prob pass


def test_word_overlap_retriever_ranks_by_shared_words(gpu_check):
    passages = [Passage("a", "Oslo", "a city in Norway"), Passage("b", "Ada", "Ada founded Norway Steel in Oslo")]
    hits = gpu_check.WordOverlapRetriever(passages).search(["who founded norway steel"], k=2)[0]
    assert [h.id for h in hits] == ["b", "a"] and hits[0].score == 3.0
    assert [len(h) for h in gpu_check.WordOverlapRetriever(passages).search(["oslo", "norway"], k=1)] == [1, 1]


def test_explicit_flags_win_over_tiny_defaults(gpu_check):
    tiny, full = gpu_check.parse(["--tiny"]), gpu_check.parse([])
    assert (tiny.questions, tiny.group, tiny.max_new_tokens) == (2, 2, 8)
    assert (full.questions, full.group, full.max_new_tokens) == (8, 5, 128)
    given = gpu_check.parse(["--tiny", "--questions", "8", "--group", "5", "--max_new_tokens", "128"])
    assert (given.questions, given.group, given.max_new_tokens) == (8, 5, 128)  # equal to the defaults: still kept


@pytest.mark.parametrize("flags, message", [
    (["--group", "1"], "--group: must be at least 2"),
    # float16 is a torch dtype too: it got through parse, and the step ran in a dtype train.py refuses to train in
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
])
def test_a_group_below_two_or_a_dtype_outside_the_choices_is_an_argument_error(gpu_check, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse(["--tiny", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def spied_tiny_run(gpu_check):
    """One --tiny run (2 questions x group 3, 1 turn, micro-batches of 4, seed 3) with its rollout (searches set to
    0, 1, 0, 1, ...), sampler, advantages, model and update recorded, and a clock whose k-th reading is 2**k
    (rollout 8 s, update 128 s)."""
    seen = {"group": [], "cfg": [], "dtype": [], "rollout_kw": []}
    real_rollout, real_groups, real_update, real_qwen = rollout.rollout, advantages.group_advantages, train.update, \
        gpu_check.random_qwen

    def spy_rollout(*args, **kw):
        seen["rollout_kw"].append(kw)
        seen["ro"] = real_rollout(*args, **kw)
        seen["ro"].searches = torch.arange(len(seen["ro"])).remainder(2)  # a random model rarely searches
        return seen["ro"]

    class Sampler(sampler.HFSampler):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            seen["sampler"] = self

    def spy_groups(scores, group, *args, **kw):
        seen["group"].append(group)
        return real_groups(scores, group, *args, **kw)

    def spy_update(cfg, *args, **kw):
        seen["cfg"].append(cfg)
        return real_update(cfg, *args, **kw)

    def spy_qwen(shape, tokenizer, dtype, device):
        seen["dtype"].append(dtype)
        seen["policy"] = real_qwen(shape, tokenizer, dtype, device)
        return seen["policy"]

    ticks = iter(range(1, 100))
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setitem(sys.modules, "bm25s", None)
        mp.setattr(rollout, "rollout", spy_rollout)
        mp.setattr(sampler, "HFSampler", Sampler)
        mp.setattr(advantages, "group_advantages", spy_groups)
        mp.setattr(train, "update", spy_update)
        mp.setattr(gpu_check, "random_qwen", spy_qwen)
        mp.setattr(gpu_check, "sync", lambda device: float(2 ** next(ticks)))
        seen["result"] = gpu_check.main(["--tiny", "--questions", "2", "--group", "3", "--max_turns", "1",
                                         "--micro_batch_size", "4", "--seed", "3"])
    seen["out"] = out.getvalue()
    return seen


def test_tiny_run_batch_is_questions_times_group_as_printed(spied_tiny_run):
    ro, out = spied_tiny_run["ro"], spied_tiny_run["out"]
    assert spied_tiny_run["result"]["trajectories"] == len(ro) == 6
    assert "rollout: 6 trajectories (2 questions x 3)" in out
    assert "in all, 0.50 searches each" in out  # 3 of the 6 searched once


def test_tiny_run_token_counts_are_the_rollouts(spied_tiny_run):
    ro, result = spied_tiny_run["ro"], spied_tiny_run["result"]
    assert result["sampled_tokens"] == int(ro.loss_mask.sum()) < int(ro.attention_mask.sum())
    assert result["update_tokens"] == int(ro.attention_mask.sum())  # one epoch: each token through once


def test_tiny_run_tokens_per_second_divide_by_their_own_phase(spied_tiny_run):
    result, out = spied_tiny_run["result"], spied_tiny_run["out"]
    # sync readings 2**1 .. 2**8: the build between readings 1 and 2 (2 s), rollout between 3 and 4 (8 s),
    # scoring between 5 and 6 (32 s), update between 7 and 8 (128 s)
    assert "gradient checkpointing, built in 2.0s\n" in out and "scoring: reference log-probs, 32.0s\n" in out
    assert result["rollout_tok_s"] == result["sampled_tokens"] / 8
    assert result["update_tok_s"] == result["update_tokens"] / 128
    assert f"rollout tokens/s: {result['sampled_tokens'] / 8:,.0f}\n" in out
    assert f"update tokens/s:  {result['update_tokens'] / 128:,.0f}\n" in out
    assert result["peak_gib"] is None and "peak GPU memory" not in out  # on a CPU: no GPU memory to report


def test_tiny_run_flags_reach_config_rollout_sampler_and_advantages(spied_tiny_run):
    (cfg,) = spied_tiny_run["cfg"]
    assert (cfg.batch_size, cfg.group, cfg.micro_batch_size, cfg.max_turns, cfg.seed) == (2, 3, 4, 1, 3)
    assert spied_tiny_run["rollout_kw"][0]["max_turns"] == 1
    assert spied_tiny_run["sampler"].seed == 3 and spied_tiny_run["sampler"].max_new_tokens == 8
    assert spied_tiny_run["group"] == [3]


def test_tiny_run_policy_is_float32_computing_in_bf16_with_checkpointing(spied_tiny_run):
    policy = spied_tiny_run["policy"]
    assert spied_tiny_run["dtype"] == [torch.float32] and policy.dtype == torch.float32
    assert policy.searchlite_compute_dtype == torch.bfloat16 and policy.is_gradient_checkpointing


def test_tiny_run_counts_the_tiny_qwens_parameters(spied_tiny_run):
    # embeddings 3000 x 64 (tied head); per layer q 64x64+64, k and v 64x32+32, o 64x64, MLP 3 x 64x128, 2 norms 64;
    # final norm 64
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert spied_tiny_run["result"]["params_b"] == (3000 * 64 + 2 * layer + 64) / 1e9 == 266304 / 1e9
    assert "model: random Qwen2, 0.3M parameters in float32 computing in bfloat16, " in spied_tiny_run["out"]


def test_bf16_weights_builds_the_policy_in_dtype_and_a_full_run_builds_qwen25_3bs_shape(gpu_check, monkeypatch,
                                                                                          capsys):
    built = []

    class Built(Exception):
        pass

    def record(shape, tokenizer, dtype, device):
        built.append((shape, dtype, device))
        raise Built  # nothing after the build is needed

    def stop(corpus):
        raise Built

    with monkeypatch.context() as mp:
        mp.setattr(gpu_check, "random_qwen", record)
        with pytest.raises(Built):
            gpu_check.main(["--tiny", "--bf16_weights"])
        with pytest.raises(Built):  # without --tiny (on the CPU here, and stopped before the 3B model is made)
            gpu_check.main(["--device", "cpu"])
    cpu = torch.device("cpu")
    assert built == [(gpu_check.TINY, torch.bfloat16, cpu), (gpu_check.QWEN25_3B, torch.float32, cpu)]
    monkeypatch.setattr(gpu_check, "toy_retriever", stop)  # once the model line is printed
    with pytest.raises(Built):
        gpu_check.main(["--tiny", "--bf16_weights"])
    assert "M parameters in bfloat16, gradient checkpointing, built in " in capsys.readouterr().out


@pytest.mark.parametrize("loss, grad_norm", [(math.nan, 1.0), (0.5, math.inf), (0.5, 0.0)])
def test_an_update_without_a_finite_loss_and_a_gradient_stops_the_check(gpu_check, monkeypatch, loss, grad_norm):
    """A NaN loss, an infinite gradient or none at all (a broken step) is not reported as a speed."""
    monkeypatch.setitem(sys.modules, "bm25s", None)
    monkeypatch.setattr(train, "update", lambda *args, **kw: {"loss": [loss], "grad_norm": [grad_norm]})
    with pytest.raises(FloatingPointError, match=f"^update: loss {loss}, grad norm {grad_norm}$"):
        gpu_check.main(["--tiny"])


def test_an_update_with_a_finite_loss_and_any_gradient_passes(gpu_check, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bm25s", None)
    monkeypatch.setattr(train, "update", lambda *args, **kw: {"loss": [0.5], "grad_norm": [0.25]})
    assert gpu_check.main(["--tiny"])["loss"] == 0.5
    assert "update: loss 0.5000, grad norm 0.250," in capsys.readouterr().out


def test_full_run_defaults_are_those_its_help_names(gpu_check, capsys):
    args = gpu_check.parse([])
    assert (args.device, args.dtype, args.bf16_weights, args.seed) == ("", "bfloat16", False, 0)
    with pytest.raises(SystemExit):
        gpu_check.parse(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in ("max_turns", "micro_batch_size"):
        said = re.search(rf"--{flag} \S+ [^()]*\(default (\d+)\)", help_text)
        assert said and int(said.group(1)) == getattr(args, flag), flag


def test_gpu_is_local_rank_and_its_memory_printed_in_gib(gpu_check, monkeypatch, capsys):
    """cuda:LOCAL_RANK by default and for --device cuda (torch.cuda.set_device refuses a device
    without an index), the index given otherwise; the card's name and memory are printed."""
    chosen = []

    def set_device(device):  # as torch's: an index is required
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        chosen.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert gpu_check.pick_device(gpu_check.parse([])) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert gpu_check.pick_device(gpu_check.parse([])) == torch.device("cuda", 3)
    assert capsys.readouterr().out.splitlines()[-1] == "device: Fake GPU (cuda:3), 80 GiB"
    assert gpu_check.pick_device(gpu_check.parse(["--device", "cuda"])) == torch.device("cuda", 3)
    assert gpu_check.pick_device(gpu_check.parse(["--device", "cuda:1"])) == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", i) for i in (0, 3, 3, 1)]


def test_no_visible_gpu_is_a_one_line_error_pointing_at_tiny(gpu_check, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"^error: no CUDA device is visible .*use --tiny for the CPU path$"):
        gpu_check.pick_device(gpu_check.parse(["--device", "cuda"]))


def test_random_qwen_suppresses_exactly_the_ids_without_text(gpu_check):
    tok = load_tokenizer(str(TOY_DIR))
    model = gpu_check.random_qwen(gpu_check.TINY, tok, torch.float32, torch.device("cpu"))
    assert model.generation_config.suppress_tokens == list(range(len(tok), 3000))
    same = gpu_check.random_qwen({**gpu_check.TINY, "vocab_size": len(tok)}, tok, torch.float32, torch.device("cpu"))
    assert same.generation_config.suppress_tokens == []  # a vocabulary the tokenizer's size: nothing to suppress


def test_random_qwen_is_built_in_its_dtype_and_refuses_a_vocabulary_short_of_the_tokenizer(gpu_check):
    """Weights in the dtype asked (the --bf16_weights path), torch's default dtype as it was after, and a
    vocabulary smaller than the tokenizer's refused by name (the tokenizer's last ids would index past the
    embedding)."""
    tok = load_tokenizer(str(TOY_DIR))
    model = gpu_check.random_qwen(gpu_check.TINY, tok, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    with pytest.raises(ValueError, match=rf"^model vocabulary {len(tok) - 1} is smaller than the tokenizer's "
                                         rf"{len(tok)}$"):
        gpu_check.random_qwen({**gpu_check.TINY, "vocab_size": len(tok) - 1}, tok, torch.float32, torch.device("cpu"))


def test_a_sampler_that_ignores_suppress_tokens_stops_the_check(gpu_check, monkeypatch):
    """Ids past the tokenizer's (the random Qwen's vocabulary is larger) are refused after the rollout, by
    name (without the raise, test_gpu_check passed, and the step went on with ids that have no text);
    so is len(tokenizer) alone, the first id past them."""
    real = gpu_check.random_qwen

    def unsuppressed(*args):
        model = real(*args)
        model.generation_config.suppress_tokens = None
        return model

    def first_past(shape, tok, *args):  # every id suppressed but len(tok), the first the tokenizer lacks
        model = real(shape, tok, *args)
        model.generation_config.suppress_tokens = [i for i in range(shape["vocab_size"]) if i != len(tok)]
        return model

    for fake in (unsuppressed, first_past):
        monkeypatch.setattr(gpu_check, "random_qwen", fake)
        with pytest.raises(RuntimeError, match="^the sampler produced ids the tokenizer does not have: "
                                               "suppress_tokens was ignored$"):
            gpu_check.main(["--tiny"])


def test_the_full_shape_has_qwen25_3bs_parameter_counts(gpu_check):
    """Its model card: 3.09B parameters, 2.77B of them not embeddings (tied: one matrix for both ends);
    exactly, its checkpoint's model.safetensors.index.json: total_size 6,171,877,376 bytes of bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**gpu_check.QWEN25_3B))
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    assert (round(total / 1e9, 2), round((total - embedding) / 1e9, 2)) == (3.09, 2.77)
    assert 2 * total == 6_171_877_376  # one more row of the MLP or the vocabulary, and the shape is not Qwen's
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # what its config.json says beside the shape (Qwen2Config's own default rope_theta is 10,000)
    rope, cfg = model.config.rope_parameters, model.config
    assert (rope["rope_theta"], cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e6, 1e-6, 32768)
