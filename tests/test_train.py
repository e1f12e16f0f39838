"""train.py end to end on a tiny random Llama: each algorithm runs, resume is exact, guards fire."""

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import train


def args(model, out, algo, steps=2, extra=()):
    return ["--model", model, "--out_dir", str(out), "--algo", algo, "--steps", str(steps), "--batch_size", "2",
            "--group", "2", "--max_new_tokens", "6", "--max_turns", "1", "--eval_size", "4", "--lr", "1e-2",
            "--micro_batch_size", "3", "--log_trajectories_every", "1", "--save_every", "1", *extra]


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def untimed(row: dict) -> dict:
    """A metrics row without its wall times, which differ between two runs of the same steps."""
    return {k: v for k, v in row.items() if k not in ("seconds", "t_rollout", "t_push")}


@pytest.fixture()
def varied_reward(monkeypatch):
    """A random model never answers right: reward 1 for about half the trajectories (a hash of the
    response text) so that advantages, and so updates, are not all zero."""
    import zlib

    monkeypatch.setattr(train, "compute_rewards", lambda ro, qs: torch.tensor(
        [float(zlib.crc32(r.encode()) % 2) for r in ro.responses]))


@pytest.mark.parametrize("algo", ["grpo", "ppo", "reinforce_pp"])
def test_two_steps_change_parameters(tiny_model, tmp_path, algo, varied_reward):
    from safetensors.torch import load_file

    out, t0 = tmp_path / algo, time.time()
    train.main(args(tiny_model, out, algo))
    took = time.time() - t0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in ("loss", "kl", "entropy", "reward"))
        assert ("vf_loss" in r) == (algo == "ppo") and "mem_loss" not in r  # no critic, no rewrites: not logged
        assert 0 <= r["t_rollout"] < r["seconds"] and 0 <= r["t_push"] < r["seconds"] < took  # step < run
    before = load_file(f"{tiny_model}/model.safetensors")
    after = load_file(out / "checkpoint" / "policy" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert any(r["reward"] not in (0.0, 1.0) for r in rows[1:])  # mixed rewards: a real update happened
    assert (out / "trajectories" / "step00002.html").exists()
    assert json.loads((out / "config.json").read_text())["algo"] == algo
    for step in (0, 2):  # each held-out evaluation keeps its per-question records, which add up to its summary
        records = [json.loads(line) for line in (out / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(records) == 4 and all("trajectory" in r and "docs" in r for r in records)
        row = next(r for r in rows if r["step"] == step)
        assert row["eval/all"]["em"] == pytest.approx(sum(r["em"] for r in records) / 4)


def test_ppo_trains_on_whitened_advantages_and_raw_returns(tiny_model, tmp_path, varied_reward, monkeypatch):
    """As verl does for Search-R1's PPO: mean 0 and std 1 over the batch's policy tokens; the
    critic's target is the unwhitened lambda-return."""
    seen, real = [], train.update

    def spy(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt, old_values, ret, mem):
        seen.append((adv.clone(), ro.loss_mask.bool(), old_values.clone(), ret.clone()))
        return real(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt, old_values, ret, mem)

    monkeypatch.setattr(train, "update", spy)
    train.main(args(tiny_model, tmp_path / "ppo", "ppo"))
    assert len(seen) == 2
    for adv, on, values, ret in seen:
        assert abs(float(adv[on].mean())) < 1e-5 and float(adv[on].std(unbiased=False)) == pytest.approx(1, abs=1e-4)
        raw = ret - values  # the GAE advantages themselves, before whitening
        assert not torch.allclose(raw[on], adv[on], atol=1e-3)
        assert float(raw[on].std()) > 0 and torch.all(adv[~on] == 0)


def test_the_training_reward_is_exact_match_of_the_final_answer():
    """Search-R1's outcome reward: EM of the parsed answer against any gold; no answer scores 0."""
    from types import SimpleNamespace

    from searchlite.data import QA

    ro = SimpleNamespace(answers=["Paris.", "the Seine", None, "Lyon"])
    questions = [QA("a", "q", ["paris"]), QA("b", "q", ["Rhine", "Seine"]), QA("c", "q", ["x"]), QA("d", "q", ["Paris"])]
    assert train.compute_rewards(ro, questions).tolist() == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("algo", ["grpo", "reinforce_pp", "ppo"])
def test_the_loop_hands_update_the_advantages_of_its_rewards(tiny_model, tmp_path, varied_reward, monkeypatch, algo):
    """What train.py passes to update(), against references built here from the step's rewards
    and log-probs: GRPO's group-normalised scores (a naive loop); REINFORCE++'s and PPO's with the
    KL to the reference, k1 = old - ref, in the reward (a large kl_coef, so its sign shows); PPO's
    lambda-returns from the critic's values. Then the update moves the critic's values toward
    those returns."""
    from searchlite.advantages import gae, ppo_token_rewards, reinforce_pp_advantages
    from searchlite.losses import masked_whiten

    seen, real_update, real_rewards = [], train.update, train.compute_rewards

    def rewards_spy(ro, questions):
        scores = real_rewards(ro, questions)  # the varied_reward stand-in
        seen.append({"scores": scores.clone()})
        return scores

    def update_spy(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt, old_values, ret,
                   mem):
        seen[-1].update(ro=ro, old=old_logp, ref=ref_logp, adv=adv.clone(), values=old_values, ret=ret, cfg=cfg)
        stats = real_update(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt,
                            old_values, ret, mem)
        if critic is not None:
            seen[-1]["values_after"] = train.score_tokens(critic, ro, 4, device, values=True)
        return stats

    monkeypatch.setattr(train, "compute_rewards", rewards_spy)
    monkeypatch.setattr(train, "update", update_spy)
    train.main(args(tiny_model, tmp_path / algo, algo, steps=2, extra=["--kl_coef", "0.5", "--critic_lr", "1e-3"]))
    assert len(seen) == 2
    for k, step in enumerate(seen):
        scores, ro, adv, cfg = step["scores"], step["ro"], step["adv"], step["cfg"]
        mask = ro.loss_mask.float()  # (N, T)
        assert float(scores.std()) > 0  # mixed rewards: the advantages say something
        if algo == "grpo":
            want = torch.zeros_like(adv)
            for i in range(len(scores)):
                g = scores[i - i % 2: i - i % 2 + 2]  # --group 2: a question's rollouts are adjacent
                want[i] = (scores[i] - g.mean()) / (g.std() + 1e-6) * mask[i]
            torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
            continue
        kl = (step["old"] - step["ref"]) * mask  # k1, per sampled token
        assert (k == 0) == (float(kl.abs().max()) == 0)  # step 1 samples with the reference itself; step 2 not
        if algo == "reinforce_pp":
            want = reinforce_pp_advantages(scores, kl, mask, 0.5, cfg.gamma)
            torch.testing.assert_close(adv, want, rtol=0, atol=1e-5)
        else:
            token_rewards = ppo_token_rewards(scores, kl, mask, 0.5)  # (N, T)
            want_adv, want_ret = gae(token_rewards, step["values"], mask, cfg.gamma, cfg.lam, whiten=masked_whiten)
            torch.testing.assert_close(adv, want_adv, rtol=0, atol=1e-5)
            torch.testing.assert_close(step["ret"], want_ret, rtol=0, atol=1e-5)
            on = mask.bool()
            moved = (step["values_after"] - step["values"])[on]
            assert float(((step["ret"] - step["values"])[on] * moved).sum()) > 0  # toward the returns


def test_the_r1pp_reward_is_the_sum_of_its_three_terms(tiny_model, tmp_path, monkeypatch):
    """--reward r1pp trains on R_format + R_answer + R_group, each term as reward_terms gives it (the
    terms themselves are tested on hand-made groups in test_r1pp.py); a random model's group term
    is always 0, so the terms here are stand-ins with none zero."""
    seen, real_update = [], train.update

    def terms(ro, questions, protocol, group, eta, group_reward, group_sigma):
        n = len(ro)
        made = {"format": -2.0 * (torch.arange(n) % 3 == 0), "answer": (torch.arange(n) % 2).float(),
                "group": 0.25 * torch.arange(n).float()}
        seen.append({k: v.clone() for k, v in made.items()})
        return made

    def update_spy(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, *rest):
        seen[-1]["adv"] = adv.clone()
        seen[-1]["mask"] = ro.loss_mask.float()
        return real_update(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, *rest)

    monkeypatch.setattr(train, "reward_terms", terms)
    monkeypatch.setattr(train, "update", update_spy)
    train.main(args(tiny_model, tmp_path / "r1pp", "grpo", steps=1, extra=["--reward", "r1pp", "--group", "4"]))
    (step,) = seen
    scores = step["format"] + step["answer"] + step["group"]
    want = torch.cat([(g - g.mean()) / (g.std() + 1e-6) for g in scores.view(-1, 4)])
    torch.testing.assert_close(step["adv"], want[:, None] * step["mask"], rtol=0, atol=1e-6)
    row = metrics(tmp_path / "r1pp")[-1]
    assert row["reward"] == pytest.approx(float(scores.mean())) and row["r_group"] == pytest.approx(0.875)


def test_ppo_settings_reach_the_update_and_the_log(tiny_model, tmp_path, varied_reward, monkeypatch):
    """Checkpoints every --save_every steps and at the end; trajectory pages every
    --log_trajectories_every; --ppo_epochs passes over --mini_batch_size mini-batches, each step's
    gradients clipped to --grad_clip (policy and critic); each optimizer's learning rate warms up
    over its own steps (--warmup_steps, --critic_warmup_steps) to its own rate (--lr, --critic_lr);
    the logged loss statistics are the means over the optimizer steps of a training step."""
    saved, clips, steps, real_save, real_clip, real_update = [], [], [], train.save_checkpoint, \
        torch.nn.utils.clip_grad_norm_, train.update

    def save_spy(out, policy, tokenizer, state, *rest):
        saved.append(state["step"])
        return real_save(out, policy, tokenizer, state, *rest)

    def clip_spy(params, max_norm, *a, **kw):
        clips.append(max_norm)
        return real_clip(params, max_norm, *a, **kw)

    def update_spy(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt, *rest):
        lrs = (opt.param_groups[0]["lr"], critic_opt.param_groups[0]["lr"])
        stats = real_update(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt, *rest)
        steps.append((lrs, stats))
        return stats

    monkeypatch.setattr(train, "save_checkpoint", save_spy)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_spy)
    monkeypatch.setattr(train, "update", update_spy)
    out = tmp_path / "ppo"
    train.main(args(tiny_model, out, "ppo", steps=5, extra=[
        "--save_every", "3", "--log_trajectories_every", "3", "--mini_batch_size", "2", "--ppo_epochs", "2",
        "--grad_clip", "0.5", "--lr", "1e-2", "--warmup_steps", "3", "--critic_lr", "1e-3",
        "--critic_warmup_steps", "4", "--eval_every", "0"]))
    assert saved == [3, 5]  # (a period of 2 could not tell a step count off by two: it picks the same steps)
    assert [p.name for p in (out / "trajectories").iterdir()] == ["step00003.html"]
    n_opt = 2 * 2  # 4 trajectories a step in mini-batches of 2, twice
    assert all(len(stats["grad_norm"]) == n_opt for _, stats in steps) and clips == [0.5] * (2 * n_opt * 5)
    assert [lr for lrs, _ in steps for lr in lrs] == pytest.approx(
        [lr for k in range(5) for lr in (1e-2 * min(1, (k + 1) / 3), 1e-3 * min(1, (k + 1) / 4))], rel=1e-12)
    rows = metrics(out)[1:]
    for row, (_, stats) in zip(rows, steps):
        for key in ("loss", "kl", "clipfrac", "entropy", "vf_loss"):
            assert row[key] == pytest.approx(sum(stats[key]) / n_opt, rel=1e-6, abs=1e-9), key
        assert row["grad_norm"] == pytest.approx(sum(stats["grad_norm"]) / n_opt, rel=1e-6)


def test_a_ppo_resume_with_another_critic_setting_is_refused(tiny_model, tmp_path, varied_reward, capsys):
    """The critic's optimizer and schedule keep the checkpoint's rate; the preset's value given as a
    flag is no change, and no note."""
    out = tmp_path / "ppo"
    train.main(args(tiny_model, out, "ppo", steps=1))
    with pytest.raises(SystemExit, match=r"trained with critic_lr = 0.001, this run has 0.002"):
        train.main(args(tiny_model, out, "ppo", steps=2, extra=["--resume", "--critic_lr", "2e-3"]))
    capsys.readouterr()
    train.main(args(tiny_model, out, "ppo", steps=2, extra=["--resume", "--critic_lr", "1e-3"]))  # [toy]'s own
    assert "changes the checkpoint's settings" not in capsys.readouterr().out


def test_resume_is_exact(tiny_model, tmp_path, varied_reward):
    """A run stopped after step 2 and resumed to step 4 logs what an uninterrupted run logs, and
    ends with the same policy and critic. Both learning rates are still warming up when it stops
    (3 and 6 steps), so each scheduler's state must come back; the model drops attention weights
    out in training, so torch's RNG state must come back too."""
    from conftest import dropout_copy

    full, part, model = tmp_path / "full", tmp_path / "part", dropout_copy(tiny_model, tmp_path / "dropout-model")
    warm = ["--warmup_steps", "3", "--critic_warmup_steps", "6", "--critic_lr", "1e-2"]
    train.main(args(model, full, "ppo", steps=4, extra=warm))
    train.main(args(model, part, "ppo", steps=2, extra=warm))
    train.main(args(model, part, "ppo", steps=4, extra=[*warm, "--resume"]))
    # wall times differ; the part run also evaluated when it stopped at step 2
    keep = lambda r: {k: v for k, v in untimed(r).items() if not k.startswith("eval/")}  # noqa: E731
    a, b = metrics(full), metrics(part)
    assert [keep(r) for r in a] == [keep(r) for r in b]
    assert {k: v for k, v in a[-1].items() if k.startswith("eval/")} == {
        k: v for k, v in b[-1].items() if k.startswith("eval/")}
    from safetensors.torch import load_file

    for model in ("policy", "critic"):
        wa, wb = (load_file(next((run / "checkpoint" / model).glob("*.safetensors"))) for run in (full, part))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), model


def test_a_bf16_resume_is_exact_with_the_float32_reference_a_fresh_run_has(tiny_model, tmp_path, varied_reward):
    """--dtype bfloat16 keeps float32 master weights and computes in bf16; a fresh run's reference
    is a copy of that policy, a resumed run's is loaded again from the model, and must be held the
    same way, or its log-probs, and so the KL and the updates, differ from an uninterrupted run's
    (loading it in bf16 passed the resume tests, all of them float32)."""
    full, part = tmp_path / "full", tmp_path / "part"
    bf16 = ["--dtype", "bfloat16", "--kl_coef", "0.5"]
    train.main(args(tiny_model, full, "grpo", steps=3, extra=bf16))
    train.main(args(tiny_model, part, "grpo", steps=1, extra=bf16))
    train.main(args(tiny_model, part, "grpo", steps=3, extra=[*bf16, "--resume"]))
    keep = lambda r: {k: v for k, v in untimed(r).items()  # noqa: E731
                      if not (r["step"] == 1 and k.startswith("eval/"))}  # (the part run evaluated at its stop)
    a, b = ({r["step"]: keep(r) for r in metrics(run)} for run in (full, part))
    assert a == b and a[3]["kl"] > 0


def test_scoring_passes_run_in_eval_mode_and_the_update_in_training_mode(tiny_model, tmp_path, monkeypatch,
                                                                        varied_reward):
    """Each step scores old log-probs, reference log-probs and values with dropout off (eval mode),
    then updates policy and critic in training mode, where transformers' --grad_checkpointing
    recomputes; both switches happen every step, as evaluation and sampling leave eval mode. With
    --kl_coef 0 there is no reference model, so no pass scores with one."""
    modes = []
    score, step = train.score_tokens, train.update

    def scored(model, *a, values=False, **k):
        modes.append(("values" if values else "logp", model.training))
        return score(model, *a, values=values, **k)

    def update(cfg, step_, policy, opt, ro, old_logp, ref_logp, adv, device, critic, *a):
        modes.append(("update", policy.training, critic.training))
        return step(cfg, step_, policy, opt, ro, old_logp, ref_logp, adv, device, critic, *a)

    monkeypatch.setattr(train, "score_tokens", scored)
    monkeypatch.setattr(train, "update", update)
    train.main(args(tiny_model, tmp_path / "run", "ppo", steps=2))
    assert modes == [("logp", False), ("logp", False), ("values", False), ("update", True, True)] * 2
    modes.clear()
    train.main(args(tiny_model, tmp_path / "no_kl", "ppo", steps=1, extra=["--kl_coef", "0"]))
    assert modes == [("logp", False), ("values", False), ("update", True, True)]  # no reference to score


def test_each_metrics_row_is_on_disk_before_the_next_step_begins(tiny_model, tmp_path, monkeypatch):
    """metrics.jsonl is flushed after step 0's evaluation and after each step's row: a run killed
    outright (SIGKILL, a lost node) keeps the log of every step it finished."""
    out, seen, real = tmp_path / "run", [], train.rollout

    def rollout(*a, **k):  # a training step begins: what is on disk now?
        seen.append([json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()])
        return real(*a, **k)

    monkeypatch.setattr(train, "rollout", rollout)
    train.main(args(tiny_model, out, "grpo", steps=3))
    assert seen == [[0], [0, 1], [0, 1, 2]]


def test_ctrl_c_checkpoints_the_step_and_resume_continues_exactly(tiny_model, tmp_path, monkeypatch, varied_reward,
                                                                   capsys):
    """Ctrl-C during step 2 of a run that saves only at its end (--save_every 0): the step
    finishes, is checkpointed, the run stops; --resume then ends where an uninterrupted run ends."""
    from conftest import CtrlC
    from safetensors.torch import load_file

    full, part = tmp_path / "full", tmp_path / "part"
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN when started in the background
    train.main(args(tiny_model, full, "grpo", steps=3, extra=["--save_every", "0"]))
    ctrl_c = CtrlC(monkeypatch, train, "compute_rewards", at=2)  # during step 2
    with pytest.raises(SystemExit) as stopped:  # 128 + SIGINT, so that a script running train.py stops too
        train.main(args(tiny_model, part, "grpo", steps=3, extra=["--save_every", "0"]))
    assert stopped.value.code == 130
    assert "stopped after step 2, checkpoint saved: rerun with --resume" in capsys.readouterr().out
    assert torch.load(part / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    ctrl_c.at = 0
    train.main(args(tiny_model, part, "grpo", steps=3, extra=["--save_every", "0", "--resume"]))
    wa = load_file(full / "checkpoint" / "policy" / "model.safetensors")
    wb = load_file(part / "checkpoint" / "policy" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["step"] for r in metrics(part)] == [0, 1, 2, 3]


def test_a_bad_corpus_line_met_mid_run_is_one_line_and_keeps_the_checkpoint(tiny_model, tmp_path, monkeypatch,
                                                                            varied_reward, capsys):
    """A lazy corpus checks a sample of its lines at load; a bad line a search meets later (Search-R1's
    FAISS file beside a corpus, or a corpus edited since its index was built) was a traceback."""
    from searchlite.data import DataError

    real, calls = train.rollout, []

    def search_meets_a_bad_line(*a, **k):  # as Corpus raises it, from inside the retriever's search
        calls.append(1)
        if len(calls) == 4:
            raise DataError("corpus.jsonl:227: bad JSON: Expecting property name (column 102)")
        return real(*a, **k)

    monkeypatch.setattr(train, "rollout", search_meets_a_bad_line)
    with pytest.raises(SystemExit) as stopped:
        train.main(args(tiny_model, tmp_path, "grpo", steps=4, extra=["--save_every", "2", "--eval_every", "0"]))
    assert stopped.value.code == ("error: corpus.jsonl:227: bad JSON: Expecting property name (column 102)\n"
                                  "the last checkpoint, if there is one, is intact (--resume continues from it); "
                                  "nothing after it was saved")
    assert torch.load(tmp_path / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 2


def test_a_signal_that_reached_another_rank_alone_stops_this_one_as_stopped(tiny_model, tmp_path, monkeypatch,
                                                                           varied_reward, capsys):
    """torchrun: a preempted node's ranks got SIGTERM, rank 0 did not. Every rank stopped after the
    same step, but rank 0 then printed 'done: ... holds the step-N model' for a step never trained
    and exited 0, so `torchrun ... && evaluate.py` went on. It now ends as the signalled rank does.
    (One process here: dist.all_max stands in for the other rank's answer at step 2.)"""
    from searchlite import distributed

    real, asks = distributed.all_max, []

    def other_rank_signalled(x):  # the loop's second ask (after step 2) meets a rank that got SIGTERM
        if sys._getframe(1).f_code.co_name != "train":  # the other asks (non-finite values, rewrites)
            return real(x)
        asks.append(x)
        return signal.SIGTERM if len(asks) == 2 else real(x)

    monkeypatch.setattr(distributed, "all_max", other_rank_signalled)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        train.main(args(tiny_model, out, "grpo", steps=4, extra=["--save_every", "0"]))
    assert stopped.value.code == 128 + signal.SIGTERM
    printed = capsys.readouterr().out
    assert "stopped after step 2 (another process got SIGTERM), checkpoint saved" in printed
    assert "done:" not in printed
    assert torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 2


def test_resume_with_no_checkpoint_says_it_starts_fresh_and_where_a_set_aside_run_is(tiny_model, tmp_path, capsys):
    """--resume in a folder with no checkpoint trains from the start and says so, naming
    checkpoint.previous when a fresh start set a run aside there; a run without --resume says nothing."""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1, extra=["--resume"]))
    assert f"--resume: no checkpoint in {out}, starting fresh\n" in capsys.readouterr().out
    assert [r["step"] for r in metrics(out)] == [0, 1]
    train.main(args(tiny_model, out, "grpo", steps=1))  # a forgotten --resume: the run goes to checkpoint.previous
    assert "--resume:" not in capsys.readouterr().out and (out / "checkpoint.previous").is_dir()
    shutil.rmtree(out / "checkpoint")
    train.main(args(tiny_model, out, "grpo", steps=1, extra=["--resume"]))
    assert (f"--resume: no checkpoint in {out}, starting fresh (checkpoint.previous holds the run a fresh start set "
            "aside: to continue it, rename it and its *.previous files back)\n") in capsys.readouterr().out


def test_ctrl_c_in_step_0s_evaluation_leaves_an_earlier_run_in_place(tiny_model, tmp_path, monkeypatch, capsys):
    """A fresh run in a used folder (a forgotten --resume) set the earlier run aside before step 0's
    held-out evaluation, minutes on a real model; a Ctrl-C there left checkpoint.previous and no
    checkpoint while the message promised that --resume continues. Now the note comes first and
    the earlier run is set aside only after that evaluation."""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1))
    files = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "run.lock"}
    capsys.readouterr()

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "score_qa", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train.main(args(tiny_model, out, "grpo", steps=1))
    assert "this run starts fresh (--resume continues it instead) and sets the earlier run aside after its step-0 " \
           "evaluation" in capsys.readouterr().out
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "run.lock"} == files
    monkeypatch.undo()
    train.main(args(tiny_model, out, "grpo", steps=1, extra=["--resume"]))  # continues the run that was there
    assert "resumed from" in capsys.readouterr().out and not list(out.glob("*.previous*"))


