"""Slow, opt-in checks (`pytest -m slow`): RL on the toy world raises the reward."""

import json

import pytest

import train


@pytest.mark.slow
def test_short_grpo_run_raises_reward(tmp_path):
    """20 GRPO steps from the shipped warm start raise held-out test EM (greedy, 200 questions)."""
    out = tmp_path / "grpo"
    train.main(["--out_dir", str(out), "--steps", "20", "--eval_every", "20", "--eval_size", "200",
                "--log_trajectories_every", "0"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before, after = rows[0]["eval/all"]["em"], rows[-1]["eval/all"]["em"]
    assert after > before + 0.05, (before, after)
