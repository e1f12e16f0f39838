"""searchlite/sampler.py's HFSampler as the rollout and the evaluation use it: stop strings and EOS
end each row where they should in a batch, the checkpoint's suppressed ids, temperature and top_p
shape the draw, budgets and --gen_batch_size follow their rows, and each call's seed makes a run
(and its resume) repeat. (The rollout's own use of it: test_rollout.py.)"""

import pytest
import torch
from conftest import make_byte_tokenizer, make_tiny_llama

from searchlite.sampler import HFSampler

ASCII = list(range(ord("a"), ord("z") + 1))  # byte tokens of the byte tokenizer are ids of ByteLevel's alphabet


def long_and_short(tok) -> list[list[int]]:
    """A long prompt and a one-token one: in a batch the short row is padded on the left."""
    return [tok.encode("a much longer prompt", add_special_tokens=False), tok.encode("b", add_special_tokens=False)]


def sampled_and_a_new_token(model, tok, prompts) -> tuple[list[list[int]], int]:
    """12 tokens for each of two prompts (seed 3, no EOS among them), and the position of a token in the
    first row, from its third on, that this row has not sampled before and the second row never samples:
    made an EOS, it ends the first row there and leaves the second whole."""
    free = HFSampler(model, tok, max_new_tokens=12, seed=3).generate(prompts)
    assert [len(o) for o in free] == [12, 12]  # no EOS sampled
    end = next(i for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i] and t not in free[1])
    return free, end


def _letters_only(model, tok):
    """Suppress every id but the lower-case letters: decoded text is plain, stop strings are exact."""
    letters = {tok.convert_tokens_to_ids(chr(c)) for c in ASCII}
    model.generation_config.suppress_tokens = [i for i in range(len(tok)) if i not in letters]
    return letters


def test_suppress_tokens_of_the_checkpoint_are_never_sampled(byte_tokenizer):
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    prompts = long_and_short(tok)
    free = HFSampler(model, tok, max_new_tokens=12, seed=1).generate(prompts)
    letters = _letters_only(model, tok)
    assert not all(t in letters for o in free for t in o)  # else the check below proves nothing
    for greedy in (True, False):
        outs = HFSampler(model, tok, max_new_tokens=12, seed=1).generate(prompts, greedy=greedy)
        assert [len(o) for o in outs] == [12, 12] and all(t in letters for o in outs for t in o)


def test_a_stop_string_in_the_sampled_text_ends_the_row_on_the_token_that_completes_it(byte_tokenizer):
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    _letters_only(model, tok)
    prompts = long_and_short(tok)
    sampler = HFSampler(model, tok, max_new_tokens=12)
    free = sampler.generate(prompts, greedy=True)
    assert [len(o) for o in free] == [12, 12]
    text = [tok.decode(o) for o in free]
    # row 0: a stop of its tokens 4..5; row 1: a stop that is its first two tokens (right after the prompt);
    # and one that straddles row 0's prompt end ("...t" + its first token): not a stop (vLLM's rule)
    stops = (text[0][4:6], text[1][:2], "t" + text[0][0])

    def cut(ids):  # the shortest prefix whose text holds a stop string (the naive rule)
        return next((ids[:j] for j in range(1, len(ids) + 1) if any(s in tok.decode(ids[:j]) for s in stops)), ids)

    want = [cut(o) for o in free]
    assert len(want[0]) <= 6 and len(want[1]) == 2  # both rows really are cut
    assert sampler.generate(prompts, stop=stops, greedy=True) == want
    assert HFSampler(model, tok, max_new_tokens=12, batch_size=1).generate(prompts, stop=stops, greedy=True) == want


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_a_row_that_samples_eos_ends_there_while_its_batch_goes_on(pad_is_eos):
    """In a batch, transformers pads a finished row; its continuation must end at its EOS, also
    with a tokenizer that has no pad token of its own (load_tokenizer pads with EOS)."""
    tok = make_byte_tokenizer()
    model = make_tiny_llama(tok, seed=5)
    prompts = long_and_short(tok)
    free, end = sampled_and_a_new_token(model, tok, prompts)
    if pad_is_eos:
        tok.eos_token = tok.pad_token = tok.convert_ids_to_tokens(free[0][end])
    else:
        model.generation_config.eos_token_id = free[0][end]
    outs = HFSampler(model, tok, max_new_tokens=12, seed=3).generate(prompts)
    assert outs == [free[0][:end + 1], free[1]]


def test_the_generation_configs_eos_may_be_a_list_or_none(byte_tokenizer):
    """Qwen2.5-Instruct's generation config names two EOS ids, and a config built from scratch may name
    none: each id of a list ends a row, and with none the tokenizer's EOS alone does."""
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    prompts = long_and_short(tok)
    free, end = sampled_and_a_new_token(model, tok, prompts)
    model.generation_config.eos_token_id = [tok.eos_token_id, free[0][end]]
    assert HFSampler(model, tok, max_new_tokens=12, seed=3).generate(prompts) == [free[0][:end + 1], free[1]]
    model.generation_config.eos_token_id = None
    sampler = HFSampler(model, tok, max_new_tokens=12, seed=3)
    assert sampler.eos_ids == [tok.eos_token_id] and sampler.generate(prompts) == free


