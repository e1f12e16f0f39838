"""torchrun on CPU: two processes (gloo) compute what one process computes.

`test_two_processes_match_one` runs train.update(), the loss code of train.py (the clipped
policy loss over masked tokens, GRPO's KL term, PPO's value loss, R1-Searcher++'s memorization
loss, micro- and mini-batches), once here on a whole batch, and once in two spawned processes
over gloo, each on its half, with DDP and with FSDP2 (FSDP2 runs on CPU with gloo). The halves
hold very different numbers of policy tokens, so a mean of the ranks' means would be wrong (the
test checks that it would be), gradients are not clipped, so a wrong scale cannot hide, and
the memorization rows all sit on rank 0, so rank 1 runs the zero-weight passes that keep the
ranks' backward calls in step.
An optimizer that records the gradients at each step() stands in for AdamW. The same processes
check the cross-rank reductions and FSDP2's optimizer-state round trip for checkpoints. Each
process's stderr goes to a file that a failure shows; a pair killed by a signal runs once more,
with a warning that carries what they printed.
`test_torchrun_train_smoke` runs `torchrun --nproc_per_node 2 train.py` for two steps, and the
next test stops such a run with Ctrl-C.
The tests at the end check each helper in one process against a stand-in process group
(`FakeGroup`), where the other ranks' numbers are set by hand: ranks and worlds the two
processes never are (3 or 4 ranks, LOCAL_RANK on GPU), and the wrapping of models.
"""

import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections import deque
from pathlib import Path

import pytest
import torch
import torch.distributed
import torch.multiprocessing as mp
from conftest import free_port, make_tiny_llama
from torch import nn

import train
from searchlite import distributed as dist
from searchlite.config import Config
from searchlite.losses import masked_whiten
from searchlite.memory import on_device
from searchlite.models import Critic, load_policy, make_optimizer
from searchlite.rollout import Rollout

HALF = 4  # trajectories per rank
ORDER = [0, 1, 4, 5, 2, 3, 6, 7]  # one process's batch: mini-batch j = both ranks' local mini-batch j
CASES = {  # name: Config overrides
    "grpo": dict(algo="grpo", loss_agg="token_mean"),
    "grpo_seq_mean": dict(algo="grpo", loss_agg="seq_mean_token_mean"),
    "ppo": dict(algo="ppo", loss_agg="token_mean"),
    "reinforce_pp_mem": dict(algo="reinforce_pp", loss_agg="token_mean", mem_coef=0.1),
    # a token budget: rank 0's long rows go one to a micro-batch, rank 1's short ones two, so rank 1
    # must split its micro-batch to run as many passes as rank 0 (train.passes)
    "grpo_tokens": dict(algo="grpo", loss_agg="token_mean", micro_batch_size=2, micro_batch_tokens=16),
}


def make_config(case: str) -> Config:
    # 2 mini-batches of 4 trajectories (2 per rank), micro-batches of 1; no gradient clipping
    return Config(**dict(mini_batch_size=4, micro_batch_size=1, ppo_epochs=1, grad_clip=1e9, kl_coef=0.1,
                         kl_kind="k3", clip_eps=0.2, value_clip_eps=0.5, temperature=0.7) | CASES[case])


def make_rollout(ids, attn, lm) -> Rollout:
    n = ids.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    return Rollout(ids, attn, lm, zeros, zeros, zeros, zeros.bool(), [None] * n, [""] * n)


def make_batch(model_dir: str, vocab: int) -> dict:
    """Eight right-padded trajectories: rows 0-3 (rank 0's) long, rows 4-7 (rank 1's) short; a 3-token
    prompt and, in the long rows, a retrieved span (loss_mask 0); old / reference log-probs near the
    model's (so some ratios clip), random advantages, values and returns; three memorization rows."""
    g = torch.Generator().manual_seed(0)
    n, width = 2 * HALF, 20
    lengths = torch.tensor([20, 18, 19, 17, 6, 7, 5, 8])  # (N,)
    pos = torch.arange(width).expand(n, width)  # (N, T)
    attn = (pos < lengths[:, None]).long()  # (N, T)
    lm = attn * (pos >= 3)  # (N, T) not the prompt
    lm[:HALF, 8:12] = 0  # retrieved passage
    ids = torch.randint(3, vocab, (n, width), generator=g) * attn  # (N, T) pad id 0
    policy = load_policy(model_dir)
    ro = make_rollout(ids, attn, lm)
    logp = train.score_tokens(policy, ro, n, "cpu", temperature=0.7)  # (N, T)
    old_logp = (logp + 0.2 * torch.randn(n, width, generator=g)) * lm  # (N, T)
    ref_logp = (old_logp + 0.3 * torch.randn(n, width, generator=g)) * lm  # (N, T)
    adv = torch.randn(n, 1, generator=g) * lm  # (N, T)
    old_values = torch.randn(n, width, generator=g) * lm  # (N, T)
    ret = torch.randn(n, width, generator=g) * lm  # (N, T)
    mem_attn = (torch.arange(12).expand(3, 12) < torch.tensor([[12], [9], [11]])).long()  # (3, 12)
    mem_lm = mem_attn * (torch.arange(12) >= 4)  # (3, 12)
    mem_ids = torch.randint(3, vocab, (3, 12), generator=g) * mem_attn  # (3, 12)
    return dict(ids=ids, attn=attn, lm=lm, old_logp=old_logp, ref_logp=ref_logp, adv=adv, old_values=old_values,
                ret=ret, mem_ids=mem_ids, mem_attn=mem_attn, mem_lm=mem_lm)


def rows_of(batch: dict, rows: list[int], with_mem: bool) -> tuple:
    ro = make_rollout(batch["ids"][rows], batch["attn"][rows], batch["lm"][rows])
    mem = make_rollout(batch["mem_ids"], batch["mem_attn"], batch["mem_lm"]) if with_mem else None
    return ro, *(batch[k][rows] for k in ("old_logp", "ref_logp", "adv", "old_values", "ret")), mem


