"""The scripted teacher under R1-Searcher++'s protocol, played by hand against fixed passages: it
answers from memory only when every hop is famous, else searches hop by hop and reads the values
from the passages; its deliberate mistakes fire at their rates."""

from types import SimpleNamespace

import pytest

from searchlite.data import QA
from searchlite.protocol import get_protocol
from searchlite.r1pp import well_formed
from searchlite.rewards import cover_exact_match
from searchlite.teacher import Teacher

PP = get_protocol("r1_searcher_pp", "toy")
TOK = SimpleNamespace(eos_token="<eos>")
EXACT = dict(p_guess=0.0, p_famous_internal=1.0, p_stop=0.0, p_verbatim=0.0, p_wrong_span=0.0)
PASSAGES = {"Kova Works": "Kova Works was founded by Lira Dun in 1850.", "Lira Dun": "Lira Dun was born in Tesk.",
            "Tesk": "Tesk is a city in the region of Varn.", "Bo Sel": "Bo Sel (born 1801 in Tesk).",
            "Ri Tam": "Ri Tam (born 1799 in Tesk)."}


def hop(query, answer, famous):
    return {"query": query, "doc_id": query, "answer": answer, "famous": famous}


def play(teacher, question, turns=4):
    """Roll the teacher out by hand: each search's passage is the queried entity's passage."""
    context, response, searches = f"Question: {question}\n", "", 0
    for _ in range(turns):
        out = teacher.turn(context + response)
        response += out
        if not out.endswith(PP.stop[0]):
            return response, searches
        query = out.rsplit("<|begin_external_search|>", 1)[1].split("<|end_external_search|>")[0].strip()
        response += f"\n{PP.info_open}Doc 1(Title: {query}) {PASSAGES[query]}\n{PP.info_close}\n"
        searches += 1
    return response, searches


def searched_once(question, query, passage):
    """A context in which the teacher searched `query` once and was shown `passage`."""
    return (f"Question: {question}\nI need to search {query}. <|begin_external_search|> {query} "
            f"<|end_external_search|>\n{PP.info_open}Doc 1(Title: {query}) {passage}\n{PP.info_close}\n")


def answer(response):
    return PP.parse(response.rsplit(PP.info_close, 1)[-1]).content  # the last turn's answer


@pytest.mark.parametrize("famous, searches", [((False, True), 2), ((True, False), 2), ((True, True), 0),
                                              ((False, False), 2)])
def test_two_hop_recalls_only_when_every_hop_is_famous(famous, searches):
    q = QA("1", "In which region was the founder's birthplace?", ["Varn"],
           {"type": "2hop", "hops": [hop("Lira Dun", "Tesk", famous[0]), hop("Tesk", "Varn", famous[1])]})
    # other names the teacher knows, so that a guess in place of the value read is seldom right
    filler = QA("9", "Who?", ["Ada"], {"type": "1hop", "hops": [hop(n, n, False) for n in ("Bex", "Cal", "Dov")]})
    for seed in range(4):  # (a guess's draw depends on the seed)
        response, n = play(Teacher(TOK, PP, [q, filler], seed=seed, **EXACT), q.question)
        assert n == searches and response.count("<|begin_internal_answer|>") == (searches == 0)
        assert well_formed(response, PP) and cover_exact_match(answer(response), q.answers) == 1.0
        if searches:  # the second search is for the bridge value read from the first passage
            assert "I found Tesk. I need to search Tesk." in response


def test_comparison_looks_up_both_years_and_compares():
    """The second lookup's thought says what the first one read (dropped, it passed the other tests)."""
    q = QA("2", "Who was born first, Bo Sel or Ri Tam?", ["Ri Tam"],
           {"type": "comparison", "hops": [hop("Bo Sel", "1801", True), hop("Ri Tam", "1799", False)]})
    response, n = play(Teacher(TOK, PP, [q], seed=0, **EXACT), q.question)
    assert n == 2 and answer(response) == "Ri Tam" and well_formed(response, PP)
    assert "I found 1801. I need to search Ri Tam." in response


def test_a_guess_answers_at_once_with_a_value_of_the_same_kind():
    """A year for a year, a name for a name, from the values the teacher's questions hold."""
    q = QA("4", "When was Bo Sel born?", ["1801"], {"type": "1hop", "hops": [hop("Bo Sel", "1801", False)]})
    other = QA("5", "When was Ri Tam born?", ["1799"], {"type": "1hop", "hops": [hop("Ri Tam", "1799", False)]})
    named = QA("7", "Who founded Kova Works?", ["Lira Dun"], {"type": "1hop",
                                                              "hops": [hop("Kova Works", "Lira Dun", False)]})
    place = QA("8", "Where was Lira Dun born?", ["Tesk"], {"type": "1hop", "hops": [hop("Lira Dun", "Tesk", False)]})
    for seed in range(4):
        teacher = Teacher(TOK, PP, [q, other, named, place], seed=seed, **(EXACT | {"p_guess": 1.0}))
        for question, kind in ((q, {"1801", "1799"}), (named, {"Lira Dun", "Tesk"})):
            response, n = play(teacher, question.question)
            assert n == 0 and "<|begin_internal_answer|>" in response and answer(response) in kind, seed


