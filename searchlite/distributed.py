"""Several processes under torchrun: the process group, rank helpers, reductions, model wrapping.

    torchrun --nproc_per_node 8 train.py --preset qwen2.5-3b-grpo

train.py calls `device = init(device)` first. Without torchrun's environment (WORLD_SIZE unset
or 1) nothing is initialised and every helper below is what one process needs: rank 0 of 1,
a sum over one process, models left as they are. So `python train.py` runs without a process
group, and these helpers change none of its numbers.

How a step is split over ranks (the choices train.py relies on):
- By question. Each rank rolls out a contiguous 1/world of the step's questions, all `group`
  samples of each (`shard`), so GRPO's group statistics and R1-Searcher++'s group reward are
  computed on the rank that holds the group. What spans the whole batch is reduced across
  ranks: GRPO's group = 1 baseline (`gather_rows`), REINFORCE++'s whitening (`masked_whiten`),
  the logged metrics (`mean`: over all rows of all ranks, not a mean of the ranks' means).
- Losses as in one process. DDP and FSDP2 *average* gradients over ranks, so a rank divides
  its token-summed loss by the mean token count per rank, (all ranks' tokens) / world: the
  average of the ranks' gradients is then the gradient of the token mean over the whole
  mini-batch, as one process computes it (tests/test_distributed.py checks this).
- Models. "ddp": a full replica per rank, gradients all-reduced in every backward; the frozen
  reference stays a plain copy. "fsdp": FSDP2 `fully_shard` (one unit per decoder layer, and
  the root) shards parameters, gradients and AdamW state of policy, critic and reference;
  full weights are gathered for transformers' generation (`gathered`; vLLM generates from its
  own copy, so the policy stays sharded), tensor by tensor for a push to vLLM
  (`vllm_sampler.checkpoint_weights`) and, to rank 0, for checkpoints (`full_state_dict`,
  `optimizer_state`).
  "auto" picks FSDP2 from `FSDP_FROM_PARAMS` trained policy parameters up, DDP below (so
  LoRA runs, whose frozen base every rank holds, use DDP). A LoRA reference (the policy with
  its adapters off) stays whole on each rank; an offloaded reference (CPU) is whole on each
  rank under DDP and sharded, its shards in CPU memory, under FSDP2.
- Rank 0 prints and writes config, metrics, trajectories and the checkpoint (full weights in a
  Hugging Face folder, optimizer state in one process's format, so a checkpoint resumes with
  any number of processes); every rank reads it on --resume. Evaluation splits the test
  questions over ranks and gathers the records, so its metrics are those of one process.
Left out on purpose: tensor / pipeline / sequence parallelism, HSDP, sharded (DCP)
checkpoints, step batches that do not split evenly over the ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
from torch import nn

from .losses import masked_whiten as local_masked_whiten

FSDP_FROM_PARAMS = 1_000_000_000  # parallel = "auto": FSDP2 from this many trained policy parameters up
PARALLEL_MODES = ("auto", "ddp", "fsdp")


# ---------------------------------------------------------------------------- process group


_own_group = False  # whether init() created the process group (close() leaves others' alone)


def init(device: torch.device) -> torch.device:
    """Join torchrun's process group when there is one; return this rank's device.

    On GPU each rank takes cuda:LOCAL_RANK, and the group runs NCCL for GPU tensors and gloo for
    CPU ones (the metric reductions below); on CPU, gloo. One process: `device` unchanged.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    global _own_group
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        _own_group = True
    return device


