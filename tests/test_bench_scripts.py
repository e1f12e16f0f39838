"""bench/update_bench.py, rollout_bench.py and sampler_bench.py: the speeds and ratios they print,
from stand-in models, samplers and clocks, and which flags reach what they time; realqa_eval.sh's
--help. Nothing here times a model (memory_bench, retrieval_bench and gpu_check: their own files)."""

import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from conftest import load_bench, make_tiny_llama

from searchlite.data import QA
from searchlite.losses import token_logprobs


def clock(steps):
    """A stand-in for time.perf_counter: call i returns the sum of steps[:i + 1]."""
    state = {"now": 0.0, "i": 0}

    def now():
        state["now"] += steps[state["i"]]
        state["i"] += 1
        return state["now"]
    return now


class Batch(SimpleNamespace):
    """A Rollout-like batch (what the scripts read of it)."""

    def __len__(self):
        return self.loss_mask.shape[0]


def batch(policy_tokens=(10, 10, 9), width=40):
    """Row i: policy_tokens[i] policy tokens among `width` real ones; turns 1, 2, 2; searches 0, 1, 1."""
    n = len(policy_tokens)
    loss_mask = torch.tensor([[1] * k + [0] * (width - k) for k in policy_tokens])
    return Batch(loss_mask=loss_mask, attention_mask=torch.ones(n, width, dtype=torch.long),
                 turns=torch.tensor([1, 2, 2][:n]), searches=torch.tensor([0, 1, 1][:n]))


@pytest.mark.parametrize("name", ["rollout_bench", "sampler_bench", "update_bench"])
def test_repeats_must_be_positive(name, monkeypatch, capsys):
    bench = load_bench(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--repeats", "0"])
    with pytest.raises(SystemExit) as e:
        bench.main()  # an argparse error, before any model is loaded
    assert e.value.code == 2 and "--repeats: must be at least 1" in capsys.readouterr().err


def test_rollout_bench_missing_realqa_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    rollout_bench = load_bench("rollout_bench")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["rollout_bench.py", "--realqa", "no-realqa"])
    with pytest.raises(SystemExit) as e:
        rollout_bench.main()  # exits before loading a model or a corpus
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.count("\n") == 1 and "no-realqa/corpus.jsonl" in err and "omit --realqa" in err


def test_realqa_eval_help_needs_no_data():
    """--help prints the script's header (what it runs, its environment) even where the data is missing."""
    script = Path(__file__).resolve().parents[1] / "bench" / "realqa_eval.sh"
    res = subprocess.run(["bash", str(script), "--help"], env={**os.environ, "REALQA": "/nowhere"},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "Environment: REALQA (data folder)" in res.stdout, res.stderr
    assert "python evaluate.py --help" in res.stdout and "#" not in res.stdout.splitlines()[0]


# ---------------------------------------------------------------------------- update_bench

@pytest.fixture()
def stubbed_update_bench(monkeypatch):
    """bench/update_bench.py with its model, rollout and training steps replaced by recorders: 3 trajectories of
    40 tokens, 29 of them policy tokens, in micro-batches of widths 30 (2 rows) and 20 (1 row)."""
    bench = load_bench("update_bench")
    seen = {"argv": [], "questions": [], "score_kw": [], "sizes": [], "bare_sizes": [], "updates": 0, "training": []}
    real_parse = bench.parse_args

    def parse_args(argv, prog):
        seen["argv"].append(argv)
        return real_parse(argv, prog=prog)

    def rollout(sampler, retriever, tok, protocol, questions, **kw):
        seen["questions"].append(questions)
        return batch()

    def micro_batches(n, size, lengths):
        seen["sizes"].append(size)
        return [[0, 1], [2]]

    def update(cfg, step, policy, *args):
        seen["updates"] += 1
        seen["training"].append(policy.training)

    def bare_step(policy, opt, ro, size):
        seen["bare_sizes"].append(size)
        seen["training"].append(policy.training)

    widths = {2: 30, 1: 20}
    fake_train = SimpleNamespace(
        micro_batches=micro_batches, trim=lambda ro, rows: (torch.zeros(len(rows), widths[len(rows)]), None, None),
        score_tokens=lambda *args, **kw: seen["score_kw"].append(kw), make_optimizer=lambda *args: (None, None),
        update=update)
    monkeypatch.setattr(bench, "train", fake_train)
    monkeypatch.setattr(bench, "parse_args", parse_args)
    monkeypatch.setattr(bench, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(bench, "load_policy", lambda path: torch.nn.Linear(1, 1).eval())  # as from_pretrained leaves it
    monkeypatch.setattr(bench, "read_qa", lambda path: [QA(f"q{i}", f"q{i}?", ["a"]) for i in range(20)])
    monkeypatch.setattr(bench, "HFSampler", lambda *args, **kw: None)
    monkeypatch.setattr(bench, "build_retriever", lambda kind, corpus: None)
    monkeypatch.setattr(bench, "get_protocol", lambda protocol, template: None)
    monkeypatch.setattr(bench, "rollout", rollout)
    monkeypatch.setattr(bench, "bare_step", bare_step)
    # each round: update, then bare loop; round 0 (warm-up) 1 s + 1 s, then updates 2, 4, 9 s and bare loops 3, 1, 5 s
    steps = [0, 1, 1] + [x for u, b in ((2, 3), (4, 1), (9, 5)) for x in (0, u, b)]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=clock(steps)))
    return bench, seen


