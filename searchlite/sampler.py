"""Samplers: turn a batch of token-id prompts into sampled continuations.

One interface, so the rollout does not care who generates:

    sampler.generate(prompts: list[list[int]], stop: tuple[str, ...], budget=None) -> list[list[int]]

Each returned list holds exactly the ids the model sampled for that prompt, up to and
including the first stop string or EOS (nothing is decoded and re-encoded). `budget`, one
int per prompt, caps its new tokens below `max_new_tokens`: the rollout passes the tokens each
trajectory has left to max_len, so a turn near the end is not generated in full and then cut.
`HFSampler` runs transformers' `generate` on the training policy itself (left padding,
temperature / top-p, stop strings); `VLLMSampler` (searchlite.vllm_sampler) runs vLLM
in-process. The trainer calls `release()` after a rollout, `push_weights(policy)` after the
update and `close()` at the end.

Seeding: sampling call number `n` of a sampler seeded with `s` runs under
`torch.manual_seed(call_seed(s, n))` inside `fork_rng`, so a rollout is reproducible, does not
disturb the training RNG, and greedy calls (evaluation) shift no later seed. Seeds far apart
(`s * 1_000_003 + n`) keep runs of neighbouring --seed values apart: with `s + n`, seed 1's
call n drew seed 0's call n + 1's noise.
Left out on purpose: beam search, speculative decoding, streaming.
"""

from __future__ import annotations

import torch

from .models import autocast


def token_caps(max_new: int, budget: list[int] | None, n: int) -> list[int]:
    """The new tokens each of `n` prompts may take: `max_new`, or its `budget` where that is less."""
    return [max_new] * n if budget is None else [min(max_new, b) for b in budget]


def call_seed(seed: int, call: int) -> int:
    """The torch seed of sampling call `call` of a sampler seeded `seed`; seed 0's call n is n.

    >>> call_seed(0, 5), call_seed(1, 0), call_seed(1, 5)
    (5, 1000003, 1000008)
    """
    return (seed * 1_000_003 + call) % 2**63


class SeedStream:
    """A sampler's stream of call seeds (`call_seed`), its count of sampling calls the state a
    checkpoint keeps. Each sampler sets `seed` and `calls` (0) in its __init__."""

    seed: int
    calls: int

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]

    def next_seed(self, draws: bool = True) -> int:
        """The seed of this call; `draws`: the call samples, so the next one gets the next seed
        (greedy calls, evaluation's, use no randomness: they shift no later seed)."""
        seed = call_seed(self.seed, self.calls)
        self.calls += draws
        return seed


class PromptTooLong(RuntimeError):
    """A prompt that leaves the model no position to generate in. A rollout ends a trajectory
    at the model's context before this, so it is a first prompt (or a direct / rag one) that is
    too long; a RuntimeError, so evaluate.py keeps the questions it finished."""

    def __init__(self, prompt_len: int, context: int):
        super().__init__(f"a prompt of {prompt_len} tokens leaves no room in the model's context of {context} "
                         "positions; shorten the prompt (its template, or its passages: --topk, --max_obs_tokens) "
                         "or use a model with a longer context")