def test_a_stop_after_the_first_hop_answers_the_bridge():
    q = QA("3", "In which region was Lira Dun born?", ["Varn"],
           {"type": "2hop", "hops": [hop("Lira Dun", "Tesk", False), hop("Tesk", "Varn", False)]})
    teacher = Teacher(TOK, PP, [q], seed=0, **(EXACT | {"p_stop": 1.0}))
    response, n = play(teacher, q.question)
    assert n == 1 and answer(response) == "Tesk"


def test_questions_without_hops_are_refused_with_the_way_out():
    from searchlite.config import ConfigError

    plain = QA(id="hq1", question="Who wrote it?", answers=["Lira Dun"], meta={})
    with pytest.raises(ConfigError, match=r"question 'hq1' has no 'hops'.*--cold_start_sampler policy"):
        Teacher(None, PP, [plain])


def test_the_question_is_the_last_known_one_in_the_context_and_an_unknown_one_is_named():
    """A prompt may show other questions before the one asked (a few-shot example): the teacher plays
    the last one it knows. A context with none of its questions is a KeyError that quotes it
    (without the raise, an AttributeError on None said nothing of the context)."""
    q = QA("2", "Who was born first, Bo Sel or Ri Tam?", ["Ri Tam"],
           {"type": "comparison", "hops": [hop("Bo Sel", "1801", False), hop("Ri Tam", "1799", False)]})
    known = QA("3", "Where was Lira Dun born?", ["Tesk"], {"type": "1hop", "hops": [hop("Lira Dun", "Tesk", True)]})
    teacher = Teacher(TOK, PP, [q, known], seed=0, **EXACT)
    example = f"Question: {known.question}\nAnswer: Tesk\n"
    assert teacher.turn(f"{example}Question: {q.question}\n") == teacher.turn(f"Question: {q.question}\n")
    assert teacher.turn(f"Question: {q.question}\n").endswith(PP.stop[0])  # a search: the known one is recalled
    with pytest.raises(KeyError, match="no known question in context: 'Question: Where was Ada born"):
        teacher.turn("Question: Where was Ada born?\n")


@pytest.mark.parametrize("values", [("Tesk", "1799"), ("1801", "Tesk")])
def test_a_comparison_of_values_that_are_not_both_years_answers_one_of_the_two_named(values):
    """The teacher compares years alone: a question of the same form over another value (a user's data)
    is answered with one of its two names, as a guess, not a crash on the value that is not a year."""
    q = QA("9", "Who was born first, Lira Dun or Ri Tam?", ["Ri Tam"],
           {"type": "comparison", "hops": [hop("Lira Dun", values[0], False), hop("Ri Tam", values[1], False)]})
    for seed in range(4):
        response, n = play(Teacher(TOK, PP, [q], seed=seed, **EXACT), q.question)
        assert n == 2 and answer(response) in ("Lira Dun", "Ri Tam"), seed


def test_a_later_comparison_picks_the_later_year():
    """Bo Sel 1801, Ri Tam 1799: born first is Ri Tam (above), born later is Bo Sel."""
    q = QA("6", "Who was born later, Bo Sel or Ri Tam?", ["Bo Sel"],
           {"type": "comparison", "hops": [hop("Bo Sel", "1801", False), hop("Ri Tam", "1799", False)]})
    response, n = play(Teacher(TOK, PP, [q], seed=0, **EXACT), q.question)
    assert n == 2 and answer(response) == "Bo Sel"


def test_a_stopped_comparison_answers_a_coin_flip_after_one_lookup():
    q = QA("2", "Who was born first, Bo Sel or Ri Tam?", ["Ri Tam"],
           {"type": "comparison", "hops": [hop("Bo Sel", "1801", False), hop("Ri Tam", "1799", False)]})
    answers = set()
    for seed in range(8):
        response, n = play(Teacher(TOK, PP, [q], seed=seed, **(EXACT | {"p_stop": 1.0})), q.question)
        assert n == 1, seed  # one lookup, then an answer
        answers.add(answer(response))
    assert answers == {"Bo Sel", "Ri Tam"}  # a coin flip between the two names