def test_resuming_a_bf16_checkpoint_from_before_master_weights_names_the_change(tiny_model, tmp_path, varied_reward):
    """A bf16 checkpoint whose config has no master_weights held bf16 weights: resumed with float32
    master weights (twice their memory), the note says so; an old float32 one says nothing."""
    from searchlite.config import parse_args

    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1, extra=["--dtype", "bfloat16", "--master_weights", "false"]))
    state = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)
    del state["config"]["master_weights"]  # as saved before the field existed
    torch.save(state, out / "checkpoint" / "trainer.pt")
    resumed = lambda dtype: parse_args(args(tiny_model, out, "grpo", steps=2, extra=["--resume", "--dtype", dtype]))  # noqa: E731
    assert "master_weights: False -> True" in train.check_resume(resumed("bfloat16"))
    state["config"]["dtype"] = "float32"
    torch.save(state, out / "checkpoint" / "trainer.pt")
    assert not any("master_weights" in c for c in train.check_resume(resumed("float32")))


def test_resume_refuses_a_setting_the_checkpoint_would_override(tiny_model, tmp_path, varied_reward, capsys):
    """The restored optimizer and schedule keep the checkpoint's learning rate: a resume with
    another --lr (or seed, weight decay, ...) is refused, naming it, before any model loads; the
    settings a resume does change are named; each step logs the rate it trained at (warm-up)."""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1, extra=["--warmup_steps", "2"]))
    with pytest.raises(SystemExit, match=r"was trained with lr = 0.01, this run has 0.001; its optimizer"):
        train.main(args(tiny_model, out, "grpo", steps=2, extra=["--warmup_steps", "2", "--resume", "--lr", "1e-3"]))
    with pytest.raises(SystemExit, match=r"batch_size = 2, this run has 4; .* data order"):  # step k's questions move
        train.main(args(tiny_model, out, "grpo", steps=2, extra=["--warmup_steps", "2", "--resume", "--batch_size", "4"]))
    capsys.readouterr()
    train.main(args(tiny_model, out, "grpo", steps=2, extra=["--warmup_steps", "2", "--resume",
                                                             "--kl_coef", "0.01",  # this one applies
                                                             "--critic_lr", "1", "--lora_alpha", "3"]))  # unused
    printed = capsys.readouterr().out
    assert "note: from step 2 on, this run changes the checkpoint's settings: " in printed
    assert "kl_coef: 0.001 -> 0.01" in printed and "steps:" not in printed and "lr: 0.01" not in printed
    assert f"done: {out / 'checkpoint' / 'policy'} holds the step-2 model" in printed
    assert [r["step"] for r in metrics(out)] == [0, 1, 2]
    assert [r["lr"] for r in metrics(out)[1:]] == [pytest.approx(0.005), pytest.approx(0.01)]  # (s + 1) / 2 of lr
    train.main(args(tiny_model, out, "grpo", steps=1, extra=["--warmup_steps", "2", "--resume", "--kl_coef", "0.01"]))
    printed = capsys.readouterr().out
    assert "already at step 2 of --steps 1: nothing to train" in printed and "holds the step-2 model" in printed
    assert json.loads((out / "config.json").read_text())["steps"] == 2  # the run's settings, not this no-op's
    train.main(args(tiny_model, out, "grpo", steps=2, extra=["--warmup_steps", "2", "--resume", "--kl_coef", "0.02"]))
    assert "already at step 2 of --steps 2: nothing to train" in capsys.readouterr().out  # a finished run resumed
    assert json.loads((out / "config.json").read_text())["kl_coef"] == 0.01  # nor here