class _StopRecorder:
    """Stopping criterion that ends a row at EOS or a stop string and records where.

    transformers pads a finished row with pad ids; `done_at[i]` is the number of tokens row i
    really sampled, which is how its continuation is cut without guessing from pad ids.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], strings, eos_ids: list[int], batch: int, prompt_len: int):
        self.strings = strings  # transformers' StopStringCriteria for `stop` (None: no stop string)
        self.tokenizer, self.stop = tokenizer, stop
        self.eos = torch.tensor(eos_ids)
        self.prompt_len = prompt_len
        self.done_at = [None] * batch

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        done = torch.isin(input_ids[:, -1], self.eos.to(input_ids.device))
        if self.strings is not None:
            hit = self.strings(input_ids, scores)  # (B,) it reads the prompt too: "\nQuestion:" may begin there
            for i in torch.nonzero(hit).flatten().tolist():  # count a stop only inside the sampled text, as vLLM
                hit[i] = any(s in self.tokenizer.decode(input_ids[i, self.prompt_len:]) for s in self.stop)
            done |= hit
        n = input_ids.shape[1] - self.prompt_len
        for i in torch.nonzero(done).flatten().tolist():
            if self.done_at[i] is None:
                self.done_at[i] = n
        return done


def _plain_generation_config(config):
    """A GenerationConfig with only `config`'s special token ids and the ids it never samples
    (`suppress_tokens`: a vocabulary padded past its tokenizer): no penalty, filter or length rule."""
    from transformers import GenerationConfig

    keep = ("bos_token_id", "eos_token_id", "pad_token_id", "suppress_tokens")
    return GenerationConfig(**{k: getattr(config, k, None) for k in keep})


def _transformers_model(model):
    """The transformers model under the wrappers that generate() passes through (a LoRA run's
    reference, `memory.LoRAReference`; peft's PeftModel, which copies its base's generation config
    in generate): its generation_config is the one generate() reads."""
    if "policy" in vars(model):  # LoRAReference
        model = model.policy
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class HFSampler(SeedStream):
    """Batched sampling with transformers `generate` on the policy module itself."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int = 500, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, batch_size: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.seed, self.calls, self.batch_size = seed, 0, batch_size
        # EOS is the generation config's and the tokenizer's, as vLLM stops on both: a checkpoint whose
        # generation_config.json names another EOS than its tokenizer's (another --tokenizer) ends turns alike
        eos = model.generation_config.eos_token_id
        self.eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.eos_ids:
            self.eos_ids.append(tokenizer.eos_token_id)
        self.stop_criteria = {}  # stop strings -> StopStringCriteria: building one reads the whole vocabulary
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        # the positions the model knows, vLLM's max_model_len: a row's prompt + new tokens stop there
        self.max_model_len = getattr(_transformers_model(model).config, "max_position_embeddings", None)

    def release(self) -> None:
        """Nothing to free: HFSampler keeps no memory between calls (VLLMSampler frees its KV cache)."""

    def push_weights(self, model) -> None:
        """Nothing to copy: HFSampler generates with the training module itself."""
        self.model = model

    def close(self) -> None:
        """Nothing to shut down (VLLMSampler stops its engine)."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], stop: tuple[str, ...] = (), max_new_tokens: int | None = None,
                 greedy: bool = False, budget: list[int] | None = None) -> list[list[int]]:
        max_new = max_new_tokens or self.max_new_tokens
        caps = token_caps(max_new, budget, len(prompts))
        step = self.batch_size or len(prompts) or 1
        device = next(self.model.parameters()).device
        on_gpu = device.type == "cuda"
        gpus = [device.index if device.index is not None else torch.cuda.current_device()] if on_gpu else []
        with torch.random.fork_rng(devices=gpus):  # manual_seed reseeds the GPU's generator too: keep it
            torch.manual_seed(self.next_seed(draws=not greedy))
            out = []
            for s in range(0, len(prompts), step):
                out += self._generate(prompts[s:s + step], stop, caps[s:s + step], greedy)
        return out

    def _generate(self, prompts, stop, caps, greedy) -> list[list[int]]:
        """One generate() call per room (the new tokens a row may take: its cap, or fewer near the
        model's context): generate() runs every row of a batch as far as its longest room, which
        would take a row past its last position and break a model with learned positions (GPT-2,
        OPT). Rows with the largest room go first: with no row near its end, it is one call."""
        if not prompts:
            return []
        rooms = caps
        if self.max_model_len is not None:  # positions left in the model's context
            left = [self.max_model_len - len(p) for p in prompts]
            if min(left) <= 0:
                raise PromptTooLong(max(len(p) for p in prompts), self.max_model_len)
            rooms = [min(cap, n) for cap, n in zip(caps, left)]
        if min(rooms) <= 0:
            raise ValueError(f"a budget of {min(rooms)} new tokens: each prompt needs at least 1")
        out = [None] * len(prompts)
        for room in sorted(set(rooms), reverse=True):
            rows = [i for i, r in enumerate(rooms) if r == room]
            for i, new in zip(rows, self._generate_rows([prompts[i] for i in rows], stop, room, greedy)):
                out[i] = new
        return out

    def _generate_rows(self, prompts, stop, room, greedy) -> list[list[int]]:
        """At most `room` new tokens for each of `prompts`, in one generate() call."""
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, P) left-padded
        mask = torch.zeros_like(ids)  # (B, P) 1 = real prompt token
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        if stop and tuple(stop) not in self.stop_criteria:
            from transformers.generation.stopping_criteria import StopStringCriteria

            self.stop_criteria[tuple(stop)] = StopStringCriteria(self.tokenizer, list(stop))
        recorder = _StopRecorder(self.tokenizer, stop, self.stop_criteria.get(tuple(stop)), self.eos_ids, len(prompts),
                                 width)
        hf = _transformers_model(self.model)
        was_training, saved = self.model.training, hf.generation_config
        self.model.eval()
        # generate() fills every setting not passed here from the checkpoint's generation config:
        # Qwen2.5-Instruct's repetition_penalty 1.05 (or a no_repeat_ngram_size, bad_words_ids, ...)
        # would sample from another distribution than the policy whose log-probs are trained on.
        hf.generation_config = _plain_generation_config(saved)
        try:
            with autocast(self.model):  # float32 master weights: one bf16 copy for the whole call (models.compute_in)
                seqs = self.model.generate(
                    input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=room,
                    do_sample=not greedy, temperature=self.temperature if not greedy else None,
                    top_p=self.top_p if not greedy else None, top_k=0 if not greedy else None,
                    stopping_criteria=[recorder], pad_token_id=self.pad_id, eos_token_id=self.eos_ids,
                    synced_gpus=False,  # under FSDP2 transformers would sync every token across ranks: the
                )  # (B, P + new)        weights are gathered (distributed.gathered), each rank generates alone
        finally:
            self.model.train(was_training)
            hf.generation_config = saved
        new = seqs[:, width:].cpu()  # (B, new)
        return [new[i, : recorder.done_at[i] or new.shape[1]].tolist() for i in range(len(prompts))]