class GradRecorder:
    """Stands in for the optimizer: step() records the full gradient of every parameter (FSDP2's
    shards gathered: a collective, as step() runs on every rank); nothing is updated."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def step(self):
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        self.grads.append({n: full(p.grad).detach().clone() for n, p in self.model.named_parameters()})

    def zero_grad(self, set_to_none=True):
        for p in self.model.parameters():
            p.grad = None


def run_update(case: str, batch: dict, rows: list[int], with_mem: bool, model_dir: str, mode: str = "ddp") -> dict:
    """train.update() on `rows` of the batch, in this process's part of the run; the gradient of
    each optimizer step and the statistics train.py logs (reduced over ranks)."""
    cfg = make_config(case)
    torch.manual_seed(0)
    policy = load_policy(model_dir)
    critic = Critic.from_pretrained(model_dir) if cfg.algo == "ppo" else None
    train_policy, train_critic = dist.wrap_model(policy, mode, torch.device("cpu")), \
        dist.wrap_model(critic, mode, torch.device("cpu"))
    rec, critic_rec = GradRecorder(policy), GradRecorder(critic) if critic is not None else None
    ro, old_logp, ref_logp, adv, old_values, ret, mem = rows_of(batch, rows, with_mem)
    policy.train()
    stats = train.update(cfg, 0, train_policy, rec, ro, old_logp, ref_logp, adv, "cpu", train_critic, critic_rec,
                         old_values if critic is not None else None, ret if critic is not None else None, mem)
    n_mini = len(stats["grad_norm"])
    logged = {k: dist.all_mean(sum(v)) / n_mini for k, v in stats.items() if v and k not in ("grad_norm", "mem_loss")}
    return {"grads": rec.grads, "critic_grads": critic_rec.grads if critic_rec else [], "logged": logged,
            "grad_norm": stats["grad_norm"], "mem_loss": [dist.all_mean(x) for x in stats["mem_loss"]]}


# ---------------------------------------------------------------------------- the two processes


def worker(rank: int, world: int, port: int, tmp: str) -> None:
    log = open(Path(tmp) / f"rank{rank}.log", "w")  # open until the process ends
    os.dup2(log.fileno(), 2)  # what this process prints, native aborts included, for the test to show
    faulthandler.enable(log)  # and the Python stack of a crash
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init(torch.device("cpu"))
    inp = torch.load(Path(tmp) / "inputs.pt", weights_only=False)
    batch, model_dir = inp["batch"], inp["model_dir"]
    mine = list(range(rank * HALF, (rank + 1) * HALF))
    out = {}
    for mode in ("ddp", "fsdp"):
        for case in CASES:
            out[mode, case] = run_update(case, batch, mine, with_mem=case.endswith("mem") and rank == 0,
                                         model_dir=model_dir, mode=mode)
    out["reductions"] = reductions(batch, mine)
    out["optimizer"] = optimizer_round_trip(batch, mine, model_dir)
    out["tied"] = tied_full_state_dict(model_dir)
    out["mixed"] = mixed_precision(batch, mine, model_dir)
    out["uneven_generation"] = uneven_generation(model_dir)
    try:  # a NaN on rank 1 alone stops both ranks
        train.check_finite(3, loss=[torch.tensor(float("nan") if rank == 1 else 1.0)])
        out["nan"] = None
    except FloatingPointError as e:
        out["nan"] = str(e)
    out["nan"] = dist.gather_objects(out["nan"])
    if rank == 0:
        torch.save(out, Path(tmp) / "outputs.pt")
    dist.close()
    log.flush()
    # Leave without the interpreter's teardown: now and then it aborted a rank here, after every result
    # was saved and the group closed ("terminate called without an active exception", SIGABRT).
    os._exit(0)


def reductions(batch: dict, mine: list[int]) -> dict:
    """Cross-rank reductions train.py uses, on this rank's rows (the one-process values are in the test)."""
    from searchlite.advantages import group_advantages

    scores = batch["adv"][:, 3]  # (N,) some numbers, one a trajectory
    ret, lm = batch["ret"][mine], batch["lm"][mine]
    uneven = torch.arange(3.0) if dist.rank() == 0 else torch.arange(5.0) + 10  # (3,) / (5,)
    return {
        "whiten": dist.gather_objects(dist.masked_whiten(ret, lm)),
        "reinforce_baseline": dist.gather_objects(dist.local_rows(group_advantages(dist.gather_rows(scores[mine]), 1))),
        "uneven_mean": dist.mean(uneven),
        "eval_shares": dist.gather_objects(dist.shard(list(range(7)), even=False)),
    }


def mixed_precision(batch: dict, mine: list[int], model_dir: str) -> dict:
    """A policy with float32 master weights that computes in bf16 (load_policy master=True) under
    FSDP2: the dtypes of its shards, of the logits its forward pass makes and of the gradients."""
    from searchlite.models import trained_logprobs

    policy = load_policy(model_dir, "bfloat16", master=True)
    dist.wrap_model(policy, "fsdp", torch.device("cpu"))
    head = []
    hook = policy.get_output_embeddings().register_forward_hook(lambda m, a, out: head.append(out.dtype))
    ro = make_rollout(batch["ids"][mine], batch["attn"][mine], batch["lm"][mine])
    logp, _, _ = trained_logprobs(policy, ro.input_ids, ro.attention_mask, ro.loss_mask)
    (logp.sum()).backward()
    hook.remove()
    return {"params": {str(p.dtype) for p in policy.parameters()}, "head": [str(d) for d in head],
            "grads": {str(p.grad.dtype) for p in policy.parameters()}, "marked": policy.searchlite_compute_dtype}


def uneven_generation(model_dir: str) -> dict:
    """Rank 1 generates twice, rank 0 once, inside `gathered` under FSDP2, then both meet in a
    collective (`sum`). transformers syncs every generated token across the ranks of an FSDP model unless
    told not to (synced_gpus): with it, rank 0's sum met rank 1's token sync and gloo aborted.
    Every weight is whole in the block before any forward pass; after the block a training forward
    pass reshards the decoder layers again, and the root keeps its own weights gathered for the
    backward, FSDP2's default (the names of the weights left as shards, `sharded_after`)."""
    from torch.distributed.tensor import DTensor

    from searchlite.models import load_tokenizer
    from searchlite.sampler import HFSampler

    model = load_policy(model_dir)
    dist.wrap_model(model, "fsdp", torch.device("cpu"))
    sampler = HFSampler(model, load_tokenizer(model_dir), max_new_tokens=3, temperature=1.0, seed=dist.rank())
    with dist.gathered(model):
        whole = not any(isinstance(p, DTensor) for p in model.parameters())
        for _ in range(1 + dist.rank()):
            sampler.generate([[5, 6, 7]])
    model(input_ids=torch.tensor([[5, 6, 7]]))
    sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    layers = {n for n, _ in model.named_parameters() if ".layers." in n}
    assert layers and len(layers) < len(list(model.parameters()))  # the root holds weights of its own
    return {"sum": dist.all_sum(1.0), "whole_inside": whole, "layers": layers, "sharded_after": sharded}


