"""Load the policy, critic and reference; build optimizers; save and resume checkpoints.

    policy = load_policy("toy/model", dtype="float32", device=dev)
    critic = Critic.from_pretrained("toy/model")         # same backbone + a scalar value head
    ref = frozen_copy(policy)                             # the KL anchor

Mixed precision: `load_policy(path, "bfloat16", master=True)` keeps the weights in float32 and
marks the model to compute in bf16 (`compute_in`): every forward pass of it, sampling, scoring,
training and SFT, runs under `torch.autocast` (`autocast(model)`); under FSDP2 its shards stay
float32 and are gathered in bf16 instead (`distributed.wrap_model`), as verl trains. An AdamW
step at the presets' learning rates (1e-6 to 1e-5) is far below bf16's resolution: on weights
stored in bf16 most updates would round back to the old value.

Checkpoints are Hugging Face `save_pretrained` folders (so a trained policy loads in
transformers and vLLM unchanged) with the trainer state beside them:

    out_dir/checkpoint/policy/        safetensors + tokenizer
    out_dir/checkpoint/critic/        backbone + value_head.pt (PPO only)
    out_dir/checkpoint/trainer.pt     optimizers, schedulers, RNG states, step, data position

A checkpoint is written to `checkpoint.tmp` and renamed into place, so an interrupted save
never leaves a half-written checkpoint where the last good one was.
Under torchrun with FSDP2, rank 0 writes the same folders from gathered full weights
(searchlite/distributed.py). Left out on purpose: sharded (DCP) checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .config import ConfigError, resolve_path
from .data import replace_durably
from .losses import picked_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    """auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N; a ConfigError for any
    other name, or for cuda where torch sees no GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise ConfigError(f"--device {name!r}: not one of auto, cpu, cuda, cuda:N")
    if name != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch {torch.__version__} sees no CUDA GPU here; use --device cpu "
                          "(or auto, which picks the GPU when there is one)")
    return torch.device(name)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def reuse_freed_memory(device: torch.device, size: int = 1 << 30) -> bool:
    """On a CPU run under glibc, keep freed blocks of up to `size` bytes for the next allocation.

    glibc maps every block over 32 MB afresh (a toy step's logits are 64 MB) and unmaps it when it
    is freed, so each forward and backward pass faults those pages in and zeroes them again: perf
    put about half of a toy PPO step in the kernel doing that. Raising the mmap and trim thresholds
    keeps such blocks in the heap. GPU runs are left alone: the host memory they use (weights read
    before they go to the device) should go back to the system. Returns whether it was applied.
    """
    if device.type != "cpu":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): its allocator is left as it is
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, size)) and bool(libc.mallopt(M_TRIM_THRESHOLD, size))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_path(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def named_tokenizer(flag: str, spec: str, path: str = ""):
    """The tokenizer that `--flag spec` names, read from `path` (a GGUF file's converted folder) or
    `spec`. One that cannot be loaded (a folder without tokenizer files, a hub name the hub does not
    know, no network) is a ConfigError naming the flag, in one line, not transformers' traceback."""
    path = path or spec
    try:
        return load_tokenizer(path)
    except (OSError, ValueError, KeyError) as e:  # ValueError: a folder without tokenizer files
        where = f" from {path}" if path != spec else ""
        hub = "" if Path(resolve_path(path)).exists() else f" (no folder {path} here, so it was asked of the hub)"
        raise ConfigError(f"--{flag} {spec}: could not load its tokenizer{where}{hub}: "
                          f"{' '.join(str(e).split())[:300]}") from None


def model_tokenizer(model: str, tokenizer: str = "", folder: str = ""):
    """The tokenizer of --tokenizer, else of --model `model` (read from `folder`, where a GGUF file was
    converted: model_spec.model_folder); one that does not load is a ConfigError naming the flag."""
    return named_tokenizer("tokenizer", tokenizer) if tokenizer else named_tokenizer("model", model, folder)


def load_policy(path: str, dtype: str = "float32", device="cpu", grad_checkpointing: bool = False,
                master: bool = False):
    """A causal LM from a Hugging Face folder or hub name; a LoRA run's checkpoint folder (an
    adapter) loads as its base model with the adapter merged in (searchlite/memory.py). `master`
    (a model to train in full): float32 weights that compute in `dtype` (`compute_in`)."""
    from transformers import AutoModelForCausalLM

    from .memory import is_adapter, load_merged

    held = "float32" if master else dtype
    if is_adapter(path):
        model = load_merged(resolve_path(path), DTYPES[held]).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(resolve_path(path), dtype=DTYPES[held]).to(device)
    if grad_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return compute_in(model, dtype) if master else model


def compute_in(model: nn.Module, dtype: str) -> nn.Module:
    """Mark `model` (float32 master weights) to run its forward passes in `dtype`: `autocast(model)`
    reads the mark, `distributed.wrap_model` turns it into FSDP2's mixed precision. Copies
    (`frozen_copy`, the reference) keep it, so they compute as the policy does. float32: no mark."""
    model.searchlite_compute_dtype = None if dtype == "float32" else DTYPES[dtype]
    return model


@contextlib.contextmanager
def autocast(model: nn.Module):
    """The context a forward pass of `model` runs in: `torch.autocast` to its compute dtype
    (`compute_in`), or nothing for a model that computes in the dtype it holds. Wrap only forward
    passes (sampling, scoring, the loss's forward), not backward() or an optimizer step: autocast
    caches its bf16 copies of the weights until the outermost context ends."""
    inner = _unwrapped(model)
    dtype = getattr(inner, "searchlite_compute_dtype", None)
    if dtype is None:
        yield
        return
    # autocast keeps a weight's bf16 copy for the block only if the weight requires grad: a frozen float32
    # copy (the reference, R1-Searcher++'s rewriter) would be cast again at every decoding step. With no
    # graph being built (no_grad), marking its weights for the block changes nothing else.
    frozen = [] if torch.is_grad_enabled() else [p for p in inner.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        with torch.autocast(next(inner.parameters()).device.type, dtype=dtype):
            yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def frozen_copy(model: nn.Module, dtype: str | None = None) -> nn.Module:
    """A copy of `model` that no gradient reaches (the reference). `dtype`: the copy held in it and
    computing in it, float32 master weights or not (a model that only samples)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    if dtype is not None:
        ref.to(DTYPES[dtype]).searchlite_compute_dtype = None
    return ref


def trained_logprobs(model, input_ids, attention_mask, mask, temperature: float = 1.0):
    """Log-probs of the tokens a loss can train on, with the LM head run only where they are drawn.

    `mask` (b, t) marks the tokens a loss reads (loss_mask; on the host, it costs the device no
    wait). The head (a small model's largest matrix; a large vocabulary's (b, t, V) logits are a
    big model's largest activation) and the log-softmax see only the n hidden states that predict
    a marked token: not the prompt, the retrieved passages or the padding. In the first batch of
    bench/update_bench.py that is 23% of the toy preset's micro-batches' columns (65% from the
    first trained column on, where the head ran before). A forward pre-hook on the head
    (`output_head`) picks them, so DDP, FSDP2 and peft wrap the model unchanged.

    Returns (logp, logits, at): logp (b, t) = log p(input_ids[:, j] | input_ids[:, :j]) under
    logits / `temperature` (divided in fp32, `losses.picked_logprobs`) where mask[:, j] is set
    (j >= 1), 0 elsewhere; logits (n, V), the head's output; at = (rows, cols) of the n tokens,
    as `losses.masked_entropy` takes them. The values are those of `token_logprobs` over the
    whole rows.
    """
    rows, cols = mask[:, 1:].nonzero(as_tuple=True)  # token cols + 1 was drawn from position cols
    rows, cols = rows.to(input_ids.device), cols.to(input_ids.device)
    hook = output_head(model).register_forward_pre_hook(lambda head, args: (args[0][rows, cols], *args[1:]))
    try:
        with autocast(model):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (n, V)
    finally:
        hook.remove()
    if logits.dim() == 3:  # a model that calls no head module: pick from its whole rows' logits
        logits = logits[rows, cols]
    at = (rows, cols + 1)
    logp = torch.zeros(input_ids.shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    return logp.index_put(at, picked_logprobs(logits, input_ids[at], temperature)), logits, at


def output_head(model) -> nn.Module:
    """The LM head of a causal LM, also under DDP, peft and a LoRA run's reference (whose other
    attributes are the policy's)."""
    return _unwrapped(model).get_output_embeddings()


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module DDP wraps (its attributes are the model's), or `model` itself."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class Critic(nn.Module):
    """The policy's backbone with a scalar value head: values (B, T) for every position."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)  # start at V = 0: no bias toward any return
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(backbone.parameters()).dtype)

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32", device="cpu", grad_checkpointing: bool = False,
                        master: bool = False):
        """`master`: float32 weights that compute in `dtype`, as `load_policy`'s."""
        from transformers import AutoModel

        from .memory import is_adapter, load_merged

        held = "float32" if master else dtype
        if is_adapter(path):  # the adapter merged in: AutoModel would attach it and freeze the rest
            backbone = load_merged(resolve_path(path), DTYPES[held]).base_model
        else:
            backbone = AutoModel.from_pretrained(resolve_path(path), dtype=DTYPES[held])
        if grad_checkpointing:
            backbone.gradient_checkpointing_enable()
        critic = cls(backbone)
        head = Path(resolve_path(path)) / "value_head.pt"
        if head.exists():
            critic.value_head.load_state_dict(torch.load(head, map_location="cpu"))
        critic = critic.to(device)
        return compute_in(critic, dtype) if master else critic

    def forward(self, input_ids, attention_mask) -> torch.Tensor:
        with autocast(self):
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
            values = self.value_head(hidden)  # (B, T, 1)
        return values.squeeze(-1).float()  # (B, T)

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        """`state_dict` (keys as in self.state_dict()), when given, is saved instead of the module's
        own weights: FSDP2's gathered ones under torchrun (searchlite/distributed.py)."""
        if state_dict is None:
            self.backbone.save_pretrained(folder)
            torch.save(self.value_head.state_dict(), Path(folder) / "value_head.pt")
            return
        part = lambda prefix: {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}  # noqa: E731
        self.backbone.save_pretrained(folder, state_dict=part("backbone."))
        torch.save(part("value_head."), Path(folder) / "value_head.pt")


def make_optimizer(params, lr: float, weight_decay: float, warmup_steps: int, kind: str = "adamw"):
    """AdamW (`kind` "adamw", or "adamw8bit": bitsandbytes' 8-bit states, searchlite/memory.py)
    over the trainable `params`, with a linear warm-up to `lr`, then constant (Search-R1's schedule).
    Step k (from 0) trains at (k + 1) / warmup_steps of `lr`: one step ahead of verl's
    `get_constant_schedule_with_warmup`, whose first step has lr 0 (it only fills Adam's moments)."""
    from .memory import make_adamw

    params = [p for p in params if p.requires_grad]
    opt = make_adamw(params, kind, lr, weight_decay)
    warm = max(1, warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return opt, sched


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopNow(KeyboardInterrupt):
    """A second signal inside `GracefulStop`: stop at once, with the exit status of `signum`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted_status(e: KeyboardInterrupt) -> int:
    """The exit status after an interrupt: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + getattr(e, "signum", signal.SIGINT)


class GracefulStop:
    """Inside `with GracefulStop() as stop:`, Ctrl-C (SIGINT) or SIGTERM (a scheduler's
    preemption) only sets `stop.requested`: the loop checkpoints at the end of its step and
    stops, so nothing trained is lost and `--resume` continues exactly. A second signal stops at
    once. Leaving the block, however it ends, puts the previous handlers back. Then
    `stop.exit_if_requested()` exits with status 128 + the signal number, as a shell reports a
    killed program, so that a script that ran it (`set -e`) stops too instead of going on."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    # Under torchrun one request can reach a rank twice: a scheduler (Slurm's scancel or time limit)
    # signals every process, and torchrun passes the signal it got on to each rank as well. The same
    # signal again within this many seconds is that one request, not a second one.
    REPEAT_SECONDS = 5.0

    def __init__(self, announce: bool = True):
        self.requested, self.signum, self.announce = False, 0, announce  # announce: print what happens
        self.previous, self.at = [], 0.0
        from .distributed import world

        self.torchrun = world() > 1

    def __enter__(self) -> "GracefulStop":
        self.previous = [signal.signal(s, self._handle) for s in self.SIGNALS]
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in zip(self.SIGNALS, self.previous):
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested:
            if self.torchrun and signum == self.signum and now - self.at < self.REPEAT_SECONDS:
                return  # the scheduler's copy and torchrun's of one request
            raise StopNow(signum)
        self.requested, self.signum, self.at = True, signum, now
        if self.announce:
            print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint; send it again "
                  "to stop at once", flush=True)

    def adopt(self, signum: int) -> None:
        """Stop as if `signum` had come here: torchrun's ranks all stop when one got it."""
        if not self.requested:
            self.requested, self.signum = True, signum

    def exit_if_requested(self, message: str = "") -> None:
        """After a signal: print `message` (how to resume), then exit with status 128 + the signal."""
        if self.requested:
            if message:
                print(message, flush=True)
            sys.exit(128 + self.signum)


def save_checkpoint(out_dir, policy, tokenizer, trainer_state: dict, critic: Critic | None = None,
                    policy_weights: dict | None = None, critic_weights: dict | None = None) -> Path:
    """Write out_dir/checkpoint atomically (a temporary folder, on disk before it is renamed) and
    return its path.
    `policy_weights` / `critic_weights`: full state dicts to write instead of the modules' own
    (FSDP2 shards them; searchlite/distributed.py gathers them to rank 0)."""
    out_dir = Path(out_dir)
    final, tmp, old = out_dir / "checkpoint", out_dir / "checkpoint.tmp", out_dir / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp / "policy", state_dict=policy_weights)
    tokenizer.save_pretrained(tmp / "policy")
    if critic is not None:
        critic.save_pretrained(tmp / "critic", state_dict=critic_weights)
    torch.save(trainer_state, tmp / "trainer.pt")
    if final.exists():  # else `old` may be the only good checkpoint (a save that died mid-rename): keep it
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    replace_durably(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def lock_run(out):
    """Held for a train.py or stage-1 run (`with lock_run(out):`): the lock on its out_dir
    (`data.held_folder`, `run.lock`), as two runs in one folder would mix their checkpoints and
    logs; a ConfigError when another run holds it. A folder this run made is removed again if
    the run leaves nothing else in it (it stopped at start-up: a bad line, a server that does not
    answer)."""
    from .data import held_folder

    return held_folder(out, "run.lock", ConfigError(f"another run is writing to {out}; wait for it to finish, "
                                                    "or choose another --out_dir"))


def set_aside(out: Path, names) -> list[str]:
    """Rename the entries `names` of `out` that exist to their `.previous` form (checkpoint ->
    checkpoint.previous, config.json -> config.previous.json), replacing the whole older such set
    of `names`; a fresh run in a folder of an earlier one keeps all of it this way. Returns "a -> b"
    for each entry moved."""

    def previous(name: str) -> Path:
        stem, dot, ext = name.partition(".")
        return out / ("checkpoint.previous" if stem == "checkpoint" else f"{stem}.previous{dot}{ext}")

    names = list(names)
    present = [name for name in names if (out / name).exists()]
    if present:  # the older set goes whole: none of its entries may stay beside this one's (another run's page)
        for name in names:
            target = previous(name)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    for name in present:
        (out / name).replace(previous(name))
    return [f"{name} -> {previous(name).name}" for name in present]


def find_checkpoint(out_dir) -> Path | None:
    """The last complete checkpoint: `checkpoint`, or `checkpoint.old` if a save died mid-rename."""
    for name in ("checkpoint", "checkpoint.old"):
        path = Path(out_dir) / name
        if (path / "trainer.pt").exists():
            return path
    return None


def load_trainer_state(ckpt: Path, mmap: bool = False) -> dict:
    """The checkpoint's trainer.pt; `mmap`: tensors stay on disk until read (a glance at its config)."""
    return torch.load(Path(ckpt) / "trainer.pt", map_location="cpu", weights_only=False, mmap=mmap)
