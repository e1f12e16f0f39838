"""The rollout loop, driven by a scripted sampler and a fake retriever through every branch."""

import warnings

import pytest
import torch
from conftest import make_byte_tokenizer, make_tiny_llama, with_bos, with_special_tags

from searchlite.protocol import get_protocol
from searchlite.retrieval import Hit
from searchlite.rollout import encode_prompt, rollout
from searchlite.sampler import HFSampler

P = get_protocol("search_r1")


class ScriptedSampler:
    """Replies from a per-question script; records every call's contexts."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tok, self.scripts, self.calls, self.asked = tokenizer, scripts, [], []

    def generate(self, prompts, stop=(), greedy=False, budget=None):
        self.calls.append(len(prompts))
        self.asked.append((stop, greedy))
        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            q = next(q for q in self.scripts if f"Question: {q}" in text)
            after = text.split(f"Question: {q}", 1)[1]  # the template itself names the tags
            turn = after.count("<information>") + after.count("My previous action is invalid")
            reply = self.scripts[q][turn]
            out.append(self.tok.encode(reply, add_special_tokens=False))
        return out


class FakeRetriever:
    def __init__(self):
        self.calls, self.ks = [], []

    def search(self, queries, k):
        self.calls.append(list(queries))
        self.ks.append(k)
        return [[Hit(id=f"{q}-{j}", title=f"T{j}", text=f"about {q} {j}", score=1.0 / (j + 1)) for j in range(k)]
                for q in queries]


SCRIPTS = {
    "q-answer": ["<think> easy </think> <answer> Paris </answer>"],
    "q-search": ["<think> need </think> <search> france capital </search>", "<answer> Paris </answer>"],
    "q-invalid": ["I am rambling", "<answer> Rome </answer>"],
    "q-budget": ["<search> a </search>", "<search> b </search>", "<search> c </search>"],
    "q-dup": ["<search> france capital </search>", "<answer> x </answer>"],
}


def _run(tok, questions, **kw):
    sampler, retriever = ScriptedSampler(tok, SCRIPTS), FakeRetriever()
    ro = rollout(sampler, retriever, tok, P, questions, topk=2, **kw)
    return ro, sampler, retriever


def test_a_tokenizer_without_a_pad_token_pads_the_batch_with_its_eos(byte_tokenizer):
    """A tokenizer passed as it is (load_tokenizer would give it one) may name no pad token: the
    batch is padded with EOS, as HFSampler pads, and the padding stays out of both masks."""
    padded, _, _ = _run(byte_tokenizer, ["q-answer", "q-search"], max_turns=2)
    tok = make_byte_tokenizer()
    tok.pad_token = None
    ro, _, _ = _run(tok, ["q-answer", "q-search"], max_turns=2)
    pad = ~ro.attention_mask.bool()  # (N, T)
    assert pad.any() and (ro.input_ids[pad] == tok.eos_token_id).all()
    assert ro.input_ids[~pad].equal(padded.input_ids[~pad]) and ro.attention_mask.equal(padded.attention_mask)
    assert ro.loss_mask.equal(padded.loss_mask) and ro.responses == padded.responses


def test_branches(byte_tokenizer):
    tok = byte_tokenizer
    ro, sampler, retriever = _run(tok, list(SCRIPTS), max_turns=2)
    assert ro.answers == ["Paris", "Paris", "Rome", None, "x"]
    assert ro.searches.tolist() == [0, 1, 0, 2, 1]
    assert ro.turns.tolist() == [1, 2, 2, 3, 2]
    assert ro.answered.tolist() == [True, True, True, False, True]
    # batched: one generate call per turn over the active trajectories only
    assert sampler.calls == [5, 4, 1]
    # each turn stops at the protocol's stop strings, sampling unless asked for greedy (evaluation)
    assert P.stop == ("</search>", "</answer>") and sampler.asked == [(P.stop, False)] * 3
    assert _run(tok, ["q-answer"], greedy=True)[1].asked == [(P.stop, True)]
    # one retriever call per turn; duplicates are passed on (the retriever dedups)
    assert retriever.calls == [["france capital", "a", "france capital"], ["b"]]
    # the forced final turn executes no search: "c" was never retrieved
    assert "c" not in sum(retriever.calls, [])
    assert "<information>" in ro.responses[1] and "Doc 2(Title: T1) about france capital 1" in ro.responses[1]
    assert "My previous action is invalid" in ro.responses[2]


def test_mask_covers_exactly_the_sampled_tokens(byte_tokenizer):
    tok = byte_tokenizer
    ro, _, _ = _run(tok, list(SCRIPTS), max_turns=2)
    for i, q in enumerate(SCRIPTS):
        n = int(ro.attention_mask[i].sum())
        p = int(ro.prompt_len[i])
        assert ro.input_ids[i, :p].tolist() == encode_prompt(tok, P, q)
        # the masked-in ids, concatenated, are exactly the sampled replies, in order
        sampled = ro.input_ids[i][ro.loss_mask[i].bool()].tolist()
        expect = sum((tok.encode(r, add_special_tokens=False) for r in SCRIPTS[q][: int(ro.turns[i])]), [])
        assert sampled == expect
        # and everything else in the response is an observation or the invalid-action message
        other = tok.decode(ro.input_ids[i, p:n][ro.loss_mask[i, p:n] == 0].tolist())
        assert other.replace(P.invalid_message, "").replace("\n", "") == "".join(
            f"<information>{P.format_passages(h)}</information>".replace("\n", "")
            for h in _chunks(ro.docs[i], 2))
        assert ro.loss_mask[i, :p].sum() == 0 and ro.loss_mask[i, n:].sum() == 0
        assert (ro.input_ids[i, n:] == tok.pad_token_id).all()


def _chunks(xs, k):
    return [xs[j:j + k] for j in range(0, len(xs), k)]


def test_unmasked_ablation_marks_passages_and_the_invalid_action_message(byte_tokenizer):
    """Search-R1's state_masking = false: every response token is trained on, the message an
    invalid action brings back included (it goes in with the observations there)."""
    ro, _, _ = _run(byte_tokenizer, ["q-search", "q-invalid"], max_turns=2, mask_retrieved=False)
    assert "<information>" in ro.responses[0] and "My previous action is invalid" in ro.responses[1]
    for i in range(2):
        p, n = int(ro.prompt_len[i]), int(ro.attention_mask[i].sum())
        assert (ro.loss_mask[i, p:n] == 1).all()  # weighed as a sampled token, not more


def test_max_turns_zero_and_max_len(byte_tokenizer):
    ro, sampler, retriever = _run(byte_tokenizer, ["q-budget", "q-answer"], max_turns=0)
    assert ro.answers == [None, "Paris"] and ro.searches.tolist() == [0, 0] and retriever.calls == []
    with pytest.warns(UserWarning, match="2 of 2 prompts fill max_len"):
        short, sampler, _ = _run(byte_tokenizer, ["q-budget", "q-answer"], max_turns=3, max_len=10)
    assert short.turns.tolist() == [0, 0] and sampler.calls == []  # the prompt alone exceeds max_len: no turn
    assert short.answers == [None, None] and not short.loss_mask.any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a prompt with room for one token gets its turn, unwarned
        ro, _, _ = _run(byte_tokenizer, ["q-answer"], max_len=len(encode_prompt(byte_tokenizer, P, "q-answer")) + 1)
    assert ro.turns.tolist() == [1] and ro.answers == [None]
    longer = len(encode_prompt(byte_tokenizer, P, "q-invalid"))  # a character longer: it fills the same max_len
    with pytest.warns(UserWarning, match=r"^1 of 2 prompts fill max_len or the model's context"):
        ro, _, _ = _run(byte_tokenizer, ["q-invalid", "q-answer"], max_len=longer)
    assert ro.turns.tolist() == [0, 1]  # the other gets its turn


def test_max_len_cuts_the_turn_or_passage_that_reaches_it(byte_tokenizer):
    """No trajectory is longer than max_len: a turn past it is cut (a cut answer is no answer),
    and so is the passage after a search; the search still counts, as it was made."""
    tok = byte_tokenizer
    prompt = len(encode_prompt(tok, P, "q-answer"))
    answer = len(tok.encode(SCRIPTS["q-answer"][0], add_special_tokens=False))
    ro, _, _ = _run(tok, ["q-answer"], max_len=prompt + answer - 3)
    assert ro.answers == [None] and ro.turns.tolist() == [1]
    assert ro.input_ids.shape[1] == prompt + answer - 3 and ro.loss_mask[0, prompt:].all()
    full, _, _ = _run(tok, ["q-search"])
    first = len(tok.encode(SCRIPTS["q-search"][0], add_special_tokens=False))
    cap = len(encode_prompt(tok, P, "q-search")) + first + 10  # the passage gets 10 of its tokens
    ro, _, retriever = _run(tok, ["q-search"], max_len=cap)
    assert ro.input_ids.shape[1] == cap and ro.searches.tolist() == [1] and ro.turns.tolist() == [1]
    assert torch.equal(ro.input_ids[0], full.input_ids[0, :cap]) and not ro.loss_mask[0, -10:].any()
    assert ro.answers == [None] and len(retriever.calls) == 1


def test_max_len_edges_the_invalid_message_a_search_and_a_full_prompt(byte_tokenizer):
    """At max_len exactly: the invalid-action message is cut there too (uncut, a row outgrew
    max_len); a search whose turn ends there is not run (it counted in R_group's retrievals); a
    prompt of max_len tokens gets no turn (a turn of budget 0 made HFSampler raise)."""
    tok = byte_tokenizer
    message = tok.encode(P.invalid_message, add_special_tokens=False)
    prompt = len(encode_prompt(tok, P, "q-invalid"))
    reply = len(tok.encode(SCRIPTS["q-invalid"][0], add_special_tokens=False))
    ro, _, _ = _run(tok, ["q-invalid"], max_len=prompt + reply + 5)
    assert ro.input_ids.shape[1] == prompt + reply + 5 and ro.input_ids[0, -5:].tolist() == message[:5]
    assert not ro.loss_mask[0, -5:].any() and ro.turns.tolist() == [1]
    prompt = len(encode_prompt(tok, P, "q-search"))
    turn = len(tok.encode(SCRIPTS["q-search"][0], add_special_tokens=False))
    ro, _, retriever = _run(tok, ["q-search"], max_len=prompt + turn)
    assert ro.searches.tolist() == [0] and retriever.calls == [] and ro.turns.tolist() == [1]
    with pytest.warns(UserWarning, match="1 of 1 prompts fill max_len"):
        ro, sampler, _ = _run(tok, ["q-search"], max_len=prompt)
    assert ro.turns.tolist() == [0] and sampler.calls == []


def test_passages_take_exactly_max_obs_tokens(byte_tokenizer):
    tok = byte_tokenizer
    full, _, _ = _run(tok, ["q-search"], max_turns=1)
    shown = int((full.loss_mask[0] == 0).sum() - full.prompt_len[0] - (full.attention_mask[0] == 0).sum())
    for cap in (7, 30):
        assert cap < shown
        ro, _, _ = _run(tok, ["q-search"], max_turns=1, max_obs_tokens=cap)
        p, n = int(ro.prompt_len[0]), int(ro.attention_mask[0].sum())
        assert int((ro.loss_mask[0, p:n] == 0).sum()) == cap


def test_the_chat_template_wraps_the_prompt(byte_tokenizer):
    """No test tokenizer had a chat template: the branch every instruct model takes was untested."""
    import copy

    tok = copy.deepcopy(byte_tokenizer)
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    want = tok.encode(f"<|user|>{P.prompt('q-answer')}\n<|assistant|>\n", add_special_tokens=False)
    assert encode_prompt(tok, P, "q-answer") == want
    assert encode_prompt(tok, P, "q-answer", chat_template=False) == tok.encode(P.prompt("q-answer"),
                                                                              add_special_tokens=False)


def test_tags_registered_as_special_tokens_still_parse(byte_tokenizer):
    """A tokenizer whose tags are special tokens: decoded without them, every action was invalid."""
    tok = with_special_tags(byte_tokenizer)
    assert tok.decode(tok.encode("<answer> x </answer>", add_special_tokens=False), skip_special_tokens=True) == " x "
    ro, _, retriever = _run(tok, ["q-answer", "q-search"], max_turns=2)
    assert ro.answers == ["Paris", "Paris"] and ro.searches.tolist() == [0, 1] and retriever.calls == [["france capital"]]
    # the responses that rewards and format checks read keep the tags, the passages' too
    assert ro.responses[0] == SCRIPTS["q-answer"][0]
    assert ro.responses[1].startswith(SCRIPTS["q-search"][0] + "\n<information>Doc 1(Title: T0) about france capital 0\n")
    assert ro.responses[1].endswith("</information>\n" + SCRIPTS["q-search"][1])


def test_a_tokenizer_that_adds_a_bos_puts_none_inside_a_response(byte_tokenizer):
    """Llama's tokenizers put <s> before whatever they encode unless told not to: the passages and
    the invalid-action message go in without one, so a response holds the ids it would without it;
    a prompt without a chat template is its text alone too."""
    tok = with_bos(byte_tokenizer)
    questions = ["q-search", "q-invalid"]
    ro, _, _ = _run(tok, questions, max_turns=2)
    plain, _, _ = _run(byte_tokenizer, questions, max_turns=2)
    assert "<information>" in ro.responses[0] and "My previous action is invalid" in ro.responses[1]
    for i in range(2):
        p, n = int(ro.prompt_len[i]), int(ro.attention_mask[i].sum())
        q, m = int(plain.prompt_len[i]), int(plain.attention_mask[i].sum())
        assert ro.input_ids[i, :n].tolist() == plain.input_ids[i, :m].tolist() and p == q
        assert tok.bos_token_id not in ro.input_ids[i, :n].tolist()


def test_a_turn_opening_question_mid_line_is_not_cut(byte_tokenizer):
    """Only a turn that opens a line is cut at "Question:": after a prompt that ends mid-line, it is
    the model's own text."""
    import dataclasses

    tok = byte_tokenizer
    protocol = dataclasses.replace(P, stop=P.stop + ("\nQuestion:",), template="Answer it. Question: {question} ->")
    scripts = {"q-inline": ["Question: x <answer> y </answer>"], "q-bare": ["Question:"]}
    ro = rollout(ScriptedSampler(tok, scripts), FakeRetriever(), tok, protocol, ["q-inline"], topk=1, max_turns=1)
    assert ro.answers == ["y"]
    newline = dataclasses.replace(protocol, template="Answer it. Question: {question}\n")  # a line opens: cut
    ro = rollout(ScriptedSampler(tok, scripts), FakeRetriever(), tok, newline, ["q-inline", "q-bare"], topk=1,
                 max_turns=0)  # (a turn that is the stop string alone ends where it does)
    assert ro.answers == [None, None] and ro.responses == ["Question:", "Question:"]


def test_docs_hold_the_passages_the_model_was_shown(byte_tokenizer):
    """A passage cut away before its start (max_obs_tokens, max_len) was never read: it is not in
    docs, which R1-Searcher++'s rewrites, the evaluation records and bench/r1pp_table.py read."""
    tok = byte_tokenizer
    full, _, _ = _run(tok, ["q-search"])
    assert [h.id for h in full.docs[0]] == ["france capital-0", "france capital-1"]
    first = len(P.observation_ids(tok, full.docs[0][:1], 10_000))
    ro, _, _ = _run(tok, ["q-search"], max_obs_tokens=first)  # room for the first passage only
    assert "Doc 2(" not in ro.responses[0] and [h.id for h in ro.docs[0]] == ["france capital-0"]
    cap = len(encode_prompt(tok, P, "q-search")) + len(tok.encode(SCRIPTS["q-search"][0], add_special_tokens=False))
    ro, _, _ = _run(tok, ["q-search"], max_len=cap + 5)  # "\n<information>": no passage starts
    assert ro.searches.tolist() == [1] and ro.docs == [[]]


def test_no_question_is_an_empty_batch(byte_tokenizer):
    ro, sampler, _ = _run(byte_tokenizer, [])
    assert ro.input_ids.shape == (0, 0) and len(ro) == 0 and sampler.calls == []


def test_observation_truncated_keeps_closing_tag(byte_tokenizer):
    hits = [Hit(id="1", title="T", text="x" * 400, score=1.0)]
    ids = P.observation_ids(byte_tokenizer, hits, max_tokens=50)
    assert len(ids) == 50
    assert byte_tokenizer.decode(ids).endswith("</information>\n")


def test_seeded_rollout_is_reproducible(byte_tokenizer):
    tok = byte_tokenizer
    runs = []
    for _ in range(2):
        model = make_tiny_llama(tok, seed=3)
        sampler = HFSampler(model, tok, max_new_tokens=12, seed=7)
        ro = rollout(sampler, FakeRetriever(), tok, P, ["who?", "what is it?"] * 2, max_turns=2, topk=1)
        runs.append(ro)
    a, b = runs
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert a.turns.tolist() == [3, 3, 3, 3]  # a random model never closes a tag: invalid every turn
    # a different sampler seed samples different tokens
    c = rollout(HFSampler(make_tiny_llama(tok, seed=3), tok, max_new_tokens=12, seed=8), FakeRetriever(), tok,
                P, ["who?", "what is it?"] * 2, max_turns=2, topk=1)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_neighbouring_seeds_do_not_share_sampling_calls(byte_tokenizer):
    """Call n of a sampler seeded s drew under torch seed s + n, so --seed 1's first rollout took
    --seed 0's second one's noise (and every later one, one call behind)."""
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=3)
    prompts = [tok.encode("a", add_special_tokens=False)] * 4
    zero, one = HFSampler(model, tok, max_new_tokens=12, seed=0), HFSampler(model, tok, max_new_tokens=12, seed=1)
    zero.generate(prompts)  # seed 0's first call
    assert zero.generate(prompts) != one.generate(prompts)  # seed 0's second call, seed 1's first
    again = HFSampler(model, tok, max_new_tokens=12, seed=1)
    assert again.generate(prompts) == HFSampler(model, tok, max_new_tokens=12, seed=1).generate(prompts)