def close() -> None:
    """Leave the process group init() created (not one another library made, e.g. vLLM's own).

    The ranks meet first, so none closes its connections while another still talks on them
    (gloo aborts a process whose peer hung up mid-transfer: "Connection reset by peer")."""
    global _own_group
    if _own_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _own_group = False


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0: the process that prints and writes files."""
    return rank() == 0


def barrier() -> None:
    if world() > 1:
        dist.barrier()


def check_settings(batch_size: int, mini_batch_size: int, parallel: str, lora_rank: int = 0,
                   optimizer: str = "adamw") -> None:
    """Raise ValueError for settings a run over `world()` processes cannot use. Every rank must
    hold as many trajectories as the others: DDP and FSDP2 sync gradients in every backward,
    so all ranks run the same number of micro-batches. train.py calls it again once "auto" is
    resolved (choose_parallel)."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"unknown parallel mode {parallel!r} (valid: {', '.join(PARALLEL_MODES)})")
    w = world()
    if w > 1 and lora_rank and parallel == "fsdp":
        raise ValueError("parallel = 'fsdp' with LoRA is not supported: a LoRA run trains few weights and "
                         "replicates its frozen base, use parallel = 'ddp' (or 'auto')")
    if w > 1 and optimizer == "adamw8bit" and parallel == "fsdp":  # bitsandbytes' kernel takes no DTensor
        raise ValueError("--optimizer adamw8bit does not run on FSDP2's sharded (DTensor) weights; use "
                         "--parallel ddp if a replica fits, or --optimizer adamw (--ref_offload and "
                         "--grad_checkpointing also save memory)")
    if batch_size % w:
        raise ValueError(f"batch_size {batch_size} does not split over {w} processes; use a multiple of {w}")
    if mini_batch_size % w:
        raise ValueError(f"mini_batch_size {mini_batch_size} (trajectories of all processes per optimizer step) "
                         f"does not split over {w} processes; use a multiple of {w}")


# ---------------------------------------------------------------------------- splitting and reducing


