"""The shipped warm-start checkpoint loads and writes well-formed trajectories."""

import pytest

from searchlite.config import TOY_DIR, resolve_path
from searchlite.data import read_qa
from searchlite.protocol import get_protocol
from searchlite.retrieval import build_retriever
from searchlite.rollout import rollout
from searchlite.sampler import HFSampler

pytestmark = pytest.mark.skipif(not (TOY_DIR / "model" / "model.safetensors").exists(),
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