def test_a_tokenizer_without_a_pad_token_pads_with_the_models_eos():
    """A tokenizer handed to HFSampler as it is (not through load_tokenizer) may have no pad token:
    the short row is padded with the EOS, masked out, and samples what it does with a pad token."""
    tok = make_byte_tokenizer()
    model = make_tiny_llama(tok, seed=5)
    prompts = long_and_short(tok)
    padded = HFSampler(model, tok, max_new_tokens=6).generate(prompts, greedy=True)
    tok.pad_token = None
    sampler = HFSampler(model, tok, max_new_tokens=6)
    assert tok.pad_token_id is None and sampler.eos_ids == [tok.eos_token_id] and sampler.pad_id == tok.eos_token_id
    assert sampler.generate(prompts, greedy=True) == padded


def test_a_tiny_temperature_or_top_p_samples_the_greedy_tokens(byte_tokenizer):
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    prompts = long_and_short(tok)
    greedy = HFSampler(model, tok, max_new_tokens=10).generate(prompts, greedy=True)
    assert HFSampler(model, tok, max_new_tokens=10, seed=1).generate(prompts) != greedy  # sampling differs at T=1
    assert HFSampler(model, tok, max_new_tokens=10, seed=1, temperature=1e-4).generate(prompts) == greedy
    assert HFSampler(model, tok, max_new_tokens=10, seed=1, top_p=1e-6).generate(prompts) == greedy


def test_sampling_draws_from_the_whole_vocabulary(byte_tokenizer):
    """No top-k filter (generate's default is top_k 50): a near-uniform random model's first tokens
    over 400 rows take far more than 50 distinct ids."""
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    outs = HFSampler(model, tok, max_new_tokens=1, seed=0).generate([tok.encode("a", add_special_tokens=False)] * 400)
    assert len({o[0] for o in outs}) > 80


def test_budgets_follow_their_rows_across_gen_batches(byte_tokenizer):
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    prompts = [[7] * 30, [9] * 30, [11] * 30]
    full = HFSampler(model, tok, max_new_tokens=12).generate(prompts, greedy=True)
    chunked = HFSampler(model, tok, max_new_tokens=12, batch_size=1).generate(prompts, greedy=True, budget=[12, 3, 5])
    assert chunked == [full[0], full[1][:3], full[2][:5]]


def test_a_calls_max_new_tokens_caps_it(byte_tokenizer):
    tok = byte_tokenizer
    sampler = HFSampler(make_tiny_llama(tok, seed=5), tok, max_new_tokens=12)
    full = sampler.generate([[7] * 5], greedy=True)[0]
    assert sampler.generate([[7] * 5], greedy=True, max_new_tokens=3) == [full[:3]]


def test_a_budget_of_zero_is_refused(byte_tokenizer):
    tok = byte_tokenizer
    sampler = HFSampler(make_tiny_llama(tok, seed=5), tok, max_new_tokens=12)
    with pytest.raises(ValueError, match="a budget of 0 new tokens"):
        sampler.generate([[7] * 5, [8] * 5], budget=[4, 0])


def test_seeds_resume_greedy_calls_do_not_count_and_the_caller_rng_is_untouched(byte_tokenizer):
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    prompts = [tok.encode("a", add_special_tokens=False)] * 3
    a = HFSampler(model, tok, max_new_tokens=8, seed=4)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    first = a.generate(prompts)
    assert torch.equal(torch.get_rng_state(), rng)  # the trainer's RNG is left alone
    assert a.state_dict() == {"calls": 1}  # a sampling call counts
    a.generate(prompts, greedy=True)  # an evaluation between rollouts
    state = a.state_dict()
    second = a.generate(prompts)
    assert second != first and state == {"calls": 1}
    b = HFSampler(model, tok, max_new_tokens=8, seed=4)
    b.load_state_dict(state)  # a resumed run draws the next call's noise, not the first one's again
    assert b.generate(prompts) == second


def test_generate_leaves_the_model_in_the_mode_it_found(byte_tokenizer):
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)
    sampler = HFSampler(model, tok, max_new_tokens=2)
    for mode in (True, False):
        model.train(mode)
        sampler.generate([[7] * 3])
        assert model.training is mode


def test_push_weights_makes_the_sampler_generate_with_the_module_given(byte_tokenizer):
    """HFSampler copies nothing: push_weights(model) hands it the module to generate with (the
    interface VLLMSampler shares, where it copies the weights into the engine)."""
    tok = byte_tokenizer
    first, second = make_tiny_llama(tok, seed=5), make_tiny_llama(tok, seed=6)
    calls = []
    for name, model in (("first", first), ("second", second)):
        model.generate = lambda *a, _generate=model.generate, _name=name, **k: calls.append(_name) or _generate(*a, **k)
    sampler = HFSampler(first, tok, max_new_tokens=4)
    sampler.generate([[7] * 3])
    sampler.push_weights(second)
    sampler.generate([[7] * 3], greedy=True)
    assert calls == ["first", "second"] and sampler.model is second


def test_gen_batch_size_splits_a_call_into_generate_calls_of_that_many_rows(byte_tokenizer):
    """batch_size (--gen_batch_size) is the memory lever for sampling: 5 prompts at 2 a call."""
    tok = byte_tokenizer
    model = make_tiny_llama(tok, seed=5)

    class Spy(HFSampler):
        def _generate_rows(self, prompts, stop, room, greedy):
            self.sizes.append(len(prompts))
            return super()._generate_rows(prompts, stop, room, greedy)

    spy = Spy(model, tok, max_new_tokens=3, batch_size=2)
    spy.sizes = []
    prompts = [[7 + i] * 4 for i in range(5)]
    outs = spy.generate(prompts, greedy=True)
    assert spy.sizes == [2, 2, 1] and outs == HFSampler(model, tok, max_new_tokens=3).generate(prompts, greedy=True)
