"""Memory levers for large models: 8-bit AdamW, LoRA with the base model as the reference,
and a reference model kept on CPU. train.py calls them where the models are built:

    opt = make_adamw(policy.parameters(), "adamw8bit", lr=1e-6, weight_decay=0.0)   # bitsandbytes
    policy = add_lora(policy, rank=16, alpha=32.0, targets="all-linear")          # peft
    ref = LoRAReference(policy)              # the same module with its adapters disabled
    with on_device(ref, device, enabled=cfg.ref_offload):   # a CPU-kept reference, moved to score
        ref_logp = score_tokens(ref, ...)

The other two levers are in models.load_policy: `--dtype bfloat16` (bf16 compute over float32
master weights, `models.compute_in`; `--master_weights false` holds the weights in bf16) and
`--grad_checkpointing` (activations recomputed in the backward pass). What each saves, per
policy parameter: AdamW keeps two fp32 states (8 bytes) for an fp32 weight; AdamW8bit keeps them
blockwise-quantized in 8 bits (2 bytes; Dettmers et al. 2022, arXiv 2110.02861; tensors under
4,096 elements stay 32-bit). LoRA (Hu et al. 2021, arXiv 2106.09685) trains low-rank adapters
only: gradients and optimizer states for the adapters alone, and the reference is the frozen
base seen with adapters disabled, so no second copy of the weights is kept. `ref_offload` keeps
the reference's weights in CPU memory between scorings (under FSDP2, its shards: each decoder
layer's are copied to the GPU, and gathered, as the forward pass reaches it).

A LoRA run's checkpoint holds the adapter only (`checkpoint/policy/adapter_config.json` and
`adapter_model.safetensors`, plus the tokenizer); `--resume` loads the base and that adapter.
`models.load_policy` (and so evaluate.py) loads such a folder as base + adapter merged, and

    python -m searchlite.memory merge runs/X/checkpoint/policy --out runs/X/merged

writes the merged model as a plain Hugging Face folder (for vLLM or any transformers loader).
Left out on purpose: QLoRA (4-bit base weights), optimizer CPU offload, paged optimizers, LoRA
on the PPO critic (the critic trains in full).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import sys
from pathlib import Path

import torch

from .config import ArgumentParser, ConfigError, HelpFormatter, resolve_path

OPTIMIZERS = ("adamw", "adamw8bit")
NO_TARGETS = "--lora_targets is empty: name modules (e.g. q_proj,v_proj) or use all-linear"


def lora_target_names(targets: str) -> list[str]:
    """--lora_targets as module names: split at commas, blanks dropped."""
    return [t.strip() for t in targets.split(",") if t.strip()]


def is_adapter(path) -> bool:
    """Whether `path` (a folder, `toy/` paths too) holds a LoRA adapter: a LoRA run's checkpoint."""
    return (Path(resolve_path(str(path))) / "adapter_config.json").is_file()