def test_graceful_stop_asks_once_stops_at_the_second_signal_and_exits_128_plus_it(capsys):
    """The first SIGTERM only sets `requested`; a second one stops at once; leaving the block puts
    the previous handlers back, even when it raises; then the exit status is 128 + 15."""
    from searchlite.models import GracefulStop, interrupted_status

    before, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as second, GracefulStop() as stop:
        assert not stop.requested
        stop.exit_if_requested("not printed")  # nothing asked yet: returns
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # the second: at once
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGINT) is before_int
    with pytest.raises(SystemExit) as stopped:
        stop.exit_if_requested("rerun with --resume")
    assert stopped.value.code == 128 + 15
    # train.py's exit status when the second signal stopped it at once: 143 as the first's, not Ctrl-C's 130
    assert interrupted_status(second.value) == 128 + 15 and interrupted_status(KeyboardInterrupt()) == 130
    out = capsys.readouterr().out
    assert "SIGTERM: finishing this step" in out and "rerun with --resume" in out and "not printed" not in out


def test_graceful_stop_that_does_not_announce_prints_nothing_and_keeps_the_signal_it_got(capsys):
    """announce=False (torchrun's ranks past 0) prints no line; a stop adopted from another rank does
    not replace the signal this rank got itself (its exit status); exit with no message prints nothing."""
    from searchlite.models import GracefulStop

    with GracefulStop(announce=False) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        stop.adopt(signal.SIGINT)
    assert stop.requested and stop.signum == signal.SIGTERM
    with pytest.raises(SystemExit) as stopped:
        stop.exit_if_requested()
    assert stopped.value.code == 128 + 15 and capsys.readouterr().out == ""


def test_ctrl_c_while_the_run_loads_exits_130_with_one_line_saying_what_is_kept(tiny_model, tmp_path):
    """`python train.py` stopped by Ctrl-C before its steps begin (here while it waits up to 10 s
    for a retrieval server that never answers): no traceback, one line saying what was kept, 130."""
    import subprocess

    from conftest import held_port

    with held_port() as port:  # connections wait in its backlog, never answered
        url = f"http://127.0.0.1:{port}"
        http = ["--retriever", "http", "--retriever_url", url]
        cmd = [sys.executable, "train.py", *args(tiny_model, tmp_path / "run", "grpo", steps=1, extra=http)]
        proc = subprocess.Popen(cmd, cwd=Path(train.__file__).parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            for line in proc.stdout:
                if line.startswith("config:"):  # printed before the data, the retriever and the models load
                    proc.send_signal(signal.SIGINT)
                    break
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 130 and err.endswith(f"\ninterrupted: {train.KEPT}\n"), err[-2000:]
    assert "Traceback" not in err and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_under_torchrun_one_stop_request_delivered_twice_is_one(monkeypatch):
    """Slurm signals every process and torchrun passes its signal on to each rank too: a rank got
    SIGTERM twice and stopped at once, with no checkpoint. The same signal again within 5 s is that
    one request; later, or another signal, stops at once; in one process the second stops at once."""
    import searchlite.distributed
    import searchlite.models
    from searchlite.models import GracefulStop

    clock = [100.0]
    monkeypatch.setattr(searchlite.models.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(searchlite.distributed, "world", lambda: 2)  # a rank of two
    passed = []  # (a KeyboardInterrupt at the copy would also end the block as pytest.raises expects)
    with pytest.raises(KeyboardInterrupt), GracefulStop(announce=False) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        clock[0] += 0.2
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's copy: still one request
        passed.append("the copy")
        clock[0] += 6.0
        os.kill(os.getpid(), signal.SIGTERM)  # a second request: at once
    assert passed == ["the copy"] and stop.requested
    with pytest.raises(KeyboardInterrupt), GracefulStop(announce=False):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # another signal: at once
    monkeypatch.setattr(searchlite.distributed, "world", lambda: 1)  # one process
    with pytest.raises(KeyboardInterrupt), GracefulStop(announce=False):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_model_the_hub_cannot_give_is_one_line(tmp_path, monkeypatch):
    """A hub name the hub does not know (or no network) ended in transformers' OSError traceback,
    about 50 s in; now one line naming the flag, before the model loads."""
    import searchlite.models

    def unknown(path):
        raise OSError(f"{path} is not a local folder and is not a valid model identifier\nmore lines")

    monkeypatch.setattr(searchlite.models, "load_tokenizer", unknown)
    with pytest.raises(SystemExit, match=r"^error: --model Org/nosuch: could not load its tokenizer \(no folder "
                                         r"Org/nosuch here, so it was asked of the hub\): Org/nosuch is "
                                         r"not a local folder and is not a valid model identifier more lines$"):
        train.main(["--model", "Org/nosuch", "--out_dir", str(tmp_path / "run"), "--steps", "1"])


@pytest.mark.parametrize("flags, message", [
    (["--algo", "grp"], "error: --algo 'grp': not one of grpo, ppo, reinforce_pp (did you mean 'grpo'?)"),  # config's
    (["--optimizer", "sgd"], "error: unknown --optimizer 'sgd' (valid: adamw, adamw8bit)"),  # the levers' (memory.py)
])
def test_train_py_refuses_a_value_no_run_can_use_before_it_makes_its_folder(tmp_path, flags, message):
    """check_config and check_levers are tested on their own: train.py without either call passed test_train,
    test_config, test_scripts and test_readme."""
    with pytest.raises(SystemExit) as e:
        train.main([*flags, "--out_dir", str(tmp_path / "run"), "--steps", "1"])
    assert e.value.code == message and not (tmp_path / "run").exists()


def test_a_tokenizer_folder_without_a_tokenizer_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --tokenizer searchlite/templates: could not load its tokenizer: "
                                         r"Couldn't instantiate the backend tokenizer"):  # was a ValueError traceback
        train.main(["--tokenizer", "searchlite/templates", "--out_dir", str(tmp_path / "run"), "--steps", "1"])


def test_a_second_run_in_a_folder_in_use_is_refused(tiny_model, tmp_path):
    """Two runs in one out_dir mixed their checkpoints and logs (a checkpoint of one seed beside
    the other's config.json); while one holds the folder, another stops before it loads anything."""
    from searchlite.data import lock_folder

    out = tmp_path / "run"
    held = lock_folder(out, "run.lock")  # what a running train.py holds
    with pytest.raises(SystemExit, match=f"another run is writing to {out}"):
        train.main(args(tiny_model, out, "grpo", steps=1))
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"] and lock_folder(out, "run.lock") is None
    held.close()
    train.main(args(tiny_model, out, "grpo", steps=1))  # let go: the folder is free
    assert (out / "checkpoint").is_dir() and lock_folder(out, "run.lock") is not None  # and main let go too


def test_set_aside_replaces_the_older_set_whole(tmp_path):
    """Three runs in one folder: the second one's set aside, none of the first's left among it (the
    first run's trajectory page beside the second's config.previous.json, when only it had pages)."""
    from searchlite.models import set_aside

    names = ("checkpoint", "config.json", "trajectories", "samples.jsonl")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "config.json").write_text("first")
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "step00001.html").write_text("first")
    (tmp_path / "samples.jsonl").write_text("first")
    assert set_aside(tmp_path, names) == ["checkpoint -> checkpoint.previous", "config.json -> config.previous.json",
                                          "trajectories -> trajectories.previous",
                                          "samples.jsonl -> samples.previous.jsonl"]
    (tmp_path / "checkpoint").mkdir()  # the second run logs no pages and no samples (a folder and a file)
    (tmp_path / "config.json").write_text("second")
    assert set_aside(tmp_path, names) == ["checkpoint -> checkpoint.previous", "config.json -> config.previous.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.previous", "config.previous.json"]
    assert (tmp_path / "config.previous.json").read_text() == "second"
    assert set_aside(tmp_path, names) == [] and (tmp_path / "checkpoint.previous").is_dir()  # nothing new: kept


def test_metrics_hold_one_row_a_step_after_a_rerun_or_an_interrupt(tiny_model, tmp_path, monkeypatch, varied_reward,
                                                                   capsys):
    """A fresh run in a used folder starts metrics.jsonl anew, keeping the earlier run's
    checkpoint, config.json, metrics.jsonl and eval/ as *.previous, but only once it has loaded
    everything (a run that stops before changes no file); a run interrupted after its last
    checkpoint and resumed logs the steps it redoes once, not twice."""
    out, before = tmp_path / "run", signal.getsignal(signal.SIGINT)
    train.main(args(tiny_model, out, "grpo", steps=1))
    assert "earlier run" not in capsys.readouterr().out  # a new folder: nothing to set aside, no note
    first, config = (out / "metrics.jsonl").read_text(), (out / "config.json").read_text()
    weights = (out / "checkpoint" / "policy" / "model.safetensors").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit, match="bad.jsonl:1"):  # a run that fails as it loads its data
        train.main(args(tiny_model, out, "grpo", steps=1, extra=["--train_data", str(bad), "--lr", "0.5"]))
    assert (out / "metrics.jsonl").read_text() == first and (out / "config.json").read_text() == config
    assert not list(out.glob("*.previous*"))
    train.main(args(tiny_model, out, "grpo", steps=1))
    printed = capsys.readouterr().out
    assert f"note: {out} holds a checkpoint of an earlier run; this run starts fresh" in printed
    assert "note: the earlier run is kept: checkpoint -> checkpoint.previous" in printed
    assert [r["step"] for r in metrics(out)] == [0, 1]
    assert (out / "metrics.previous.jsonl").read_text() == first and (out / "config.previous.json").read_text() == config
    assert (out / "checkpoint.previous" / "policy" / "model.safetensors").read_bytes() == weights
    assert (out / "eval.previous" / "step_000000.jsonl").exists() and (out / "eval" / "step_000000.jsonl").exists()
    rewards, calls = train.compute_rewards, []

    def interrupted(ro, qs):  # step 4's rewards: an interrupt after step 3 was logged, with the checkpoint at 2
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return rewards(ro, qs)

    monkeypatch.setattr(train, "compute_rewards", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.main(args(tiny_model, out, "grpo", steps=4, extra=["--save_every", "2"]))
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is before  # a run that raised puts Ctrl-C back too
    monkeypatch.setattr(train, "compute_rewards", rewards)
    train.main(args(tiny_model, out, "grpo", steps=4, extra=["--save_every", "2", "--resume"]))
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3, 4]