def test_update_bench_prints_medians_and_bare_over_update_ratio(stubbed_update_bench, monkeypatch, capsys):
    bench, seen = stubbed_update_bench
    monkeypatch.setattr(sys, "argv", ["update_bench.py", "--repeats", "3"])
    bench.main()
    out = capsys.readouterr().out.splitlines()
    assert seen["updates"] == 4  # a warm-up round, then 3 counted
    assert seen["training"] == [True] * 8  # both timed in training mode, as train.py updates
    # medians: update 4 s (of 2, 4, 9), bare 3 s (of 3, 1, 5); 29 policy tokens
    assert out[-1] == ("train.update: 7 policy tokens/s (4.00s); bare loop: 10 policy tokens/s (3.00s); "
                       "ratio 0.750 (goal >= 0.9), medians of 3")


def test_update_bench_batch_line_counts_policy_tokens_and_lm_head_columns(stubbed_update_bench, monkeypatch, capsys):
    bench, seen = stubbed_update_bench
    monkeypatch.setattr(sys, "argv", ["update_bench.py", "--repeats", "3"])
    bench.main()
    assert capsys.readouterr().out.splitlines()[0] == (
        "batch: 3 trajectories, 120 tokens, 29 policy tokens, micro-batches of 10 ([toy] preset, temperature 0.7); "
        "the LM head runs on the 29 positions that predict a policy token, 36% of the micro-batches' 80 columns")


def test_update_bench_defaults_reach_the_toy_config_rollout_and_both_loops(stubbed_update_bench, monkeypatch):
    bench, seen = stubbed_update_bench
    monkeypatch.setattr(sys, "argv", ["update_bench.py", "--repeats", "3"])
    bench.main()
    assert seen["argv"] == [["--preset", "toy", "--group", "5", "--batch_size", "16", "--lr", "1e-5"]]
    (questions,) = seen["questions"]
    assert len(questions) == 80 and len(set(questions)) == 16 and questions[:6] == ["q0?"] * 5 + ["q1?"]
    assert seen["score_kw"] == [{"temperature": 0.7}]  # old log-probs at the sampling temperature, as train.py
    assert seen["bare_sizes"] == [10] * 4  # the bare loop in train.update's micro-batches of 10


def test_update_bench_without_flags_times_the_toy_model_5_times_and_its_flags_reach_the_batch(stubbed_update_bench,
                                                                                             monkeypatch):
    """With no flags: the toy warm start, a warm-up round and 5 counted; --model, --questions, --group and
    --repeats, given, reach what is loaded, the batch and the rounds (as numbers: a batch of "3" failed)."""
    bench, seen = stubbed_update_bench
    loaded = []
    monkeypatch.setattr(bench, "load_tokenizer", lambda path: loaded.append(("tokenizer", path)))
    monkeypatch.setattr(bench, "load_policy", lambda path: loaded.append(("policy", path)) or torch.nn.Linear(1, 1))
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=clock([1] * 18)))  # 6 rounds of 3 readings
    monkeypatch.setattr(sys, "argv", ["update_bench.py"])
    bench.main()
    assert loaded == [("tokenizer", "toy/model"), ("policy", "toy/model")] and seen["updates"] == 6
    loaded.clear()
    monkeypatch.setattr(sys, "argv", ["update_bench.py", "--model", "elsewhere", "--questions", "3", "--group", "2",
                                      "--repeats", "1"])
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=clock([1] * 6)))
    bench.main()
    assert loaded == [("tokenizer", "elsewhere"), ("policy", "elsewhere")] and seen["updates"] == 6 + 2
    assert seen["argv"][-1] == ["--preset", "toy", "--group", "2", "--batch_size", "3", "--lr", "1e-5"]
    assert seen["questions"][-1] == ["q0?", "q0?", "q1?", "q1?", "q2?", "q2?"]


