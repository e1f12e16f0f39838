"""The shipped warm-start checkpoint loads and writes well-formed trajectories; a build stopped
by Ctrl-C and resumed writes the bytes of one never stopped; the teacher's data trains on its own
tokens only, and a build runs its careful, then its imperfect phase, each pass on a fresh seed."""

import hashlib
import json
import shutil

import pytest
import torch

from searchlite.config import TOY_DIR, parse_args, resolve_path
from searchlite.data import read_qa
from searchlite.models import load_tokenizer
from searchlite.protocol import get_protocol
from searchlite.retrieval import build_retriever
from searchlite.rollout import rollout
from searchlite.sampler import HFSampler


@pytest.mark.skipif(not (TOY_DIR / "model" / "model.safetensors").exists(),
                    reason="the toy warm-start model is not built (python -m searchlite.warmstart)")
def test_shipped_checkpoint_rolls_out_well_formed():
    from searchlite.models import load_policy

    tok, model = load_tokenizer("toy/model"), load_policy("toy/model")
    assert sum(p.numel() for p in model.parameters()) < 2.5e6
    assert (TOY_DIR / "model" / "model.safetensors").stat().st_size <= 10 * 2**20
    qa = read_qa(resolve_path("toy/test.jsonl"))[:8]
    protocol = get_protocol("search_r1", "toy")
    retriever = build_retriever("bm25", resolve_path("toy/corpus.jsonl"))
    ro = rollout(HFSampler(model, tok, max_new_tokens=64, seed=0), retriever, tok, protocol,
                 [q.question for q in qa], max_turns=4, topk=3)
    for i in range(len(ro)):
        assert ro.responses[i].startswith("<think>"), ro.responses[i][:80]
        assert protocol.format_ok(ro.responses[i]), ro.responses[i]
    assert ro.answered.all()