def test_a_verbatim_search_queries_the_whole_question():
    q = QA("4", "When was Bo Sel born?", ["1801"], {"type": "1hop", "hops": [hop("Bo Sel", "1801", False)]})
    out = Teacher(TOK, PP, [q], seed=0, **(EXACT | {"p_verbatim": 1.0})).turn(f"Question: {q.question}\n")
    assert out.endswith(f"<|begin_external_search|> {q.question} <|end_external_search|>")


def test_a_wrong_span_copies_another_value_from_the_passage():
    """With p_wrong_span 1 the teacher copies a value of the same kind that the passage shows, never
    the right one and never one the passage lacks."""
    q = QA("4", "When was Bo Sel born?", ["1801"], {"type": "1hop", "hops": [hop("Bo Sel", "1801", False)]})
    others = [QA("5", "When was Ri Tam born?", ["1799"], {"type": "1hop", "hops": [hop("Ri Tam", "1799", False)]}),
              QA("7", "When was Kova Works founded?", ["1850"], {"type": "1hop", "hops": [hop("Kova", "1850", False)]}),
              QA("8", "When was Lo Pim born?", ["1803"], {"type": "1hop", "hops": [hop("Lo Pim", "1803", False)]})]
    context = searched_once(q.question, "Bo Sel", "Bo Sel (born 1801, baptised 1803).")
    for seed in range(10):
        out = Teacher(TOK, PP, [q, *others], seed=seed, **(EXACT | {"p_wrong_span": 1.0})).turn(context)
        assert PP.parse(out).content == "1803", seed
        right = Teacher(TOK, PP, [q, *others], seed=seed, **EXACT).turn(context)
        assert PP.parse(right).content == "1801", seed


def test_a_wrong_span_of_a_name_copies_another_name_and_a_passage_without_the_value_gives_a_guess():
    """A name hop's wrong span is another name the passage shows (the years it shows are not drawn);
    a passage that shows neither the value nor another of its kind leaves a guess of that kind."""
    q = QA("3", "Where was Lira Dun born?", ["Tesk"], {"type": "1hop", "hops": [hop("Lira Dun", "Tesk", False)]})
    others = [QA("5", "Where is Tesk?", ["Varn"], {"type": "1hop", "hops": [hop("Tesk", "Varn", False)]}),
              QA("7", "When was Bo Sel born?", ["1801"], {"type": "1hop", "hops": [hop("Bo Sel", "1801", False)]})]
    two_names, no_name = (searched_once(q.question, "Lira Dun", passage) for passage in (
        "Lira Dun (born 1801) grew up in Tesk, in Varn.", "Lira Dun was a painter (1801)."))
    for seed in range(10):
        wrong = Teacher(TOK, PP, [q, *others], seed=seed, **(EXACT | {"p_wrong_span": 1.0}))
        assert PP.parse(wrong.turn(two_names)).content == "Varn", seed
        guess = Teacher(TOK, PP, [q, *others], seed=seed, **EXACT).turn(no_name)
        assert PP.parse(guess).content in {"Tesk", "Varn"}, seed


def test_under_search_r1_the_teacher_writes_search_r1_turns():
    """The warm start teaches both protocols: under Search-R1's, each turn is a <think> block, then a
    <search> or an <answer>, from memory too (recall's rewrite demonstrations are R1-Searcher++'s)."""
    sr = get_protocol("search_r1", "toy")
    q = QA("1", "In which region was the founder's birthplace?", ["Varn"],
           {"type": "2hop", "hops": [hop("Lira Dun", "Tesk", True), hop("Tesk", "Varn", True)]})
    ask = f"Question: {sr.ask(q.question)}\n"
    assert Teacher(TOK, sr, [q], seed=0, **EXACT).turn(ask) == "<think> I know this. </think>\n<answer> Varn </answer>"
    teacher = Teacher(TOK, sr, [q], seed=0, **(EXACT | {"p_famous_internal": 0.0}))
    context, turns = ask, []
    for query in ("Lira Dun", "Tesk", None):
        turns.append(teacher.turn(context))
        context += f"{turns[-1]}\n{sr.info_open}Doc 1(Title: {query}) {PASSAGES.get(query)}\n{sr.info_close}\n"
    assert turns == ["<think> I need to search Lira Dun. </think>\n<search> Lira Dun </search>",
                     "<think> I found Tesk. I need to search Tesk. </think>\n<search> Tesk </search>",
                     "<think> I found Varn. </think>\n<answer> Varn </answer>"]