def test_hf_sampler_ids_are_what_the_model_scores(byte_tokenizer):
    """Greedy ids, re-scored by a right-padded forward pass, are each the argmax: positions agree."""
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    sampler = HFSampler(model, tok, max_new_tokens=8)
    prompts = [tok.encode("a", add_special_tokens=False), tok.encode("a much longer prompt", add_special_tokens=False)]
    outs = sampler.generate(prompts, greedy=True)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o])
        logits = model(ids).logits[0]  # (T, V)
        assert logits[len(p) - 1: -1].argmax(-1).tolist() == o


def test_hf_sampler_ignores_the_checkpoint_sampling_settings(byte_tokenizer):
    """A checkpoint's generation config (Qwen2.5-Instruct ships repetition_penalty 1.05) must not
    change what is sampled: the rollout must come from the policy whose log-probs are trained on."""
    tok = byte_tokenizer
    prompts = [tok.encode("a", add_special_tokens=False), tok.encode("a much longer prompt", add_special_tokens=False)]
    model = make_tiny_llama(tok, seed=5)
    plain_greedy = HFSampler(model, tok, max_new_tokens=16).generate(prompts, greedy=True)
    plain_sampled = HFSampler(model, tok, max_new_tokens=16, seed=3).generate(prompts)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.top_k = 1
    saved = model.generation_config.to_dict()
    assert HFSampler(model, tok, max_new_tokens=16).generate(prompts, greedy=True) == plain_greedy
    assert HFSampler(model, tok, max_new_tokens=16, seed=3).generate(prompts) == plain_sampled
    assert model.generation_config.to_dict() == saved  # the checkpoint's own settings are kept for saving
    from searchlite.memory import LoRAReference, add_lora

    lora = add_lora(model, 4, 8.0, "all-linear")  # new adapters start at zero: the same function
    for wrapped in (lora, LoRAReference(lora)):  # a LoRA policy, and a LoRA run's reference (the rewriter)
        assert HFSampler(wrapped, tok, max_new_tokens=16).generate(prompts, greedy=True) == plain_greedy
    assert model.generation_config.to_dict() == saved