def test_a_run_of_no_steps_says_it_saved_no_model(tiny_model, tmp_path, capsys):
    """--steps 0 (an evaluation of the starting model) said checkpoint/policy held the step-0 model."""
    train.main(args(tiny_model, tmp_path / "run", "grpo", steps=0))
    printed = capsys.readouterr().out
    assert f"done: nothing trained, so no model saved; {tmp_path / 'run' / 'metrics.jsonl'}" in printed
    assert "holds the step" not in printed and not (tmp_path / "run" / "checkpoint").exists()
    assert [r["step"] for r in metrics(tmp_path / "run")] == [0]


@pytest.mark.parametrize("resume", [False, True])
def test_an_earlier_run_without_a_checkpoint_is_set_aside_too(tiny_model, tmp_path, capsys, resume):
    """A --steps 0 evaluation (or a run stopped before its first save) left only its log: the next run
    there, fresh or with a --resume that finds no checkpoint, emptied metrics.jsonl and eval/ without a word."""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=0))
    first = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    train.main(args(tiny_model, out, "grpo", steps=0, extra=["--resume"] * resume))
    printed = capsys.readouterr().out
    assert (f"note: {out} holds the metrics.jsonl, with no checkpoint, of an earlier run; this run starts fresh and "
            "sets the earlier run aside after its step-0 evaluation") in printed
    assert ("note: the earlier run is kept: config.json -> config.previous.json, metrics.jsonl -> "
            "metrics.previous.jsonl, eval -> eval.previous") in printed
    assert (out / "metrics.previous.jsonl").read_text() == first
    assert (out / "eval.previous" / "step_000000.jsonl").exists()
    assert [r["step"] for r in metrics(out)] == [0]


def test_an_empty_log_alone_is_no_earlier_run(tiny_model, tmp_path, capsys):
    """A run stopped after it emptied metrics.jsonl but before it wrote step 0 there kept nothing: the next
    run in that folder has no earlier run to set aside, and says nothing of one."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    train.main(args(tiny_model, out, "grpo", steps=0))
    assert "earlier run" not in capsys.readouterr().out
    assert not (out / "metrics.previous.jsonl").exists() and [r["step"] for r in metrics(out)] == [0]


def test_a_log_alone_does_not_replace_an_earlier_run_set_aside_with_its_model(tiny_model, tmp_path):
    """A trained run set aside (checkpoint.previous and its log) by a --steps 0 run: the next run there set that
    log-only run aside too, replacing the trained run's config, log and eval beside its checkpoint.previous."""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1))
    train.main(args(tiny_model, out, "grpo", steps=0))  # sets the trained run aside, whole
    trained = {p.relative_to(out): p.read_bytes() for p in out.glob("*.previous*/**/*") if p.is_file()}
    trained |= {p.relative_to(out): p.read_bytes() for p in out.glob("*.previous*") if p.is_file()}
    train.main(args(tiny_model, out, "grpo", steps=0))
    now = {p.relative_to(out): p.read_bytes() for p in out.glob("*.previous*/**/*") if p.is_file()}
    now |= {p.relative_to(out): p.read_bytes() for p in out.glob("*.previous*") if p.is_file()}
    assert now == trained and Path("checkpoint.previous/trainer.pt") in now


def test_setting_aside_an_earlier_run_leaves_no_checkpoint_of_it_to_resume(tiny_model, tmp_path):
    """A save that died before removing checkpoint.old leaves it beside checkpoint: the earlier run set
    aside, a fresh run that has not saved yet (here: --steps 0) must not leave that copy for --resume."""
    import shutil

    from searchlite.models import find_checkpoint

    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1))
    shutil.copytree(out / "checkpoint", out / "checkpoint.old")
    train.main(args(tiny_model, out, "grpo", steps=0))
    assert find_checkpoint(out) is None and (out / "checkpoint.previous" / "trainer.pt").exists()


def test_the_finite_check_names_the_first_value_that_is_not():
    """Finite numbers, tensors and lists (an empty one too) pass; of two bad values the first is named."""
    train.check_finite(1, loss=[], reward=torch.tensor([1.0, 2.0]), grad_norm=0.5)
    with pytest.raises(FloatingPointError, match=r"^step 3: loss is not finite \(\[1\.0, nan\]\.\.\.\); the last good"):
        train.check_finite(3, kl=[torch.tensor(0.0)], loss=[torch.tensor(1.0), torch.tensor(float("nan"))],
                           reward=float("inf"))


@pytest.mark.parametrize("algo, poisoned, name", [("grpo", "policy_loss", "loss"), ("ppo", "value_loss", "value_loss"),
                                                  ("grpo", "compute_rewards", "reward"),
                                                  ("grpo", "policy_loss", "grad_norm")])
def test_nan_guard_keeps_last_checkpoint(tiny_model, tmp_path, monkeypatch, algo, poisoned, name):
    """A NaN in the policy loss, the critic's loss or the reward, or a finite loss whose gradient
    is not (grad_norm), stops the run at that step, naming it, and the checkpoint of the step
    before stays as it was."""
    out = tmp_path / "nan"
    train.main(args(tiny_model, out, algo, steps=1))
    saved = (out / "checkpoint" / "policy" / "model.safetensors").read_bytes()
    real = getattr(train, poisoned)

    def poison(*a, **k):
        got = real(*a, **k)
        if name == "grad_norm":  # the loss stays as it is, its backward carries an infinity
            got[0].register_hook(lambda g: g * float("inf"))
            return got
        return got * float("nan") if name == "reward" else (got[0] * float("nan"), *got[1:])

    monkeypatch.setattr(train, poisoned, poison)
    first = "nan]" if name == "grad_norm" else "nan, "  # one norm; the others hold one value a micro-batch or row
    with pytest.raises(FloatingPointError, match=rf"^step 2: {name} is not finite \(\[{first}"):
        train.main(args(tiny_model, out, algo, steps=2, extra=["--resume"]))
    assert (out / "checkpoint" / "policy" / "model.safetensors").read_bytes() == saved


def test_a_resume_names_a_damaged_log_before_loading_and_passes_over_stray_files(tiny_model, tmp_path, monkeypatch):
    """A NaN in metrics.jsonl (which json.dumps wrote for a NaN kl) stopped --resume with a DataError
    traceback after the models had loaded; a file of another name in eval/ with a TypeError. A run
    that starts fresh there does not read the log: it sets it aside."""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1))
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([rows[0], rows[1].replace('"kl": ', '"kl": NaN, "was": ')]) + "\n")
    load = train.load_policy
    monkeypatch.setattr(train, "load_policy", lambda *a, **k: pytest.fail("a model loaded before the log was read"))
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(out / 'metrics.jsonl'))}:2: bad JSON: NaN is not"):
        train.main(args(tiny_model, out, "grpo", steps=2, extra=["--resume"]))
    monkeypatch.setattr(train, "load_policy", load)
    fresh = tmp_path / "fresh"  # without --resume the damaged log is not read: it is set aside, as it is
    shutil.copytree(out, fresh)
    train.main(args(tiny_model, fresh, "grpo", steps=1))
    assert (fresh / "metrics.previous.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in metrics(fresh)] == [0, 1]
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (out / "eval" / "step_best.jsonl").write_text("")  # a user's file
    train.main(args(tiny_model, out, "grpo", steps=2, extra=["--resume"]))
    assert [r["step"] for r in metrics(out)] == [0, 1, 2] and (out / "eval" / "step_best.jsonl").exists()


def test_a_damaged_trainer_state_is_named_on_resume(tiny_model, tmp_path):
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1))
    state = out / "checkpoint" / "trainer.pt"
    state.write_bytes(state.read_bytes()[:200])  # damaged outside the program: was a torch.load traceback
    with pytest.raises(SystemExit, match=rf"^error: --resume: {re.escape(str(state))} cannot be read \(.*\); resume"):
        train.main(args(tiny_model, out, "grpo", steps=2, extra=["--resume"]))


def test_a_checkpoint_without_its_weights_is_named_on_resume(tiny_model, tmp_path, monkeypatch):
    """A policy (or PPO critic) folder whose weights were deleted outside the program ended in
    transformers' traceback; now one line naming the folder, before any model loads."""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "ppo", steps=1))
    monkeypatch.setattr(train, "load_policy", lambda *a, **k: pytest.fail("a model loaded"))
    for part in ("critic", "policy"):
        for f in (out / "checkpoint" / part).glob("*.safetensors"):
            f.unlink()
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: --resume: {out / 'checkpoint' / part} holds no "
                                                             "weights (no *.safetensors file); resume from a copy")):
            train.main(args(tiny_model, out, "ppo", steps=2, extra=["--resume"]))


def test_a_metric_that_is_not_finite_is_logged_as_null():
    from searchlite.data import json_line

    line = json_line({"step": 3, "kl": float("nan"), "eval/all": {"em": float("inf"), "searches": 1.5}, "n": 2})
    assert json.loads(line) == {"step": 3, "kl": None, "eval/all": {"em": None, "searches": 1.5}, "n": 2}
    assert line.endswith("}\n") and "NaN" not in line and "Infinity" not in line


def test_bad_flag_exits_with_message(tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"did you mean 'group'"):
        train.main(["--grup", "5"])


