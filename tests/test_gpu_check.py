"""bench/gpu_check.py's code path on CPU (--tiny): the one GPU check runs the same steps."""

import math
import sys

import pytest
from conftest import load_bench


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
    from searchlite.data import Passage

    passages = [Passage("a", "Oslo", "a city in Norway"), Passage("b", "Ada", "Ada founded Norway Steel in Oslo")]
    hits = gpu_check.WordOverlapRetriever(passages).search(["who founded norway steel"], k=2)[0]
    assert [h.id for h in hits] == ["b", "a"] and hits[0].score == 3.0


def test_explicit_flags_win_over_tiny_defaults(gpu_check):
    tiny, full = gpu_check.parse(["--tiny"]), gpu_check.parse([])
    assert (tiny.questions, tiny.group, tiny.max_new_tokens) == (2, 2, 8)
    assert (full.questions, full.group, full.max_new_tokens) == (8, 5, 128)
    given = gpu_check.parse(["--tiny", "--questions", "8", "--group", "5", "--max_new_tokens", "128"])
    assert (given.questions, given.group, given.max_new_tokens) == (8, 5, 128)  # equal to the defaults: still kept


def test_group_below_two_is_an_argument_error(gpu_check, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse(["--tiny", "--group", "1"])
    assert e.value.code == 2 and "--group: must be at least 2" in capsys.readouterr().err
