"""R1-Searcher++: reward terms on hand-computed groups, well-formedness, rejection sampling, the
rewrite data for memorization, the zero weight of L_M at mu = 0, and stage 1 / stage 2 end to end."""

import json
import random
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import with_bos, with_special_tags

import train
from searchlite import r1pp
from searchlite.config import parse_args
from searchlite.data import QA, DataError, append_log, read_log
from searchlite.models import load_tokenizer
from searchlite.protocol import get_protocol
from searchlite.retrieval import Hit
from searchlite.rollout import _collate, encode_prompt

PP = get_protocol("r1_searcher_pp", "toy")
RESULT = "\n<|begin_search_result|>Doc 1(Title: T) some text\n<|end_search_result|>\n"


def internal(answer: str) -> str:
    return f"I know. <|begin_internal_answer|> {answer} <|end_internal_answer|>\nSo \\boxed{{{answer}}}."


def searched(answer: str, n: int = 1) -> str:
    """A response that searched `n` times, result blocks as the rollout inserts them."""
    return "".join(f"Look. <|begin_external_search|> q{k} <|end_external_search|>{RESULT}" for k in range(n)) + \
        f"I found it. So \\boxed{{{answer}}}."


class _Fake:
    """The fields of a Rollout that reward_terms and memorization_batch read, from (response, answer, searches)."""

    def __init__(self, rows, docs=None):
        self.responses = [r for r, _, _ in rows]
        self.answers = [a for _, a, _ in rows]
        self.searches = torch.tensor([s for _, _, s in rows])
        self.docs = docs or [[] for _ in rows]

    def __len__(self):
        return len(self.responses)


# ---------------------------------------------------------------------------- rewards


def test_well_formed():
    assert r1pp.well_formed(internal("paris"), PP)
    assert r1pp.well_formed(searched("paris", 2), PP)  # the environment's result blocks are fine
    assert not r1pp.well_formed("So the answer is paris.", PP)  # no \boxed{}
    assert not r1pp.well_formed(internal("paris") + " \\boxed{lyon}", PP)  # two answers
    assert not r1pp.well_formed("<|begin_internal_answer|> paris \\boxed{paris}", PP)  # unclosed tag
    assert not r1pp.well_formed("<|end_internal_answer|> x <|begin_internal_answer|> \\boxed{x}", PP)  # order
    # result tags the model wrote itself (not after a search call)
    assert not r1pp.well_formed("<|begin_search_result|> made up <|end_search_result|> \\boxed{paris}", PP)
    # a search written after the answer: the rollout ended at the answer, the search never ran
    assert not r1pp.well_formed(internal("paris") + " Let me check. <|begin_external_search|> q <|end_external_search|>", PP)
    # an invalid action: the rollout injected its correction message
    assert not r1pp.well_formed("oops" + PP.invalid_message + internal("paris"), PP)
    # a real tokenizer's last token may run past the stop string (SmolLM2's ">.", ">,"; "|>\n"): the
    # block is still the environment's
    for rest in ("\n", ".", ",", ".\n\n"):
        tail = searched("paris").replace(f"<|end_external_search|>{RESULT}", f"<|end_external_search|>{rest}{RESULT}")
        assert tail != searched("paris") and r1pp.well_formed(tail, PP), rest
    # more than a token's tail is the model's own writing before a result block it made up
    made_up = searched("paris").replace(f"<|end_external_search|>{RESULT}",
                                        f"<|end_external_search|> and the results say{RESULT}")
    assert not r1pp.well_formed(made_up, PP)


def test_reward_terms_hand_computed_groups():
    gold_a, gold_b = QA("a", "qa", ["Paris"]), QA("b", "qb", ["Berlin"])
    ro = _Fake([
        # group A, gold Paris: two correct rollouts tie for the fewest searches (0)
        (internal("paris"), "paris", 0),
        (searched("Paris", 1), "Paris", 1),
        (searched("lyon", 2), "lyon", 2),
        (internal("The Paris"), "The Paris", 0),
        # group B, gold Berlin: no correct rollout
        ("<|begin_internal_answer|> berlin \\boxed{berlin}", "berlin", 0),  # right answer, malformed tag: -2
        (searched("one two three four five six seven eight nine ten berlin"),
         "one two three four five six seven eight nine ten berlin", 1),  # 11 words: R_answer 0
        ("I give up.", None, 2),  # no answer: malformed
        (searched("bonn", 3), "bonn", 3),
    ])
    questions = [gold_a] * 4 + [gold_b] * 4
    t = r1pp.reward_terms(ro, questions, PP, group=4, eta=2.0)
    assert t["format"].tolist() == [0, 0, 0, 0, -2, 0, -2, 0]
    assert t["answer"].tolist() == [1, 1, 0, 1, 1, 0, 0, 0]
    assert t["correct"].tolist() == [True, True, False, True, False, False, False, False]
    # group A: counts 0,1,2,0 -> mean 0.75, population var (0.5625+0.0625+1.5625+0.5625)/4 = 0.6875,
    # 2 var = 1.375 < eta; both correct rollouts with 0 searches get it. Group B: none correct -> 0
    # (its var 1.25 would give min(2.5, 2) = 2 to a correct one).
    assert t["group"].tolist() == pytest.approx([1.375, 0, 0, 1.375, 0, 0, 0, 0], abs=1e-7)
    total = t["format"] + t["answer"] + t["group"]
    assert total.tolist() == pytest.approx([2.375, 1, 0, 2.375, -1, 0, -2, 0], abs=1e-7)
    assert r1pp.reward_terms(ro, questions, PP, group=4, use_group=False)["group"].tolist() == [0.0] * 8
    # sigma over the correct rollouts only: group A's correct counts 0, 1, 0 -> var 2/9 -> 4/9
    by_correct = r1pp.reward_terms(ro, questions, PP, group=4, eta=2.0, sigma_over="correct")["group"].tolist()
    assert by_correct == pytest.approx([4 / 9, 0, 0, 4 / 9, 0, 0, 0, 0], abs=1e-7)
    with pytest.raises(ValueError, match="8 rollouts do not split into groups of 3"):  # not a short last group
        r1pp.reward_terms(ro, questions, PP, group=3)


def test_a_trajectory_that_never_answers_is_malformed():
    """A \\boxed{} written inside a search query made the tag check pass, so a trajectory that ran out
    of turns without answering escaped R_format's -2 (and scored as a wrong answer)."""
    q = QA("a", "qa", ["paris"])
    boxed_query = "<|begin_external_search|> \\boxed{paris} <|end_external_search|>" + RESULT
    assert r1pp.well_formed(boxed_query, PP)  # the text alone passes the tag check...
    t = r1pp.reward_terms(_Fake([(boxed_query, None, 1), (internal("paris"), "paris", 0)]), [q] * 2, PP, group=2)
    assert t["format"].tolist() == [-2, 0]  # ...but with no answer it is malformed


def test_group_reward_capped_at_eta_and_given_to_the_cheapest_correct():
    q = QA("a", "qa", ["paris"])
    ro = _Fake([(searched("paris", 4), "paris", 4), (internal("lyon"), "lyon", 0), (searched("paris", 1), "paris", 1),
                (internal("rome"), "rome", 0)])
    # counts 4,0,1,0: mean 1.25, var (7.5625+1.5625+0.0625+1.5625)/4 = 2.6875 -> 5.375, capped at 2;
    # the wrong rollouts with 0 searches do not count: the fewest among the correct is 1
    assert r1pp.reward_terms(ro, [q] * 4, PP, group=4, eta=2.0)["group"].tolist() == [0, 0, 2.0, 0]


# ---------------------------------------------------------------------------- rejection sampling (stage 1)


class ScriptedSampler:
    """Writes a fixed turn for each question (looked up in the prompt), per turn number."""

    def __init__(self, tok, scripts: dict):
        self.tok, self.scripts, self.prompts, self.stops = tok, scripts, [], []

    def generate(self, prompts, stop=(), greedy=False, max_new_tokens=None, budget=None):
        out = []
        self.stops.append(stop)
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            self.prompts.append(text)
            key = next(k for k in self.scripts if f"Question: {k}" in text)
            turns = self.scripts[key]
            turn = turns[min(text.count("<|begin_search_result|>"), len(turns) - 1)]
            eos = [] if turn.endswith(stop) else [self.tok.eos_token_id]  # a turn ends at a stop string or EOS
            out.append(self.tok.encode(turn, add_special_tokens=False) + eos)
        return out


class FixedRetriever:
    def search(self, queries, k):
        return [[Hit("7", "Paris", "Paris is the capital of France.", 1.0)] for _ in queries]