@pytest.fixture()
def torch_settings():
    """warmstart fixes the thread count and turns on deterministic algorithms: put both back."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("stop_at", [3, 14])  # SFT steps: in the careful phase (9 steps), in the imperfect one (9)
def test_stopped_and_resumed_build_writes_the_same_model(tmp_path, monkeypatch, capsys, torch_settings, stop_at):
    from conftest import CtrlC
    from searchlite import sft, warmstart

    small = ["--questions", "30", "--read_passes", "1", "--epochs", "1", "--threads", "1"]
    digest = lambda out: hashlib.sha256((out / "model" / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    ctrl_c = CtrlC(monkeypatch, sft, "sft_loss")  # counts SFT steps
    warmstart.main(["--out", str(tmp_path / "whole"), *small])
    steps = ctrl_c.calls
    assert steps == 18

    ctrl_c.calls, ctrl_c.at = 0, stop_at
    out = tmp_path / "stopped"
    with pytest.raises(SystemExit) as stopped:
        warmstart.main(["--out", str(out), *small])
    assert stopped.value.code == 130
    assert "rerun the same command with --resume" in capsys.readouterr().out
    assert not (out / "model" / "model.safetensors").exists()
    assert ctrl_c.calls == stop_at  # the step in hand finished, no other began

    ctrl_c.calls, ctrl_c.at = 0, 0
    warmstart.main(["--out", str(out), *small, "--resume"])
    assert ctrl_c.calls == steps - stop_at  # nothing trained is trained again
    assert digest(out) == digest(tmp_path / "whole")
    assert list(out.glob("warmstart_state_*.pt")) == []  # removed once the model is written


def test_a_phase_of_zero_passes_is_skipped_and_a_resume_names_a_changed_flag(tmp_path, monkeypatch, capsys,
                                                                            torch_settings):
    """Also: a build without --resume over a stopped one trains from its first step (without the
    removal of the saved states, it went on from the stopped step and test_warmstart passed)."""
    import shutil

    from conftest import CtrlC
    from searchlite import sft, warmstart

    small = ["--questions", "10", "--read_passes", "0", "--epochs", "1", "--threads", "1"]
    out = tmp_path / "run"
    ctrl_c = CtrlC(monkeypatch, sft, "sft_loss", at=2)
    with pytest.raises(SystemExit) as stopped:
        warmstart.main(["--out", str(out), *small])
    assert stopped.value.code == 130 and "of the imperfect phase" in capsys.readouterr().out
    ctrl_c.at = 0
    with pytest.raises(SystemExit, match=r"--questions = 10, this one has 12; other rows to train on; "
                                         r"resume with its settings, or rerun without --resume"):
        warmstart.main(["--out", str(out), *small, "--questions", "12", "--resume"])
    with pytest.raises(SystemExit, match=r"a run with --lr = 0.003, this one has 0.001"):  # by the flag
        warmstart.main(["--out", str(out), *small, "--lr", "1e-3", "--resume"])
    shutil.copytree(out, tmp_path / "afresh")  # the stopped build, its saved state with it
    ctrl_c.calls = 0
    warmstart.main(["--out", str(tmp_path / "afresh"), *small])
    steps, ctrl_c.calls = ctrl_c.calls, 0
    warmstart.main(["--out", str(out), *small, "--resume"])
    assert (out / "model" / "model.safetensors").exists() and ctrl_c.calls == steps - 2 > 0
    with pytest.raises(SystemExit):
        warmstart.main(["--out", str(out), *small, "--epochs", "0"])
    assert "--read_passes 0 and --epochs 0 leave nothing to train on" in capsys.readouterr().err


@pytest.fixture(scope="module")
def toy():
    tok = load_tokenizer("toy/")
    qa = read_qa(resolve_path("toy/train.jsonl"))
    retriever = build_retriever("bm25", resolve_path("toy/corpus.jsonl"))
    return tok, qa, retriever


def test_only_the_default_build_writes_the_shipped_folder(monkeypatch, capsys):
    from searchlite import warmstart

    def build(args):
        raise AssertionError(f"a build into {args.out} began")

    monkeypatch.setattr(warmstart, "build", build)
    with pytest.raises(SystemExit) as stopped:
        warmstart.main(["--epochs", "1"])
    assert stopped.value.code == 2
    assert f"error: --epochs 1 would rewrite the shipped toy world and model in {TOY_DIR}, " in capsys.readouterr().err
    built = []
    monkeypatch.setattr(warmstart, "build", built.append)
    warmstart.main(["--resume"])  # the default build: into the shipped folder
    assert [args.out for args in built] == [str(TOY_DIR)]
    # the shipped bytes: the world of `toyworld build`'s default seed (test_toyworld), made on 2 threads
    assert [(args.seed, args.threads) for args in built] == [(0, 2)]


def test_teacher_data_trains_on_the_teachers_tokens_only(toy):
    from searchlite.warmstart import CAREFUL, teacher_data

    tok, qa, retriever = toy
    topk = parse_args([]).topk  # the toy run's passages per search
    plain = [q for q in qa if not q.meta["famous"] and q.meta["type"] == "1hop"][:4]
    ids, loss, att = teacher_data(tok, plain, retriever, [0], famous_repeats=0, teacher=CAREFUL)
    assert ids.shape == loss.shape == att.shape and len(ids) == 4
    for i in range(len(ids)):
        n = int(att[i].sum())
        assert att[i, :n].all() and not att[i, n:].any()  # right-padded
        assert not loss[i, n:].any() and (ids[i, n:] == tok.pad_token_id).all()
        text = tok.decode(ids[i, :n], skip_special_tokens=False)
        trained = tok.decode(ids[i][loss[i] == 1], skip_special_tokens=False)
        assert plain[i].question in text and plain[i].question not in trained  # the prompt is not trained on
        doc_title = plain[i].meta["hops"][0]["query"]
        assert "<information>" in text and "<information>" not in trained  # passages are not trained on
        assert f"Doc {topk}(" in text and f"Doc {topk + 1}(" not in text  # what RL's searches show
        assert "<search>" in trained and "<answer>" in trained  # the teacher's own turns are
        assert text.count(doc_title) > trained.count(doc_title)
        assert 0 < int(loss[i].sum()) < n
        # the row ends with the careful teacher's closed answer, trained on to its last token
        assert text.endswith(f"<answer> {plain[i].answers[0]} </answer>") and loss[i, n - 1] == 1


def test_the_careful_teacher_searches_every_hop_and_answers_right(toy):
    """CAREFUL, the warm start's first phase, makes no mistake on any kind of question: a bridge
    question is not answered with its bridge entity, nor a comparison after one lookup (the stop
    rate matters only past the first hop, so a 1-hop test alone passed with it at 1), and no search
    asks the whole question in place of its entity (CAREFUL's p_verbatim dropped, test_warmstart
    passed)."""
    from searchlite.warmstart import CAREFUL, teacher_data

    tok, qa, retriever = toy
    picked = [q for kind in ("1hop", "2hop", "comparison")
              for q in [q for q in qa if q.meta["type"] == kind and not any(h["famous"] for h in q.meta["hops"])][:3]]
    ids, loss, att = teacher_data(tok, picked, retriever, [0, 1], famous_repeats=0, teacher=CAREFUL)
    assert len(ids) == 2 * len(picked)
    for i in range(len(ids)):
        n = int(att[i].sum())
        text = tok.decode(ids[i, :n], skip_special_tokens=False)
        q = next(q for q in picked if q.question in text)
        trained = tok.decode(ids[i][loss[i] == 1], skip_special_tokens=False)
        assert trained.count("<search>") == len(q.meta["hops"]), (q.meta["type"], text)
        assert f"<search> {q.meta['hops'][0]['query']} </search>" in trained  # the entity, not the question
        assert text.endswith(f"<answer> {q.answers[0]} </answer>"), (q.meta["type"], text)


def test_teacher_data_repeats_famous_questions_and_draws_each_seed_afresh(toy):
    from searchlite.warmstart import teacher_data

    tok, qa, retriever = toy
    few = qa[:12]
    k = sum(bool(q.meta["famous"]) for q in few)
    assert 0 < k < 12
    ids0, _, _ = teacher_data(tok, few, retriever, [0], famous_repeats=2)
    assert len(ids0) == 12 + 2 * k
    ids01, _, _ = teacher_data(tok, few, retriever, [0, 1], famous_repeats=2)
    assert len(ids01) == 2 * (12 + 2 * k)
    first, second = ids01[:12 + 2 * k], ids01[12 + 2 * k:]
    w = ids0.shape[1]
    assert torch.equal(first[:, :w], ids0) and not first[:, w:].ne(tok.pad_token_id).any()
    assert not torch.equal(first, second)  # another seed, other draws of the teacher's choices


def _fake_build(monkeypatch, tmp_path, flags):
    """Run warmstart.main with the world copied from the shipped one, teacher_data and sft recorded."""
    from searchlite import sft, toyworld, warmstart

    def world(argv):
        out = argv[argv.index("--out") + 1]
        shutil.copytree(TOY_DIR, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model"))

    calls = {"data": [], "sft": []}

    def data(tokenizer, qa, retriever, seeds, famous_repeats, teacher=None, **kw):
        calls["data"].append(dict(n=len(qa), seeds=list(seeds), famous_repeats=famous_repeats, teacher=teacher))
        return (torch.ones((2, 3), dtype=torch.long),) * 3

    def fit(model, input_ids, loss_mask, **kw):
        calls["sft"].append(kw)
        return [float(step) for step in range(25)]  # a loss per step

    monkeypatch.setattr(toyworld, "main", world)
    monkeypatch.setattr(warmstart, "teacher_data", data)
    monkeypatch.setattr(sft, "sft", fit)
    warmstart.main(["--out", str(tmp_path), "--threads", "1", *flags])
    return calls


def test_build_runs_a_careful_then_an_imperfect_phase_on_fresh_seeds(monkeypatch, tmp_path, torch_settings):
    from searchlite.warmstart import CAREFUL

    calls = _fake_build(monkeypatch, tmp_path / "a", ["--seed", "7", "--read_passes", "2", "--epochs", "3",
                                                      "--questions", "5", "--famous_repeats", "2"])
    careful, imperfect = calls["data"]
    assert careful["teacher"] == CAREFUL and imperfect["teacher"] is None
    assert len(careful["seeds"]) == 2 and len(imperfect["seeds"]) == 3
    assert len(set(careful["seeds"] + imperfect["seeds"])) == 5  # each pass draws afresh
    assert careful["n"] == imperfect["n"] == 5 and careful["famous_repeats"] == 2
    assert [c["epochs"] for c in calls["sft"]] == [1, 1]  # the passes are in the rows, one epoch over them
    assert [c["warmup"] for c in calls["sft"]] == [50, 50]  # the shipped model's (sft's own default is 20)
    assert [c["lr"] for c in calls["sft"]] == [3e-3, 3e-3] and [c["batch_size"] for c in calls["sft"]] == [4, 4]
    assert calls["sft"][0]["seed"] != calls["sft"][1]["seed"]
    other = _fake_build(monkeypatch, tmp_path / "b", ["--seed", "8", "--read_passes", "2", "--epochs", "3",
                                                     "--questions", "5", "--lr", "2e-3"])
    assert [c["lr"] for c in other["sft"]] == [2e-3, 2e-3]  # a number (read as text, test_warmstart passed)
    seeds = lambda c: {s for d in c["data"] for s in d["seeds"]}  # noqa: E731
    assert not seeds(calls) & seeds(other)  # --seed reaches the teacher
    assert {c["seed"] for c in calls["sft"]} != {c["seed"] for c in other["sft"]}


def test_build_teaches_on_every_question_by_default_and_inits_from_the_seed(monkeypatch, tmp_path, torch_settings,
                                                                            capsys):
    from transformers import AutoModelForCausalLM

    from searchlite.warmstart import make_model

    torch.set_num_threads(2)  # (torch_settings puts them back)
    torch.use_deterministic_algorithms(False)
    least = ["--questions", "0", "--famous_repeats", "0", "--batch_size", "1"]  # each flag's least value
    calls = _fake_build(monkeypatch, tmp_path, ["--seed", "3", "--read_passes", "1", "--epochs", "0", *least])
    assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()  # a rebuild's same bytes
    assert [d["n"] for d in calls["data"]] == [len(read_qa(TOY_DIR / "train.jsonl"))]  # --questions 0: all
    assert calls["data"][0]["famous_repeats"] == 0 and calls["sft"][0]["batch_size"] == 1
    tok = load_tokenizer(str(tmp_path / "model"))  # the model folder loads alone, its tokenizer in it
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (tok.eos_token_id,
                                                                                           tok.pad_token_id)
    # the shipped model's shape and ids: what the rebuild the README promises must make again (each named, not
    # read from MODEL: a field dropped there took transformers' default, a 7B Llama's, unseen)
    config, shipped = (json.loads((folder / "model" / "config.json").read_text()) for folder in (tmp_path, TOY_DIR))
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "tie_word_embeddings", "vocab_size", "eos_token_id", "pad_token_id",
            "bos_token_id")
    assert {k: config[k] for k in keys} == {k: shipped[k] for k in keys}
    digest = hashlib.sha256((tmp_path / "model" / "model.safetensors").read_bytes()).hexdigest()[:16]
    # the last 20 steps' mean loss (steps 5 to 24), and the digest to hold against the shipped file's
    assert f"final sft loss 14.5000; wrote {tmp_path / 'model'} (sha256 {digest}) in " in capsys.readouterr().out
    saved = model.state_dict()
    init = make_model(load_tokenizer(str(tmp_path)), 3).state_dict()
    other = make_model(load_tokenizer(str(tmp_path)), 4).state_dict()
    assert all(torch.equal(saved[k], init[k]) for k in saved)  # sft recorded, not run: the init is saved
    assert not all(torch.equal(init[k], other[k]) for k in init)