def test_update_bench_bare_step_takes_the_gradient_of_the_token_mean_nll(byte_tokenizer):
    """Micro-batches of 2 rows, each cut to its width, sum to the gradient of -(mean log-prob of the
    policy tokens) over the whole batch, as one pass over whole rows gives it."""
    bench = load_bench("update_bench")
    model = make_tiny_llama(byte_tokenizer, seed=4)
    g = torch.Generator().manual_seed(0)
    lengths = [9, 6, 4]  # real tokens a row; the rest padding
    attention_mask = torch.tensor([[1] * k + [0] * (9 - k) for k in lengths])  # (3, 9)
    loss_mask = attention_mask * (torch.rand(3, 9, generator=g) < 0.6)  # (3, 9)
    loss_mask[:, 0], loss_mask[0, 8] = 0, 1
    ro = Batch(input_ids=torch.randint(3, 200, (3, 9), generator=g), attention_mask=attention_mask,
               loss_mask=loss_mask)
    logits = model(input_ids=ro.input_ids, attention_mask=attention_mask).logits  # (3, 9, V)
    (-(token_logprobs(logits, ro.input_ids) * loss_mask).sum() / loss_mask.sum()).backward()  # whole rows
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = {}
    opt = SimpleNamespace(step=lambda: got.update({n: p.grad.clone() for n, p in model.named_parameters()}),
                          zero_grad=lambda set_to_none: model.zero_grad(set_to_none=set_to_none))
    bench.bare_step(model, opt, ro, 2)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step


def test_update_bench_bare_loop_groups_micro_batches_as_update(monkeypatch):
    bench = load_bench("update_bench")
    seen = []
    monkeypatch.setattr(bench.train, "micro_batches", lambda n, size, lengths: seen.append((n, size)) or [])
    opt = SimpleNamespace(step=lambda: seen.append("step"), zero_grad=lambda set_to_none: seen.append("zero"))
    bench.bare_step(None, opt, batch(), 10)
    assert seen == [(3, 10), "step", "zero"]


# ---------------------------------------------------------------------------- rollout_bench

def test_rollout_bench_bm25_speed_compares_batched_with_up_to_100_single_queries(monkeypatch, tmp_path, capsys):
    rollout_bench = load_bench("rollout_bench")
    searches = []
    retriever = SimpleNamespace(search=lambda queries, k: searches.append((len(queries), k)))
    monkeypatch.setattr("searchlite.retrieval.build_retriever", lambda kind, corpus: retriever)
    monkeypatch.setattr("searchlite.data.read_qa", lambda path: [QA(f"q{i}", f"q{i}?", ["a"]) for i in range(150)])
    # build 2 s (from a clock reading 5 s); batched 150 queries in 3 s (50/s); 100 single ones in 10 s (10/s)
    monkeypatch.setattr(rollout_bench, "time", SimpleNamespace(perf_counter=clock([5, 2, 8, 3, 7, 10])))
    rollout_bench.bm25_speed(tmp_path)
    assert searches == [(1, 3), (150, 3)] + [(1, 3)] * 100  # an untimed warm-up, the batch, 100 single queries
    assert capsys.readouterr().out == (f"bm25s on {tmp_path / 'corpus.jsonl'}: index build 2.00s; HotpotQA-500 top-3: "
                                       "batched 5.0x the queries/s of one at a time (50 vs 10 queries/s)\n")
    # a file of 40 questions: 40 single queries in 4 s (10/s), not 100
    monkeypatch.setattr("searchlite.data.read_qa", lambda path: [QA(f"q{i}", f"q{i}?", ["a"]) for i in range(40)])
    monkeypatch.setattr(rollout_bench, "time", SimpleNamespace(perf_counter=clock([5, 2, 8, 4, 7, 4])))
    rollout_bench.bm25_speed(tmp_path)
    assert capsys.readouterr().out.endswith("batched 1.0x the queries/s of one at a time (10 vs 10 queries/s)\n")


