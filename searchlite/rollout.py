"""The multi-turn rollout: Algorithm 1 of Search-R1 (arXiv 2503.09516 §3.2), batched.

    ro = rollout(sampler, retriever, tokenizer, protocol, questions, max_turns=4, topk=3)

For up to `max_turns` turns, every *active* trajectory generates in one batched call until
a stop string or EOS; then each is parsed: an answer ends it; a search is queued (all
queries of the turn go to the retriever in one call, which searches duplicates once) and its
passages are appended as an observation; anything else gets the invalid-action message.
After the budget, one last turn runs without search: an answer ends the trajectory, and so
does anything else (Search-R1's final `do_search=False` turn).

A trajectory ends at `max_len` tokens (prompt + response) or the model's context, whichever is
smaller: a turn, passage or message that runs past it is cut there (a cut answer is no answer),
so no row is longer than the model can read; a prompt that already fills it gets no turn. The
sampler is told each trajectory's tokens left (`budget`), so a turn near the end is sampled
only that far.
The ids kept are exactly the ids the sampler produced; observations and messages are
tokenised once and appended as ids. `loss_mask` is written while appending: 1 for sampled
tokens, 0 for prompt, passages, messages and padding (passages get 1 only when
`mask_retrieved=False`, Search-R1 Table 4's ablation). Left out on purpose: tool calls
other than search, and continuous batching across turns (the vLLM sampler does that inside
one turn).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    """A batch of finished trajectories; a question's `group` samples are adjacent rows."""

    input_ids: torch.Tensor  # (N, T) prompt + response ids, right-padded with pad_id
    attention_mask: torch.Tensor  # (N, T) 1 = real token
    loss_mask: torch.Tensor  # (N, T) 1 = in the loss: sampled by the policy (and passages if not mask_retrieved)
    prompt_len: torch.Tensor  # (N,) tokens of the prompt
    searches: torch.Tensor  # (N,) valid search calls made
    turns: torch.Tensor  # (N,) generate calls made
    answered: torch.Tensor  # (N,) bool, ended with an answer
    answers: list  # N parsed final answers (str) or None
    responses: list  # N decoded responses (everything after the prompt), for rewards and logs
    docs: list = field(default_factory=list)  # N lists of the Hits shown (at least a passage's start), in order

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx) -> "Rollout":
        """Rows `idx` (a list of ints) as a new Rollout."""
        t = torch.as_tensor(idx, dtype=torch.long)
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return Rollout(self.input_ids[t], self.attention_mask[t], self.loss_mask[t], self.prompt_len[t],
                       self.searches[t], self.turns[t], self.answered[t], pick(self.answers),
                       pick(self.responses), pick(self.docs) if self.docs else [])


def encode_text(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Prompt ids of `text` as one user turn, in the tokenizer's chat template when it has one (and
    `chat_template`), the assistant's turn opened; else the text alone, with no BOS added."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(tokenizer, protocol, question: str, chat_template: bool = True) -> list[int]:
    """The prompt ids: the protocol's template, in the tokenizer's chat template when it has one."""
    return encode_text(tokenizer, protocol.prompt(question), chat_template)


