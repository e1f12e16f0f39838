"""Run by tests/test_distributed.py under torchrun: a sharded (FSDP2) policy whose weights differ
from its checkpoint's is pushed to vLLM outside `gathered`, as train.py pushes it; vLLM's greedy
tokens must be the gathered policy's own (HFSampler). Prints one RESULT line per rank."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from searchlite import distributed as dist  # noqa: E402
from searchlite.config import TOY_DIR, resolve_path  # noqa: E402
from searchlite.data import read_qa  # noqa: E402
from searchlite.models import load_policy, load_tokenizer  # noqa: E402
from searchlite.protocol import get_protocol  # noqa: E402
from searchlite.rollout import encode_prompt  # noqa: E402
from searchlite.sampler import HFSampler  # noqa: E402
from searchlite.vllm_sampler import VLLMSampler  # noqa: E402


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM in this process (imported by VLLMSampler)
    torch.set_num_threads(1)
    dist.init(torch.device("cpu"))
    model = str(TOY_DIR / "model")
    tok = load_tokenizer(model)
    policy = load_policy(model, "float32", torch.device("cpu"))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the weights vLLM starts from
    dist.wrap_model(policy, "fsdp", torch.device("cpu"))
    assert dist.is_sharded(policy)
    sampler = VLLMSampler(model, max_new_tokens=16, seed=0, cpu_kv_cache_gib=0.25)
    protocol = get_protocol("search_r1", "toy")
    prompts = [encode_prompt(tok, protocol, q.question) for q in read_qa(resolve_path("toy/test.jsonl"))[:4]]
    before = sampler.generate(prompts, greedy=True)
    sampler.push_weights(policy)
    got = sampler.generate(prompts, greedy=True)
    with dist.gathered(policy):
        want = HFSampler(policy, tok, max_new_tokens=16).generate(prompts, greedy=True)
    print(f"RESULT rank {dist.rank()} pushed {got == want} unpushed {before == want}", flush=True)
    sampler.close()
    dist.close()


if __name__ == "__main__":  # (pytest imports this file for doctests: nothing runs then)
    main()