def tied_full_state_dict(model_dir: str) -> dict:
    """The embedding keys of full_state_dict() of a model with tied embeddings under FSDP2 (rank 0's;
    the others get none), and whether its shared tensor is the whole model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    whole = model.get_input_embeddings().weight.detach().clone()
    dist.wrap_model(model, "fsdp", torch.device("cpu"))
    state = dist.full_state_dict(model)
    keys = sorted(k for k in state if "embed" in k or "lm_head" in k)
    return {"keys": keys, "equal": all(torch.equal(state[k], whole) for k in keys)}


def optimizer_round_trip(batch: dict, mine: list[int], model_dir: str) -> dict:
    """One AdamW step through FSDP2; optimizer_state() as rank 0 saves it, and whether
    load_optimizer_state() of it gives every rank back its own shards."""
    cfg = make_config("grpo")
    policy = load_policy(model_dir)
    dist.wrap_model(policy, "fsdp", torch.device("cpu"))
    opt, _ = make_optimizer(policy.parameters(), 1e-3, 0.0, 0)
    ro, old_logp, ref_logp, adv, *_ = rows_of(batch, mine, False)
    train.update(cfg, 0, policy, opt, ro, old_logp, ref_logp, adv, "cpu")
    state = dist.optimizer_state(policy, opt)
    params = {n: p.full_tensor() for n, p in policy.named_parameters()}
    loaded, _ = make_optimizer(policy.parameters(), 1e-3, 0.0, 0)
    dist.load_optimizer_state(policy, loaded, dist.gather_objects(state)[0])  # every rank reads rank 0's file
    a, b = opt.state_dict()["state"], loaded.state_dict()["state"]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    same = a.keys() == b.keys() and all(torch.equal(local(a[i][k]), local(b[i][k])) for i in a for k in a[i])
    # a frozen reference: FSDP2 keeps its root's weights whole after a forward, until dist.release
    ref = load_policy(model_dir).requires_grad_(False)
    dist.wrap_model(ref, "fsdp", torch.device("cpu"))
    sharded = lambda: all(hasattr(p, "to_local") for p in ref.parameters())  # noqa: E731
    with torch.no_grad():
        ref(input_ids=ro.input_ids[:1])
    after_forward = sharded()
    dist.release(ref)
    # --ref_offload under FSDP2: every unit keeps its shards in CPU memory (FSDP2's CPU offload);
    # it scores as the whole model does, and on_device leaves it to FSDP2
    off = load_policy(model_dir).requires_grad_(False)
    dist.wrap_model(off, "fsdp", torch.device("cpu"), offload=True)
    units = [m for m in off.modules() if hasattr(m, "_get_fsdp_state")]
    offloaded = all(fp.offload_to_cpu for u in units for fp in u._get_fsdp_state()._fsdp_param_group.fsdp_params)
    with torch.no_grad(), on_device(off, torch.device("cpu")):
        logits = off(input_ids=ro.input_ids[:2]).logits
    dist.release(off)
    with torch.no_grad():
        whole = load_policy(model_dir)(input_ids=ro.input_ids[:2]).logits
    return {"state": state, "params": params, "reload_equal": dist.all_sum(float(same)) == dist.world(),
            "ref_sharded": (after_forward, sharded()),
            "offload": (len(units), offloaded, sharded_all(off), rel_err(logits, whole))}


def sharded_all(model) -> bool:
    return all(hasattr(p, "to_local") for p in model.parameters())


def worker_logs(tmp: Path, lines: int = 30) -> str:
    """The last lines each process wrote to its stderr, led by the line most likely to name the
    cause (a C++ exception's what(), else an error), so pytest's one-line summary shows it too."""
    out, causes = "", []
    for log in sorted(Path(tmp).glob("rank*.log")):
        text = log.read_text(errors="replace").splitlines()
        for priority, pattern in enumerate((r"what\(\)", r"Error\b")):
            causes += [(priority, f" ({log.stem}: {line.strip()})") for line in text if re.search(pattern, line)]
        out += f"\n--- {log.stem}, last {min(lines, len(text))} lines of stderr ---\n" + "\n".join(text[-lines:])
    return min(causes, default=(0, ""))[1] + out


# ---------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def setup(tmp_path_factory, byte_tokenizer):
    """The tiny model and batch, and the two processes' outputs (spawned once for all checks)."""
    tmp = tmp_path_factory.mktemp("dist")
    model_dir = str(tmp / "model")
    model = make_tiny_llama(byte_tokenizer)
    model.save_pretrained(model_dir)
    byte_tokenizer.save_pretrained(model_dir)  # for the sampler of uneven_generation
    torch.manual_seed(1)
    head = torch.nn.Linear(model.config.hidden_size, 1)  # a random value head, so the critic's gradient is rich
    torch.save(head.state_dict(), Path(model_dir) / "value_head.pt")
    batch = make_batch(model_dir, len(byte_tokenizer))
    torch.save({"batch": batch, "model_dir": model_dir}, tmp / "inputs.pt")
    for attempt in (1, 2):
        try:
            run_workers(tmp)
            break
        except mp.ProcessExitedException as e:  # killed by a signal: what the processes printed says why
            if attempt == 2:
                pytest.fail(f"{e}{worker_logs(tmp)}")
            # A process killed by a signal (gloo's transport can abort one on a dropped connection)
            # is run once more, loudly; a Python error or a wrong number is never retried.
            warnings.warn(f"the two processes crashed, running them again: {e}{worker_logs(tmp)}", stacklevel=1)
    return batch, model_dir, torch.load(tmp / "outputs.pt", weights_only=False)


def run_workers(tmp: Path) -> None:
    """Spawn the two processes and wait for them (at most 300 s)."""
    procs = mp.spawn(worker, args=(2, free_port(), str(tmp)), nprocs=2, join=False)
    deadline = time.time() + 300
    while not procs.join(timeout=5):  # raises if a process failed, with its traceback
        if time.time() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("the two processes did not finish within 300 s" + worker_logs(tmp))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def assert_same_grads(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) == 2  # two optimizer steps (mini-batches)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for name in w:
            assert w[name].abs().sum() > 0, name  # every parameter gets a gradient
            assert rel_err(g[name], w[name]) < 1e-6, (name, rel_err(g[name], w[name]))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one(setup, case, mode):
    batch, model_dir, outputs = setup
    one = run_update(case, batch, ORDER, with_mem=case.endswith("mem"), model_dir=model_dir)
    two = outputs[mode, case]
    assert_same_grads(two["grads"], one["grads"])
    if case == "ppo":
        assert_same_grads(two["critic_grads"], one["critic_grads"])
    assert two["logged"].keys() == one["logged"].keys()
    for k, v in one["logged"].items():
        assert two["logged"][k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6)
    assert two["mem_loss"] == pytest.approx(one["mem_loss"], rel=1e-6)
    if case.endswith("mem"):
        assert len(one["mem_loss"]) == 2  # rank 0's rewrites reach both optimizer steps; rank 1 has none


def test_the_batch_tells_a_global_mean_from_a_mean_of_rank_means(setup):
    """The check above has teeth: averaging the two halves' own token means gives another gradient."""
    batch, model_dir, _ = setup
    one = run_update("grpo", batch, ORDER, with_mem=False, model_dir=model_dir)
    halves = [run_update("grpo", batch, rows, with_mem=False, model_dir=model_dir)
              for rows in ([0, 1], [4, 5])]  # mini-batch 0 of each rank, alone
    naive = {n: (halves[0]["grads"][0][n] + halves[1]["grads"][0][n]) / 2 for n in one["grads"][0]}
    assert max(rel_err(naive[n], one["grads"][0][n]) for n in naive) > 1e-2


def test_cross_rank_reductions(setup):
    from searchlite.advantages import group_advantages

    batch, _, outputs = setup
    red = outputs["reductions"]
    halves = [list(range(HALF)), list(range(HALF, 2 * HALF))]
    want = masked_whiten(batch["ret"], batch["lm"])  # (N, T) over the whole batch
    assert torch.equal(torch.cat(red["whiten"]), want)  # both in float64: the same to the bit here
    assert not torch.allclose(torch.cat([masked_whiten(batch["ret"][h], batch["lm"][h]) for h in halves]), want,
                              atol=1e-3)  # whitening each half alone differs
    scores = batch["adv"][:, 3]
    assert torch.allclose(torch.cat(red["reinforce_baseline"]), group_advantages(scores, 1), atol=1e-6)
    assert red["uneven_mean"] == pytest.approx((0 + 1 + 2 + 10 + 11 + 12 + 13 + 14) / 8)  # not (1 + 12) / 2
    assert red["eval_shares"] == [[0, 1, 2], [3, 4, 5, 6]]


def test_a_value_that_is_not_finite_on_one_rank_stops_every_rank(setup):
    rank0, rank1 = setup[2]["nan"]
    assert rank1.startswith("step 3: loss is not finite ([nan]") and rank0.startswith(
        "step 3: another process found a value that is not finite")


def test_fsdp_master_weights_stay_float32_and_compute_in_bf16(setup):
    """FSDP2's mixed precision (verl's): float32 shards and gradients, bf16 forward passes; the
    autocast mark is cleared, as FSDP2 casts the gathered weights itself."""
    assert setup[2]["mixed"] == {"params": {"torch.float32"}, "head": ["torch.bfloat16"],
                                 "grads": {"torch.float32"}, "marked": None}


def test_fsdp_ranks_generate_unevenly_without_syncing(setup):
    got = setup[2]["uneven_generation"]
    assert got["sum"] == 2.0 and got["whole_inside"] and got["sharded_after"] == got["layers"]


def test_fsdp_checkpoint_of_tied_embeddings_holds_them_once(setup):
    """The gathered copies of a shared matrix are separate tensors: without the dedup both names
    were saved (a 3B model's embeddings twice); now only the first, as save_pretrained keeps it."""
    assert setup[2]["tied"] == {"keys": ["model.embed_tokens.weight"], "equal": True}


def test_fsdp_optimizer_state_is_one_process_format(setup):
    """A checkpoint written under FSDP2 holds the optimizer state one process would have."""
    batch, model_dir, outputs = setup
    got = outputs["optimizer"]
    assert got["reload_equal"]
    assert got["ref_sharded"] == (False, True)  # whole after a forward pass, sharded again after dist.release
    units, offloaded, sharded, err = got["offload"]
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    assert units == layers + 1 and offloaded and sharded  # each decoder layer, then the root
    assert err < 1e-6  # --ref_offload's reference scores as the whole model does
    cfg = make_config("grpo")
    policy = load_policy(model_dir)
    opt, _ = make_optimizer(policy.parameters(), 1e-3, 0.0, 0)
    ro, old_logp, ref_logp, adv, *_ = rows_of(batch, ORDER, False)
    train.update(cfg, 0, policy, opt, ro, old_logp, ref_logp, adv, "cpu")
    want = opt.state_dict()
    assert got["state"]["param_groups"] == want["param_groups"]
    assert got["state"]["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        assert rel_err(got["state"]["state"][i]["exp_avg"], s["exp_avg"]) < 1e-5
        assert rel_err(got["state"]["state"][i]["exp_avg_sq"], s["exp_avg_sq"]) < 1e-5
    for name, p in policy.named_parameters():  # (AdamW's first step divides by |g|, magnifying rounding near g = 0)
        assert rel_err(got["params"][name], p.detach()) < 1e-5, name


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py"]
TORCHRUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun_train(model, out, steps, *extra) -> str:
    """torchrun --nproc_per_node 2 train.py, GRPO in batches of 4 questions with 3 test questions, then
    `extra`: what it printed (it must exit 0)."""
    from test_train import args

    cmd = [*TORCHRUN, *args(model, out, "grpo", steps=steps), "--batch_size", "4", "--eval_size", "3", *extra]
    res = subprocess.run(cmd, cwd=Path(train.__file__).parent, env=TORCHRUN_ENV, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize("offload", [[], ["--ref_offload"]], ids=["ref", "ref_offload"])
def test_torchrun_train_smoke(tiny_model, tmp_path, offload):
    """torchrun --nproc_per_node 2 train.py: two steps under FSDP2, one checkpoint, one metrics
    file; also with the reference's shards kept in CPU memory (--ref_offload). The 3 test questions
    do not split evenly over the 2 ranks: the evaluation answers each once (a share of 2 and of 1)."""
    out = tmp_path / "run"
    said = torchrun_train(tiny_model, out, 2, "--parallel", "fsdp", "--save_every", "2", *offload)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # written once, by rank 0
    assert [r["eval/all"]["n"] for r in rows if "eval/all" in r] == [3, 3]  # steps 0 and 2
    assert said.count("step    2 |") == 1  # printed once, as are the config and each evaluation
    assert [said.count(s) for s in ("config:\n", "eval step 0 ", "eval step 2 ")] == [1, 1, 1]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    assert (out / "checkpoint" / "policy" / "model.safetensors").exists()
    state = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["step"] == 2 and len(state["sampler"]) == 2  # each rank's sampler state
    assert isinstance(next(iter(state["opt"]["state"])), int)  # one process's optimizer-state format


def test_torchrun_resumes_and_starts_fresh_over_an_earlier_run_once(tiny_model, tmp_path):
    """Under torchrun, rank 0 alone says that --resume found no checkpoint or where it resumed, and a fresh
    start in the folder of an earlier run says so and sets that run aside once (by every rank, the second
    could move the first's new files over it)."""
    from test_train import metrics

    out = tmp_path / "run"
    said = torchrun_train(tiny_model, out, 1, "--resume")
    assert said.count(f"--resume: no checkpoint in {out}, starting fresh") == 1
    said = torchrun_train(tiny_model, out, 2, "--resume")
    assert said.count("resumed from ") == 1 and [r["step"] for r in metrics(out)] == [0, 1, 2]
    said = torchrun_train(tiny_model, out, 1)
    assert [said.count(s) for s in ("of an earlier run; this run starts fresh", "the earlier run is kept: ")] == [1, 1]
    assert [r["step"] for r in metrics(out)] == [0, 1]
    earlier = [json.loads(line)["step"] for line in (out / "metrics.previous.jsonl").read_text().splitlines()]
    assert earlier == [0, 1, 2] and json.loads((out / "config.previous.json").read_text())["steps"] == 2
    assert torch.load(out / "checkpoint.previous" / "trainer.pt", weights_only=False)["step"] == 2


def test_torchrun_vllm_follows_a_sharded_policy():
    """Under FSDP2 the policy stays sharded while vLLM generates, and a push gathers it tensor by
    tensor: vLLM then answers as the policy does (and did not before the push)."""
    pytest.importorskip("vllm")
    script = Path(__file__).with_name("torchrun_vllm_push.py")
    res = subprocess.run([*TORCHRUN[:-1], str(script)], env=TORCHRUN_ENV, capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    # (the ranks share one stdout: one's line may run into the other's before its newline)
    assert sorted(re.findall(r"RESULT rank (\d) pushed (True|False) unpushed (True|False)", res.stdout)) == [
        ("0", "True", "False"), ("1", "True", "False")]


def _train_and_signal(tiny_model, out, signal_it) -> tuple[int, str]:
    """torchrun --nproc_per_node 2 train.py for up to 500 steps; `signal_it(proc)` once step 1 is
    logged. (exit status, everything printed)"""
    from test_train import args

    cmd = [*TORCHRUN, *args(tiny_model, out, "grpo", steps=500), "--save_every", "0", "--batch_size", "4",
           "--eval_every", "0"]
    proc = subprocess.Popen(cmd, cwd=Path(train.__file__).parent, env=TORCHRUN_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # wait until training runs
            seen.append(line)
            if "step    1 |" in line:
                signal_it(proc)
                break
        seen.append(proc.communicate(timeout=120)[0])  # the rest, till it exits
    finally:
        proc.kill()
    return proc.returncode, "".join(seen)


def test_torchrun_ctrl_c_stops_every_rank_after_one_step(tiny_model, tmp_path):
    """Ctrl-C reaches torchrun, which passes it on to each rank: the ranks finish the same step,
    rank 0 checkpoints it and says so once, and the metrics end at that step."""
    out = tmp_path / "run"
    _, text = _train_and_signal(tiny_model, out, lambda proc: proc.send_signal(signal.SIGINT))
    assert text.count("finishing this step and saving a checkpoint") == 1, text[-3000:]  # rank 0 alone says it
    stopped = re.findall(r"stopped after step (\d+), checkpoint saved", text)
    assert len(stopped) == 1, text[-3000:]
    step = int(stopped[0])
    assert 1 <= step < 500
    assert torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)["step"] == step
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()][-1] == step


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun `parent`'s child process of RANK `rank` (Linux: /proc)."""
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    return None


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds rank 1's process through /proc")
def test_torchrun_a_signal_to_one_rank_alone_stops_every_rank_as_stopped(tiny_model, tmp_path):
    """SIGTERM to rank 1 alone (a preempted node, a kill): every rank stopped after the same step,
    but rank 0 then printed 'done: ... holds the step-500 model' and exited 0."""
    out = tmp_path / "run"
    status, text = _train_and_signal(tiny_model, out, lambda proc: os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM))
    assert status != 0, text[-3000:]
    stopped = re.findall(r"stopped after step (\d+) \(another process got SIGTERM\), checkpoint saved", text)
    assert len(stopped) == 1 and "done:" not in text, text[-3000:]
    assert torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)["step"] == int(stopped[0])


def test_settings_two_processes_cannot_use_are_refused_before_training(monkeypatch):
    monkeypatch.setattr(dist, "world", lambda: 2)
    dist.check_settings(8, 4, "ddp", optimizer="adamw8bit")  # a replica per rank: bitsandbytes' kernel works
    dist.check_settings(8, 4, "fsdp", optimizer="adamw")
    with pytest.raises(ValueError, match="adamw8bit does not run on FSDP2's sharded .DTensor. weights; use --parallel ddp"):
        dist.check_settings(8, 4, "fsdp", optimizer="adamw8bit")  # it failed at the first optimizer step
    with pytest.raises(ValueError, match="'fsdp' with LoRA is not supported"):
        dist.check_settings(8, 4, "fsdp", lora_rank=8)
    with pytest.raises(ValueError, match="batch_size 7 does not split over 2 processes"):
        dist.check_settings(7, 0, "ddp")
    with pytest.raises(ValueError, match=r"mini_batch_size 3 \(trajectories of all processes .*does not split over 2"):
        dist.check_settings(8, 3, "ddp")  # each rank's share, 3 // 2, would silently be 1
    monkeypatch.setattr(dist, "world", lambda: 1)
    dist.check_settings(7, 0, "fsdp", lora_rank=8, optimizer="adamw8bit")  # one process: nothing is sharded


def test_train_py_stops_with_those_refusals_in_one_line_before_and_after_auto_is_resolved(tiny_model, tmp_path,
                                                                                          monkeypatch):
    """train.py exits with check_settings' message as its error line: a batch that does not split
    over the processes before any model loads, and a LoRA run that --parallel auto resolves to
    FSDP2 (here from one trained parameter up) before any model is wrapped."""
    from test_train import args

    monkeypatch.setattr(dist, "world", lambda: 2)  # two processes as train.py sees them, no group needed
    load = train.load_policy
    monkeypatch.setattr(train, "load_policy", lambda *a, **k: pytest.fail("a model loaded before the check"))
    with pytest.raises(SystemExit, match=r"^error: batch_size 3 does not split over 2 processes; use a multiple of 2$"):
        train.main(args(tiny_model, tmp_path / "odd", "grpo", extra=["--batch_size", "3"]))
    monkeypatch.setattr(train, "load_policy", load)
    monkeypatch.setattr(dist, "FSDP_FROM_PARAMS", 1)
    monkeypatch.setattr(dist, "wrap_model", lambda *a, **k: pytest.fail("a model was wrapped before the check"))
    with pytest.raises(SystemExit, match=r"^error: parallel = 'fsdp' with LoRA is not supported"):
        train.main(args(tiny_model, tmp_path / "lora", "grpo", extra=["--lora_rank", "4"]))


# ---------------------------------------------------------------------------- one process, a stand-in group
# `FakeGroup` replaces torch.distributed inside searchlite.distributed: this process is rank `rank`
# of `world`, and what the other ranks contribute to each collective is given in advance (in rank
# order, this rank left out), so every reduction is checked against numbers worked out by hand.
# Model wrapping is checked by recording what FSDP2's `fully_shard` and DDP are called with.


class FakeGroup:
    """torch.distributed as seen by rank `rank` of `world`; `peers` holds, per collective call,
    the other ranks' contributions in rank order (this rank's left out)."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, world: int, rank: int, peers=(), initialized: bool = True):
        self.world, self.rank_, self.peers = world, rank, deque(peers)
        self.initialized = initialized
        self.calls = []

    def is_initialized(self):
        return self.initialized

    def get_world_size(self):
        return self.world

    def get_rank(self):
        return self.rank_

    def _everyone(self, mine):
        others = list(self.peers.popleft())
        assert len(others) == self.world - 1
        return others[:self.rank_] + [mine] + others[self.rank_:]

    def all_reduce(self, t, op=torch.distributed.ReduceOp.SUM):
        self.calls.append(("all_reduce", op))
        values = torch.stack([torch.as_tensor(v, dtype=t.dtype) for v in self._everyone(t.clone())])
        t.copy_(values.max(0).values if op == torch.distributed.ReduceOp.MAX else values.sum(0))

    def all_gather(self, parts, x):
        self.calls.append(("all_gather",))
        for p, v in zip(parts, self._everyone(x), strict=True):
            p.copy_(torch.as_tensor(v, dtype=x.dtype))

    def all_gather_object(self, out, obj):
        out[:] = self._everyone(obj)

    def init_process_group(self, backend):
        self.calls.append(("init_process_group", backend))
        self.initialized = True

    def barrier(self):
        self.calls.append(("barrier",))

    def destroy_process_group(self):
        self.calls.append(("destroy_process_group",))
        self.initialized = False


@pytest.fixture()
def group(monkeypatch):
    """Make this process rank `rank` of `world` (with the other ranks' values `peers`)."""

    def make(world: int, rank: int, peers=(), initialized: bool = True) -> FakeGroup:
        fake = FakeGroup(world, rank, peers, initialized)
        monkeypatch.setattr(dist, "dist", fake)
        return fake

    return make


# ------------------------------------------------ splitting


def test_shard_gives_each_rank_its_contiguous_share_in_rank_order(group):
    """Eight questions over four ranks: rank r takes items 2r and 2r + 1."""
    for r in range(4):
        group(4, r)
        assert dist.shard(list(range(8))) == [2 * r, 2 * r + 1]


def test_shard_refuses_an_uneven_split_unless_asked_not_to(group):
    """A step's batch must split evenly (every rank runs as many micro-batches); evaluation
    questions need not, and rank 1 of 3 then takes items 2 and 3 of 7 (bounds 7k // 3)."""
    group(3, 1)
    with pytest.raises(ValueError, match="7 items do not split evenly over 3 processes"):
        dist.shard(list(range(7)))
    assert dist.shard(list(range(7)), even=False) == [2, 3]


def test_this_rank_takes_its_own_entry_and_the_last_when_the_run_had_fewer(monkeypatch):
    """Resuming per-rank states (sampler calls, RNG): rank r takes entry r; a rank the saving
    run did not have takes the last entry; a one-process state is used as it is."""
    monkeypatch.setattr(dist, "rank", lambda: 1)
    assert dist.this_rank([{"calls": 3}, {"calls": 5}, {"calls": 9}]) == {"calls": 5}
    monkeypatch.setattr(dist, "rank", lambda: 3)
    assert dist.this_rank([{"calls": 3}, {"calls": 5}]) == {"calls": 5}
    assert dist.this_rank({"calls": 4}) == {"calls": 4}


# ------------------------------------------------ reductions


def test_all_sum_adds_every_rank_in_float64(group):
    """2**24 + 1 is not a float32: a sum in float32 would lose the 1."""
    group(2, 0, peers=[[2.0]])
    assert dist.all_sum(2.0**24 + 1) == 2.0**24 + 3


def test_all_mean_divides_by_the_number_of_ranks(group):
    group(4, 2, peers=[[1.0, 2.0, 3.0]])
    assert dist.all_mean(6.0) == pytest.approx(3.0, rel=1e-12)


def test_all_max_takes_the_largest_value_of_any_rank(group):
    """e.g. train.py's micro-batch passes: every rank runs as many as the rank that needs most."""
    fake = group(3, 0, peers=[[7, 2]])
    assert dist.all_max(3) == 7
    assert fake.calls == [("all_reduce", torch.distributed.ReduceOp.MAX)]


def test_mean_in_one_process_is_the_plain_mean():
    assert dist.mean(torch.tensor([1, 2, 3, 10])) == pytest.approx(4.0, rel=1e-12)
    assert dist.mean(torch.tensor([[True, False], [False, False]])) == pytest.approx(0.25, rel=1e-12)


def test_mean_weighs_every_element_of_every_rank(group):
    """Rank 1 holds 5 values summing to 60, rank 0 3 summing to 3: 63 / 8, not the ranks' mean of means."""
    group(2, 1, peers=[[[3.0, 3.0]]])
    assert dist.mean(torch.arange(5.0) + 10) == pytest.approx(63 / 8, rel=1e-12)


def test_gather_rows_concatenates_in_rank_order_and_local_rows_undoes_it(group):
    mine = torch.tensor([[2.0, 3.0]])  # (1, 2) rank 1 of 3
    group(3, 1, peers=[[[[0.0, 1.0]], [[4.0, 5.0]]]])
    rows = dist.gather_rows(mine)
    assert torch.equal(rows, torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]))
    assert torch.equal(dist.local_rows(rows), mine)
    assert torch.equal(dist.local_rows(torch.arange(12.0).reshape(6, 2)), torch.tensor([[4.0, 5.0], [6.0, 7.0]]))