def check_levers(cfg) -> None:
    """Raise ConfigError for lever settings that cannot work, before any model is loaded."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown --optimizer {cfg.optimizer!r} (valid: {', '.join(OPTIMIZERS)})")
    if cfg.optimizer == "adamw8bit" and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes "
                          "(pip install -e '.[bnb]')")
    if cfg.lora_rank < 0:
        raise ConfigError(f"--lora_rank must be >= 0 (0 = no LoRA), got {cfg.lora_rank}")
    if cfg.lora_rank and not lora_target_names(cfg.lora_targets):
        raise ConfigError(NO_TARGETS)
    if cfg.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError("--lora_rank needs peft: pip install peft (pip install -e '.[lora]')")
    if cfg.lora_rank and is_adapter(cfg.model):
        # a second adapter over a merged first one: its files would name the bare base and lose the first
        raise ConfigError(f"--model {cfg.model} is a LoRA adapter; to train a new adapter on it, merge it first "
                          f"(python -m searchlite.memory merge {cfg.model} --out DIR) and pass --model DIR")
    if cfg.lora_rank and cfg.ref_offload:
        raise ConfigError("--ref_offload with --lora_rank: the LoRA reference is the policy itself with its "
                          "adapters disabled, there is no separate reference to offload; drop one of the two")
    shared = [t for t in lora_target_names(cfg.lora_targets) if t.endswith(("embed_tokens", "lm_head"))]
    if cfg.lora_rank and cfg.sampler == "vllm" and shared and ties_embeddings(cfg.model):
        raise ConfigError(f"--lora_targets {cfg.lora_targets} with --sampler vllm: {cfg.model} ties its embeddings and "
                          f"LM head, which vLLM holds as one matrix, and a LoRA on {', '.join(shared)} makes them "
                          "two; leave those targets out, or use --sampler hf")
    if cfg.resume:
        from .models import find_checkpoint

        ckpt = find_checkpoint(cfg.out_dir)
        has_adapter = ckpt is not None and is_adapter(ckpt / "policy")
        if ckpt is not None and has_adapter != bool(cfg.lora_rank):
            what = "a LoRA adapter" if has_adapter else "full weights"
            raise ConfigError(f"--resume: {ckpt / 'policy'} holds {what} but --lora_rank is {cfg.lora_rank}; "
                              "resume with the run's own settings (its config.json)")


def ties_embeddings(model: str) -> bool:
    """Whether the model --model names (a folder, or the one in a run's or stage 1's folder) ties its
    input embeddings to its LM head (its config, with the architecture's default); False for what is
    not a local folder (a hub name, a GGUF file: the load says more)."""
    from .model_spec import ModelError, resolve_model

    try:
        kind, folder = resolve_model(model)
    except ModelError:
        return False
    if kind != "hf" or not (Path(folder) / "config.json").is_file():
        return False
    from transformers import AutoConfig

    try:
        return bool(getattr(AutoConfig.from_pretrained(folder), "tie_word_embeddings", False))
    except (OSError, ValueError, KeyError):  # a config transformers cannot read: the load names it
        return False


# ---------------------------------------------------------------------------- optimizer


def _bitsandbytes():
    # bitsandbytes logs a warning about optional CPU 4-bit kernels on import; 8-bit AdamW needs none
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise ImportError("--optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes") from None
    return bitsandbytes


@functools.cache
def _check_8bit_runs(device_type: str) -> None:
    """One AdamW8bit step on a 4,096-element tensor (the smallest that gets 8-bit states): older
    bitsandbytes releases have no CPU kernels, and this says so before a model is trained."""
    bnb = _bitsandbytes()
    p = torch.zeros(4096, device=device_type, requires_grad=True)  # (4096,)
    p.grad = torch.ones_like(p)
    try:
        bnb.optim.AdamW8bit([p], lr=1e-3).step()
        moved = bool((p.detach() != 0).all())
    except Exception as e:  # noqa: BLE001 - any failure here means: not on this device
        raise RuntimeError(f"bitsandbytes {bnb.__version__} cannot run AdamW8bit on {device_type}: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. Install a release with a "
                           f"{device_type} backend (pip install -U bitsandbytes) or use --optimizer adamw") from None
    if not moved:
        raise RuntimeError(f"bitsandbytes {bnb.__version__}: an AdamW8bit step on {device_type} left the weights "
                           "unchanged; use --optimizer adamw")


def make_adamw(params, kind: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch's AdamW, or bitsandbytes' AdamW8bit (same update, states stored in 8 bits)."""
    params = list(params)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if kind == "adamw8bit":
        _check_8bit_runs(params[0].device.type if params else "cpu")
        return _bitsandbytes().optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {kind!r} (valid: {', '.join(OPTIMIZERS)})")


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes held in the optimizer's per-parameter state tensors (a tensor shared between
    parameters, such as bitsandbytes' quantization map, counted once)."""
    seen = {v.data_ptr(): v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
            if torch.is_tensor(v)}
    return sum(seen.values())


# ---------------------------------------------------------------------------- LoRA


def _peft():
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # peft imports bitsandbytes when present
    try:
        import peft
    except ImportError:
        raise ImportError("--lora_rank needs peft: pip install peft") from None
    return peft


def add_lora(model, rank: int, alpha: float, targets: str, adapter: str | Path | None = None):
    """`model` wrapped in a peft LoRA adapter: a new one of `rank` on the `targets` modules
    (comma-separated names such as "q_proj,v_proj", or "all-linear"), or the saved `adapter`
    folder to continue training. Only adapter weights require gradients afterwards."""
    peft = _peft()
    if adapter is not None:
        saved = json.loads((Path(adapter) / "adapter_config.json").read_text(encoding="utf-8"))
        if saved.get("r") != rank:
            raise ConfigError(f"{adapter}: the saved adapter has rank {saved.get('r')}, --lora_rank is {rank}")
        return peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    names = targets if targets == "all-linear" else lora_target_names(targets)
    if not names:
        raise ConfigError(NO_TARGETS)
    if names != "all-linear":  # peft adapts what matches and drops a misspelt name without a word
        modules = [n for n, _ in model.named_modules()]
        missing = [t for t in names if not any(n == t or n.endswith("." + t) for n in modules)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise ConfigError(f"--lora_targets: no module of the model is named {', '.join(map(repr, missing))} "
                              f"(its linear layers: {', '.join(linear)})")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=names, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


class LoRAReference:
    """The reference policy of a LoRA run: the policy module itself, called with its adapters
    disabled, i.e. the frozen starting model, without a second copy of its weights. Forward calls
    and `generate` run under `disable_adapter()`; every other attribute is the policy's."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def generate(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.policy, name)


def adapter_base(adapter_dir: str | Path) -> str:
    """The base model a LoRA checkpoint was trained on, as its adapter_config.json names it ("" if none)."""
    saved = json.loads((Path(adapter_dir) / "adapter_config.json").read_text(encoding="utf-8"))
    return saved.get("base_model_name_or_path") or ""


def load_merged(adapter_dir: str | Path, dtype=torch.float32, base: str = ""):
    """A LoRA checkpoint folder as one plain model: its base (`base`, or the path the adapter was
    trained on) with the adapter merged into the weights."""
    from transformers import AutoModelForCausalLM

    adapter_dir = Path(adapter_dir)
    base = base or adapter_base(adapter_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(resolve_path(base), dtype=dtype)
    except OSError as e:
        raise OSError(f"{adapter_dir} is a LoRA adapter whose base model {base!r} cannot be loaded "
                      f"({str(e).splitlines()[0]}); pass the base with `python -m searchlite.memory merge "
                      f"{adapter_dir} --base PATH --out DIR`") from None
    targets = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8")).get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets  # "all-linear" leaves lm_head alone
    if getattr(model.config, "tie_word_embeddings", False) and any(
            t.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens") for t in targets):
        # the adapter trained one of the two tied matrices alone: untie them, or the merge would change both
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.config.tie_word_embeddings = False
    merged = _peft().PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return merged.requires_grad_(True)  # peft froze the base for inference; a plain model trains in full


# ---------------------------------------------------------------------------- reference offload


@contextlib.contextmanager
def on_device(model, device, enabled: bool = True):
    """Inside the block `model` sits on `device`; after it, back in CPU memory. A no-op when not
    `enabled`, when `model` is None (the model then stays wherever it is), and for a model sharded
    by FSDP2: `distributed.wrap_model(..., offload=True)` keeps its shards in CPU memory and each
    forward pass copies a unit's shards to the device, so no rank holds a whole copy to score
    (`distributed.gathered`, for generation, gathers it whole)."""
    from .distributed import is_sharded

    if not enabled or model is None or is_sharded(model):
        yield model
        return
    model.to(device)
    try:
        yield model
    finally:
        model.to("cpu")


def main(argv=None) -> None:
    about = "Merge a LoRA checkpoint into its base model and save a plain Hugging Face folder (weights + tokenizer)."
    ap = ArgumentParser(prog="python -m searchlite.memory", description=about, formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="base + adapter -> one model folder", description=about,
                       formatter_class=HelpFormatter)
    m.add_argument("adapter", help="a LoRA run's checkpoint/policy folder (adapter_config.json)")
    m.add_argument("--out", required=True, help="folder to write the merged model to")
    m.add_argument("--base", default="", help="base model folder or hub name; default: the one it was trained on")
    m.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the merged weights (default bfloat16)")
    args = ap.parse_args(argv)
    if not is_adapter(args.adapter):
        what = "holds full weights, not a LoRA adapter: use it as it is" if (
            Path(args.adapter) / "config.json").is_file() else "is not a folder with adapter_config.json"
        sys.exit(f"error: {args.adapter} {what}")
    from transformers import AutoTokenizer

    from .models import DTYPES

    try:
        model = load_merged(args.adapter, DTYPES[args.dtype], args.base)
    except OSError as e:  # the base model cannot be loaded: the message says how to name it
        sys.exit(f"error: {e}")
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.adapter).save_pretrained(args.out)
    print(f"merged {args.adapter} into {model.config.name_or_path or args.base} -> {args.out}")


if __name__ == "__main__":
    main()