@pytest.fixture()
def stubbed_rollout_efficiency(monkeypatch):
    """rollout_bench.rollout_efficiency over stand-ins: 3 questions whose rollout samples 10, 10 and 9 tokens
    (turns 1, 2, 2; searches 0, 1, 1), on a clock where each counted rollout takes 4 s (2 s inside generate) and
    the plain calls take 8, 3.625 and 2 s."""
    rollout_bench = load_bench("rollout_bench")
    seen = {"init": [], "plain": [], "rollout_kw": []}

    class Sampler:
        def __init__(self, model, tok, max_new_tokens, seed):
            seen["init"].append((max_new_tokens, seed))

        def generate(self, prompts, stop=(), max_new_tokens=None):
            if stop == ():
                seen["plain"].append(max_new_tokens)
            return [[0] * max_new_tokens for _ in prompts]

    def rollout(sampler, retriever, tok, protocol, questions, **kw):
        seen["rollout_kw"].append(kw)
        sampler.generate([[1]], stop=("</search>",), max_new_tokens=1)
        return batch()

    monkeypatch.setattr("searchlite.data.read_qa", lambda path: [QA(f"q{i}", f"q{i}?", ["a"]) for i in range(5)])
    monkeypatch.setattr("searchlite.models.load_tokenizer", lambda path: None)
    monkeypatch.setattr("searchlite.models.load_policy", lambda path: None)
    monkeypatch.setattr("searchlite.retrieval.build_retriever", lambda kind, corpus: None)
    monkeypatch.setattr("searchlite.rollout.encode_prompt", lambda tok, protocol, q: [1, 2])
    monkeypatch.setattr("searchlite.rollout.rollout", rollout)
    monkeypatch.setattr("searchlite.sampler.HFSampler", Sampler)
    # a round's readings: rollout start, generate start, generate end, rollout end, then the same for the plain call
    rounds = [(1, 1, 1, 1)] + [(1, 2, 1, plain) for plain in (8, 3.625, 2)]
    steps = [x for a, g, b, p in rounds for x in (0, a, g, b, 0, 0, p, 0)]
    monkeypatch.setattr(rollout_bench, "time", SimpleNamespace(perf_counter=clock(steps)))
    return rollout_bench, seen


def test_rollout_bench_ratio_is_rollout_over_plain_tok_s_median_of_repeats(stubbed_rollout_efficiency, capsys):
    rollout_bench, seen = stubbed_rollout_efficiency
    rollout_bench.rollout_efficiency("m", n=3, repeats=3, seed=7)
    out = capsys.readouterr().out.splitlines()
    # 29 tokens in 4 s against 30 (3 rows x round(29 / 3)) in 8, 3.625, 2 s: ratios 1.933, 0.876, 0.483
    assert out[0] == ("  repeat 1: rollout 29 tokens in 4.00s (7 tok/s, 1.67 turns, 0.67 searches; 50% of it inside "
                      "generate); plain generate 30 tokens in 8.00s (4 tok/s); ratio 1.933")
    assert [line.rsplit(" ", 1)[1] for line in out[:3]] == ["1.933", "0.876", "0.483"]
    assert out[3] == ("rollout efficiency (multi-turn tok/s / plain generate tok/s), 3 trajectories, m: median 0.876 "
                      "over 3 repeats (goal >= 0.85: met)")


def test_rollout_bench_says_a_median_under_0_85_does_not_meet_the_goal(stubbed_rollout_efficiency, monkeypatch,
                                                                        capsys):
    rollout_bench, _ = stubbed_rollout_efficiency
    monkeypatch.setattr(rollout_bench, "statistics", SimpleNamespace(median=lambda ratios: 0.849))
    rollout_bench.rollout_efficiency("m", n=3, repeats=3, seed=7)
    assert capsys.readouterr().out.splitlines()[3].endswith(": median 0.849 over 3 repeats (goal >= 0.85: not met)")


def test_rollout_bench_sampler_settings_and_seeds_per_round(stubbed_rollout_efficiency, capsys):
    rollout_bench, seen = stubbed_rollout_efficiency
    rollout_bench.rollout_efficiency("m", n=3, repeats=3, seed=7)
    assert seen["init"] == [(64, 7), (64, 8), (64, 9), (64, 10)]  # --seed, then one more each round
    assert [(kw["max_turns"], kw["topk"]) for kw in seen["rollout_kw"]] == [(4, 3)] * 4
    assert seen["plain"] == [10] * 4  # round(29 / 3 trajectories): the rollout's tokens per row, rounded