def test_gather_objects_and_per_rank_list_every_ranks_object_in_rank_order(group):
    group(3, 1, peers=[[{"calls": 3}, {"calls": 9}], [{"calls": 3}, {"calls": 9}]])
    assert dist.gather_objects({"calls": 5}) == [{"calls": 3}, {"calls": 5}, {"calls": 9}]
    assert dist.per_rank({"calls": 5}) == [{"calls": 3}, {"calls": 5}, {"calls": 9}]


def test_masked_whiten_uses_the_mean_and_variance_of_every_rank(group):
    """Rank 1's rows whitened with the statistics of both ranks' masked entries equal the
    one-process whitening of the whole batch, row for row; masked-out entries are 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)  # (B, T) the whole batch
    mask = (torch.rand(4, 6, generator=g) < 0.6).long()  # (B, T)
    mask[0, 0] = mask[3, 5] = 1
    x0, m0, x1, m1 = x[:2], mask[:2].bool(), x[2:], mask[2:]
    mu = float(x[mask.bool()].mean())
    peers = [[float(m0.sum())], [float(x0[m0].sum())], [float(((x0[m0] - mu) ** 2).sum())]]  # rank 0's sums
    group(2, 1, peers=peers)
    got = dist.masked_whiten(x1, m1)
    want = masked_whiten(x, mask)[2:]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.all(got[m1 == 0] == 0)


def test_masked_whiten_adds_eps_to_the_variance_before_the_square_root(group):
    """Nearly equal values (variance 1e-8, eps 1e-8): each is (x - mean) / sqrt(var + eps)."""
    x = torch.tensor([[1.0, 1.0 + 2e-4, 5.0]], dtype=torch.float64)  # (1, 3), the 5 is masked out
    mask = torch.tensor([[1, 1, 0]])
    group(2, 0, peers=[[0.0], [0.0], [0.0]])  # rank 1 holds no masked entry
    got = dist.masked_whiten(x, mask)
    want = torch.tensor([[-1e-4, 1e-4, 0.0]], dtype=torch.float64) / (1e-8 + 1e-8) ** 0.5
    assert torch.allclose(got, want, rtol=1e-6, atol=0)


def test_masked_whiten_of_one_masked_entry_or_none_over_every_rank(group):
    """One masked entry in the whole batch is its own mean: 0, as one process gives. None on any rank:
    every entry 0 (the count of 0 is taken as 1, not divided by)."""
    x, mask = torch.tensor([[3.0, 7.0]], dtype=torch.float64), torch.tensor([[1, 0]])  # (1, 2)
    group(2, 0, peers=[[0.0], [0.0], [0.0]])  # rank 1 holds no masked entry
    assert torch.equal(dist.masked_whiten(x, mask), torch.zeros(1, 2, dtype=torch.float64))
    assert torch.equal(masked_whiten(x, mask), torch.zeros(1, 2, dtype=torch.float64))
    group(2, 0, peers=[[0.0], [0.0], [0.0]])
    assert torch.equal(dist.masked_whiten(x, torch.zeros_like(mask)), torch.zeros(1, 2, dtype=torch.float64))


# ------------------------------------------------ settings


def test_unknown_parallel_mode_is_refused(monkeypatch):
    for world in (1, 2):
        monkeypatch.setattr(dist, "world", lambda w=world: w)
        with pytest.raises(ValueError, match="unknown parallel mode 'tp'"):
            dist.check_settings(8, 4, "tp")
    with pytest.raises(ValueError, match="unknown parallel mode 'tp'"):
        dist.choose_parallel(nn.Linear(2, 2), "tp")


def test_settings_that_split_evenly_over_four_processes_pass(monkeypatch):
    """Four processes: 12 and 8 split; 6 and 10 do not (6 // 4 would leave trajectories out)."""
    monkeypatch.setattr(dist, "world", lambda: 4)
    dist.check_settings(12, 8, "ddp", lora_rank=8)
    with pytest.raises(ValueError, match="batch_size 6 does not split over 4 processes"):
        dist.check_settings(6, 4, "ddp")
    with pytest.raises(ValueError, match="mini_batch_size 10 .*does not split over 4"):
        dist.check_settings(12, 10, "ddp")


def test_choose_parallel_picks_fsdp_from_the_threshold_of_trained_parameters_up(monkeypatch):
    """'auto' counts trainable parameters only (a LoRA run's frozen base does not count), and
    FSDP2 starts at exactly FSDP_FROM_PARAMS of them; an explicit mode is kept as given."""
    monkeypatch.setattr(dist, "FSDP_FROM_PARAMS", 6)
    model = nn.Linear(2, 2)  # 4 weights + 2 biases
    assert dist.choose_parallel(model, "auto") == "fsdp"
    model.bias.requires_grad_(False)  # 4 trained
    assert dist.choose_parallel(model, "auto") == "ddp"
    monkeypatch.setattr(dist, "FSDP_FROM_PARAMS", 5)
    assert dist.choose_parallel(model, "auto") == "ddp"
    monkeypatch.setattr(dist, "FSDP_FROM_PARAMS", 4)
    assert dist.choose_parallel(model, "auto") == "fsdp"
    monkeypatch.setattr(dist, "FSDP_FROM_PARAMS", 1000)
    assert dist.choose_parallel(model, "fsdp") == "fsdp"
    monkeypatch.setattr(dist, "FSDP_FROM_PARAMS", 1)
    assert dist.choose_parallel(model, "ddp") == "ddp"


def test_auto_takes_fsdp_from_the_documented_one_billion_trained_parameters_up():
    """--parallel's help and configs.toml say 'FSDP2 from 1B trained parameters'; the sizes are on
    the meta device, so no memory is held."""
    def model(n):
        m = nn.Module()
        m.weight = nn.Parameter(torch.empty(n, device="meta"))
        return m

    assert dist.choose_parallel(model(1_000_000_000), "auto") == "fsdp"
    assert dist.choose_parallel(model(999_999_999), "auto") == "ddp"


# ------------------------------------------------ models


class RecordedDDP(nn.Module):
    """Stands in for DistributedDataParallel (a torch before 2.13): keeps what it was built with."""

    def __init__(self, module, device_ids=None, broadcast_buffers=True):
        super().__init__()
        self.module, self.device_ids, self.broadcast_buffers = module, device_ids, broadcast_buffers


class RecordedNewerDDP(RecordedDDP):
    """The same for torch 2.13, whose DDP warns on broadcast_buffers and takes forward_sync_buffers."""

    def __init__(self, module, device_ids=None, broadcast_buffers=None, forward_sync_buffers=None):
        if broadcast_buffers is not None:
            warnings.warn("`broadcast_buffers` is deprecated", FutureWarning)
        super().__init__(module, device_ids, forward_sync_buffers)


def test_ddp_wraps_a_partly_frozen_model_and_leaves_a_frozen_one(monkeypatch):
    """A LoRA policy (frozen base, trainable adapters) must be wrapped, or its gradients are never
    averaged over ranks; the reference (nothing trainable) stays a plain module."""
    monkeypatch.setattr(dist, "world", lambda: 2)
    lora_like = nn.Sequential(nn.Linear(3, 3).requires_grad_(False), nn.Linear(3, 3))
    for ddp in (RecordedDDP, RecordedNewerDDP):  # no buffer broadcast a forward, by the name each torch takes
        monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", ddp)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch 2.13's deprecation warning on every torchrun run
            wrapped = dist.wrap_model(lora_like, "ddp", torch.device("cpu"))
        assert isinstance(wrapped, ddp) and wrapped.module is lora_like and wrapped.device_ids is None
        assert wrapped.broadcast_buffers is False
    frozen = nn.Linear(3, 3).requires_grad_(False)
    assert dist.wrap_model(frozen, "ddp", torch.device("cpu")) is frozen
    with pytest.raises(ValueError, match="mode must be 'ddp' or 'fsdp'"):
        dist.wrap_model(lora_like, "auto", torch.device("cpu"))


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("compute", [None, torch.bfloat16])
def test_fsdp_shards_each_decoder_layer_then_the_root(monkeypatch, byte_tokenizer, offload, compute):
    """fully_shard on every decoder layer, in order, then on the model; each with the CPU offload
    policy exactly when asked, and bf16 compute with float32 gradient reduction for a model
    marked to compute in bf16 (the mark is then cleared)."""
    from torch.distributed import fsdp

    calls = []
    monkeypatch.setattr(dist, "world", lambda: 2)
    monkeypatch.setattr(dist, "_mesh", lambda device_type: ("mesh", device_type))
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append((module, kw)))
    model = make_tiny_llama(byte_tokenizer, layers=3)
    model.searchlite_compute_dtype = compute
    assert dist.wrap_model(model, "fsdp", torch.device("cpu"), offload=offload) is model
    assert [m for m, _ in calls] == [*model.model.layers, model]
    for _, kw in calls:
        assert kw["mesh"] == ("mesh", "cpu")
        assert type(kw["offload_policy"]) is (fsdp.CPUOffloadPolicy if offload else fsdp.OffloadPolicy)
        assert kw["mp_policy"].param_dtype == compute
        assert kw["mp_policy"].reduce_dtype == (torch.float32 if compute else None)
    assert model.searchlite_compute_dtype is None