def rollout(sampler, retriever, tokenizer, protocol, questions: list[str], *, max_turns: int = 4,
            topk: int = 3, max_obs_tokens: int = 500, max_len: int = 4096, mask_retrieved: bool = True,
            chat_template: bool = True, greedy: bool = False, progress: bool = False) -> Rollout:
    n = len(questions)
    prompts = [encode_prompt(tokenizer, protocol, q, chat_template) for q in questions]
    resp: list[list[int]] = [[] for _ in range(n)]  # response ids of each trajectory
    mask: list[list[int]] = [[] for _ in range(n)]  # loss_mask of those ids
    searches, turns, answers = [0] * n, [0] * n, [None] * n
    docs: list[list] = [[] for _ in range(n)]
    message = tokenizer.encode(protocol.invalid_message, add_special_tokens=False)
    obs_mask = 0 if mask_retrieved else 1  # false: Search-R1's ablation trains on every response token
    # a trajectory ends at max_len, or where the sampler's model runs out of positions (vLLM's
    # max_model_len; HFSampler's model's max_position_embeddings), whichever comes first
    max_len = min(max_len, getattr(sampler, "max_model_len", None) or max_len)
    line_starts = [s[1:] for s in protocol.stop if s.startswith("\n") and len(s) > 1]  # see _cut_line_start
    room = lambda i: max_len - len(prompts[i]) - len(resp[i])  # noqa: E731  tokens left to trajectory i
    active = [i for i in range(n) if room(i) > 0]
    if len(active) < n:
        warnings.warn(f"{n - len(active)} of {n} prompts fill max_len or the model's context ({max_len} "
                      "tokens): they get no turn and no answer", stacklevel=2)
    bar = _bar(progress, max_turns + 1)
    for turn in range(max_turns + 1):
        if not active:
            break
        final = turn == max_turns  # the forced-answer turn: no search is executed
        outs = sampler.generate([prompts[i] + resp[i] for i in active], stop=protocol.stop, greedy=greedy,
                                budget=[room(i) for i in active])  # a turn near max_len stops there
        queries, searchers, still = [], [], []
        for i, out in zip(active, outs):
            out = out[:room(i)]  # (a sampler that does not stop at its budget is cut there)
            if line_starts:
                out = _cut_line_start(out, prompts[i] + resp[i], line_starts, tokenizer)
            resp[i] += out
            mask[i] += [1] * len(out)
            turns[i] += 1
            action = protocol.parse(tokenizer.decode(out, skip_special_tokens=False))
            if action.kind == "answer":
                answers[i] = action.content
            elif final or room(i) <= 0:
                pass  # out of budget: ends without an answer
            elif action.kind == "search":
                queries.append(action.content)
                searchers.append(i)
            else:
                cut = message[:room(i)]
                resp[i] += cut
                mask[i] += [obs_mask] * len(cut)  # what the engine appends, like a passage
                still.append(i)
        if queries:
            for i, hits in zip(searchers, retriever.search(queries, topk)):
                obs = protocol.observation_ids(tokenizer, hits, max_obs_tokens)[:room(i)]
                resp[i] += obs
                mask[i] += [obs_mask] * len(obs)
                searches[i] += 1
                docs[i].extend(protocol.shown(tokenizer, hits, obs))  # not passages cut away before they start
                still.append(i)
        active = sorted(i for i in still if room(i) > 0)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(active=len(active))
    if bar is not None:
        bar.close()
    return _collate(prompts, resp, mask, searches, turns, answers, docs, tokenizer)


def _cut_line_start(out: list[int], context: list[int], starts: list[str], tokenizer) -> list[int]:
    """`out` cut just past a stop string that begins with a newline ("\nQuestion:") when the turn
    opens a line with the rest of it: after a prompt, passages or a message that end in "\n", the
    samplers (which count a stop only inside the sampled text) miss it, and a search in the
    question the model made up would run. A turn that opens otherwise is returned as it is."""
    if not context or not tokenizer.decode(context[-1:], skip_special_tokens=False).endswith("\n"):
        return out
    text = tokenizer.decode(out, skip_special_tokens=False)
    for start in starts:
        if text.startswith(start):
            return next(out[:k] for k in range(1, len(out) + 1)
                        if tokenizer.decode(out[:k], skip_special_tokens=False).startswith(start))
    return out


def _bar(progress: bool, total: int):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="rollout turns", leave=False)


def _collate(prompts, resp, mask, searches, turns, answers, docs, tokenizer) -> Rollout:
    n = len(prompts)
    width = max((len(p) + len(r) for p, r in zip(prompts, resp)), default=0)  # no question: an empty batch
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((n, width), pad, dtype=torch.long)  # (N, T)
    attention_mask = torch.zeros((n, width), dtype=torch.long)  # (N, T)
    loss_mask = torch.zeros((n, width), dtype=torch.long)  # (N, T)
    for i in range(n):
        p, r = len(prompts[i]), len(resp[i])
        input_ids[i, : p + r] = torch.tensor(prompts[i] + resp[i], dtype=torch.long)
        attention_mask[i, : p + r] = 1
        loss_mask[i, p: p + r] = torch.tensor(mask[i], dtype=torch.long)
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        prompt_len=torch.tensor([len(p) for p in prompts]),
        searches=torch.tensor(searches),
        turns=torch.tensor(turns),
        answered=torch.tensor([a is not None for a in answers]),
        answers=answers,
        responses=[tokenizer.decode(r, skip_special_tokens=False) for r in resp],
        docs=docs,
    )