def test_rejection_sampling_keeps_only_correct_well_formed(byte_tokenizer):
    tok = byte_tokenizer
    scripts = {
        "q-internal": [internal("paris")],  # kept
        "q-search": ["Search. <|begin_external_search|> paris <|end_external_search|>", "So \\boxed{paris}."],  # kept
        "q-malformed": ["<|begin_internal_answer|> paris \\boxed{paris}"],  # unclosed tag
        "q-wrong": [internal("lyon")],  # well formed, wrong
        "q-long": ["So \\boxed{one two three four five six seven eight nine ten paris}"],  # 11 words
        "q-none": ["I do not know."],  # no answer at all
    }
    qa = [QA(k, k, ["Paris"]) for k in scripts]
    kept, n, asked = r1pp.rejection_sample(ScriptedSampler(tok, scripts), FixedRetriever(), tok, PP, qa, samples=2,
                                           batch_size=4, max_turns=2, topk=1, chat_template=False)
    assert n == {"questions": 6, "sampled": 12, "well_formed": 8, "correct": 4, "kept": 2, "kept_internal": 1,
                 "questions_kept": 2}  # the two identical samples of a question are kept once
    texts = [tok.decode(kept.input_ids[i, :int(kept.attention_mask[i].sum())]) for i in range(len(kept))]
    assert [t.split("Question: ")[1].split("\n")[0] for t in texts] == ["q-internal", "q-search"]
    assert kept.searches.tolist() == [0, 1]
    # the search result is in the trajectory but masked out of the SFT loss
    i = 1
    trained = tok.decode(kept.input_ids[i][kept.loss_mask[i].bool()])
    assert "Paris is the capital" in texts[i] and "Paris is the capital" not in trained
    assert "<|begin_search_result|>" not in trained
    assert asked == ["q-internal", "q-search"]

    # stage 1's rewrite demonstrations (toy world): only the kept trajectory that searched gives one
    template = r1pp.rewrite_template(PP, "toy")
    demos = r1pp.rewrite_demos(kept, asked, tok, PP, template, internal, n=5, chat_template=False)
    assert len(demos) == 1 and demos.searches.tolist() == [0] and demos.turns.tolist() == [1]
    assert demos.answers == ["paris"]
    ids, lm = demos.input_ids[0][demos.attention_mask[0].bool()], demos.loss_mask[0][demos.attention_mask[0].bool()]
    prompt = r1pp.rewrite_prompt(tok, PP, template, "q-search", kept.docs[1], chat_template=False)
    assert ids[:len(prompt)].tolist() == prompt and not lm[:len(prompt)].any()
    assert tok.decode(prompt).count("Paris is the capital of France.") == 1  # its passage, in the prompt only
    assert tok.decode(ids[lm.bool()]) == internal("paris") and lm[len(prompt):].eq(1).all()  # every response token
    assert r1pp.keep_rewrite(internal("paris"), ["Paris"], PP)  # what stage 2 keeps from the rewrite model
    call = "<|begin_external_search|> capital of france <|end_external_search|> "  # well formed, but not memory
    assert r1pp.well_formed(call + internal("paris"), PP) and not r1pp.keep_rewrite(call + internal("paris"),
                                                                                     ["Paris"], PP)
    for title in ("Notes from Underground", "Field Notes"):  # a giveaway word inside the answer itself, at its
        assert r1pp.keep_rewrite(internal(title), [title], PP)  # start or its end, is no giveaway
        assert not r1pp.keep_rewrite("My notes say so. " + internal(title), [title], PP)
    # a gold inside a giveaway word excuses nothing (they were cut from the text before the check)
    for said, gold in [("From the notes, ", "no"), ("The documents list five ", "men"), ("Doc 2 says ", "2"),
                       ("According to the context, ", "yes")]:
        assert not r1pp.keep_rewrite(said + internal(gold), [gold, ""], PP), (said, gold)
        assert r1pp.keep_rewrite("I recall: " + internal(gold), [gold, ""], PP), gold
    assert r1pp.rewrite_demos(kept.select([0]), asked[:1], tok, PP, template, internal, n=5) is None  # no search
    blind = kept.select([1])
    blind.docs = [[]]  # it searched, but was shown no passage: nothing to rewrite from
    assert r1pp.rewrite_demos(blind, asked[1:], tok, PP, template, internal, n=5) is None

    both = r1pp.join(kept, demos, tok)  # the SFT data: the kept rows, then the demonstrations, unchanged
    assert len(both) == 3 and both.answers == ["paris"] * 3
    assert both.docs == [kept.docs[0], kept.docs[1], demos.docs[0]] and both.docs[1]  # the search's passages too
    assert both.searches.tolist() == [*kept.searches.tolist(), 0] and both.turns.tolist() == [*kept.turns.tolist(), 1]
    for row, (src, i) in enumerate([(kept, 0), (kept, 1), (demos, 0)]):
        n_tok = int(src.attention_mask[i].sum())
        assert int(both.attention_mask[row].sum()) == n_tok
        assert torch.equal(both.input_ids[row, :n_tok], src.input_ids[i, :n_tok])
        assert torch.equal(both.loss_mask[row, :n_tok], src.loss_mask[i, :n_tok])
    assert r1pp.join(kept, None, tok) is kept


def test_kept_internal_counts_the_kept_trajectories_that_never_searched(byte_tokenizer):
    """stage1.json's kept_internal (how many of stage 1's trajectories answer from memory): the kept
    trajectories with no search, not those with one or two."""
    search = "Look. <|begin_external_search|> {} <|end_external_search|>"
    scripts = {"q-internal": [internal("paris")], "q-twice": [search.format("paris"), search.format("france"),
                                                              "So \\boxed{paris}."]}
    qa = [QA(k, k, ["Paris"]) for k in scripts]
    kept, n, _ = r1pp.rejection_sample(ScriptedSampler(byte_tokenizer, scripts), FixedRetriever(), byte_tokenizer,
                                       PP, qa, samples=1, batch_size=2, max_turns=3, topk=1, chat_template=False)
    assert kept.searches.tolist() == [0, 2] and (n["kept"], n["kept_internal"]) == (2, 1)


def test_two_questions_with_the_same_correct_response_are_both_kept(byte_tokenizer):
    """A trajectory is the same one only with the same prompt: two questions answered alike are two
    trajectories (the same response ids, each after its own question)."""
    scripts = {"q-one": [internal("paris")], "q-two": [internal("paris")]}
    qa = [QA(k, k, ["Paris"]) for k in scripts]
    kept, n, _ = r1pp.rejection_sample(ScriptedSampler(byte_tokenizer, scripts), FixedRetriever(), byte_tokenizer, PP,
                                       qa, samples=2, batch_size=2, max_turns=1, topk=1, chat_template=False)
    assert n["kept"] == 2 and n["questions_kept"] == 2  # and each question's two identical samples once


def test_a_searched_search_r1_trajectory_is_well_formed(byte_tokenizer):
    """--reward r1pp with --protocol search_r1: the rollout's <information> blocks after a search are the
    environment's, as R1-Searcher++'s result blocks are."""
    from searchlite.rollout import rollout

    sr1 = get_protocol("search_r1", "toy")

    class Sampler:
        def generate(self, prompts, stop=(), greedy=False, budget=None):
            return [byte_tokenizer.encode("<search> capital </search>" if "<information>" not in
                                          byte_tokenizer.decode(p) else "<answer> Paris </answer>",
                                          add_special_tokens=False) for p in prompts]

    ro = rollout(Sampler(), FixedRetriever(), byte_tokenizer, sr1, ["q?"], max_turns=2, topk=1, chat_template=False)
    assert ro.searches.tolist() == [1] and "<information>" in ro.responses[0]
    assert r1pp.well_formed(ro.responses[0], sr1) and r1pp.is_correct(ro.responses[0], ro.answers[0], ["Paris"], sr1)
    assert not r1pp.well_formed("<information> made up </information> <answer> Paris </answer>", sr1)


def test_memorization_reads_and_keeps_well_formed_trajectories_only(byte_tokenizer):
    """A right answer in a malformed trajectory (an unclosed tag, two answers) is not correct: it
    seeds no rewrite, and a malformed rewrite is not kept."""
    assert not r1pp.keep_rewrite("<|begin_internal_answer|> paris \\boxed{paris}", ["Paris"], PP)
    assert r1pp.keep_rewrite(internal("paris"), ["Paris"], PP)
    doc = Hit("7", "Paris", "The capital of Fooland is Paris.", 1.0)
    two_answers = searched("paris") + " Or \\boxed{paris}."
    assert not r1pp.well_formed(two_answers, PP)
    ro = _Fake([(two_answers, "paris", 1), (searched("paris"), "paris", 1)], docs=[[doc], [doc]])
    sampler = ScriptedSampler(byte_tokenizer, {"q-a": [internal("paris")], "q-b": [internal("paris")]})
    mem, tried = r1pp.memorization_batch(sampler, byte_tokenizer, PP, r1pp.rewrite_template(PP, "toy"), ro,
                                         [QA("a", "q-a", ["Paris"]), QA("b", "q-b", ["Paris"])], chat_template=False)
    assert tried == 1 and len(mem) == 1 and all("Question: q-b" in p for p in sampler.prompts)
    assert sampler.stops == [PP.stop] == [("<|end_external_search|>",)]  # a rewrite that searches ends there


def test_a_rewrite_whose_tags_are_special_tokens_is_read_with_them(byte_tokenizer):
    """A tokenizer whose protocol tags are special tokens: the rewrite is decoded with them, so a
    well-formed one is kept (decoded without them, none would be)."""
    tok = with_special_tags(byte_tokenizer)
    assert tok.decode(tok.encode(internal("x"), add_special_tokens=False), skip_special_tokens=True) == \
        "I know.  x \nSo \\boxed{x}."
    doc = Hit("7", "Paris", "The capital of Fooland is Paris.", 1.0)
    ro = _Fake([(searched("paris"), "paris", 1)], docs=[[doc]])
    sampler = ScriptedSampler(tok, {"q-b": [internal("paris")]})
    mem, tried = r1pp.memorization_batch(sampler, tok, PP, r1pp.rewrite_template(PP, "toy"), ro,
                                         [QA("b", "q-b", ["Paris"])], chat_template=False)
    assert tried == 1 and len(mem) == 1 and mem.answers == ["paris"]