def test_every_answer_turn_ends_with_eos():
    """The teacher's turns are whole: an answer from memory (and recall, which writes stage 1's
    rewrite demonstrations) ends with EOS, so the SFT teaches the model to stop there."""
    q = QA("1", "In which region was the founder's birthplace?", ["Varn"],
           {"type": "2hop", "hops": [hop("Lira Dun", "Tesk", True), hop("Tesk", "Varn", True)]})
    teacher = Teacher(TOK, PP, [q], seed=0, **EXACT)
    response, n = play(teacher, q.question)
    assert n == 0 and response.endswith("\\boxed{Varn}.<eos>")
    assert teacher.recall("Varn").endswith("\\boxed{Varn}.<eos>")
    searched, n = play(Teacher(TOK, PP, [q], seed=0, **(EXACT | {"p_famous_internal": 0.0})), q.question)
    assert n == 2 and searched.endswith("\\boxed{Varn}.<eos>")


def test_each_mistake_fires_at_its_default_rate():
    """The warm start's teacher takes its defaults: guess 0.3, recall a famous question 0.9, stop
    after the first hop 0.45, search verbatim 0.05, copy a wrong span 0.05 (the module docstring's
    list). Each is measured alone, the others off, over 4000 decisions of one seeded stream
    (so the share is fixed): within 0.02 of its rate, 2.5 standard errors at 0.45. A doubled rate
    passed the tests above, which set each mistake's rate to 1 or 0."""
    import inspect

    rates = {k: p.default for k, p in inspect.signature(Teacher).parameters.items() if k.startswith("p_")}
    assert rates == {"p_guess": 0.3, "p_famous_internal": 0.9, "p_stop": 0.45, "p_verbatim": 0.05,
                     "p_wrong_span": 0.05}
    plain = QA("4", "When was Bo Sel born?", ["1801"], {"type": "1hop", "hops": [hop("Bo Sel", "1801", False)]})
    famous = QA("5", "When was Ri Tam born?", ["1799"], {"type": "1hop", "hops": [hop("Ri Tam", "1799", True)]})
    bridge = QA("3", "In which region was Lira Dun born?", ["Varn"],
                {"type": "2hop", "hops": [hop("Lira Dun", "Tesk", False), hop("Tesk", "Varn", False)]})
    lo_pim = QA("8", "When was Lo Pim born?", ["1803"], {"type": "1hop", "hops": [hop("Lo Pim", "1803", False)]})
    qa = [plain, famous, bridge, lo_pim]
    read = (f"Question: {plain.question}\nI need to search Bo Sel. <|begin_external_search|> Bo Sel "
            f"<|end_external_search|>\n{PP.info_open}Doc 1(Title: Bo Sel) Bo Sel (born 1801, baptised 1803).\n"
            f"{PP.info_close}\n")
    after_one_hop = (f"Question: {bridge.question}\nI need to search Lira Dun. <|begin_external_search|> Lira Dun "
                     f"<|end_external_search|>\n{PP.info_open}Doc 1(Title: Lira Dun) {PASSAGES['Lira Dun']}\n"
                     f"{PP.info_close}\n")
    checks = {  # the rate's name: (the context of the decision, whether the turn shows the mistake)
        "p_guess": (f"Question: {plain.question}\n", lambda out: "<|begin_internal_answer|>" in out),
        "p_famous_internal": (f"Question: {famous.question}\n", lambda out: "<|begin_internal_answer|>" in out),
        "p_stop": (after_one_hop, lambda out: "<|begin_external_search|>" not in out),
        "p_verbatim": (f"Question: {plain.question}\n", lambda out: f"> {plain.question} <" in out),
        "p_wrong_span": (read, lambda out: PP.parse(out).content == "1803"),
    }
    n = 4000
    for name, (context, mistake) in checks.items():
        teacher = Teacher(TOK, PP, qa, seed=0, **{k: v for k, v in EXACT.items() if k != name})  # name: its default
        share = sum(mistake(teacher.turn(context)) for _ in range(n)) / n
        assert share == pytest.approx(rates[name], abs=0.02), name


def test_generate_gives_the_turn_alone_with_no_bos_from_the_tokenizer():
    """As a sampler, the teacher returns each prompt's next turn as token ids: the turn's text and no
    BOS, under a tokenizer that adds one to what it encodes (without add_special_tokens=False, a BOS
    opened each turn; the tests' other tokenizers add none)."""
    from conftest import make_byte_tokenizer, with_bos

    tok = with_bos(make_byte_tokenizer())
    q = QA("1", "In which region was the founder's birthplace?", ["Varn"],
           {"type": "2hop", "hops": [hop("Lira Dun", "Tesk", False), hop("Tesk", "Varn", False)]})
    teacher = Teacher(tok, PP, [q], seed=0, **EXACT)
    prompt = tok.encode(f"Question: {q.question}\n", add_special_tokens=False)
    (ids,) = teacher.generate([prompt])
    assert tok.bos_token_id not in ids
    assert tok.decode(ids) == Teacher(tok, PP, [q], seed=0, **EXACT).turn(f"Question: {q.question}\n")
    assert tok.decode(ids).endswith(PP.stop[0])  # a search: the first hop is not famous
