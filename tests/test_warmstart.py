"""The shipped warm-start checkpoint loads and writes well-formed trajectories; a build stopped
by Ctrl-C and resumed writes the bytes of one never stopped."""

import hashlib

import pytest
import torch

from searchlite.config import TOY_DIR, resolve_path
from searchlite.data import read_qa
from searchlite.protocol import get_protocol
from searchlite.retrieval import build_retriever
from searchlite.rollout import rollout
from searchlite.sampler import HFSampler


@pytest.mark.skipif(not (TOY_DIR / "model" / "model.safetensors").exists(),
                    reason="the toy warm-start model is not built (python -m searchlite.warmstart)")
def test_shipped_checkpoint_rolls_out_well_formed():
    from searchlite.models import load_policy, load_tokenizer

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
    from conftest import CtrlC
    from searchlite import sft, warmstart

    small = ["--questions", "10", "--read_passes", "0", "--epochs", "1", "--threads", "1"]
    ctrl_c = CtrlC(monkeypatch, sft, "sft_loss", at=2)
    with pytest.raises(SystemExit) as stopped:
        warmstart.main(["--out", str(tmp_path), *small])
    assert stopped.value.code == 130 and "of the imperfect phase" in capsys.readouterr().out
    ctrl_c.at = 0
    with pytest.raises(SystemExit, match=r"--questions = 10, this one has 12; other rows to train on; "
                                         r"resume with its settings, or rerun without --resume"):
        warmstart.main(["--out", str(tmp_path), *small, "--questions", "12", "--resume"])
    warmstart.main(["--out", str(tmp_path), *small, "--resume"])
    assert (tmp_path / "model" / "model.safetensors").exists() and ctrl_c.calls > 2
    with pytest.raises(SystemExit):
        warmstart.main(["--out", str(tmp_path), *small, "--epochs", "0"])
    assert "--read_passes 0 and --epochs 0 leave nothing to train on" in capsys.readouterr().err