def test_hf_sampler_stops_only_on_a_stop_string_in_the_sampled_text(byte_tokenizer):
    """transformers' stop-string check reads the prompt too: a first token that completes a stop
    string begun in the prompt ("...assistant\\n" + "Question:") must not end the turn (vLLM's rule)."""
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    prompt = tok.encode("a much longer prompt", add_special_tokens=False)
    free = HFSampler(model, tok, max_new_tokens=12).generate([prompt], greedy=True)[0]
    stop = tok.decode(prompt[-2:]) + tok.decode(free[:1])  # "pt" + "t": straddles the prompt's end
    assert stop not in tok.decode(free)  # so a stop inside the sampled text cannot explain a cut
    assert HFSampler(model, tok, max_new_tokens=12).generate([prompt], stop=(stop,), greedy=True)[0] == free


def test_hf_sampler_stops_each_row_at_the_model_context(byte_tokenizer):
    """Rows with 3 and 20 positions left of the model's max_position_embeddings get 3 and 12
    tokens (max_new_tokens 12), the same ones as alone; a rollout with a larger max_len ends the
    first row's trajectory there instead of sampling past the context."""
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    model.config.max_position_embeddings = 100
    sampler = HFSampler(model, tok, max_new_tokens=12)
    prompts = [[7] * 97, [9] * 80]
    outs = sampler.generate(prompts, greedy=True)
    assert [len(o) for o in outs] == [3, 12]  # a random model never stops early
    assert outs[0] == sampler.generate(prompts[:1], greedy=True)[0]
    with pytest.raises(RuntimeError, match="context of 100 positions; shorten the prompt"):
        sampler.generate([[7] * 100])
    assert [len(o) for o in sampler.generate([[7] * 99], greedy=True)] == [1]  # its last position: one token
    model.config.max_position_embeddings = len(encode_prompt(tok, P, "who?")) + 20
    ro = rollout(HFSampler(model, tok, max_new_tokens=12), FakeRetriever(), tok, P, ["who?"], max_turns=3, topk=1, max_len=4096, greedy=True)
    assert ro.turns.tolist() == [1] and int(ro.loss_mask[0].nonzero().max()) < model.config.max_position_embeddings