def test_bad_data_line_stops_the_run_before_any_model_loads(tiny_model, tmp_path, monkeypatch):
    """The data are read before the models: a bad line is reported with its file, line and
    field in seconds, not after a large model has loaded."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "who?", "golden_answers": ["x"]}\n{"question": "where?"}\n')
    monkeypatch.setattr(train, "load_policy", lambda *a, **k: pytest.fail("a model loaded before the data were read"))
    with pytest.raises(SystemExit, match=rf"error: {data}:2: missing field 'golden_answers'"):
        train.main(args(tiny_model, tmp_path / "out", "grpo", extra=["--train_data", str(data)]))
    data.write_text("\n")  # no questions at all
    with pytest.raises(SystemExit, match=rf"error: --train_data {data}: no questions in the file"):
        train.main(args(tiny_model, tmp_path / "out", "grpo", extra=["--train_data", str(data)]))
    assert not (tmp_path / "out").exists()  # the folder it made for its lock is gone again (run.lock was left)
    (tmp_path / "kept").mkdir()  # a folder that was there before the run stays
    with pytest.raises(SystemExit, match=r"no questions in the file"):
        train.main(args(tiny_model, tmp_path / "kept", "grpo", extra=["--train_data", str(data)]))
    assert (tmp_path / "kept").is_dir()


def test_a_test_set_with_a_repeated_id_is_refused_and_a_training_set_may_repeat_one(tiny_model, tmp_path, monkeypatch):
    """The evaluation's records are keyed by id: a test set repeating one wrote two records under it,
    and the evaluate.py command the run ends with refused the file. A training set may repeat an id."""
    data = tmp_path / "qa.jsonl"
    data.write_text('{"id": "a", "question": "who?", "golden_answers": ["x"]}\n'
                    '{"id": "a", "question": "where?", "golden_answers": ["y"]}\n')
    monkeypatch.setattr(train, "load_policy", lambda *a, **k: pytest.fail("a model loaded before the data were read"))
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {data}:2: duplicate id 'a' (first on line 1)") + "$"):
        train.main(args(tiny_model, tmp_path / "out", "grpo", extra=["--test_data", str(data)]))
    monkeypatch.setattr(train, "load_policy", lambda *a, **k: pytest.fail("read"))  # the data passed: a model loads
    with pytest.raises(pytest.fail.Exception, match="read"):
        train.main(args(tiny_model, tmp_path / "out", "grpo", extra=["--train_data", str(data)]))


def test_score_tokens_uses_the_sampling_temperature(tiny_llama):
    from searchlite.losses import token_logprobs

    ids = torch.tensor([[5, 9, 12, 7, 3], [4, 4, 8, 2, 6]])
    with torch.no_grad():
        logits = tiny_llama(input_ids=ids).logits
        got = train.score_tokens(tiny_llama, _Rows(ids), 2, "cpu", temperature=0.5)
        assert torch.allclose(got, token_logprobs(logits / 0.5, ids), atol=1e-5)
        assert not torch.allclose(got, token_logprobs(logits, ids), atol=1e-3)


def test_trained_logprobs_runs_the_head_where_trained_tokens_are_drawn_only(tiny_llama):
    """Log-probs, their gradient and the entropy are those of the whole rows' logits where the
    mask is set (0 elsewhere), while the LM head reads only the n hidden states that predict a
    masked token: not the prompt, a passage between two turns, or the padding."""
    from searchlite.losses import masked_entropy, token_logprobs
    from searchlite.models import trained_logprobs

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (3, 9), generator=gen)
    attn = torch.ones_like(ids)
    attn[2, 7:] = 0  # right padding
    mask = torch.zeros_like(ids)
    mask[0, 4:6], mask[0, 8], mask[1, 6:8], mask[2, 5:7] = 1, 1, 1, 1  # row 0: a passage at 6, 7
    seen = []
    hook = tiny_llama.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    logp, logits, at = trained_logprobs(tiny_llama, ids, attn, mask, temperature=0.7)
    hook.remove()
    n = int(mask.sum())
    assert seen == [(n, tiny_llama.config.hidden_size)] and logits.shape == (n, tiny_llama.config.vocab_size)
    assert torch.equal(torch.zeros_like(mask).index_put(at, torch.tensor(1)), mask)
    full_logits = tiny_llama(input_ids=ids, attention_mask=attn).logits / 0.7
    full = token_logprobs(full_logits, ids)
    on = mask.bool()
    assert torch.allclose(logp[on], full[on], atol=1e-6, rtol=0) and (logp[~on] == 0).all()
    b, t = mask[:, 1:].nonzero(as_tuple=True)
    want_ent = masked_entropy(full_logits[b, t], (b, t + 1), mask.shape)
    assert torch.allclose(masked_entropy(logits, at, mask.shape, 0.7), want_ent, atol=1e-6, rtol=0)
    params = list(tiny_llama.parameters())
    got = torch.autograd.grad((logp * mask).sum(), params)
    want = torch.autograd.grad((full * mask).sum(), params)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(got, want))
    assert any(a.abs().sum() > 0 for a in got)
    none, none_logits, none_at = trained_logprobs(tiny_llama, ids, attn, torch.zeros_like(mask))  # nothing trained
    assert none_logits.shape[0] == 0 and (none == 0).all()
    # a micro-batch of such rows (prompts that filled max_len) still backpropagates: zeros
    loss = none.sum() + masked_entropy(none_logits, none_at, mask.shape).sum()
    assert all((g == 0).all() for g in torch.autograd.grad(loss, params, allow_unused=True) if g is not None)
    assert not tiny_llama.lm_head._forward_pre_hooks  # the pick is gone: generate() sees every position


def test_trained_logprobs_of_a_model_whose_head_module_is_never_called(tiny_llama, monkeypatch):
    """A model whose forward makes its logits without calling the module get_output_embeddings
    names (so the pre-hook never picks): the rows' logits are picked afterwards, the same values."""
    from searchlite.losses import token_logprobs
    from searchlite.models import trained_logprobs

    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    attn, mask = torch.ones_like(ids), torch.zeros_like(ids)
    mask[0, 3:5], mask[1, 2], mask[1, 6] = 1, 1, 1
    full = token_logprobs(tiny_llama(input_ids=ids, attention_mask=attn).logits, ids)
    monkeypatch.setattr(type(tiny_llama), "get_output_embeddings", lambda self: torch.nn.Linear(1, 1))  # never called
    logp, logits, at = trained_logprobs(tiny_llama, ids, attn, mask)
    assert logits.shape == (4, tiny_llama.config.vocab_size) and not tiny_llama.lm_head._forward_pre_hooks
    on = mask.bool()
    assert torch.allclose(logp[on], full[on], atol=1e-6, rtol=0) and (logp[~on] == 0).all()


class _Rows:
    """The three fields of a Rollout that score_tokens reads."""

    def __init__(self, ids):
        self.input_ids, self.attention_mask, self.loss_mask = ids, torch.ones_like(ids), torch.ones_like(ids)

    def __len__(self):
        return len(self.input_ids)


def test_a_save_interrupted_twice_keeps_a_checkpoint_to_resume_from(tiny_llama, byte_tokenizer, tmp_path, monkeypatch):
    """A save killed between its two renames leaves checkpoint.old; the next save, killed before its
    own rename, must not have deleted it first."""
    from pathlib import Path

    from searchlite.models import find_checkpoint, load_trainer_state, save_checkpoint

    save_checkpoint(tmp_path, tiny_llama, byte_tokenizer, {"step": 2})
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # the first kill, mid-rename
    real = os.replace

    def killed(src, dst):
        if Path(src).name == "checkpoint.tmp":
            raise KeyboardInterrupt  # the second kill, just before the new checkpoint is in place
        return real(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, tiny_llama, byte_tokenizer, {"step": 4})
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoint.old"
    assert load_trainer_state(find_checkpoint(tmp_path))["step"] == 2
    monkeypatch.setattr(os, "replace", real)
    (tmp_path / "checkpoint.tmp" / "critic").mkdir()  # in the folder the killed save left: one it does not write
    save_checkpoint(tmp_path, tiny_llama, byte_tokenizer, {"step": 4})  # the next save completes and tidies up
    assert load_trainer_state(find_checkpoint(tmp_path))["step"] == 4 and not (tmp_path / "checkpoint.old").exists()
    assert not (tmp_path / "checkpoint" / "critic").exists()  # nothing of the temporary folder it found stays
    shutil.copytree(tmp_path / "checkpoint", tmp_path / "checkpoint.old")  # a save killed before its last tidy-up
    save_checkpoint(tmp_path, tiny_llama, byte_tokenizer, {"step": 6})
    assert load_trainer_state(find_checkpoint(tmp_path))["step"] == 6 and not (tmp_path / "checkpoint.old").exists()


def test_a_checkpoint_is_on_disk_before_it_takes_its_name(tiny_llama, byte_tokenizer, tmp_path, monkeypatch):
    """Every file of a checkpoint is fsynced before the rename that makes it the checkpoint, and
    the folder holding it after: a power cut can never leave a `checkpoint` of empty files."""
    from pathlib import Path

    from searchlite.models import save_checkpoint

    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("rename", str(src))), replace(src, dst)))
    ckpt = save_checkpoint(tmp_path, tiny_llama, byte_tokenizer, {"step": 1})
    renamed = events.index(("rename", str(tmp_path / "checkpoint.tmp")))
    synced = {Path(p).relative_to(tmp_path / "checkpoint.tmp") for kind, p in events[:renamed]
              if kind == "sync" and p.startswith(str(tmp_path / "checkpoint.tmp"))}
    files = {f.relative_to(ckpt) for f in ckpt.rglob("*") if f.is_file()}
    assert {Path("trainer.pt"), Path("policy/model.safetensors"), Path("policy/tokenizer.json")} <= files <= synced
    assert ("sync", str(tmp_path)) in events[renamed:]


class Capture:
    """An optimizer that keeps the gradient it is asked to apply (the last step's)."""

    def __init__(self, params):
        self.params, self.grads = list(params), None

    def step(self):
        self.grads = [p.grad.clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _update_inputs(model, tokenizer, lengths, g, empty=(), temperature=1.0):
    """(rollout, old log-probs at `temperature`, advantages) of random responses of `lengths` after
    4-token prompts; each response's second token is retrieved (loss_mask 0), and the rows in `empty` all are."""
    from searchlite.rollout import _collate

    n = len(lengths)
    prompts = [torch.randint(3, 200, (4,), generator=g).tolist() for _ in lengths]
    resp = [torch.randint(3, 200, (k,), generator=g).tolist() for k in lengths]
    masks = [[0] * k if i in empty else [1, 0] + [1] * (k - 2) for i, k in enumerate(lengths)]
    ro = _collate(prompts, resp, masks, [0] * n, [1] * n, [None] * n, [[]] * n, tokenizer)
    old_logp = train.score_tokens(model, ro, 8, "cpu", temperature=temperature)
    return ro, old_logp, torch.linspace(-1, 1, old_logp.numel()).view_as(old_logp) * ro.loss_mask


def test_entropy_bonus_adds_minus_coef_times_the_entropy_gradient(tiny_llama, byte_tokenizer):
    """update() with --entropy_coef c: its gradient minus the gradient at c = 0 is -c times the
    gradient of the policy tokens' mean entropy, computed here with torch's Categorical."""
    from searchlite.config import parse_args

    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 3, 6), torch.Generator().manual_seed(0))

    def grads(coef):
        cfg = parse_args(["--preset", "none", "--entropy_coef", str(coef), "--kl_coef", "0", "--grad_clip", "1e9",
                          "--micro_batch_size", "8"])
        opt = Capture(tiny_llama.parameters())
        train.update(cfg, 0, tiny_llama, opt, ro, old_logp, old_logp, adv, "cpu")
        return opt.grads

    logits = tiny_llama(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits  # (3, T, V)
    ents = [torch.distributions.Categorical(logits=logits[b, t - 1]).entropy()
            for b in range(3) for t in range(ro.input_ids.shape[1]) if ro.loss_mask[b, t]]
    want = torch.autograd.grad(torch.stack(ents).mean(), list(tiny_llama.parameters()))
    for got0, got, w in zip(grads(0.0), grads(0.05), want):
        torch.testing.assert_close(got - got0, -0.05 * w, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_sum_to_the_gradient_of_the_whole_mini_batch(tiny_llama, byte_tokenizer, loss_agg):
    """The micro-batches' weighted gradients add up to the gradient of one pass over the whole
    mini-batch (policy loss, GRPO's KL and the entropy bonus, each aggregated by --loss_agg),
    also when a row has no policy token (all its response retrieved): under seq_mean_token_mean
    such a row is no sequence of the mean, whichever micro-batch it falls in."""
    from searchlite.config import parse_args

    g = torch.Generator().manual_seed(1)
    # micro-batches of 2 by length: rows [1, 3], [0, 4], [2]; row 1 has no policy token, beside row 3
    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 2, 7, 3, 6), g, empty=(1,))
    ref_logp = old_logp + 0.3 * torch.randn(old_logp.shape, generator=g)  # a KL term with a gradient
    old_logp = old_logp + 0.3 * torch.randn(old_logp.shape, generator=g)  # ratios off 1: some clip

    def grads(micro):
        cfg = parse_args(["--preset", "none", "--algo", "grpo", "--kl_coef", "0.1", "--entropy_coef", "0.01",
                          "--loss_agg", loss_agg, "--grad_clip", "1e9", "--micro_batch_size", str(micro)])
        assert train.micro_batches(5, micro, ro.attention_mask.sum(1)) == ([[1, 3], [0, 4], [2]] if micro == 2
                                                                           else [[1, 3, 0, 4, 2]])
        opt = Capture(tiny_llama.parameters())
        stats = train.update(cfg, 0, tiny_llama, opt, ro, old_logp, ref_logp, adv, "cpu")
        return opt.grads, {k: sum(stats[k]) for k in ("loss", "kl", "entropy", "clipfrac")}

    (got, logged), (want, whole) = grads(2), grads(8)
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, atol=1e-7, rtol=1e-5)
    assert 0 < whole["clipfrac"] < 1  # some ratios clip
    for k, v in whole.items():  # and the logged statistics are the whole mini-batch's too
        assert logged[k] == pytest.approx(v, rel=1e-5, abs=1e-8), k