def test_rewrite_prompt_keeps_each_passage_once_even_without_ids(byte_tokenizer):
    """A retrieval server may send passages without ids (retrieval._parse_item gives them ""):
    the bridge passage of a 2-hop question must not be lost to the second one."""

    a, b = Hit(id="", title="Tozem", text="Born in Sakri.", score=1.0), Hit(id="", title="Sakri", text="A city.", score=1.0)
    text = byte_tokenizer.decode(r1pp.rewrite_prompt(byte_tokenizer, PP, "{documents}\n{question}", "q?", [a, b, a],
                                                     chat_template=False))
    assert text.count("Born in Sakri.") == 1 and text.count("A city.") == 1


def _toy_sampling(n_questions: int = 12):
    """The toy world's tokenizer, retriever and first train questions, for rejection sampling with the teacher."""
    from searchlite.config import TOY_DIR
    from searchlite.data import read_qa
    from searchlite.retrieval import build_retriever

    return (load_tokenizer(str(TOY_DIR)), build_retriever("bm25", TOY_DIR / "corpus.jsonl"),
            read_qa(TOY_DIR / "train.jsonl")[:n_questions])


class Interrupted(Exception):
    pass


def _sample(tok, retriever, qa, log=None, stop_after=None):
    """rejection_sample with the teacher, 2 samples a question, 4 questions a batch; with
    `stop_after`, the teacher raises Interrupted at that generate call (an interrupt)."""
    from searchlite.teacher import Teacher

    teacher = Teacher(tok, PP, qa, seed=0)
    calls, generate = [0], teacher.generate

    def counted(*args, **kw):
        calls[0] += 1
        if calls[0] == stop_after:
            raise Interrupted
        return generate(*args, **kw)

    teacher.generate = counted
    kept, n, asked = r1pp.rejection_sample(teacher, retriever, tok, PP, qa, samples=2, batch_size=4, log=log,
                                           max_turns=4, topk=3, chat_template=False)
    return kept, n, asked, calls[0]