def test_a_turn_near_max_len_is_sampled_only_to_it(byte_tokenizer):
    """The rollout gives the sampler each trajectory's tokens left to max_len: a turn near the end
    is generated only that far (it was generated to max_new_tokens, then cut), and the ids kept
    are the same ones. `budget` caps a row below max_new_tokens, never above it."""
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    sampler = HFSampler(model, tok, max_new_tokens=12)
    prompts = [[7] * 30, [9] * 30]
    full = sampler.generate(prompts, greedy=True)
    assert [len(o) for o in full] == [12, 12]  # a random model never stops early
    assert sampler.generate(prompts, greedy=True, budget=[5, 50]) == [full[0][:5], full[1]]

    class Counting(HFSampler):
        made = 0

        def _generate_rows(self, prompts, stop, room, greedy):
            outs = super()._generate_rows(prompts, stop, room, greedy)
            self.made += sum(map(len, outs))
            return outs

    prompt = len(encode_prompt(tok, P, "who?"))
    runs = {}
    for budgeted in (True, False):
        counting = Counting(model, tok, max_new_tokens=12)
        if not budgeted:  # the sampler as before: every turn in full
            plain = counting.generate
            counting.generate = lambda prompts, budget=None, **kw: plain(prompts, **kw)
        ro = rollout(counting, FakeRetriever(), tok, P, ["who?", "who?"], max_turns=3, topk=1, max_len=prompt + 7,
                     greedy=True)
        runs[budgeted] = ro, counting.made
    (ro, made), (before, made_before) = runs[True], runs[False]
    assert ro.input_ids.tolist() == before.input_ids.tolist() and ro.loss_mask.tolist() == before.loss_mask.tolist()
    assert ro.turns.tolist() == [1, 1] and made == 2 * 7 and made_before == 2 * 12