def test_ppo_micro_batches_sum_to_the_critics_whole_gradient_too(tiny_llama, byte_tokenizer):
    """PPO: the critic's value-loss gradient over micro-batches of 2 is that of one pass over the
    mini-batch (each micro-batch weighted by its token share), as the policy's is, and so is the
    logged value loss."""
    from conftest import make_tiny_llama
    from searchlite.config import parse_args
    from searchlite.models import Critic

    g = torch.Generator().manual_seed(6)
    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 2, 7, 3, 6), g)
    critic = Critic(make_tiny_llama(byte_tokenizer, seed=1).model)
    values = train.score_tokens(critic, ro, 8, "cpu", values=True)
    old_values = values + 0.3 * torch.randn(values.shape, generator=g)  # some value errors clip
    ret = values + torch.randn(values.shape, generator=g)

    def grads(micro):
        cfg = parse_args(["--preset", "none", "--algo", "ppo", "--kl_coef", "0", "--grad_clip", "1e9",
                          "--micro_batch_size", str(micro)])
        opt, critic_opt = Capture(tiny_llama.parameters()), Capture(critic.parameters())
        stats = train.update(cfg, 0, tiny_llama, opt, ro, old_logp, old_logp, adv, "cpu", critic, critic_opt,
                             old_values, ret)
        return opt.grads, critic_opt.grads, sum(stats["vf_loss"])

    (got, got_critic, logged), (want, want_critic, whole) = grads(2), grads(8)
    for g_, w in zip(got + got_critic, want + want_critic):
        torch.testing.assert_close(g_, w, atol=1e-7, rtol=1e-5)
    assert sum(float(w.abs().sum()) for w in want_critic) > 0 and logged == pytest.approx(whole, rel=1e-5)


def test_micro_batches_group_rows_of_like_length():
    """Every row once; with lengths, shortest first, so each micro-batch is padded to little more
    than its own rows (here 23 tokens with padding instead of 32)."""
    lengths = [9, 2, 5, 1, 4]
    assert train.micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    by_length = train.micro_batches(5, 2, lengths)
    assert by_length == [[3, 1], [4, 2], [0]] and sorted(sum(by_length, [])) == list(range(5))
    padded = lambda batches: sum(max(lengths[r] for r in b) * len(b) for b in batches)  # noqa: E731
    assert (padded(train.micro_batches(5, 2)), padded(by_length)) == (9 * 2 + 5 * 2 + 4, 2 * 2 + 5 * 2 + 9)


def test_micro_batches_hold_at_most_max_tokens():
    """With a token budget a micro-batch holds rows x its longest row <= max_tokens (a longer row
    alone), rows still shortest first and each once, and the row limit still holds."""
    lengths = [9, 2, 5, 1, 4]  # shortest first: rows 3, 1, 4, 2, 0
    assert train.micro_batches(5, 0, lengths, max_tokens=8) == [[3, 1], [4], [2], [0]]
    assert train.micro_batches(5, 0, lengths, max_tokens=10) == [[3, 1], [4, 2], [0]]
    assert train.micro_batches(5, 1, lengths, max_tokens=100) == [[3], [1], [4], [2], [0]]
    assert train.micro_batches(5, 0, lengths, max_tokens=100) == [[3, 1, 4, 2, 0]]


def test_passes_split_until_every_rank_has_as_many(monkeypatch):
    """Under torchrun a rank whose budget made fewer micro-batches than another's splits its
    largest until it has as many (each forward / backward is a collective); without a budget
    every rank has as many already and nothing is asked of the others."""
    lengths = [3, 1, 2, 2, 1]
    monkeypatch.setattr(train.dist, "all_max", lambda n: 4)  # another rank made 4
    got = train.passes(5, 0, lengths, max_tokens=100)
    assert len(got) == 4 and all(got) and sorted(sum(got, [])) == list(range(5))
    assert got == [[1], [4], [2], [3, 0]]  # [1, 4, 2, 3, 0] halved, then [2, 3, 0], then the first of two pairs
    monkeypatch.setattr(train.dist, "all_max", lambda n: pytest.fail("no budget: no collective"))
    assert train.passes(5, 2, lengths) == train.micro_batches(5, 2, lengths)


def test_token_budget_micro_batches_sum_to_the_whole_gradient(tiny_llama, byte_tokenizer):
    """Micro-batches cut by --micro_batch_tokens add up to the gradient of one pass, as row-count ones do."""
    from searchlite.config import parse_args

    g = torch.Generator().manual_seed(2)
    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 2, 7, 3, 6), g)

    def grads(*flags):
        cfg = parse_args(["--preset", "none", "--algo", "grpo", "--kl_coef", "0.1", "--grad_clip", "1e9", *flags])
        opt = Capture(tiny_llama.parameters())
        train.update(cfg, 0, tiny_llama, opt, ro, old_logp, old_logp, adv, "cpu")
        return opt.grads

    lengths = ro.attention_mask.sum(1)
    budget = 2 * int(lengths.sort().values[1])  # the two shortest rows together, the others alone
    assert len(train.micro_batches(5, 8, lengths, budget)) == 4
    for got, want in zip(grads("--micro_batch_size", "8", "--micro_batch_tokens", str(budget)),
                         grads("--micro_batch_size", "8")):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)


def test_the_scoring_passes_keep_to_the_token_budget_too(tiny_model, tmp_path, monkeypatch, varied_reward):
    """--micro_batch_tokens caps the passes that score the old and reference log-probs and the values
    as it caps the update's: they hold the same activations (dropped from them, it changed no result
    and passed every test that reaches the lines: only memory would grow)."""
    budgets, real = [], train.passes
    monkeypatch.setattr(train, "passes", lambda n, size, lengths, max_tokens=0: budgets.append(max_tokens) or
                        real(n, size, lengths, max_tokens))
    train.main(args(tiny_model, tmp_path / "run", "ppo", steps=1, extra=["--micro_batch_tokens", "500"]))
    assert len(budgets) == 4 and set(budgets) == {500}  # old log-probs, reference, values; then the update


def _policy_logps(model, ro, temperature):
    """{(b, t): log p(input_ids[b, t]) at `temperature`} for every policy token, one softmax at a time."""
    logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits  # (N, T, V)
    return {(b, t): torch.log_softmax(logits[b, t - 1] / temperature, -1)[ro.input_ids[b, t]]
            for b, t in ro.loss_mask.nonzero().tolist()}


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("algo", ["grpo", "ppo", "reinforce_pp"])
def test_policy_gradient_is_that_of_the_clipped_surrogate_token_by_token(tiny_llama, byte_tokenizer, algo, loss_agg):
    """update()'s policy gradient (no KL, no entropy) is the gradient of -min(r A, clip(r, 0.8, 1.2) A),
    r = p / p_old at temperature 0.7, computed token by token and averaged as --loss_agg says."""
    from searchlite.config import parse_args

    g = torch.Generator().manual_seed(2)
    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (6, 4, 7, 5), g, temperature=0.7)
    old_logp = old_logp + 0.5 * torch.randn(old_logp.shape, generator=g)  # ratios beyond both clip bounds
    cfg = parse_args(["--preset", "none", "--algo", algo, "--loss_agg", loss_agg, "--temperature", "0.7",
                      "--clip_eps", "0.2", "--kl_coef", "0", "--entropy_coef", "0", "--grad_clip", "1e9",
                      "--micro_batch_size", "8"])
    opt = Capture(tiny_llama.parameters())
    train.update(cfg, 0, tiny_llama, opt, ro, old_logp, old_logp, adv, "cpu")

    per_row, seen = [[] for _ in range(len(ro))], set()  # each row's token losses; (A > 0, r > 1) outside the clip
    for (b, t), logp in _policy_logps(tiny_llama, ro, 0.7).items():
        ratio, a = torch.exp(logp - old_logp[b, t]), adv[b, t]
        per_row[b].append(-torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a))
        if not 0.8 <= ratio.item() <= 1.2:
            seen.add((a.item() > 0, ratio.item() > 1))
    assert seen == {(True, True), (True, False), (False, True), (False, False)}  # every sign past every bound
    rows = [torch.stack(r) for r in per_row if r]
    loss = torch.cat(rows).mean() if loss_agg == "token_mean" else torch.stack([r.mean() for r in rows]).mean()
    want = torch.autograd.grad(loss, list(tiny_llama.parameters()))
    for got, w in zip(opt.grads, want):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("algo", ["grpo", "ppo", "reinforce_pp"])
def test_kl_is_in_the_grpo_loss_and_not_in_the_others_update(tiny_llama, byte_tokenizer, algo):
    """GRPO: update()'s gradient at kl_coef 0.1 minus at 0 is 0.1 times the gradient of the policy tokens'
    mean k3, exp(ref - logp) - (ref - logp) - 1; PPO and REINFORCE++ put the KL in the reward, before update."""
    from searchlite.config import parse_args

    g = torch.Generator().manual_seed(3)
    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 3, 6), g, temperature=0.7)
    ref_logp = old_logp + 0.3 * torch.randn(old_logp.shape, generator=g)  # a KL with a gradient

    def grads(kl_coef):
        cfg = parse_args(["--preset", "none", "--algo", algo, "--kl_coef", str(kl_coef), "--temperature", "0.7",
                          "--grad_clip", "1e9", "--micro_batch_size", "8"])
        opt = Capture(tiny_llama.parameters())
        train.update(cfg, 0, tiny_llama, opt, ro, old_logp, ref_logp, adv, "cpu")
        return opt.grads

    log_r = [ref_logp[b, t] - logp for (b, t), logp in _policy_logps(tiny_llama, ro, 0.7).items()]
    k3 = torch.stack([torch.exp(x) - x - 1 for x in log_r]).mean()
    want = torch.autograd.grad(k3, list(tiny_llama.parameters()))
    for got0, got, w in zip(grads(0.0), grads(0.1), want):
        if algo == "grpo":
            torch.testing.assert_close(got - got0, 0.1 * w, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(got, got0)


def test_first_pass_of_update_sees_the_rollouts_log_probs_and_values(tiny_llama, byte_tokenizer, monkeypatch):
    """One epoch, one mini-batch: every micro-batch's log-probs and critic values, as update() feeds
    them to the losses, equal score_tokens' at every policy token (nothing steps before the last)."""
    from searchlite.config import parse_args
    from searchlite.models import Critic

    from conftest import make_tiny_llama

    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 3, 6, 4), torch.Generator().manual_seed(4),
                                       temperature=0.7)
    critic = Critic(make_tiny_llama(byte_tokenizer, seed=1).model)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # not a fresh critic's zero values
    old_values = train.score_tokens(critic, ro, 8, "cpu", values=True)  # (N, T)
    seen = {"policy": [], "value": []}  # (what the loss got as logp / values, loss_mask) per call

    def spy(kind, real):
        def record(new, old, target, loss_mask, *rest):
            seen[kind].append((new.detach(), loss_mask.bool()))
            return real(new, old, target, loss_mask, *rest)
        return record

    monkeypatch.setattr(train, "policy_loss", spy("policy", train.policy_loss))
    monkeypatch.setattr(train, "value_loss", spy("value", train.value_loss))
    cfg = parse_args(["--preset", "none", "--algo", "ppo", "--temperature", "0.7", "--ppo_epochs", "1",
                      "--mini_batch_size", "0", "--micro_batch_size", "2"])
    # real steps: one taken before the mini-batch's last micro-batch would move the later ones' log-probs
    opt, critic_opt = torch.optim.SGD(tiny_llama.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)
    train.update(cfg, 0, tiny_llama, opt, ro, old_logp, old_logp, adv, "cpu", critic, critic_opt, old_values,
                 old_values + adv)
    rows = train.micro_batches(len(ro), 2, ro.attention_mask.sum(1))  # update's micro-batches, in its order
    for kind, want in (("policy", old_logp), ("value", old_values)):
        assert len(seen[kind]) == len(rows) == 2
        for (got, m), r in zip(seen[kind], rows):
            assert torch.equal(m, ro.loss_mask[r, :m.shape[1]].bool())
            torch.testing.assert_close(got[m], want[r, :m.shape[1]][m], atol=1e-5, rtol=0)