def test_fsdp_offload_pins_host_memory_only_for_a_gpu(monkeypatch, byte_tokenizer):
    """--ref_offload: the CPU shards are pinned (page-locked, for fast copies to the GPU) on a GPU run only."""
    from torch.distributed import fsdp

    monkeypatch.setattr(dist, "world", lambda: 2)
    monkeypatch.setattr(dist, "_mesh", lambda device_type: ("mesh", device_type))
    for device, pinned in (("cpu", False), ("cuda", True)):
        calls = []
        monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append(kw["offload_policy"]))
        dist.wrap_model(make_tiny_llama(byte_tokenizer, layers=1), "fsdp", torch.device(device), offload=True)
        assert calls and {policy.pin_memory for policy in calls} == {pinned}


# ------------------------------------------------ the process group


def test_init_takes_cuda_local_rank_and_a_group_for_cpu_and_gpu_tensors(group, monkeypatch):
    """On GPU, rank 3 of a 4-GPU-a-node run (LOCAL_RANK 1) takes cuda:1, and the group runs gloo
    for the CPU metric reductions beside NCCL; on CPU, gloo; one process joins nothing."""
    set_device = []
    monkeypatch.setattr(torch.cuda, "set_device", set_device.append)
    monkeypatch.setattr(dist, "_own_group", False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    fake = group(4, 3, initialized=False)
    assert dist.init(torch.device("cuda")) == torch.device("cuda", 1)
    assert set_device == [torch.device("cuda", 1)]
    assert fake.calls == [("init_process_group", "cpu:gloo,cuda:nccl")] and dist._own_group  # close() ends it
    monkeypatch.setattr(dist, "_own_group", False)
    fake = group(4, 3, initialized=False)
    assert dist.init(torch.device("cpu")) == torch.device("cpu")
    assert fake.calls == [("init_process_group", "gloo")] and dist._own_group
    monkeypatch.setattr(dist, "_own_group", False)
    fake = group(4, 3)  # a group another library made: joined as it is, and not this module's to close
    assert dist.init(torch.device("cpu")) == torch.device("cpu") and fake.calls == [] and not dist._own_group
    monkeypatch.setenv("WORLD_SIZE", "1")
    fake = group(1, 0, initialized=False)
    assert dist.init(torch.device("cpu")) == torch.device("cpu") and fake.calls == []


def test_close_leaves_a_group_it_did_not_create(group, monkeypatch):
    """vLLM's own process group is not destroyed; the one init() made is, after a barrier."""
    monkeypatch.setattr(dist, "_own_group", False)
    fake = group(2, 0)
    dist.close()
    assert fake.calls == [] and fake.initialized
    monkeypatch.setattr(dist, "_own_group", True)
    dist.close()
    assert fake.calls == [("barrier",), ("destroy_process_group",)] and not dist._own_group


def test_barrier_waits_on_the_other_ranks_only_when_there_are_some(group):
    """A group of one (such as vLLM's own in one process) has no rank to wait for."""
    fake = group(2, 1)
    dist.barrier()
    assert fake.calls == [("barrier",)]
    fake = group(1, 0)
    dist.barrier()
    assert fake.calls == []


def test_one_process_helpers_change_nothing():
    """Without a process group: rank 0 of 1, sums and gathers of one, whole shares, models as they are."""
    model = nn.Linear(2, 2)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert (dist.world(), dist.rank(), dist.is_main()) == (1, 0, True)
    assert dist.shard([1, 2, 3]) == [1, 2, 3] and dist.all_sum(2.5) == 2.5 and dist.all_max(3) == 3
    assert dist.gather_rows(x) is x and torch.equal(dist.local_rows(x), x)
    assert dist.wrap_model(model, "fsdp", torch.device("cpu")) is model and not dist.is_sharded(model)
    assert dist.full_state_dict(model) is None
    assert dist.per_rank({"calls": 1}) == {"calls": 1}
    assert dist.gather_objects("mine") == ["mine"] and dist.all_mean(2.5) == 2.5
    dist.barrier()  # no process group to wait on: torch.distributed's would raise