def test_hf_sampler_keeps_a_learned_position_model_inside_its_context(byte_tokenizer):
    """GPT-2 has a position embedding for each of its n_positions and none past them: a row with 3
    positions left goes in a generate() call of its own (in one batch with a row that has 12 left,
    it would run 12 and index past the table), and each row gets the tokens it gets alone."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = byte_tokenizer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=100, n_embd=32, n_layer=2, n_head=2,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    sampler = HFSampler(model, tok, max_new_tokens=12)
    prompts = [[7] * 97, [9] * 80, [11] * 97]
    outs = sampler.generate(prompts, greedy=True)
    assert [len(o) for o in outs] == [3, 12, 3]
    assert outs == [sampler.generate([p], greedy=True)[0] for p in prompts]


def test_a_sampled_eos_is_trained_on_and_the_padding_after_it_is_not(byte_tokenizer):
    """The sampler returns its ids up to and including EOS (sampler.py), and the rollout masks in
    every sampled id: the EOS gets loss_mask 1, so the policy learns where to stop; the right
    padding after it gets attention and loss_mask 0. An EOS without an answer ends only the turn:
    the invalid-action message follows it (loss_mask 0) and the next turn answers."""
    tok = byte_tokenizer
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert eos != pad  # so the padding is told apart from the sampled EOS by its id too

    class EosSampler(ScriptedSampler):
        def generate(self, prompts, stop=(), greedy=False, budget=None):
            return [ids + [eos] if "q-eos-" in self.tok.decode(p) else ids
                    for p, ids in zip(prompts, super().generate(prompts, stop, greedy))]

    scripts = {"q-eos-answer": ["<answer> Paris </answer>"],
               "q-eos-ramble": ["I stop here", "<answer> Rome </answer>"],
               "q-long": ["<answer> " + "very " * 200 + "long </answer>"]}  # the longest row: the others are padded
    ro = rollout(EosSampler(tok, scripts), FakeRetriever(), tok, P, list(scripts), max_turns=2, topk=2)
    assert ro.answers[:2] == ["Paris", "Rome"] and ro.turns.tolist() == [1, 2, 1]
    n = ro.attention_mask.sum(1).tolist()
    assert n[0] < n[2] and n[1] < n[2]
    # q-eos-answer: the reply, its EOS last, all trained; then padding, untrained
    p = int(ro.prompt_len[0])
    reply = tok.encode(scripts["q-eos-answer"][0], add_special_tokens=False) + [eos]
    assert ro.input_ids[0, p:n[0]].tolist() == reply and ro.loss_mask[0, p:n[0]].tolist() == [1] * len(reply)
    assert (ro.input_ids[0, n[0]:] == pad).all() and not ro.loss_mask[0, n[0]:].any()
    assert not ro.attention_mask[0, n[0]:].any()
    # q-eos-ramble: EOS (trained), the message (not), the answer and its EOS (trained), padding (not)
    p = int(ro.prompt_len[1])
    first = tok.encode("I stop here", add_special_tokens=False) + [eos]
    message = tok.encode(P.invalid_message, add_special_tokens=False)
    second = tok.encode("<answer> Rome </answer>", add_special_tokens=False) + [eos]
    assert ro.input_ids[1, p:n[1]].tolist() == first + message + second
    assert ro.loss_mask[1, p:].tolist() == [1] * len(first) + [0] * len(message) + [1] * len(second) + \
        [0] * (ro.input_ids.shape[1] - n[1])


def test_hf_sampler_stops_on_the_tokenizers_eos_as_vllm_does():
    """A checkpoint whose generation_config.json names another EOS than its tokenizer's: vLLM stops
    on both, HFSampler stopped on the generation config's alone and sampled on past the tokenizer's."""
    from conftest import make_byte_tokenizer

    tok = make_byte_tokenizer()
    model = make_tiny_llama(tok, seed=5)
    prompt = tok.encode("a much longer prompt", add_special_tokens=False)
    free = HFSampler(model, tok, max_new_tokens=12, seed=3).generate([prompt])[0]  # sampled: greedy repeats one
    end = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 2)  # a token first sampled there
    model.generation_config.eos_token_id = next(t for t in range(256) if t not in free)
    tok.eos_token = tok.convert_ids_to_tokens(free[end])
    assert HFSampler(model, tok, max_new_tokens=12, seed=3).generate([prompt])[0] == free[:end + 1]


def test_hf_sampler_builds_its_stop_string_check_once(byte_tokenizer, monkeypatch):
    """transformers' StopStringCriteria reads the whole vocabulary when built (0.5 s of a 1.4 s
    call with a 49k vocabulary): it was built again for every turn and every gen_batch_size chunk."""
    from transformers.generation import stopping_criteria

    built = []

    class Counted(stopping_criteria.StopStringCriteria):
        def __init__(self, tokenizer, stop_strings):
            built.append(stop_strings)
            super().__init__(tokenizer, stop_strings)

    monkeypatch.setattr(stopping_criteria, "StopStringCriteria", Counted)
    sampler = HFSampler(make_tiny_llama(byte_tokenizer, seed=5), byte_tokenizer, max_new_tokens=4, batch_size=1)
    prompts = [byte_tokenizer.encode(t, add_special_tokens=False) for t in ("one prompt", "another")]
    for _ in range(2):
        sampler.generate(prompts, stop=("</search>", "</answer>"))
    sampler.generate(prompts, stop=("\nQuestion:",))
    assert built == [["</search>", "</answer>"], ["\nQuestion:"]]


def test_a_turn_opening_with_a_newline_stop_after_a_newline_is_cut_there(byte_tokenizer):
    """"\nQuestion:" stops a turn only inside the sampled text: a turn that opened with "Question:"
    right after the passages' closing "\n" ran the search of the question the model made up."""
    import dataclasses

    tok = byte_tokenizer
    scripts = {"q-made-up": ["<search> first </search>", "Question: who else?\n<search> made up </search>",
                             "<answer> Paris </answer>"],
               "q-mid-line": ["<search> Question: a title </search>", "<answer> Lyon </answer>"]}
    protocol = dataclasses.replace(P, stop=P.stop + ("\nQuestion:",))
    retriever = FakeRetriever()
    ro = rollout(ScriptedSampler(tok, scripts), retriever, tok, protocol, list(scripts), topk=1, max_turns=3)
    assert retriever.calls == [["first", "Question: a title"]]  # "made up" never searched
    assert "</information>\nQuestion:\nMy previous action is invalid" in ro.responses[0]
    assert ro.answers == ["Paris", "Lyon"] and ro.searches.tolist() == [1, 1]
    plain = rollout(ScriptedSampler(tok, scripts), FakeRetriever(), tok, P, list(scripts), topk=1, max_turns=3)
    assert plain.searches.tolist() == [2, 1]  # a protocol without it: the turn is the model's