def test_one_step_on_policy_grpo_takes_old_log_probs_from_its_forward(tiny_llama, byte_tokenizer):
    """GRPO with one epoch and one mini-batch updates the policy that sampled: update() without
    old log-probs (or a reference) uses its own forward's, and its gradient is the one it takes
    with score_tokens' (the pass it saves); more steps a batch, or PPO / REINFORCE++, keep the pass."""
    from searchlite.config import parse_args

    flags = ["--preset", "none", "--algo", "grpo", "--temperature", "0.7", "--kl_coef", "0.1",
             "--micro_batch_size", "2", "--grad_clip", "1e9", "--batch_size", "2", "--group", "2"]
    cfg = parse_args(flags)
    assert train.one_step_on_policy(cfg, 4)
    assert not train.one_step_on_policy(parse_args(flags + ["--mini_batch_size", "2"]), 4)
    assert not train.one_step_on_policy(parse_args(flags + ["--ppo_epochs", "2"]), 4)
    assert not any(train.one_step_on_policy(parse_args(flags + ["--algo", a]), 4) for a in ("ppo", "reinforce_pp"))
    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 3, 6, 4), torch.Generator().manual_seed(6),
                                       temperature=0.7)
    grads = []
    for old, ref in ((old_logp, old_logp), (None, None)):
        opt = Capture(tiny_llama.parameters())
        train.update(cfg, 0, tiny_llama, opt, ro, old, ref, adv, "cpu")
        grads.append(opt.grads)
    assert any(g.abs().max() > 1e-4 for g in grads[0])  # a real gradient
    for scored, own in zip(*grads):
        torch.testing.assert_close(own, scored, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("algo, passes", [("grpo", 1), ("reinforce_pp", 2)])
def test_train_scores_the_old_policy_only_when_it_must(tiny_model, tmp_path, varied_reward, monkeypatch, algo, passes):
    """A step of GRPO on its whole batch scores the reference alone; REINFORCE++ scores the policy too."""
    calls = []
    real = train.score_tokens
    monkeypatch.setattr(train, "score_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    train.main(args(tiny_model, tmp_path / algo, algo, steps=1, extra=("--eval_every", "0")))
    assert len(calls) == passes


def test_a_resume_drops_evaluations_and_trajectories_past_its_checkpoint(tiny_model, tmp_path):
    """A run killed after step 3 with its checkpoint at step 2 left eval/step_000003.jsonl and its
    trajectories beside the resumed run's, and bench/r1pp_table.py read the last eval file as the
    run's latest evaluation: of a policy the resumed run never trained."""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo"))
    (out / "eval" / "step_000003.jsonl").write_text("{}\n")  # the killed run's, after its last checkpoint
    (out / "trajectories" / "step00003-memorization.html").write_text("<html></html>")
    train.main(args(tiny_model, out, "grpo", extra=["--resume"]))  # at its --steps already: trains nothing
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["step_000000.jsonl", "step_000002.jsonl"]
    assert sorted(p.name for p in (out / "trajectories").iterdir()) == ["step00001.html", "step00002.html"]


def test_a_resume_from_a_model_changed_since_is_refused(tiny_model, tmp_path, capsys):
    """Stage 1 rerun into its folder replaced the model a stage-2 run started from, and --resume
    took its KL reference (and rewrite model) from the new one without a word: kl jumped from
    0.00 to 3.68. The checkpoint keeps a digest of the starting model's weight files."""
    from safetensors.torch import load_file, save_file

    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(tiny_model, model)
    train.main(args(str(model), out, "grpo", steps=1))
    shutil.copytree(model, tmp_path / "copy")  # copied back (new modification times): the same model
    shutil.rmtree(model)
    (tmp_path / "copy").rename(model)
    train.main(args(str(model), out, "grpo", steps=2, extra=["--resume"]))
    printed = capsys.readouterr().out  # a step to train: no word of a finished run
    assert f"resumed from {out / 'checkpoint'} at step 1\n" in printed and "nothing to train" not in printed
    weights = load_file(model / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=rf"--resume: --model {re.escape(str(model))} is not the model .*checkpoint's "
                                         r"run started from \(changed since: model.safetensors\); the KL reference"):
        train.main(args(str(model), out, "grpo", steps=3, extra=["--resume"]))


def test_a_run_prints_its_config_first_and_a_step_line_before_its_evaluation(tiny_model, tmp_path, capsys):
    """A run's output begins with every setting it runs with; 'eval step 1' was printed before
    'step    1 | reward ...', the step it evaluates."""
    argv = args(tiny_model, tmp_path / "run", "grpo", steps=1)
    train.main(argv)
    printed = capsys.readouterr().out
    assert printed.startswith(f"config:\n{train.format_config(train.parse_args(argv))}\n")
    lines = [line for line in printed.splitlines() if line.startswith(("step ", "eval step "))]
    assert [line.split("|")[0].split()[:3] for line in lines] == [["eval", "step", "0"], ["step", "1"],
                                                                    ["eval", "step", "1"]]


def test_sampling_and_rollout_flags_reach_the_sampler_and_the_rollout(tiny_model, tmp_path, varied_reward,
                                                                       monkeypatch):
    """--seed, --temperature, --top_p, --max_new_tokens, --gen_batch_size reach the training sampler;
    --max_turns, --topk, --max_obs_tokens, --max_len, --chat_template, --mask_retrieved each rollout."""
    samplers, rollouts = [], []
    real_sampler, real_rollout = train.HFSampler, train.rollout

    def sampler_spy(model, tokenizer, **kw):
        samplers.append(kw)
        return real_sampler(model, tokenizer, **kw)

    def rollout_spy(*a, **kw):
        rollouts.append(kw)
        kw["ro"] = real_rollout(*a, **{k: v for k, v in kw.items()})
        return kw["ro"]

    monkeypatch.setattr(train, "HFSampler", sampler_spy)
    monkeypatch.setattr(train, "rollout", rollout_spy)
    train.main(args(tiny_model, tmp_path / "run", "grpo", steps=1, extra=[
        "--seed", "7", "--temperature", "0.9", "--top_p", "0.8", "--max_new_tokens", "5", "--gen_batch_size", "3",
        "--max_turns", "2", "--topk", "2", "--max_obs_tokens", "40", "--max_len", "300", "--chat_template", "false",
        "--mask_retrieved", "false", "--eval_every", "0"]))
    assert samplers == [dict(max_new_tokens=5, temperature=0.9, top_p=0.8, seed=7, batch_size=3)]
    (kw,) = rollouts  # one training step (the evaluations go through score_qa)
    assert {k: kw[k] for k in ("max_turns", "topk", "max_obs_tokens", "max_len", "chat_template", "mask_retrieved")} \
        == dict(max_turns=2, topk=2, max_obs_tokens=40, max_len=300, chat_template=False, mask_retrieved=False)
    ro, row = kw["ro"], metrics(tmp_path / "run")[-1]  # the step's means over its trajectories
    assert row["response_len"] == pytest.approx(float(ro.loss_mask.sum(1).float().mean()))
    assert (row["searches"], row["turns"]) == (pytest.approx(sum(ro.searches) / len(ro)),
                                               pytest.approx(sum(ro.turns) / len(ro)))


def test_eval_every_evaluates_after_every_nth_step_and_at_the_end(tiny_model, tmp_path):
    """--eval_every 3 over 4 steps: before step 1 (a fresh run), after step 3, and after the last, 4.
    (With 2, a step count off by two would evaluate at the same steps.)"""
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=4, extra=["--eval_every", "3", "--save_every", "0",
                                                             "--log_trajectories_every", "0"]))
    assert [r["step"] for r in metrics(out) if "eval/all" in r] == [0, 3, 4]
    assert sorted(p.name for p in (out / "eval").iterdir()) == [f"step_{s:06d}.jsonl" for s in (0, 3, 4)]


@pytest.mark.parametrize("size, asked", [(0, 5), (3, 3)])
def test_eval_size_0_evaluates_every_test_question_and_n_the_first_n(tiny_model, tmp_path, size, asked):
    from searchlite.config import TOY_DIR

    test = tmp_path / "test.jsonl"
    test.write_text("".join(TOY_DIR.joinpath("test.jsonl").read_text().splitlines(keepends=True)[:5]))
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=0, extra=["--test_data", str(test), "--eval_size", str(size)]))
    evaluated = [json.loads(line)["id"] for line in (out / "eval" / "step_000000.jsonl").read_text().splitlines()]
    assert evaluated == [json.loads(line)["id"] for line in test.read_text().splitlines()][:asked]


def test_epochs_are_fresh_permutations_and_the_seed_sets_the_order():
    """batch_questions over 10 questions, batches of 5: each epoch (two steps) is every question once; the
    second epoch is another order than the first; another --seed another order."""
    qa = list(range(10))
    epochs = [train.batch_questions(qa, 2 * e, 5, 0) + train.batch_questions(qa, 2 * e + 1, 5, 0) for e in range(3)]
    assert all(sorted(e) == qa for e in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert [train.batch_questions(qa, s, 5, 1) for s in (0, 1)] != [epochs[0][:5], epochs[0][5:]]
    assert train.batch_questions(qa, 3, 5, 0) == epochs[1][5:]  # any step is recomputable (exact resume)


def test_gamma_and_lam_reach_the_advantages(tiny_model, tmp_path, varied_reward, monkeypatch):
    """PPO's GAE takes --gamma then --lam, REINFORCE++'s return --gamma, as the flags say (both 1 by default,
    so a swap or a dropped value would not show at the defaults)."""
    from searchlite.advantages import gae, ppo_token_rewards, reinforce_pp_advantages
    from searchlite.losses import masked_whiten

    real_update = train.update
    for algo in ("ppo", "reinforce_pp"):
        seen = []

        def spy(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt, old_values, ret, mem):
            seen.append(dict(ro=ro, old=old_logp, ref=ref_logp, adv=adv.clone(), values=old_values))
            return real_update(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt,
                               old_values, ret, mem)

        monkeypatch.setattr(train, "update", spy)
        # two steps: a fresh critic's values are all 0, where GAE depends on gamma * lam alone
        train.main(args(tiny_model, tmp_path / algo, algo, steps=2, extra=[
            "--gamma", "0.5", "--lam", "0.25", "--kl_coef", "0", "--critic_lr", "1e-2", "--eval_every", "0"]))
        assert len(seen) == 2
        for s in seen:
            mask = s["ro"].loss_mask.float()
            scores = train.compute_rewards(s["ro"], None)  # the varied_reward stand-in: a hash of the responses
            kl = torch.zeros_like(mask)
            if algo == "ppo":
                want, _ = gae(ppo_token_rewards(scores, kl, mask, 0.0), s["values"], mask, 0.5, 0.25,
                              whiten=masked_whiten)
            else:
                want = reinforce_pp_advantages(scores, kl, mask, 0.0, 0.5)
            torch.testing.assert_close(s["adv"], want, rtol=0, atol=1e-5)
        if algo == "ppo":
            assert float(seen[1]["values"].abs().max()) > 1e-3  # a trained critic: gamma and lam apart


def test_r1pp_settings_reach_the_reward_and_em_is_logged_apart(tiny_model, tmp_path, varied_reward, monkeypatch):
    """--eta, --group_reward, --group_sigma reach reward_terms; the logged em stays exact match (the
    compute_rewards stand-in), not the r1pp reward trained on."""
    calls = []

    def terms(ro, questions, protocol, group, eta, group_reward, group_sigma):
        calls.append((group, eta, group_reward, group_sigma))
        n = len(ro)
        return {"format": torch.zeros(n), "answer": torch.full((n,), 0.3), "group": torch.zeros(n)}

    em = []
    real = train.compute_rewards
    monkeypatch.setattr(train, "compute_rewards", lambda ro, qs: em.append(real(ro, qs)) or em[-1])
    monkeypatch.setattr(train, "reward_terms", terms)
    out = tmp_path / "r1pp"
    train.main(args(tiny_model, out, "grpo", steps=1, extra=[
        "--reward", "r1pp", "--eta", "0.7", "--group_reward", "false", "--group_sigma", "correct",
        "--eval_every", "0"]))
    assert calls == [(2, 0.7, False, "correct")]
    row = metrics(out)[-1]
    assert row["reward"] == pytest.approx(0.3) and row["em"] == pytest.approx(float(em[0].mean()))


def test_weight_decay_reaches_both_optimizers(tiny_model, tmp_path, varied_reward, monkeypatch):
    seen, real = [], train.update

    def spy(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt, *rest):
        seen.append((opt.param_groups[0]["weight_decay"], critic_opt.param_groups[0]["weight_decay"]))
        return real(cfg, step, policy, opt, ro, old_logp, ref_logp, adv, device, critic, critic_opt, *rest)

    monkeypatch.setattr(train, "update", spy)
    train.main(args(tiny_model, tmp_path / "ppo", "ppo", steps=1,
                    extra=["--weight_decay", "0.03", "--eval_every", "0"]))
    assert seen == [(0.03, 0.03)]


def _grpo_update(model, ro, old_logp, ref_logp, adv, *flags):
    from searchlite.config import parse_args

    cfg = parse_args(["--preset", "none", "--algo", "grpo", "--temperature", "0.7", "--grad_clip", "1e9",
                      "--micro_batch_size", "8", "--entropy_coef", "0", *flags])
    opt = Capture(model.parameters())
    return train.update(cfg, 0, model, opt, ro, old_logp, ref_logp, adv, "cpu")


def test_clip_eps_sets_which_ratios_clip(tiny_llama, byte_tokenizer):
    """The logged clipfrac is the share of policy tokens whose clipped term is the smaller, at --clip_eps."""
    g = torch.Generator().manual_seed(2)
    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (6, 4, 7, 5), g, temperature=0.7)
    old_logp = old_logp + 0.3 * torch.randn(old_logp.shape, generator=g)
    for eps in (0.05, 0.5):
        want = []
        for (b, t), logp in _policy_logps(tiny_llama, ro, 0.7).items():
            r, a = torch.exp(logp - old_logp[b, t]).item(), adv[b, t].item()
            want.append(min(max(r, 1 - eps), 1 + eps) * a < r * a)
        stats = _grpo_update(tiny_llama, ro, old_logp, old_logp, adv, "--clip_eps", str(eps), "--kl_coef", "0")
        assert sum(stats["clipfrac"]) == pytest.approx(sum(want) / len(want), abs=1e-6), eps
    assert 0 < sum(want) < len(want)