def shard(items: list, even: bool = True) -> list:
    """This rank's contiguous share of `items`, shares in rank order; `even` = they must be equal."""
    w, r = world(), rank()
    if even and len(items) % w:
        raise ValueError(f"{len(items)} items do not split evenly over {w} processes")
    bounds = [len(items) * k // w for k in range(w + 1)]
    return items[bounds[r]:bounds[r + 1]]


def all_sum(x: float) -> float:
    """x summed over ranks (in float64)."""
    if world() == 1:
        return x
    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def all_mean(x: float) -> float:
    return x if world() == 1 else all_sum(x) / world()


def all_max(x: int) -> int:
    if world() == 1:
        return x
    t = torch.tensor(int(x), dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def mean(x: torch.Tensor) -> float:
    """Mean over every element of every rank's `x` (not a mean of the ranks' means)."""
    if world() == 1:
        return float(x.float().mean())
    t = torch.tensor([float(x.double().sum()), x.numel()], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` (same shape on each) concatenated along dim 0 in rank order: (world * n, ...)."""
    if world() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def local_rows(x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a `gather_rows` result: (n, ...)."""
    n = x.shape[0] // world()
    return x[rank() * n:(rank() + 1) * n]


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order, on every rank."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def per_rank(state):
    """A state that differs between ranks (sampler calls, RNG), for rank 0's checkpoint: the list of
    every rank's when there are several, as it is in one process."""
    return state if world() == 1 else gather_objects(state)


def this_rank(state):
    """This rank's entry of a `per_rank` state (the last one when the run had fewer processes)."""
    return state[min(rank(), len(state) - 1)] if isinstance(state, list) else state


@torch.no_grad()
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """losses.masked_whiten with the mean and (population) variance of the masked entries of
    every rank: REINFORCE++ whitens over the whole batch (R1-Searcher++ eq. 2). (B, T) -> (B, T)."""
    if world() == 1:
        return local_masked_whiten(x, mask, eps)
    m = mask.bool()  # (B, T)
    n = max(1.0, all_sum(float(m.sum())))
    mu = all_sum(float(torch.where(m, x, torch.zeros_like(x)).double().sum())) / n
    var = all_sum(float(torch.where(m, (x.double() - mu) ** 2, torch.zeros_like(x, dtype=torch.float64)).sum())) / n
    out = ((x.double() - mu) * (1.0 / (var + eps) ** 0.5)).to(x.dtype)  # (B, T), in float64 as on one process
    return torch.where(m, out, torch.zeros_like(out))


# ---------------------------------------------------------------------------- models


def choose_parallel(model: nn.Module, mode: str) -> str:
    """"ddp" or "fsdp" for `mode`. "auto" counts the policy's trainable parameters: gradients and
    AdamW state (12-16 bytes a parameter) are what a replica cannot afford, so FSDP2 from
    `FSDP_FROM_PARAMS` up; a LoRA run trains few and so replicates its frozen base (DDP)."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"unknown parallel mode {mode!r} (valid: {', '.join(PARALLEL_MODES)})")
    if mode != "auto":
        return mode
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return "fsdp" if trained >= FSDP_FROM_PARAMS else "ddp"


def wrap_model(model: nn.Module | None, mode: str, device: torch.device,
               offload: bool = False) -> nn.Module | None:
    """The module to run training forward/backward passes through.

    One process: `model` itself. "fsdp": `model`, sharded in place by FSDP2 (each decoder layer
    its own unit, then the root); with `offload` (--ref_offload) its shards stay in CPU memory and
    each unit's are copied to the device when a forward pass gathers it. "ddp": a
    DistributedDataParallel wrapper around `model` (use `model` itself for generation and
    saving); a model without trainable parameters (the reference) is returned as it is, a full
    copy on each rank. Build optimizers after this.
    """
    if model is None or world() == 1:
        return model
    if mode == "fsdp":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = _mesh(device.type)
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
        # float32 master weights that compute in bf16 (models.compute_in): the shards stay float32, each
        # unit is gathered in bf16 for its forward and backward, and gradients are reduced in float32
        # (verl's mixed precision); this replaces autocast, so the mark is cleared
        compute = getattr(model, "searchlite_compute_dtype", None)
        mixed = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
        model.searchlite_compute_dtype = None
        for block in _blocks(model):
            fully_shard(block, mesh=mesh, offload_policy=policy, mp_policy=mixed)
        fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mixed)
        return model
    if mode != "ddp":
        raise ValueError(f"wrap_model: mode must be 'ddp' or 'fsdp', got {mode!r}")
    if not any(p.requires_grad for p in model.parameters()):
        return model
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # no buffer broadcast before each forward: the buffers (rotary tables) are equal everywhere, and a
    # forward pass then needs no collective (torch 2.13 names it forward_sync_buffers, warns on the older
    # name, and broadcasts the buffers once as DDP starts, which changes nothing here)
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   **{"forward_sync_buffers" if newer else "broadcast_buffers": False})


@functools.lru_cache(maxsize=2)
def _mesh(device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world(),))


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (its `_no_split_modules`: decoder layers)."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def is_sharded(model) -> bool:
    """Whether `model` is sharded by FSDP2 (so it cannot be deep-copied, and generates inside `gathered`)."""
    if model is None or world() == 1:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def release(model: nn.Module | None) -> None:
    """FSDP2 keeps the root unit's weights (embeddings, head, final norm) gathered after a forward
    pass, for the backward it expects next; a model that never runs one (the reference) frees
    them here. Nothing to do otherwise."""
    if is_sharded(model):
        model.reshard()


@contextlib.contextmanager
def gathered(model: nn.Module | None):
    """Full weights on every rank inside the block (FSDP2); nothing to do otherwise (or for None).

    For transformers' generation. Forward passes inside need no collective, so ranks
    may run different numbers of them (generation ends when a rank's own trajectories are done).
    """
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)  # FSDP2's default: the root keeps its weights


def full_state_dict(model: nn.Module | None) -> dict | None:
    """FSDP2: the model's full weights, as CPU tensors on rank 0 ({} on the others), for
    save_pretrained(state_dict=...); a collective, call it on every rank. Otherwise None: the
    module itself holds its full weights. A parameter shared by two names (tied embeddings) is
    kept once, under its first name, as save_pretrained keeps it from an unsharded model: the
    gathered copies are separate tensors, and a 3B model's embeddings would be written twice."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # a shared parameter's other names: named_parameters() gives each parameter under its first name only
    again = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {k: v for k, v in full.items() if k not in again}


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """`opt.state_dict()` in one process's format (parameters by index), for rank 0 to save.

    FSDP2's sharded state is gathered to rank 0 (a collective: call it on every rank); the other
    ranks get {}. With DDP every rank's state is already the full one.
    """
    if not is_sharded(model):
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return {}
    index: dict[str, int] = {}  # parameter name -> position in the optimizer, as state_dict() numbers them
    groups = [{**g, "params": [index.setdefault(name, len(index)) for name in g["params"]]}
              for g in full["param_groups"]]
    return {"state": {index[name]: s for name, s in full["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Load an `optimizer_state` (or a 1-process `opt.state_dict()`) on every rank.

    Under FSDP2 every rank passes the whole state, and torch copies one tensor at a time to the
    device and keeps this rank's shard of it. train.py reads it with mmap, so on one machine the
    ranks share one copy in the page cache; rank 0 broadcasting it (`broadcast_from_rank0`) would
    save no host memory there and would add a collective per tensor."""
    if not is_sharded(model):
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]  # index -> parameter name
    full = {"state": {order[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, opt, full, options=StateDictOptions(full_state_dict=True))