def test_an_answer_that_ends_exactly_at_max_len_counts(byte_tokenizer):
    """A trajectory whose answer turn fills max_len to the last token has answered: nothing was cut."""
    prompt = len(encode_prompt(byte_tokenizer, P, "q-answer"))
    reply = len(byte_tokenizer.encode(SCRIPTS["q-answer"][0], add_special_tokens=False))
    ro, _, _ = _run(byte_tokenizer, ["q-answer"], max_len=prompt + reply)
    assert ro.input_ids.shape[1] == prompt + reply
    assert ro.answers == ["Paris"] and ro.answered.tolist() == [True]
    assert ro.loss_mask[0].tolist() == [0] * prompt + [1] * reply


def test_the_retriever_is_asked_for_topk_passages(byte_tokenizer):
    """Each search asks the retriever for exactly topk passages, and all of them are shown when they fit."""
    for k in (1, 4):
        sampler, retriever = ScriptedSampler(byte_tokenizer, SCRIPTS), FakeRetriever()
        ro = rollout(sampler, retriever, byte_tokenizer, P, ["q-search"], topk=k, max_turns=2)
        assert retriever.ks == [k]
        assert [h.id for h in ro.docs[0]] == [f"france capital-{j}" for j in range(k)]
        assert ro.responses[0].count("Doc ") == k