def test_kl_kind_sets_the_grpo_kl_estimator(tiny_llama, byte_tokenizer):
    """--kl_kind k1: the logged (and trained-on) KL is the mean of logp - ref, not k3's."""
    g = torch.Generator().manual_seed(3)
    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 3, 6), g, temperature=0.7)
    ref_logp = old_logp + 0.3 * torch.randn(old_logp.shape, generator=g)
    d = [float(logp.detach() - ref_logp[b, t]) for (b, t), logp in _policy_logps(tiny_llama, ro, 0.7).items()]
    k1 = sum(d) / len(d)
    k3 = sum(torch.exp(torch.tensor(-x)).item() + x - 1 for x in d) / len(d)
    for kind, want in (("k1", k1), ("k3", k3)):
        stats = _grpo_update(tiny_llama, ro, old_logp, ref_logp, adv, "--kl_kind", kind, "--kl_coef", "0.1")
        assert sum(stats["kl"]) == pytest.approx(want, rel=1e-4, abs=1e-6), kind


def test_value_clip_eps_bounds_the_critics_move(tiny_llama, byte_tokenizer):
    """PPO's value loss at --value_clip_eps: 0.5 * max((v - R)^2, (clip(v, old +- eps) - R)^2). With the
    rollout's values v = old and returns R = old + 1, the clipped value is old: the loss is 0.5 either
    way; with old moved by +2 (v - old = -2), clip keeps v within eps of old, hand-computed below."""
    from conftest import make_tiny_llama

    from searchlite.config import parse_args
    from searchlite.models import Critic

    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 3), torch.Generator().manual_seed(4))
    critic = Critic(make_tiny_llama(byte_tokenizer, seed=1).model)
    values = train.score_tokens(critic, ro, 8, "cpu", values=True)
    old_values = values + 2.0  # v - old = -2
    ret = values  # v - R = 0: unclipped error 0; clipped: (old - eps) - R = 2 - eps
    for eps in (0.5, 1.5):
        cfg = parse_args(["--preset", "none", "--algo", "ppo", "--value_clip_eps", str(eps), "--kl_coef", "0",
                          "--micro_batch_size", "8"])
        stats = train.update(cfg, 0, tiny_llama, Capture(tiny_llama.parameters()), ro, old_logp, old_logp, adv,
                             "cpu", critic, Capture(critic.parameters()), old_values, ret)
        assert sum(stats["vf_loss"]) == pytest.approx(0.5 * (2 - eps) ** 2, rel=1e-4), eps


def test_resume_refuses_every_setting_the_checkpoint_keeps(tmp_path, monkeypatch):
    """check_resume against a checkpoint's saved config (stood in for here): --seed (the data order),
    --warmup_steps and --weight_decay (the restored schedule and optimizer) and, with LoRA, the adapter's
    rank, alpha and targets may not change on --resume; targets listed in another order, or with a stray
    comma, are no change."""
    from searchlite.config import ConfigError, parse_args, to_dict

    base = ["--preset", "none", "--resume", "--out_dir", str(tmp_path / "run"), "--lora_rank", "8",
            "--lora_targets", "q_proj,v_proj"]
    saved = to_dict(parse_args(base))
    (tmp_path / "run" / "checkpoint" / "policy").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "policy" / "adapter_model.safetensors").touch()  # weights, as far as it looks
    monkeypatch.setattr(train, "find_checkpoint", lambda out: tmp_path / "run" / "checkpoint")
    monkeypatch.setattr(train, "load_trainer_state", lambda ckpt, mmap=False: {"config": saved})
    assert train.check_resume(parse_args(base + ["--lora_targets", "v_proj, q_proj"])) == []
    assert train.check_resume(parse_args(base + ["--lora_targets", "q_proj,v_proj,"])) == []
    for flag, value in (("seed", "1"), ("warmup_steps", "5"), ("weight_decay", "0.1"), ("lora_rank", "4"),
                        ("lora_alpha", "16"), ("lora_targets", "q_proj")):
        with pytest.raises(ConfigError, match=rf"was trained with {flag} = .*, this run has"):
            train.check_resume(parse_args(base + [f"--{flag}", value]))


def test_resume_restores_the_rewriters_sampling_state(tiny_model, tmp_path, monkeypatch):
    """R1-Searcher++ stage 2: the rewrite model's sampler state (its call count, which seeds each call) comes
    back from the checkpoint on --resume, as the policy sampler's does; else the rewrites replay call 0's noise."""
    from test_r1pp import stage2_args

    seen, real = [], train.memorization_batch

    def spy(sampler, *a, **kw):
        seen.append(sampler.state_dict())
        return real(sampler, *a, **kw)

    monkeypatch.setattr(train, "memorization_batch", spy)
    out = tmp_path / "run"
    train.main(stage2_args(tiny_model, out, ["--steps", "1", "--eval_every", "0"]))
    assert seen == [{"calls": 0}]
    state = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)
    assert "rewriter" in state
    state["rewriter"] = {"calls": 7}  # as a run whose rewriter had sampled 7 times would have saved
    torch.save(state, out / "checkpoint" / "trainer.pt")
    seen.clear()
    train.main(stage2_args(tiny_model, out, ["--steps", "2", "--eval_every", "0", "--resume"]))
    assert seen == [{"calls": 7}]


def test_logged_loss_statistics_are_the_optimizer_steps_means_over_many_micro_batches(tiny_model, tmp_path,
                                                                                      varied_reward, monkeypatch):
    """One optimizer step a training step, in 4 micro-batches of 1 row: each logged statistic is the sum of
    the micro-batches' weighted values (the mini-batch's mean), not that sum over the micro-batch count."""
    seen, real = [], train.update

    def spy(*a):
        seen.append(real(*a))
        return seen[-1]

    monkeypatch.setattr(train, "update", spy)
    out = tmp_path / "run"
    train.main(args(tiny_model, out, "grpo", steps=1, extra=["--micro_batch_size", "1", "--eval_every", "0"]))
    (stats,) = seen
    assert len(stats["entropy"]) == 4 and len(stats["grad_norm"]) == 1
    row = metrics(out)[-1]
    for key in ("loss", "kl", "clipfrac", "entropy"):
        assert row[key] == pytest.approx(sum(stats[key]), rel=1e-6, abs=1e-9), key
    assert row["entropy"] > 0


def test_each_mini_batch_is_averaged_over_its_own_tokens(tiny_llama, byte_tokenizer):
    """--mini_batch_size 2 over 4 rows: two optimizer steps, rows [0, 1] then [2, 3], each logging the mean
    entropy of its own policy tokens (the loss is normalised per mini-batch, not over the whole batch).
    Capture takes no step, so both see the same model, whose entropies are computed here."""
    from searchlite.config import parse_args

    ro, old_logp, adv = _update_inputs(tiny_llama, byte_tokenizer, (5, 3, 6, 4), torch.Generator().manual_seed(5))
    cfg = parse_args(["--preset", "none", "--algo", "grpo", "--kl_coef", "0", "--mini_batch_size", "2",
                      "--micro_batch_size", "8", "--grad_clip", "1e9"])
    stats = train.update(cfg, 0, tiny_llama, Capture(tiny_llama.parameters()), ro, old_logp, old_logp, adv, "cpu")
    assert len(stats["grad_norm"]) == 2
    logits = tiny_llama(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits
    ent = {(b, t): torch.distributions.Categorical(logits=logits[b, t - 1]).entropy().item()
           for b, t in ro.loss_mask.nonzero().tolist()}
    means = [sum(v for (b, _), v in ent.items() if b in rows) / sum(1 for b, _ in ent if b in rows)
             for rows in ((0, 1), (2, 3))]
    assert stats["entropy"] == pytest.approx(means, rel=1e-4)


def test_mem_coef_scales_the_memorization_gradient(tiny_llama, byte_tokenizer):
    """--mem_coef mu reaches update's L_M term: with advantages 0 and no KL or entropy, L_M alone has a
    gradient, mu * grad L_M, so mu = 0.3 gives 3 times mu = 0.1's."""
    from test_r1pp import GradRecorder, _batch

    from searchlite.config import parse_args

    mem, ro = _batch(byte_tokenizer, n=3, seed=1), _batch(byte_tokenizer)
    params = list(tiny_llama.parameters())
    logp = train.score_tokens(tiny_llama, ro, 2, "cpu")

    def grads(mu):
        cfg = parse_args(["--preset", "none", "--mem_coef", str(mu), "--kl_coef", "0", "--grad_clip", "1e9",
                          "--micro_batch_size", "2"])
        opt = GradRecorder(params)
        train.update(cfg, 0, tiny_llama, opt, ro, logp, logp, torch.zeros_like(logp), "cpu", mem=mem)
        (g,) = opt.grads
        return g

    small, big = grads(0.1), grads(0.3)
    assert any(float(g.abs().max()) > 1e-4 for g in small)
    for a, b in zip(small, big):
        torch.testing.assert_close(b, 3 * a, atol=1e-6, rtol=1e-4)


def test_a_vllm_that_does_not_import_is_one_line(tiny_model, tmp_path, broken_vllm):
    """--sampler vllm with vLLM installed but failing to import (check_config only sees it
    installed) ended in the ImportError's traceback once the models had loaded. The engine was
    asked for --model with --tokenizer."""
    from conftest import BROKEN_VLLM

    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {BROKEN_VLLM}") + "$"):
        train.main(args(tiny_model, tmp_path / "run", "grpo", extra=("--sampler", "vllm", "--tokenizer", tiny_model)))
    assert broken_vllm == [(tiny_model, tiny_model)]