def test_rejection_sampling_resumes_where_it_stopped(tmp_path, monkeypatch):
    """10 questions in batches of 4 (the last of 2), stopped after a whole batch and resumed: the resumed
    run samples only the missing batches, its progress bar starting at the first of them."""
    import tqdm
    from conftest import recording_bars

    bars = recording_bars(monkeypatch, tqdm)
    tok, retriever, qa = _toy_sampling(10)
    fields = {"group": 2, "batch_size": 4, "seed": 0}
    whole, n_whole, asked_whole, calls_whole = _sample(tok, retriever, qa,
                                                       r1pp.open_sampling_log(tmp_path / "a.jsonl", fields, False))
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 1 + 3  # the fields, then one line a batch
    log = r1pp.open_sampling_log(tmp_path / "b.jsonl", fields, False)
    with pytest.raises(Interrupted):
        _sample(tok, retriever, qa, log, stop_after=calls_whole // 2 + 1)
    done = len(log.read_text().splitlines()) - 1
    assert 1 <= done < 3  # interrupted after a whole batch, before the last
    with open(log, "a") as f:
        f.write('{"next": 12, "counts": {"sampl')  # a line the interrupt cut short
    log = r1pp.open_sampling_log(log, fields, resume=True)
    resumed, n_resumed, asked_resumed, calls = _sample(tok, retriever, qa, log)
    assert 0 < calls < calls_whole  # only the missing batches were sampled
    assert [(b.kw, b.ticks) for b in (bars[0], bars[-1])] == [
        ({"desc": "rejection sampling", "initial": i, "total": 3}, 3 - i) for i in (0, done)]
    assert n_resumed == n_whole and asked_resumed == asked_whole
    assert torch.equal(resumed.input_ids, whole.input_ids) and torch.equal(resumed.loss_mask, whole.loss_mask)
    assert resumed.docs == whole.docs and resumed.answers == whole.answers
    assert log.read_text() == (tmp_path / "a.jsonl").read_text()
    # the teacher's random state travels in the log: resumed from its first state instead, batches 2-3 differ
    from searchlite.teacher import Teacher

    first = json.loads(log.read_text().splitlines()[1]) | {"sampler": Teacher(tok, PP, qa, seed=0).state_dict()}
    stale = r1pp.open_sampling_log(tmp_path / "c.jsonl", fields, False)
    with open(stale, "a") as f:
        f.write(json.dumps(first) + "\n")
    other = _sample(tok, retriever, qa, stale)[0]
    assert [other.responses, other.answers] != [whole.responses, whole.answers]


def test_a_sampling_log_that_holds_every_batch_needs_no_sampler(tmp_path, capsys):
    """Stage 1 resumed after its last batch starts no vLLM engine and passes no sampler: the log alone
    gives the result, and says how much it held; a fresh run says nothing of a resume."""
    tok, retriever, qa = _toy_sampling()
    fields = {"group": 2, "batch_size": 4, "seed": 0}
    whole, n_whole, asked_whole, _ = _sample(tok, retriever, qa,
                                             r1pp.open_sampling_log(tmp_path / "a.jsonl", fields, False))
    assert "--resume" not in capsys.readouterr().out
    log = r1pp.open_sampling_log(tmp_path / "a.jsonl", fields, resume=True)
    kept, n, asked = r1pp.rejection_sample(None, retriever, tok, PP, qa, samples=2, batch_size=4, log=log,
                                           max_turns=4, topk=3, chat_template=False)
    assert torch.equal(kept.input_ids, whole.input_ids) and (n, asked) == (n_whole, asked_whole)
    assert f"--resume: {log} holds the samples of questions 1 to {len(qa)} of {len(qa)}\n" in capsys.readouterr().out


def test_a_sampling_log_naming_a_utf8_path_resumes_under_an_ascii_locale(tmp_path):
    """The log is written in UTF-8 (append_log) and read back so, whatever the locale: a model or data
    path with an accent resumes (read in the locale's encoding, it passed the tests that reach the line)."""
    from conftest import run_under_ascii_locale

    fields = {"model": "mod\u00e8les/m", "group": 2}
    log = r1pp.open_sampling_log(tmp_path / "log.jsonl", fields, False)
    script = ("import sys; from pathlib import Path; from searchlite.r1pp import open_sampling_log; "
              "print(open_sampling_log(Path(sys.argv[1]), {'model': 'mod\\u00e8les/m', 'group': 2}, True) "
              "== Path(sys.argv[1]))")
    done = run_under_ascii_locale(script, str(log))
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


def test_a_resumed_sampling_log_must_match_the_run(tmp_path):
    fields = {"group": 2, "seed": 0, "model": "m"}
    log = r1pp.open_sampling_log(tmp_path / "log.jsonl", fields, False)
    with pytest.raises(SystemExit, match=r"log.jsonl:1: sampled with group = 2, this run has group = 3; "
                                         r"rerun with --group 2, or without --resume"):
        r1pp.open_sampling_log(log, fields | {"group": 3}, resume=True)
    with pytest.raises(SystemExit, match=r"the log does not record gen_batch_size; rerun without --resume"):
        r1pp.open_sampling_log(log, fields | {"gen_batch_size": 8}, resume=True)  # a chunk size changes the samples
    assert "gen_batch_size" in r1pp.SAMPLING_FIELDS
    # a log from before query_prefix was recorded was sampled without one
    assert r1pp.open_sampling_log(log, fields | {"query_prefix": ""}, resume=True) == log
    with pytest.raises(SystemExit, match=r"sampled with query_prefix = '', this run has query_prefix = 'query: '; "
                                         r"rerun with --query_prefix '', or without"):
        r1pp.open_sampling_log(log, fields | {"query_prefix": "query: "}, resume=True)
    assert "query_prefix" in r1pp.SAMPLING_FIELDS
    with open(log, "a") as f:
        f.write("not json\n{}\n")
    with pytest.raises(DataError, match="log.jsonl:2: bad JSON"):  # only the last line may be cut short
        read_log(log)
    assert r1pp.open_sampling_log(log, fields, resume=False).read_text() == json.dumps({"fields": fields}) + "\n"


# ---------------------------------------------------------------------------- memorization (stage 2)


def test_rewrite_data_have_no_documents_and_no_search_results(byte_tokenizer):
    tok = byte_tokenizer
    doc = Hit("7", "Paris", "The capital of Fooland is Paris.", 1.0)
    good = internal("paris")  # kept: each rejected rewrite below is this one plus one fault
    assert r1pp.keep_rewrite(good, ["Paris"], PP)
    rewrites = {
        "q-good": [good],
        # tried to search: a search call after the answer (where a sampler stops, at the stop string)
        "q-search": [good + " To be sure: <|begin_external_search|> fooland capital <|end_external_search|>"],
        # result tags it wrote itself, between its internal answer and the final answer
        "q-result": [good.replace("\nSo ", "\n<|begin_search_result|> Paris <|end_search_result|>\nSo ")],
        "q-wrong": [internal("lyon")],
        "q-giveaway": ["The documents say so. " + good],  # mentions what it was shown
        "q-label": ["According to Doc 1(Title: Paris), " + good],  # or the label the passages were shown with
        "q-bare": ["So \\boxed{paris}."],  # right, but recalls nothing with the internal-answer tags
    }
    for name in ("q-search", "q-result", "q-giveaway", "q-label"):  # each answers "paris"; its fault alone rejects it
        text = rewrites[name][0]
        assert PP.parse(text).content == "paris" and not r1pp.keep_rewrite(text, ["Paris"], PP), name
    rows = [(searched("paris"), "paris", 1) for _ in rewrites]
    rows += [(internal("paris"), "paris", 0), (searched("lyon"), "lyon", 1)]  # no documents; wrong
    names = list(rewrites) + ["q-nodocs", "q-wrongrollout"]
    ro = _Fake(rows, docs=[[doc, doc] for _ in rewrites] + [[], [doc]])
    questions = [QA(k, k, ["Paris"]) for k in names]
    sampler = ScriptedSampler(tok, {**rewrites, "q-wrongrollout": [internal("paris")]})
    template = r1pp.rewrite_template(PP, "toy")
    mem, tried = r1pp.memorization_batch(sampler, tok, PP, template, ro, questions, chat_template=False)
    assert tried == 7  # one rewrite per correct rollout that searched
    assert all(p.count("The capital of Fooland is Paris.") == 1 for p in sampler.prompts)  # documents in context, once
    assert len(mem) == 1 and mem.answers == ["paris"] and mem.searches.tolist() == [0] and mem.turns.tolist() == [1]
    ids, lm = mem.input_ids[0][mem.attention_mask[0].bool()], mem.loss_mask[0][mem.attention_mask[0].bool()]
    prompt = encode_prompt(tok, PP, "q-good", chat_template=False)
    assert ids[:len(prompt)].tolist() == prompt and not lm[:len(prompt)].any()  # the plain prompt, untrained
    assert lm[len(prompt):].eq(1).all()  # loss-mask 1, as sampled tokens carry
    assert "Fooland" not in tok.decode(ids)  # no document anywhere in the trajectory
    trained = ids[lm.bool()].tolist()
    for tag in (PP.info_open, PP.info_close, "<|begin_external_search|>", "<|end_external_search|>"):
        assert tok.convert_tokens_to_ids(tag) not in trained
        assert tag not in tok.decode(trained)
    assert tok.decode(trained) == internal("paris") + tok.eos_token


def test_rewrite_template_choice():
    assert "{documents}" in r1pp.rewrite_template(PP, "toy") and len(r1pp.rewrite_template(PP, "toy")) < 200
    assert "Notes:" in r1pp.rewrite_template(PP, "") == r1pp.rewrite_template(PP, "some/file.txt")
    with pytest.raises(FileNotFoundError):
        r1pp.rewrite_template(get_protocol("search_r1"), "")


def _batch(tok, n=4, seed=0):
    """A small Rollout of random ids with a prompt part, and the matching memorization rows."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (5,), generator=g).tolist() for _ in range(n)]
    resp = [torch.randint(3, 200, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
    ro = _collate(prompts, resp, [[1] * len(r) for r in resp], [0] * n, [1] * n, [None] * n, [[]] * n, tok)
    return ro


def _params_after_update(model, tok, mem, mem_coef, mini_batch_size=0):
    import copy

    from searchlite.models import make_optimizer

    policy = copy.deepcopy(model)
    cfg = parse_args(["--preset", "none", "--mem_coef", str(mem_coef), "--micro_batch_size", "2",
                      "--mini_batch_size", str(mini_batch_size), "--lr", "1e-2"])
    ro = _batch(tok)
    opt, _ = make_optimizer(policy.parameters(), cfg.lr, 0.0, 0)
    old_logp = train.score_tokens(policy, ro, 2, "cpu")
    adv = torch.linspace(-1, 1, ro.input_ids.numel()).view_as(old_logp) * ro.loss_mask
    stats = train.update(cfg, 0, policy, opt, ro, old_logp, old_logp, adv, "cpu", mem=mem)
    return [p.detach().clone() for p in policy.parameters()], stats


def test_memorization_loss_is_zero_weighted_at_mu_zero(tiny_llama, byte_tokenizer):
    mem = _batch(byte_tokenizer, n=3, seed=1)
    without, _ = _params_after_update(tiny_llama, byte_tokenizer, None, 0.0)
    zero, stats = _params_after_update(tiny_llama, byte_tokenizer, mem, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(without, zero)) and stats["mem_loss"] == []
    on, stats = _params_after_update(tiny_llama, byte_tokenizer, mem, 0.1)
    assert any(not torch.equal(a, b) for a, b in zip(without, on)) and len(stats["mem_loss"]) == 1


def test_a_mini_batch_with_no_rewrite_logs_no_memorization_loss(tiny_llama, byte_tokenizer):
    """One rewrite and two mini-batches: the second has none, and logs no L_M (not a None in the log)."""
    _, stats = _params_after_update(tiny_llama, byte_tokenizer, _batch(byte_tokenizer, n=1, seed=1), 0.1,
                                    mini_batch_size=2)
    assert len(stats["loss"]) == 2 and len(stats["mem_loss"]) == 1 and isinstance(stats["mem_loss"][0], float)


def test_a_memorization_loss_that_is_not_finite_stops_the_update_naming_it(tiny_llama, byte_tokenizer,
                                                                          monkeypatch):
    """A NaN L_M raises, with the step as train.py counts it (update's step + 1), as the policy loss does."""
    real = train.memorization_backward
    monkeypatch.setattr(train, "memorization_backward", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(FloatingPointError, match=r"^step 1: mem_loss is not finite \(\[nan\]"):
        _params_after_update(tiny_llama, byte_tokenizer, _batch(byte_tokenizer, n=3, seed=1), 0.1)


class GradRecorder:
    """Stands in for the optimizer: keeps each step's gradients and moves no weight."""

    def __init__(self, params):
        self.params, self.grads = list(params), []

    def step(self):
        self.grads.append([p.grad.clone() for p in self.params])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def naive_nll(model, mem, rows) -> torch.Tensor:
    """L_M over `rows`: the NLL of every response token, one row and one token at a time, over their count."""
    total, n = 0.0, 0
    for r in rows:
        ids = mem.input_ids[r, :int(mem.attention_mask[r].sum())]  # (t,) the row alone, no padding
        logits = model(input_ids=ids[None]).logits[0]  # (t, V)
        for t in range(1, len(ids)):
            if mem.loss_mask[r, t]:
                total = total - torch.log_softmax(logits[t - 1], -1)[ids[t]]
                n += 1
    return total / n


def test_each_mini_batch_takes_mu_times_l_m_of_its_share(tiny_llama, byte_tokenizer):
    """With two mini-batches the 3 rewrites are split between the optimizer steps (rows 0-1, then
    row 2) and each step's gradient is mu * grad L_M over its share (token mean): mu weighs L_M
    in each step as it does in a step over all of them. Advantages 0, kl_coef 0 and no clipping,
    so L_M alone has a gradient; the recorder takes no step, so both see the same weights."""
    mu, mem, ro = 0.1, _batch(byte_tokenizer, n=3, seed=1), _batch(byte_tokenizer)
    params = list(tiny_llama.parameters())

    def steps(mini_batch_size):
        cfg = parse_args(["--preset", "none", "--mem_coef", str(mu), "--kl_coef", "0", "--grad_clip", "1e9",
                          "--micro_batch_size", "2", "--mini_batch_size", str(mini_batch_size)])
        opt = GradRecorder(params)
        logp = train.score_tokens(tiny_llama, ro, 2, "cpu")
        stats = train.update(cfg, 0, tiny_llama, opt, ro, logp, logp, torch.zeros_like(logp), "cpu", mem=mem)
        return opt.grads, stats["mem_loss"]

    def want(rows):
        tiny_llama.zero_grad(set_to_none=True)
        nll = naive_nll(tiny_llama, mem, rows)
        (mu * nll).backward()
        grads = [p.grad.clone() for p in params]
        tiny_llama.zero_grad(set_to_none=True)
        return nll.item(), grads

    for mini_batch_size, shares in [(0, [[0, 1, 2]]), (2, [[0, 1], [2]])]:
        grads, losses = steps(mini_batch_size)
        assert len(grads) == len(losses) == len(shares), mini_batch_size
        for got, loss, rows in zip(grads, losses, shares):
            nll, grad = want(rows)
            assert loss == pytest.approx(nll, abs=1e-5)
            for g, w in zip(got, grad):
                torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("micro_batch_size, passes", [(2, [2, 2, 1]), (0, [5])])
def test_memorization_gradient_is_mu_times_token_mean_nll(tiny_llama, byte_tokenizer, micro_batch_size, passes):
    """Micro-batches (0: one pass of every row) bound memory and leave L_M and its gradient unchanged."""
    from searchlite.sft import sft_loss

    mem = _batch(byte_tokenizer, n=5, seed=2)
    sizes = []  # the rows of each forward pass
    hook = tiny_llama.register_forward_pre_hook(lambda m, a, kw: sizes.append(len(kw["input_ids"])), with_kwargs=True)
    loss = r1pp.memorization_backward(tiny_llama, mem, list(range(5)), 0.1, micro_batch_size, "cpu")
    hook.remove()
    assert sizes == passes
    got = [p.grad.clone() for p in tiny_llama.parameters()]
    tiny_llama.zero_grad()
    ref = sft_loss(tiny_llama, mem.input_ids, mem.loss_mask, mem.attention_mask)  # one token mean over all rows
    (0.1 * ref).backward()
    assert loss == pytest.approx(ref.item(), abs=1e-5)
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(got, tiny_llama.parameters()))


# ---------------------------------------------------------------------------- end to end


def test_stage1_with_the_teacher_writes_a_model(tiny_model, tmp_path, monkeypatch, capsys):
    from searchlite import sft

    out = tmp_path / "s1"
    small = ["--sft_questions", "6", "--group", "2", "--batch_size", "6", "--sft_batch_size", "4", "--sft_rewrites", "2",
             "--sft_epochs", "2"]
    trained, losses, real_sft = [], [], sft.sft

    def sft_spy(model, input_ids, loss_mask, **kw):
        trained.append((input_ids, loss_mask))
        losses.extend(real_sft(model, input_ids, loss_mask, **kw))
        return losses

    monkeypatch.setattr(sft, "sft", sft_spy)
    t0 = time.time()
    r1pp.main(["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--out_dir", str(out), *small])
    counts = json.loads((out / "stage1.json").read_text())
    assert 0 < counts["seconds"] <= time.time() - t0 and counts["sft_first_loss"] == losses[0]
    assert counts["sft_loss"] == pytest.approx(sum(losses[-20:]) / len(losses[-20:]), rel=1e-12)  # the last 20 steps'
    assert counts["sampled"] == 12 and 0 < counts["kept"] <= counts["correct"] <= counts["well_formed"]
    printed = capsys.readouterr().out.splitlines()  # the counts as they come, and where the model went
    sampling = {k: v for k, v in counts.items() if k not in ("t_sample", "rewrite_demos") and not k.startswith(
        ("sft_", "seconds"))}
    assert "rejection sampling: " + ", ".join(f"{k} {v}" for k, v in sampling.items()) in printed
    assert f"rewrite demonstrations: {counts['rewrite_demos']}" in printed
    assert 0 < counts["t_sample"] < counts["seconds"]
    assert (f"stage 1: sft loss {counts['sft_loss']:.4f} over {counts['sft_steps']} steps; wrote {out / 'model'} "
            f"in {counts['seconds']:.0f}s") == printed[-1]
    assert 0 < counts["rewrite_demos"] <= min(2, counts["kept"] - counts["kept_internal"])
    rows = counts["kept"] + counts["rewrite_demos"]
    assert counts["sft_steps"] == 2 * -(-rows // 4)  # --sft_epochs 2 of --sft_batch_size 4
    (ids, mask), = trained  # SFT on the sampled tokens alone: no prompt, no search result
    tok = load_tokenizer(str(out / "model"))
    assert len(ids) == rows and not mask[:, 0].any()
    for row, m in zip(ids, mask):
        text = tok.decode(row[m.bool()], skip_special_tokens=False)
        assert "Question:" not in text and PP.info_open not in text and "Doc 1" not in text
    searched_rows = [i for i in range(rows) if PP.info_open in tok.decode(ids[i], skip_special_tokens=False)]
    assert searched_rows  # the check above saw result blocks to leave out
    assert (out / "model" / "model.safetensors").exists() and (out / "trajectories" / "kept.html").exists()
    lines = (out / "rejection_sampling.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["fields"]["group"] == 2 and json.loads(lines[1])["next"] == 6
    assert sum(len(json.loads(line)["rows"]) for line in lines[1:]) == counts["kept"]  # each kept row once
    stamp = (out / "model" / "model.safetensors").stat().st_mtime_ns
    r1pp.main(["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--out_dir", str(out), *small, "--resume"])
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns == stamp  # finished: nothing redone
    # a forgotten --resume: a stage 1 that fails as it loads changes no file; one that starts keeps the earlier
    weights, config, log = ((out / f).read_bytes() for f in ("model/model.safetensors", "config.json",
                                                               "rejection_sampling.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    small = ["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--out_dir", str(out), "--sft_questions",
             "2", "--group", "2", "--batch_size", "2", "--sft_batch_size", "4"]
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        r1pp.main([*small, "--train_data", str(bad)])
    plain = tmp_path / "plain.jsonl"  # real data: no hops for the teacher to script (it had moved the files first)
    plain.write_text('{"id": "q1", "question": "who?", "golden_answers": ["x"]}\n')
    with pytest.raises(SystemExit, match="question 'q1' has no 'hops'"):
        r1pp.main([*small, "--train_data", str(plain)])
    assert (out / "stage1.json").exists() and (out / "config.json").read_bytes() == config
    assert not list(out.glob("*previous*"))
    capsys.readouterr()
    r1pp.main(small)
    note = (f"note: {out} holds an earlier stage 1; this one starts afresh (--resume continues it instead), and the "
            "earlier one is kept: model -> model.previous, stage1.json -> stage1.previous.json")
    assert note in capsys.readouterr().out
    assert (out / "model.previous" / "model.safetensors").read_bytes() == weights
    assert (out / "config.previous.json").read_bytes() == config
    assert (out / "rejection_sampling.previous.jsonl").read_bytes() == log
    assert json.loads((out / "stage1.json").read_text())["sampled"] == 4  # the new stage 1's


def test_stage1_stopped_during_sft_resumes_to_the_same_model(tiny_model, tmp_path, monkeypatch, capsys):
    """Ctrl-C during SFT step 2: the step finishes, its state is saved, stage 1 stops; --resume
    takes the SFT from step 3 and writes the model an uninterrupted stage 1 writes. The model
    drops attention weights out, so each stage 1 must seed torch's RNG and the resume restore it."""
    import searchlite.sft
    from conftest import CtrlC, dropout_copy
    from safetensors.torch import load_file

    model = dropout_copy(tiny_model, tmp_path / "dropout-model")
    flags = ["stage1", "--preset", "toy-r1pp-sft", "--model", model, "--sft_questions", "6", "--group", "2",
             "--batch_size", "6", "--sft_batch_size", "4", "--sft_rewrites", "0", "--sft_epochs", "2"]
    r1pp.main([*flags, "--out_dir", str(tmp_path / "whole"), "--resume"])  # nothing to resume: starts afresh
    ctrl_c = CtrlC(monkeypatch, searchlite.sft, "sft_loss", at=2)  # during SFT step 2
    part = tmp_path / "part"
    with pytest.raises(SystemExit) as stopped:
        r1pp.main([*flags, "--out_dir", str(part)])
    assert stopped.value.code == 130  # 128 + SIGINT, as train.py
    assert re.search(r"stopped after SFT step 2, its state saved in .*sft_state.pt: rerun", capsys.readouterr().out)
    assert (part / "sft_state.pt").exists() and not (part / "model").exists()
    with pytest.raises(SystemExit, match=r"sft_state.pt: saved by a run with --master_weights = True, this one has "
                                         r"False; resume"):  # its weights would go on in another form
        r1pp.main([*flags, "--out_dir", str(part), "--resume", "--master_weights", "false"])
    # named by stage 1's flag: --batch_size is the questions of a sampling round, which the sampling log keeps
    with pytest.raises(SystemExit, match=r"sft_state.pt: saved by a run with --sft_batch_size = 4, this one has 2; "
                                         r"resume with its settings"):
        r1pp.main([*flags, "--out_dir", str(part), "--resume", "--sft_batch_size", "2"])
    capsys.readouterr()
    r1pp.main([*flags, "--out_dir", str(part), "--resume"])
    assert re.search(r"--resume: .*sft_state.pt holds 2 of the \d+ SFT steps", capsys.readouterr().out)
    assert ctrl_c.calls == json.loads((part / "stage1.json").read_text())["sft_steps"]  # no step taken twice
    a, b = (load_file(run / "model" / "model.safetensors") for run in (tmp_path / "whole", part))
    assert all(torch.equal(a[k], b[k]) for k in a) and not (part / "sft_state.pt").exists()
    # finished: --resume takes it as it is, only with its settings (bench/r1pp_ablation.sh trained stage 2 on
    # a stage 1 of another --sft_epochs without a word)
    r1pp.main([*flags, "--out_dir", str(part), "--resume"])
    assert "stage 1 already finished" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--resume: stage 1 in .*part finished with sft_epochs = 2, this run has 3; "
                                         r"rerun without --resume"):
        r1pp.main([*flags, "--out_dir", str(part), "--resume", "--sft_epochs", "3"])


def test_stage1_stopped_while_sampling_says_what_is_kept(tiny_model, tmp_path, monkeypatch, capsys):
    """A Ctrl-C during rejection sampling ended in a KeyboardInterrupt traceback; it says what is
    kept and exits 130, and --resume samples only the batches still missing."""
    from conftest import CtrlC

    flags = ["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--sft_questions", "4", "--group", "2",
             "--batch_size", "2", "--sft_batch_size", "4", "--sft_rewrites", "0", "--out_dir", str(tmp_path)]
    ctrl_c = CtrlC(monkeypatch, r1pp, "rollout", at=2)  # during the second batch
    with pytest.raises(SystemExit) as stopped:
        r1pp.main(flags)
    assert stopped.value.code == 130
    assert "interrupted: rejection_sampling.jsonl keeps each finished sampling batch" in capsys.readouterr().err
    from searchlite import models

    loads, load = [], models.load_policy
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: loads.append(a) or load(*a, **k))
    with pytest.raises(SystemExit, match="sampled with temperature"):  # refused: no note says it goes on with it
        r1pp.main([*flags, "--resume", "--temperature", "1.0"])
    assert "continues with settings" not in capsys.readouterr().out
    assert loads == []  # refused before the model loads (a 7B model, or a vLLM engine, took minutes first)
    r1pp.main([*flags, "--resume", "--micro_batch_size", "2"])  # (a memory setting: the samples stay those kept)
    assert ctrl_c.calls == 3 and (tmp_path / "model" / "model.safetensors").exists()  # the first batch not again
    out = capsys.readouterr().out  # what it continues, and with which changes, as train.py's resume says
    assert "note: --resume continues with settings of its own: micro_batch_size: 16 -> 2 (config.json now" in out
    assert f"--resume: {tmp_path / 'rejection_sampling.jsonl'} holds the samples of questions 1 to 2 of 4\n" in out


def test_stage1_stopped_while_loading_says_it_changed_nothing(tiny_model, tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the model loads, in a folder holding a finished stage 1, said that
    rejection_sampling.jsonl and sft_state.pt kept this run's work and to --resume, which then found the
    earlier stage 1 finished (or refused its settings); this run had changed no file."""
    from conftest import CtrlC

    from searchlite import models

    flags = ["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--sft_questions", "4", "--group", "2",
             "--batch_size", "2", "--sft_batch_size", "4", "--sft_rewrites", "0", "--out_dir", str(tmp_path)]
    r1pp.main(flags)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "run.lock"}
    capsys.readouterr()
    CtrlC(monkeypatch, models, "load_policy", at=1)
    with pytest.raises(SystemExit) as stopped:
        r1pp.main([*flags, "--sft_epochs", "2"])
    assert stopped.value.code == 130
    assert capsys.readouterr().err.endswith(f"\ninterrupted before stage 1 changed any file in {tmp_path}\n")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "run.lock"} == before


def test_stage1_rewrite_demos_need_the_teacher(tiny_model, tmp_path):
    with pytest.raises(SystemExit, match="--sft_rewrites needs --cold_start_sampler teacher"):
        r1pp.main(["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--out_dir", str(tmp_path),
                   "--cold_start_sampler", "policy", "--sft_rewrites", "2"])


def test_stage1_refuses_vllm_with_the_scripted_teacher():
    """The teacher writes its trajectories without a model: a vLLM engine would sample nothing."""
    from searchlite.config import ConfigError

    cfg = parse_args(["--preset", "toy-r1pp-sft", "--sampler", "vllm", "--cold_start_sampler", "teacher"],
                     reads=r1pp.STAGE1_FIELDS)
    with pytest.raises(ConfigError, match=r"^--sampler vllm samples the model \(--cold_start_sampler policy\)"):
        r1pp.check_stage1(cfg)
    r1pp.check_stage1(parse_args(["--preset", "toy-r1pp-sft", "--sampler", "vllm", "--cold_start_sampler", "policy",
                                  "--sft_rewrites", "0"], reads=r1pp.STAGE1_FIELDS))


def test_stage1_refuses_rewrite_demos_without_a_rewrite_prompt_before_sampling(tiny_model, tmp_path, monkeypatch):
    """search_r1 has no rewrite prompt: the preset's sft_rewrites were refused by a traceback only after
    the whole training set was sampled; now in one line before anything loads or is written."""
    from searchlite import models

    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("a model loaded before the check"))
    with pytest.raises(SystemExit, match=r"error: --sft_rewrites 600: the rewrite demonstrations need a rewrite "
                                         r"prompt: .*toy_search_r1_rewrite.txt does not exist: .*--sft_rewrites 0"):
        r1pp.main(["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--out_dir", str(tmp_path / "out"),
                   "--protocol", "search_r1"])
    assert not (tmp_path / "out").exists()


def test_stage1_reads_its_data_before_loading_the_model(tiny_model, tmp_path, monkeypatch):
    from searchlite import models

    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "who?", "golden_answers": "x"}\n')
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("a model loaded before the data were read"))
    with pytest.raises(SystemExit, match=rf"error: {data}:1: field 'golden_answers'"):
        r1pp.main(["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--out_dir", str(tmp_path / "out"),
                   "--train_data", str(data)])


def test_stage1_with_a_vllm_that_does_not_import_is_one_line_and_changes_no_file(tiny_model, tmp_path, broken_vllm):
    """Stage 1 sampling with the model through vLLM, installed but failing to import: one line, as
    train.py gives, and the out_dir untouched. The engine was asked for --model with --tokenizer."""
    from conftest import BROKEN_VLLM

    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {BROKEN_VLLM}") + "$"):
        r1pp.main(["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--out_dir", str(tmp_path / "s1"),
                   "--cold_start_sampler", "policy", "--sft_rewrites", "0", "--sampler", "vllm",
                   "--tokenizer", tiny_model])
    assert not (tmp_path / "s1").exists() and broken_vllm == [(tiny_model, tiny_model)]


def test_stage1_refuses_an_sft_lr_of_zero_before_it_starts(tmp_path):
    """An SFT at learning rate 0 would sample and train for nothing; it is refused as --lr 0 is."""
    with pytest.raises(SystemExit, match=r"^error: .*--sft_lr 0\.0: must be in \(0, inf\)$"):
        r1pp.main(["stage1", "--sft_lr", "0", "--out_dir", str(tmp_path / "s1")])
    assert not (tmp_path / "s1").exists()


def test_stage1_refuses_a_flag_it_does_not_read_and_lists_what_it_reads(capsys, monkeypatch):
    with pytest.raises(SystemExit, match=r"does not read --lr \(it reads: --out_dir, --resume, .*--sft_lr"):
        r1pp.main(["stage1", "--lr", "1e-5"])  # stage 1's learning rate is --sft_lr
    with pytest.raises(SystemExit):
        r1pp.main(["stage1", "--help"])
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  --")}
    assert listed == {f"--{name}" for name in r1pp.STAGE1_FIELDS} and "--lr" not in listed
    # its own name, default preset and words for the flags it reads otherwise than train.py (dropping any of
    # them passed the tests that reach the line)
    assert out.startswith("usage: python -m searchlite.r1pp stage1") and "'toy-r1pp-sft'" in out
    assert " ".join(r1pp.STAGE1_HELP["group"].split()[:5]) in " ".join(out.split())
    monkeypatch.setattr("sys.argv", ["r1pp.py", "stage1", "--help"])  # no argv: the command line's, after its name
    with pytest.raises(SystemExit):
        r1pp.main()
    assert "  --sft_lr" in capsys.readouterr().out
    r1pp.main(["--help"])  # the module's own help: on stdout, and no error exit
    assert capsys.readouterr().out == r1pp.USAGE + "\n"
    with pytest.raises(SystemExit) as bare:  # no command: the usage, as an error
        r1pp.main([])
    assert bare.value.code == r1pp.USAGE and r1pp.USAGE.startswith("usage: python -m searchlite.r1pp stage1")
    with pytest.raises(SystemExit) as other:  # stage 2 is train.py's
        r1pp.main(["stage2", "--preset", "toy-r1pp"])
    assert other.value.code == ("error: unknown command 'stage2'; this module runs stage 1, stage 2 is "
                                f"`python train.py --preset toy-r1pp`\n\n{r1pp.USAGE}")


def test_stage1_says_so_when_nothing_is_kept(tiny_model, tmp_path, monkeypatch):
    """A random model writes no valid trajectory. It sampled with the run's settings, as train.py
    samples, rolled out with its limits and its chat-template choice, and loaded as --master_weights
    says (dropping the sampler's settings, the master flag or the chat-template choice passed the
    tests that reach the line)."""
    from searchlite import models, sampler

    made, loaded, rolled = [], [], []
    real_sampler, real_load, real_rollout = sampler.HFSampler, models.load_policy, r1pp.rollout
    monkeypatch.setattr(sampler, "HFSampler", lambda *a, **kw: made.append(kw) or real_sampler(*a, **kw))
    monkeypatch.setattr(models, "load_policy", lambda *a, **kw: loaded.append(kw) or real_load(*a, **kw))
    monkeypatch.setattr(r1pp, "rollout", lambda *a, **kw: rolled.append(kw) or real_rollout(*a, **kw))
    with pytest.raises(SystemExit, match="no sampled trajectory"):
        r1pp.main(["stage1", "--preset", "toy-r1pp-sft", "--cold_start_sampler", "policy", "--model", tiny_model,
                   "--out_dir", str(tmp_path), "--sft_questions", "2", "--group", "2", "--max_new_tokens", "4",
                   "--max_turns", "1", "--sft_rewrites", "0", "--temperature", "0.5", "--top_p", "0.9", "--seed", "7",
                   "--gen_batch_size", "3", "--master_weights", "false", "--chat_template", "false",
                   "--topk", "2", "--max_obs_tokens", "50", "--max_len", "300"])
    assert made == [dict(max_new_tokens=4, temperature=0.5, top_p=0.9, seed=7, batch_size=3)]
    assert [kw.get("master") for kw in loaded] == [False]
    assert rolled and all(kw == dict(max_turns=1, topk=2, max_obs_tokens=50, max_len=300, chat_template=False)
                          for kw in rolled)  # the rollouts take the run's settings too


def stage2_args(model, out, extra=()):
    return ["--preset", "toy-r1pp", "--model", model, "--out_dir", str(out), "--steps", "2", "--batch_size", "2",
            "--group", "2", "--max_new_tokens", "6", "--max_turns", "1", "--eval_size", "4", "--lr", "1e-2",
            "--micro_batch_size", "3", "--log_trajectories_every", "1", "--save_every", "1", *extra]


def stub_rewrites(monkeypatch, tok, seen_samplers: list) -> None:
    """train.memorization_batch replaced: a random model is never right, so each step's rewrites
    are 3 real trajectories (question prompt + internal answer), to run the L_M path; the rewrite
    sampler of each call goes to `seen_samplers`."""

    def rewrites(sampler, tokenizer, protocol, template, ro, questions, chat_template=True):
        seen_samplers.append(sampler)
        resp = [tok.encode(internal(q.answers[0]) + tok.eos_token, add_special_tokens=False) for q in questions[:3]]
        prompts = [encode_prompt(tok, protocol, q.question, chat_template) for q in questions[:3]]
        return _collate(prompts, resp, [[1] * len(r) for r in resp], [0] * 3, [1] * 3, ["x"] * 3, [[]] * 3, tok), 3

    monkeypatch.setattr(train, "memorization_batch", rewrites)


def test_two_stage2_steps_give_finite_losses(tiny_model, tmp_path, monkeypatch):
    """The full recipe for 2 steps, the rewrites stubbed (stub_rewrites)."""
    seen_samplers = []
    stub_rewrites(monkeypatch, load_tokenizer(tiny_model), seen_samplers)
    out, sampling = tmp_path / "full", ["--top_p", "0.9", "--gen_batch_size", "3"]  # (neither HFSampler's default)
    train.main(stage2_args(tiny_model, out, sampling))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        for k in ("loss", "kl", "entropy", "reward", "mem_loss", "r_format", "r_answer", "r_group"):
            assert torch.isfinite(torch.tensor(float(r[k]))), k
        assert r["mem_kept"] == r["mem_tried"] == 3 and 0 <= r["t_rewrite"] < r["seconds"]
    rewriter = seen_samplers[0]
    assert not any(p.requires_grad for p in rewriter.model.parameters())  # the rewrite model is frozen
    ran = []  # and it is the model that generates the rewrites (not a view on the policy's sampler)
    hook = rewriter.model.register_forward_hook(lambda *a: ran.append(1))
    rewriter.generate([[5, 9, 12]], max_new_tokens=2, greedy=True)
    hook.remove()
    assert ran
    cfg = json.loads((out / "config.json").read_text())
    # the rewriter samples as the policy does (its turn length, temperature, top-p, batches: dropping any of
    # them passed every test that reaches the line), from its own stream (sampler.call_seed), never the policy
    # sampler's (it started 7,919 calls later, so a long run's rewrites replayed its rollouts' noise)
    assert {(s.max_new_tokens, s.temperature, s.top_p, s.batch_size) for s in seen_samplers} == {
        (cfg["max_new_tokens"], cfg["temperature"], 0.9, 3)} and cfg["temperature"] != 1.0
    assert [s.seed - cfg["seed"] for s in seen_samplers] == [1_000_003] * 2
    assert (out / "trajectories" / "step00002-memorization.html").exists()
    train.main(stage2_args(tiny_model, out, [*sampling, "--steps", "3", "--resume"]))  # its seed stream resumes too
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_without_a_reference_the_rewriter_is_the_starting_model_also_after_a_resume(tiny_model, tmp_path,
                                                                                  monkeypatch):
    """--kl_coef 0 loads no reference model: the rewrite model is then a frozen copy of --model (the
    stage-1 model), loaded from its folder on a resume, never the policy as trained so far."""
    from safetensors.torch import load_file

    samplers = []
    stub_rewrites(monkeypatch, load_tokenizer(tiny_model), samplers)
    out, weights = tmp_path / "run", []
    real_update = train.update

    def update(*a, **kw):  # the rewrite model's weights as the step uses them
        weights.append({name: w.detach().clone() for name, w in samplers[-1].model.state_dict().items()})
        return real_update(*a, **kw)

    monkeypatch.setattr(train, "update", update)
    train.main(stage2_args(tiny_model, out, ["--kl_coef", "0", "--steps", "1"]))
    train.main(stage2_args(tiny_model, out, ["--kl_coef", "0", "--steps", "2", "--resume"]))
    start, trained = load_file(Path(tiny_model) / "model.safetensors"), load_file(
        out / "checkpoint" / "policy" / "model.safetensors")
    assert len(weights) == 2 and any(not torch.equal(trained[k], start[k]) for k in start)  # the policy moved
    for step in weights:
        assert all(torch.equal(step[k], start[k]) for k in start)


def test_stage2_ablations_and_baseline_run(tiny_model, tmp_path):
    for name, extra in [("no-mem-no-group", ["--mem_coef", "0", "--group_reward", "false"]),
                        ("em", ["--reward", "em", "--mem_coef", "0", "--steps", "1"])]:
        out = tmp_path / name
        train.main(stage2_args(tiny_model, out, extra))
        last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        assert torch.isfinite(torch.tensor(last["loss"])) and "mem_kept" not in last and "t_rewrite" not in last
        assert ("r_group" in last) == (name != "em") and last.get("r_group", 0.0) == 0.0
    # a run without L_M resumed with it: its checkpoint has no rewriter state, the rewriter starts anew
    train.main(stage2_args(tiny_model, out, ["--reward", "em", "--steps", "2", "--resume"]))
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["mem_kept"] == last["mem_tried"] == 0  # a random model is never right:
    assert last["mem_loss"] is None  # nothing to rewrite, nothing kept, no L_M


def test_unknown_reward_exits():
    with pytest.raises(SystemExit, match="--reward 'f1': not one of em, r1pp"):
        train.main(["--reward", "f1"])


def test_stage1_folder_is_named_after_its_preset_alone():
    """Stage 1 reads no --algo, yet its default folder was runs/<preset>-grpo, the --algo default."""
    from searchlite.config import parse_args
    from searchlite.r1pp import STAGE1_FIELDS

    assert parse_args(["--preset", "none"], reads=STAGE1_FIELDS).out_dir == "runs/none"
    assert parse_args(["--preset", "none", "--algo", "ppo"]).out_dir == "runs/none-ppo"  # train.py's


# ---------------------------------------------------------------------------- rejection sampling


def test_a_kept_trajectory_keeps_every_sampled_token_up_to_its_eos(byte_tokenizer):
    """The SFT must see the whole response, its last token (EOS) included: a model that never
    trains on EOS does not learn to stop after \\boxed{}."""
    tok = byte_tokenizer
    scripts = {"q-internal": [internal("paris")],
               "q-search": ["Search. <|begin_external_search|> paris <|end_external_search|>", "So \\boxed{paris}."]}
    qa = [QA(k, k, ["Paris"]) for k in scripts]
    kept, _, _ = r1pp.rejection_sample(ScriptedSampler(tok, scripts), FixedRetriever(), tok, PP, qa, samples=1,
                                       batch_size=2, max_turns=2, topk=1, chat_template=False)
    trained = [tok.decode(kept.input_ids[i][kept.loss_mask[i].bool()], skip_special_tokens=False)
               for i in range(len(kept))]
    assert trained == [internal("paris") + tok.eos_token,
                       "Search. <|begin_external_search|> paris <|end_external_search|>So \\boxed{paris}."
                       + tok.eos_token]
    for i in range(len(kept)):  # the row ends with the EOS, untruncated
        end = int(kept.attention_mask[i].sum())
        assert int(kept.input_ids[i, end - 1]) == tok.eos_token_id


def test_well_formed_refuses_a_lone_result_tag_the_model_wrote():
    """Only the environment writes result tags; a model that opens (or closes) one itself, even
    without its pair, wrote a malformed trajectory: no format reward, not kept in stage 1."""
    assert r1pp.well_formed(internal("paris"), PP)
    assert not r1pp.well_formed(f"{PP.info_open} Paris is the capital. " + internal("paris"), PP)
    assert not r1pp.well_formed("Paris is the capital. " + PP.info_close + " " + internal("paris"), PP)


def test_open_sampling_log_with_resume_but_no_log_starts_one(tmp_path):
    """--resume on a stage 1 that never wrote its log (a first run, or one stopped before it): a
    fresh log, not a crash."""
    fields = {"group": 2, "seed": 0}
    log = r1pp.open_sampling_log(tmp_path / "sub" / "log.jsonl", fields, resume=True)
    assert log.read_text() == '{"fields": {"group": 2, "seed": 0}}\n'


def test_logged_questions_reads_the_last_whole_batch_line(tmp_path):
    """What a resumed stage 1 has sampled: the last whole line's `next`, not a torn line after it;
    0 with no log or no batch; a bad last line is named by its line."""
    fields = {"group": 2, "seed": 0}
    log = tmp_path / "log.jsonl"
    assert r1pp.logged_questions(log, fields) == 0 and not log.exists()  # read, not made
    r1pp.open_sampling_log(log, fields, resume=False)
    assert r1pp.logged_questions(log, fields) == 0
    append_log(log, [{"next": 4, "rows": []}])
    assert r1pp.logged_questions(log, fields) == 4  # the first batch, on line 2
    append_log(log, [{"next": 8, "rows": []}])
    with open(log, "a") as f:
        f.write('\n{"next": 12, "ro')  # a blank line, then a line the interrupt cut short
    assert r1pp.logged_questions(log, fields) == 8
    log.write_text(log.read_text().rsplit("\n", 1)[0] + '\n{"next": 12, "ro\n')
    with pytest.raises(DataError, match=re.escape(f"{log}:5: bad JSON")):
        r1pp.logged_questions(log, fields)
    with pytest.raises(SystemExit, match="sampled with group = 2, this run has group = 3"):
        r1pp.logged_questions(log, fields | {"group": 3})


def test_a_resumed_file_that_is_no_sampling_log_is_named(tmp_path):
    """A file in the log's place whose first line is not the fields line (another log, a torn write,
    an empty file) is refused by its path and line, before anything is sampled into it."""
    fields = {"group": 2, "seed": 0}
    for first in ["", "not json\n", '{"question": "q"}\n', "[1, 2]\n"]:
        log = tmp_path / "log.jsonl"
        log.write_text(first)
        with pytest.raises(SystemExit, match=r"error: .*log.jsonl:1: not a rejection-sampling log \(no fields line\); "
                                             r"rerun without --resume"):
            r1pp.open_sampling_log(log, fields, resume=True)
        assert log.read_text() == first  # left as it was


# ---------------------------------------------------------------------------- rewrite demonstrations


def _kept_four(tok):
    """Four kept trajectories that searched, answers a-d, one passage each."""
    prompts = [tok.encode(f"Question: q{k}\n", add_special_tokens=False) for k in "abcd"]
    resp = [tok.encode(internal(k), add_special_tokens=False) for k in "abcd"]
    docs = [[Hit(k, k, f"passage {k}", 1.0)] for k in "abcd"]
    return _collate(prompts, resp, [[1] * len(r) for r in resp], [1] * 4, [2] * 4, list("abcd"), docs, tok)


def test_a_rewrite_demonstration_holds_no_bos_from_a_tokenizer_that_adds_one(byte_tokenizer):
    """The response of a demonstration is `recall(answer)` as it encodes without a BOS: a Llama
    tokenizer's <s> would otherwise sit between the prompt and the trained answer."""
    tok = with_bos(byte_tokenizer)
    demos = r1pp.rewrite_demos(_kept_four(tok), [f"q{k}" for k in "abcd"], tok, PP, "{documents}\n{question}",
                               internal, n=4, chat_template=False)
    assert sorted(demos.answers) == list("abcd")
    for i, answer in enumerate(demos.answers):
        p, n = int(demos.prompt_len[i]), int(demos.attention_mask[i].sum())
        assert demos.input_ids[i, p:n].tolist() == tok.encode(internal(answer), add_special_tokens=False)


def test_rewrite_demos_are_drawn_with_the_seed(byte_tokenizer):
    """`n` of the searched trajectories, drawn with `seed` (random.Random(seed).shuffle), not the
    first `n` of the kept list (which is in question order: always the first questions)."""
    kept, template = _kept_four(byte_tokenizer), "{documents}\n{question}"
    picked = {}
    for seed in range(6):
        demos = r1pp.rewrite_demos(kept, [f"q{k}" for k in "abcd"], byte_tokenizer, PP, template, internal, n=2,
                                   seed=seed, chat_template=False)
        order = [0, 1, 2, 3]
        random.Random(seed).shuffle(order)
        assert demos.answers == ["abcd"[i] for i in order[:2]], seed
        picked[seed] = tuple(demos.answers)
    assert len(set(picked.values())) > 1


# ---------------------------------------------------------------------------- rewrite prompt


def test_rewrite_template_needs_both_placeholders(tmp_path, monkeypatch):
    for text in ("{documents} only, no question\n", "Question: {question}, no documents\n"):
        path = tmp_path / "custom_rewrite.txt"
        path.write_text(text)
        monkeypatch.setattr(r1pp, "rewrite_path", lambda name, template="": path)
        with pytest.raises(ValueError, match=r"needs \{documents\} and \{question\}"):
            r1pp.rewrite_template(PP, "custom")


# ---------------------------------------------------------------------------- memorization (stage 2)


def test_memorization_batch_counts_its_rewrites_when_none_is_kept(byte_tokenizer):
    """mem_tried counts the rewrites asked for, kept or not: 2 correct searched rollouts whose
    rewrites are both refused give (None, 2), so the metrics show 2 tried and 0 kept; with no
    correct rollout that searched, none is asked for: (None, 0)."""
    doc = Hit("7", "Paris", "The capital of Fooland is Paris.", 1.0)

    ro = _Fake([(searched("paris"), "paris", 1), (searched("paris"), "paris", 1)], docs=[[doc], [doc]])
    sampler = ScriptedSampler(byte_tokenizer, {"q-a": ["The documents say " + internal("paris")],
                                               "q-b": [internal("lyon")]})
    questions = [QA("a", "q-a", ["Paris"]), QA("b", "q-b", ["Paris"])]
    mem, tried = r1pp.memorization_batch(sampler, byte_tokenizer, PP, r1pp.rewrite_template(PP, "toy"), ro,
                                         questions, chat_template=False)
    assert mem is None and tried == 2
    wrong_or_unsearched = _Fake([(searched("lyon"), "lyon", 1), (internal("paris"), "paris", 0)], docs=[[doc], []])
    asked = len(sampler.prompts)
    assert r1pp.memorization_batch(sampler, byte_tokenizer, PP, r1pp.rewrite_template(PP, "toy"), wrong_or_unsearched,
                                   questions, chat_template=False) == (None, 0)
    assert len(sampler.prompts) == asked


def test_memorization_backward_without_rows_reports_no_loss(tiny_llama, byte_tokenizer):
    """A mini-batch with no rewrite has no L_M: None (train.py then logs nothing), not 0.0, which
    would pull the logged mem_loss toward 0; and no gradient."""
    mem = _batch(byte_tokenizer, n=2)
    assert r1pp.memorization_backward(tiny_llama, mem, [], 0.1, 2, "cpu") is None
    assert r1pp.memorization_backward(tiny_llama, None, [0, 1], 0.1, 2, "cpu") is None
    assert all(p.grad is None for p in tiny_llama.parameters())


class Seen(Exception):
    pass


def _flags(tiny_model, out, *extra):
    return ["stage1", "--preset", "toy-r1pp-sft", "--model", tiny_model, "--out_dir", str(out),
            "--sft_questions", "4", "--group", "2", "--batch_size", "4", "--sft_rewrites", "1", *extra]


def test_stage1_seed_draws_the_questions_and_seeds_the_teacher(tiny_model, tmp_path, monkeypatch):
    """--seed shuffles the train questions before --sft_questions cuts them (random.Random(seed)),
    and the teacher starts from random.Random(seed); the rollout gets --topk, --max_len,
    --max_turns and --max_obs_tokens."""
    from searchlite.config import TOY_DIR
    from searchlite.data import read_qa

    seen = {}

    def spy(sampler, retriever, tokenizer, protocol, qa, samples, batch_size, log=None, **kw):
        seen.update(ids=[q.id for q in qa], rng=sampler.rng.getstate(), samples=samples, batch_size=batch_size, kw=kw)
        raise Seen

    monkeypatch.setattr(r1pp, "rejection_sample", spy)
    for seed in (3, 4):
        with pytest.raises(Seen):
            r1pp.main(_flags(tiny_model, tmp_path / str(seed), "--seed", str(seed), "--topk", "2", "--max_len", "900",
                             "--max_turns", "3", "--max_obs_tokens", "77"))
        qa = list(read_qa(TOY_DIR / "train.jsonl"))
        random.Random(seed).shuffle(qa)
        assert seen["ids"] == [q.id for q in qa[:4]], seed
        assert seen["rng"] == random.Random(seed).getstate(), seed
        assert (seen["samples"], seen["batch_size"]) == (2, 4)
        assert {k: seen["kw"][k] for k in ("topk", "max_len", "max_turns", "max_obs_tokens")} == \
            {"topk": 2, "max_len": 900, "max_turns": 3, "max_obs_tokens": 77}


def test_stage1_sft_flags_reach_the_sft_and_the_demonstrations(tiny_model, tmp_path, monkeypatch):
    """--seed seeds the rewrite demonstrations' draw and the SFT's batch order; --weight_decay,
    --grad_clip, --micro_batch_size, --sft_lr, --sft_batch_size and --sft_epochs reach sft()."""
    from searchlite import sft

    seen, real_demos = {}, r1pp.rewrite_demos

    def demos_spy(kept, asked, tokenizer, protocol, template, recall, n, seed=0, chat_template=True):
        seen["demo_seed"], seen["demo_n"] = seed, n
        return real_demos(kept, asked, tokenizer, protocol, template, recall, n, seed, chat_template)

    def sft_spy(model, input_ids, loss_mask, **kw):
        seen["sft"] = kw
        raise Seen

    monkeypatch.setattr(r1pp, "rewrite_demos", demos_spy)
    monkeypatch.setattr(sft, "sft", sft_spy)
    with pytest.raises(Seen):
        r1pp.main(_flags(tiny_model, tmp_path, "--seed", "5", "--weight_decay", "0.125", "--grad_clip", "0.5",
                         "--micro_batch_size", "2", "--sft_lr", "0.0625", "--sft_batch_size", "3", "--sft_epochs", "2"))
    assert (seen["demo_seed"], seen["demo_n"]) == (5, 1)
    got = {k: seen["sft"][k] for k in ("seed", "weight_decay", "grad_clip", "micro_batch_size", "lr", "batch_size",
                                       "epochs")}
    assert got == {"seed": 5, "weight_decay": 0.125, "grad_clip": 0.5, "micro_batch_size": 2, "lr": 0.0625,
                   "batch_size": 3, "epochs": 2}


@pytest.mark.parametrize("rewrites", [0, 1])
def test_stage1_with_no_rewrite_demonstration_trains_on_the_kept_rows_alone(tiny_model, tmp_path, monkeypatch, capsys,
                                                                           rewrites):
    """--sft_rewrites 0 asks for no demonstration and prints no count of them; with 1, rewrite_demos
    gives None when no kept trajectory searched, and stage 1 counts 0 and fine-tunes on the kept rows."""
    from searchlite import sft

    seen, real_sample = {"demo_calls": 0}, r1pp.rejection_sample

    def sample_spy(*a, **kw):
        kept, counts, asked = real_sample(*a, **kw)
        seen["kept"] = len(kept)
        return kept, counts, asked

    def demos_spy(*a, **kw):
        seen["demo_calls"] += 1
        return None  # what rewrite_demos gives when no kept trajectory searched

    def sft_spy(model, input_ids, loss_mask, **kw):
        seen["rows"] = len(input_ids)
        raise Seen

    monkeypatch.setattr(r1pp, "rejection_sample", sample_spy)
    monkeypatch.setattr(r1pp, "rewrite_demos", demos_spy)
    monkeypatch.setattr(sft, "sft", sft_spy)
    with pytest.raises(Seen):
        r1pp.main(_flags(tiny_model, tmp_path, "--sft_rewrites", str(rewrites)))  # (the last --sft_rewrites counts)
    assert seen["demo_calls"] == rewrites and seen["rows"] == seen["kept"] > 0
    demos_line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rewrite demonstrations")]
    assert demos_line == (["rewrite demonstrations: 0"] if rewrites else [])