def test_rollout_bench_n_takes_the_first_n_training_questions(stubbed_rollout_efficiency, capsys):
    """--n 2 of the 5: 2 trajectories. --n 80 beyond them: the 5 it has, and the plain call samples the
    rollout's 29 tokens over those 5 questions (6 each), not over the 80 asked."""
    rollout_bench, seen = stubbed_rollout_efficiency
    rollout_bench.rollout_efficiency("m", n=2, repeats=1, seed=0)
    assert "rollout efficiency (multi-turn tok/s / plain generate tok/s), 2 trajectories" in capsys.readouterr().out
    seen["plain"].clear()
    rollout_bench.rollout_efficiency("m", n=80, repeats=1, seed=0)
    assert "5 trajectories" in capsys.readouterr().out and seen["plain"] == [6, 6]


def test_rollout_bench_flags_and_defaults_reach_the_measurements(monkeypatch, tmp_path):
    rollout_bench = load_bench("rollout_bench")
    calls = []
    monkeypatch.setattr(rollout_bench, "rollout_efficiency", lambda *args: calls.append(("rollout", *args)))
    monkeypatch.setattr(rollout_bench, "bm25_speed", lambda realqa: calls.append(("bm25", realqa)))
    monkeypatch.setattr(sys, "argv", ["rollout_bench.py"])
    rollout_bench.main()
    assert calls == [("rollout", "toy/model", 80, 3, 0)]  # no --realqa: no BM25 part
    for name in rollout_bench.REALQA_FILES:
        (tmp_path / name).write_text("")
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["rollout_bench.py", "--realqa", str(tmp_path), "--model", "mm", "--n", "5",
                                      "--repeats", "2", "--seed", "4"])
    rollout_bench.main()
    assert calls == [("bm25", tmp_path), ("rollout", "mm", 5, 2, 4)]