def test_select_keeps_every_field_of_the_rows_it_picks(byte_tokenizer):
    """Rollout.select(idx) gives rows idx, in that order, of the tensors and of the answers, responses and docs."""
    ro, _, _ = _run(byte_tokenizer, ["q-answer", "q-search", "q-invalid"], max_turns=2)
    sub = ro.select([2, 1])
    assert sub.answers == ["Rome", "Paris"] and sub.responses == [ro.responses[2], ro.responses[1]]
    assert [[h.id for h in d] for d in sub.docs] == [[], ["france capital-0", "france capital-1"]]
    assert sub.searches.tolist() == [0, 1] and sub.turns.tolist() == [2, 2]
    assert sub.input_ids.equal(ro.input_ids[[2, 1]]) and sub.loss_mask.equal(ro.loss_mask[[2, 1]])


def test_a_turn_that_samples_nothing_still_counts_as_a_turn(byte_tokenizer):
    """turns counts generate calls: a turn that returned no token is a turn (and an invalid action)."""
    sampler = ScriptedSampler(byte_tokenizer, {"q-empty": ["", "<answer> Oslo </answer>"]})
    ro = rollout(sampler, FakeRetriever(), byte_tokenizer, P, ["q-empty"], topk=1, max_turns=2)
    assert ro.turns.tolist() == [2] and ro.answers == ["Oslo"]
    assert ro.responses[0] == P.invalid_message + "<answer> Oslo </answer>"


def test_the_progress_bar_counts_turns_and_the_rows_still_active(byte_tokenizer, monkeypatch):
    """progress=True: one bar over max_turns + 1 turns, a tick and the active rows after each turn
    run, closed at the end (also when every row answered early); progress=False: no bar."""
    import tqdm
    from conftest import recording_bars

    bars = recording_bars(monkeypatch, tqdm)
    _run(byte_tokenizer, list(SCRIPTS), max_turns=2)
    assert bars == []
    _run(byte_tokenizer, list(SCRIPTS), max_turns=2, progress=True)  # 5 rows, then 4, then 1 (test_branches)
    _run(byte_tokenizer, ["q-answer"], max_turns=3, progress=True)  # answered in the first of 4 turns
    shown = dict(desc="rollout turns", leave=False)
    assert [(b.kw, b.ticks, [p["active"] for p in b.postfixes], b.closed) for b in bars] == [
        ({"total": 3, **shown}, 3, [4, 1, 0], True), ({"total": 4, **shown}, 1, [0], True)]