def test_rollout_bench_realqa_without_the_questions_file_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    rollout_bench = load_bench("rollout_bench")
    (tmp_path / "corpus.jsonl").write_text("")
    monkeypatch.setattr(rollout_bench, "bm25_speed", lambda realqa: pytest.fail("measured without its questions"))
    monkeypatch.setattr(sys, "argv", ["rollout_bench.py", "--realqa", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        rollout_bench.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"no {tmp_path / 'hotpotqa_500.jsonl'};" in err


# ---------------------------------------------------------------------------- sampler_bench

def test_sampler_bench_timed_rollout_counts_policy_tokens_and_turns(monkeypatch):
    sampler_bench = load_bench("sampler_bench")
    kws = []
    monkeypatch.setattr("searchlite.rollout.rollout", lambda *args, **kw: kws.append(kw) or batch())
    # clocks that do not start at 0: the time taken is a difference of two readings
    monkeypatch.setattr(sampler_bench, "time", SimpleNamespace(perf_counter=clock([100, 4]),
                                                               process_time=clock([50, 1])))
    assert sampler_bench.timed_rollout(None, None, None, None, ["q"] * 3) == (29, 4.0, 1.0, pytest.approx(5 / 3))
    assert kws == [{"max_turns": 4, "topk": 3, "max_obs_tokens": 500}]


def test_sampler_bench_timed_generate_counts_sampled_tokens_at_max_new(monkeypatch):
    sampler_bench = load_bench("sampler_bench")
    sampler = SimpleNamespace(generate=lambda prompts, max_new_tokens=64: [[0] * max_new_tokens for _ in prompts])
    # clocks that do not start at 0: the time taken is a difference of two readings
    monkeypatch.setattr(sampler_bench, "time", SimpleNamespace(perf_counter=clock([100, 4]),
                                                               process_time=clock([50, 1])))
    assert sampler_bench.timed_generate(sampler, [[1], [2]], 100) == (200, 4.0, 1.0)


@pytest.fixture()
def stubbed_sampler_bench(monkeypatch):
    """bench/sampler_bench.py's main over stand-ins (no vLLM, no model). Rollouts of 120 tokens: HF's take 4 s then
    2 s of wall time (2 s of CPU), vLLM's 1 s (0.5 s of CPU); plain generate: HF's 8 s, vLLM's 2 s; each weight push
    0.25 s. The warm-up round takes 100 s each."""
    sampler_bench = load_bench("sampler_bench")
    seen = {"vllm": [], "hf": [], "pushed": [], "policy_device": [], "questions": [], "plain_max_new": [],
            "threads": [], "protocol": []}
    policy, random_policy = torch.nn.Linear(1000, 1000), torch.nn.Linear(10, 10)
    policy.config = random_policy.config = "config"

    class VLLM:
        on_cpu = True

        def __init__(self, folder, **kw):
            seen["vllm"].append(kw)

        def push_weights(self, model):
            seen["pushed"].append(model)

    class HF:
        def __init__(self, model, tok, **kw):
            seen["hf"].append(kw)

    def load_policy(folder, device):
        seen["policy_device"].append(device)
        return policy

    rounds = {HF: iter([(120, 100, 100, 1), (120, 4, 2, 1.5), (120, 2, 2, 1.5)]),
              VLLM: iter([(120, 100, 100, 1), (120, 1, 0.5, 1.5), (120, 1, 0.5, 1.5)])}

    def timed_rollout(sampler, retriever, tok, protocol, questions):
        seen["questions"].append(questions)
        return next(rounds[type(sampler)])

    def timed_generate(sampler, prompts, max_new):
        seen["plain_max_new"].append(max_new)
        return len(prompts) * max_new, 8.0 if isinstance(sampler, HF) else 2.0, 1.0

    vllm_sampler = types.ModuleType("searchlite.vllm_sampler")
    vllm_sampler.VLLMSampler = VLLM
    monkeypatch.setitem(sys.modules, "searchlite.vllm_sampler", vllm_sampler)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda config: random_policy)
    monkeypatch.setattr("searchlite.model_spec.model_folder", lambda model: "folder")
    monkeypatch.setattr("searchlite.models.load_tokenizer", lambda folder: None)
    monkeypatch.setattr("searchlite.models.load_policy", load_policy)
    monkeypatch.setattr("searchlite.sampler.HFSampler", HF)
    monkeypatch.setattr("searchlite.retrieval.build_retriever", lambda kind, corpus: None)
    monkeypatch.setattr("searchlite.protocol.get_protocol", lambda *args: seen["protocol"].append(args))
    monkeypatch.setattr("searchlite.data.read_qa", lambda path: [QA(f"q{i}", f"q{i}?", ["a"]) for i in range(20)])
    monkeypatch.setattr("searchlite.rollout.encode_prompt", lambda tok, protocol, q: [1])
    monkeypatch.setattr(sampler_bench, "timed_rollout", timed_rollout)
    monkeypatch.setattr(sampler_bench, "timed_generate", timed_generate)
    monkeypatch.setattr(sampler_bench, "time", SimpleNamespace(perf_counter=clock([0.25] * 20)))
    monkeypatch.setattr(sampler_bench.torch, "set_num_threads", seen["threads"].append)
    return sampler_bench, seen, policy, random_policy


def test_sampler_bench_prints_median_speeds_and_vllm_over_hf_ratios(stubbed_sampler_bench, monkeypatch, capsys):
    sampler_bench, seen, policy, random_policy = stubbed_sampler_bench
    monkeypatch.setattr(sys, "argv", ["sampler_bench.py", "--repeats", "2"])
    sampler_bench.main()
    out = capsys.readouterr().out.splitlines()
    # HF: 120 tokens in 4 s and 2 s (30, 60 tok/s: median 45; CPU 60), vLLM 120 tok/s (CPU 240)
    assert ("rollout, 80 trajectories (16 questions x group 5), toy/model, medians of 2: HFSampler 45 tok/s, "
            "VLLMSampler 120 tok/s, ratio 2.67; per CPU second: 60 vs 240, ratio 4.00") in out
    # plain generate: 80 prompts x 100 tokens, HF in 8 s (1,000 tok/s), vLLM in 2 s (4,000 tok/s)
    assert "  plain generate hf  : 8000 tokens in 8.00s = 1,000 tok/s (CPU 1.00s)" in out
    assert "plain generate, 80 prompts x 100 tokens, random weights: ratio 4.00" in out
    assert out[-1] == "push_weights: 250 ms for 1.00M parameters (median of 5)"


def test_sampler_bench_batch_and_plain_calls_follow_the_flags(stubbed_sampler_bench, monkeypatch, capsys):
    sampler_bench, seen, policy, random_policy = stubbed_sampler_bench
    monkeypatch.setattr(sys, "argv", ["sampler_bench.py", "--repeats", "2", "--questions", "3", "--group", "2"])
    sampler_bench.main()
    assert len(seen["questions"]) == 6  # 3 rounds (1 warm-up) x 2 samplers
    assert seen["questions"][0] == ["q0?", "q0?", "q1?", "q1?", "q2?", "q2?"]
    assert seen["plain_max_new"] == [8, 100, 8, 100]  # a warm-up, then the printed 100 tokens each


def test_sampler_bench_names_the_questions_it_had_beyond_the_training_set(stubbed_sampler_bench, monkeypatch,
                                                                          capsys):
    sampler_bench = stubbed_sampler_bench[0]
    monkeypatch.setattr(sys, "argv", ["sampler_bench.py", "--repeats", "2", "--questions", "30", "--group", "2"])
    sampler_bench.main()  # 30 asked of the 20 training questions
    assert "rollout, 40 trajectories (20 questions x group 2)" in capsys.readouterr().out


def test_sampler_bench_defaults_reach_both_samplers_on_vllms_device(stubbed_sampler_bench, monkeypatch, capsys):
    sampler_bench, seen, policy, random_policy = stubbed_sampler_bench
    monkeypatch.setattr(sys, "argv", ["sampler_bench.py", "--repeats", "2"])
    sampler_bench.main()
    sampling = {"max_new_tokens": 64, "temperature": 0.7, "seed": 0}
    assert seen["vllm"] == [{"eager": False, "max_step_tokens": None, **sampling}]  # 0: vLLM's own default
    assert seen["hf"] == [sampling, sampling] and seen["policy_device"] == ["cpu"] and seen["threads"] == []
    # the trained policy, then the random one for plain generate (as HF's), then 5 timed pushes of the policy
    assert seen["pushed"][:2] == [policy, random_policy] and seen["pushed"][2:] == [policy] * 5
    assert seen["protocol"] == [("search_r1", "toy")]  # the toy world's prompt, as train.py's [toy] preset


def test_sampler_bench_loads_the_hf_policy_on_the_gpu_when_vllm_runs_on_one(stubbed_sampler_bench, monkeypatch):
    """Else the ratios would compare a GPU with a CPU."""
    sampler_bench = stubbed_sampler_bench[0]
    monkeypatch.setattr(sys.modules["searchlite.vllm_sampler"].VLLMSampler, "on_cpu", False)
    devices = []

    class Loaded(Exception):
        pass

    def load_policy(folder, device):
        devices.append(device)
        raise Loaded  # (nothing after it runs without a GPU)

    monkeypatch.setattr("searchlite.models.load_policy", load_policy)
    monkeypatch.setattr(sys, "argv", ["sampler_bench.py"])
    with pytest.raises(Loaded):
        sampler_bench.main()
    assert devices == ["cuda"]


def test_sampler_bench_without_repeats_times_3_rounds_after_its_warm_up(stubbed_sampler_bench, monkeypatch, capsys):
    sampler_bench, seen, *_ = stubbed_sampler_bench
    rollout = lambda *args: seen["questions"].append(args[-1]) or (120, 2, 1, 1)  # noqa: E731
    monkeypatch.setattr(sampler_bench, "timed_rollout", rollout)
    monkeypatch.setattr(sys, "argv", ["sampler_bench.py"])
    sampler_bench.main()
    assert len(seen["questions"]) == 8  # 4 rounds x 2 samplers
    assert "rollout, 80 trajectories (16 questions x group 5), toy/model, medians of 3:" in capsys.readouterr().out


def test_sampler_bench_flags_reach_both_samplers(stubbed_sampler_bench, monkeypatch, capsys):
    sampler_bench, seen, policy, random_policy = stubbed_sampler_bench
    monkeypatch.setattr(sys, "argv", ["sampler_bench.py", "--repeats", "2", "--max_new_tokens", "32", "--temperature",
                                      "1.0", "--seed", "5", "--eager", "--max_step_tokens", "256", "--threads", "2",
                                      "--template", ""])
    sampler_bench.main()
    sampling = {"max_new_tokens": 32, "temperature": 1.0, "seed": 5}
    assert seen["vllm"] == [{"eager": True, "max_step_tokens": 256, **sampling}]
    assert seen["hf"] == [sampling, sampling] and seen["threads"] == [2]
    assert seen["protocol"] == [("search_r1", "")]  # '': Search-R1's own prompt
