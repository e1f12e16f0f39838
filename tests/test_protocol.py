"""Action parsing never raises and finds the first complete action; templates load from files."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from searchlite.protocol import MAX_QUERY_CHARS, Action, _unwrap_text, get_protocol
from searchlite.retrieval import Hit

SR1 = get_protocol("search_r1")
PP = get_protocol("r1_searcher_pp")

TAG_SOUP = st.lists(st.sampled_from(["<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>",
                                     "\\boxed{", "}", "{", "<|begin_external_search|>",
                                     "<|end_external_search|>", "<|begin_internal_answer|>",
                                     "<|end_internal_answer|>", " ", "x", "Paris", "\n"]), max_size=40)
PP_SPANS = {"<|begin_internal_answer|>": "<|end_internal_answer|>",
            "<|begin_external_search|>": "<|end_external_search|>"}


def occurrences(text: str, tag: str) -> list[int]:
    """Every position where `tag` starts, one character at a time."""
    return [i for i in range(len(text)) if text.startswith(tag, i)]


def complete_pairs(text: str, open_tag: str, close_tag: str) -> int:
    """How many open ... close pairs a left-to-right reader completes, each close the first after its open."""
    n, end, closes = 0, 0, occurrences(text, close_tag)  # end: where the last completed pair closes
    for start in occurrences(text, open_tag):
        if n and start < end:  # inside the pair just completed
            continue
        after = [c for c in closes if c >= start + len(open_tag)]
        if not after:
            break
        n, end = n + 1, after[0] + len(close_tag)
    return n


def naive_format_ok(p, text: str) -> bool:
    """Protocol.format_ok's rules, checked by a plain scan, one character at a time (no regex, no sorting)."""
    if p is SR1:  # one complete answer, one <answer> at all, and every <search> completed
        return (complete_pairs(text, "<answer>", "</answer>") == 1 and len(occurrences(text, "<answer>")) == 1
                and len(occurrences(text, "<search>")) == complete_pairs(text, "<search>", "</search>"))
    open_tag, i = None, 0  # R1-Searcher++: one span at a time, each closed by its own tag...
    while i < len(text):
        tag = next((t for t in (*PP_SPANS, *PP_SPANS.values()) if text.startswith(t, i)), None)
        if tag is None:
            i += 1
            continue
        if tag in PP_SPANS:
            if open_tag is not None:
                return False
            open_tag = tag
        elif open_tag is None or PP_SPANS[open_tag] != tag:
            return False
        else:
            open_tag = None
        i += len(tag)
    boxes = occurrences(text, "\\boxed{")
    if open_tag is not None or len(boxes) != 1:  # ...and exactly one \boxed{}, closed, with an answer in it...
        return False
    if any(occurrences(text, tag) and occurrences(text, tag)[-1] > boxes[0] for tag in PP_SPANS):
        return False  # ...after which no span opens
    depth = 0
    for j in range(boxes[0] + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return bool(_unwrap_text(text[boxes[0] + len("\\boxed{"):j]).strip())
    return False


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), TAG_SOUP.map("".join)))
def test_parse_never_raises(text):
    for p in (SR1, PP):
        a = p.parse(text)
        assert a.kind in ("search", "answer", "invalid")
        assert len(a.content) <= max(MAX_QUERY_CHARS, len(text))
        assert p.format_ok(text) is naive_format_ok(p, text)


@pytest.mark.parametrize("p, units", [
    (SR1, ["<answer>", "</answer>", "<search>", "</search>", " x "]),
    (PP, [*PP_SPANS, *PP_SPANS.values(), "\\boxed{x}", "\\boxed{ }", "}"]),
])
def test_format_ok_matches_the_plain_scan_on_every_short_sequence(p, units):
    """Every text of up to 5 units (nested and crossed spans, two answers, an empty or unclosed
    \\boxed{} among them), which random text rarely builds, against the scan above."""
    import itertools

    texts = ["".join(seq) for n in range(6) for seq in itertools.product(units, repeat=n)]
    got = [p.format_ok(t) for t in texts]
    assert got == [naive_format_ok(p, t) for t in texts]
    assert 0 < sum(got) < len(texts) / 2  # both answers occur: the scan is not trivially False (or True)


@pytest.mark.parametrize("text, expect", [
    ("<search> a b </search>", Action("search", "a b")),
    ("<search>\n  a \n b </search>", Action("search", "a b")),  # whitespace folded
    ("<answer>x</answer>", Action("answer", "x")),
    ("<search></search>", Action("invalid")),  # empty query
    ("<answer>   </answer>", Action("invalid")),  # empty answer
    ("<search> unclosed", Action("invalid")),
    ("no tags at all", Action("invalid")),
    ("<search> a </search> <answer> b </answer>", Action("search", "a")),  # first complete action
    ("<answer> b </answer> <search> a </search>", Action("answer", "b")),
    ("<search> a <search> b </search>", Action("search", "a <search> b")),  # nested: up to first close
    ("</search> <search> q </search>", Action("search", "q")),
])
def test_search_r1_cases(text, expect):
    assert SR1.parse(text) == expect


def test_long_query_is_cut():
    a = SR1.parse("<search> " + "w" * 10_000 + " </search>")
    assert a.kind == "search" and len(a.content) == MAX_QUERY_CHARS


@pytest.mark.parametrize("text, expect", [
    ("<|begin_external_search|> q1 <|end_external_search|>", Action("search", "q1")),
    ("<|begin_internal_answer|> it is X <|end_internal_answer|> so \\boxed{X}", Action("answer", "X")),
    ("\\boxed{a {nested} b}", Action("answer", "a {nested} b")),
    ("\\boxed{first} then \\boxed{second}", Action("answer", "second")),  # the last boxed answer
    ("\\boxed{unclosed", Action("invalid")),
    ("so \\boxed{Paris}. Also \\boxed{Lyo", Action("answer", "Paris")),  # a last box left open (a turn cut short)
    ("\\boxed{Paris} or \\boxed{Lyo", Action("answer", "Paris")),  # ...also when the closed one opens the text
    ("<|begin_external_search|> q", Action("invalid")),
    # in text order: an answer closed before the search opens ends the trajectory...
    ("\\boxed{a} <|begin_external_search|> q \\boxed{b} <|end_external_search|>", Action("answer", "a")),
    ("\\boxed{a} <|begin_external_search|> q <|end_external_search|> \\boxed{b}", Action("answer", "a")),
    # ...and one that opens after it, or inside the query, does not
    ("<|begin_external_search|> q <|end_external_search|> \\boxed{b}", Action("search", "q")),
    ("<|begin_external_search|> q \\boxed{b} <|end_external_search|>", Action("search", "q \\boxed{b}")),
])
def test_r1_searcher_pp_cases(text, expect):
    assert PP.parse(text) == expect


@pytest.mark.parametrize("text, expect", [
    (r"\boxed{\text{Paris}}", "Paris"),  # would be "\text{Paris}", normalized "textparis"
    (r"\boxed{\textbf{1984}}", "1984"),
    (r"\boxed{\textit{Hamlet}}", "Hamlet"),
    (r"\boxed{\mathrm{H_2O}}", "H_2O"),
    (r"\boxed{Paris}", "Paris"),
    (r"\boxed{\text{a {b} c}}", "a {b} c"),  # braces inside a wrapper are kept, and matched
    (r"\boxed{\text{New} \text{York}}", "New York"),  # several wrappers
    (r"\boxed{\textbf{\text{Nested}}}", "Nested"),  # nested wrappers
    (r"\boxed{\text {Lima} {x}}", "Lima {x}"),  # a space before the brace; plain braces kept
    (r"so \boxed{\text{first}} then \boxed{\textbf{second}}.", "second"),  # still the last boxed
    (r"\boxed{\textsc{Paris}}", "Paris"),  # other font forms too
    (r"\boxed{\emph{Hamlet}}", "Hamlet"),  # would normalize to "emphhamlet"
    (r"\boxed{\mbox{Paris}}", "Paris"),
    (r"\boxed{\operatorname{x}}", "x"),
    (r"\boxed{\mathit{\textsf{Lima}}}", "Lima"),
    (r"\boxed{Barack~Obama}", "Barack Obama"),  # a tie is a space (normalized "barackobama" before)
    (r"\boxed{\text{New\ York\,City}}", "New York City"),  # and so are \  and \,
    (r"\boxed{1\,000\,000}", "1,000,000"),  # between digit groups: a thousands separator ("1 000 000" before)
    (r"\boxed{12\;500~km}", "12,500 km"),
    (r"\boxed{3\,14}", "3 14"),  # not a group of three: a space
    (r"\boxed{\mathbb{R}}", r"\mathbb{R}"),  # not a text style: left alone
    (r"\boxed{\texts{Paris}}", r"\texts{Paris}"),  # a longer command name is not \text
    (r"\boxed{\text{}}", None),  # nothing left: no answer
])
def test_r1_searcher_pp_boxed_text_unwrapped(text, expect):
    assert PP.parse(text) == (Action("answer", expect) if expect is not None else Action("invalid"))


def test_unwrap_text_deep_and_unclosed():
    deep = "\\boxed{" + "\\text{" * 10_000 + "x" + "}" * 10_001
    assert PP.parse(deep) == Action("answer", "x")  # one pass, no recursion (a RecursionError would be "invalid")
    assert _unwrap_text(r"\text{a") == r"\text{a"  # cannot come from \boxed{} (braces matched): kept as is


def test_format_ok():
    assert SR1.format_ok("<think> t </think> <search> q </search>\n<information>..</information>\n<answer> a </answer>")
    assert not SR1.format_ok("<think> t </think>")
    assert not SR1.format_ok("<answer> a </answer><answer> b </answer>")
    assert PP.format_ok("<|begin_internal_answer|> a <|end_internal_answer|> \\boxed{a}")
    assert not PP.format_ok("<|begin_internal_answer|> a \\boxed{a}")  # unbalanced
    assert not PP.format_ok("no answer")
    assert not PP.format_ok("\\boxed{a} \\boxed{b}")
    # one span at a time: a search inside an internal answer, or the other way round, is not well formed
    ia, ea = "<|begin_internal_answer|> a <|end_internal_answer|>", "<|begin_external_search|> q <|end_external_search|>"
    assert PP.format_ok(f"{ia} {ea} \\boxed{{a}}") and PP.format_ok(f"{ea} {ia} {ea} \\boxed{{a}}")
    assert not PP.format_ok("<|begin_internal_answer|> " + ea + " <|end_internal_answer|> \\boxed{a}")
    assert not PP.format_ok("<|begin_external_search|> q " + ia + " <|end_external_search|> \\boxed{a}")
    assert not PP.format_ok("<|begin_internal_answer|> a <|end_external_search|> \\boxed{a}")  # the wrong close
    assert not PP.format_ok("<|begin_internal_answer|> <|begin_internal_answer|> a <|end_internal_answer|> "
                            "<|end_internal_answer|> \\boxed{a}")
    # the answer is the last action: a search (or recall) written after it is never run
    assert not PP.format_ok(f"{ia} \\boxed{{a}} Let me check. {ea}")
    assert not PP.format_ok(f"\\boxed{{a}} {ia}")
    assert PP.format_ok("<|begin_internal_answer|> so \\boxed{a} <|end_internal_answer|>")  # inside its span


def test_each_protocol_stops_a_turn_at_its_action_tags():
    """A turn that ran on past its </answer> trained the tokens after it with the answer's reward."""
    assert get_protocol("search_r1").stop == ("</search>", "</answer>")
    assert get_protocol("r1_searcher_pp").stop == ("<|end_external_search|>",)  # a \boxed{} answer ends at EOS


def test_template_from_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("Q: {question}\nA:")
    p = get_protocol("search_r1", str(f))
    assert p.prompt("  why?  ") == "Q: why?\nA:\n"
    bad = tmp_path / "bad.txt"
    bad.write_text("no placeholder")
    with pytest.raises(ValueError, match="placeholder"):
        get_protocol("search_r1", str(bad))
    with pytest.raises(ValueError, match="unknown protocol"):
        get_protocol("search_r2")


def test_a_bare_file_name_here_is_a_template_unless_a_set_has_that_name(tmp_path, monkeypatch):
    """--template mytemplate (a file here, no extension) was read as the missing set 'mytemplate'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mytemplate").write_text("Mine: {question}")
    assert get_protocol("search_r1", "mytemplate").prompt("why") == "Mine: why?\n"
    (tmp_path / "toy").write_text("Mine: {question}")  # a set of that name wins, as documented
    assert "Mine" not in get_protocol("search_r1", "toy").template


def test_the_rewrite_prompt_is_a_sets_own_else_the_papers(tmp_path, monkeypatch):
    """R1-Searcher++'s rewrite prompt: a template set's own rewrite file; for the paper's prompt or
    a prompt file, also one named by a bare word here, the paper-style one (that bare file was
    used as the rewrite prompt: the question prompt, asked to rewrite)."""
    from searchlite.protocol import TEMPLATE_DIR, rewrite_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "myprompt").write_text("Mine: {question}")
    papers = TEMPLATE_DIR / "r1_searcher_pp_rewrite.txt"
    assert rewrite_path("r1_searcher_pp", "toy") == TEMPLATE_DIR / "toy_r1_searcher_pp_rewrite.txt"
    for template in ("", "myprompt", str(tmp_path / "myprompt"), "prompts/mine.txt"):
        assert rewrite_path("r1_searcher_pp", template) == papers, template
    assert papers.is_file() and rewrite_path("r1_searcher_pp", "toy").is_file()


def test_a_utf8_template_is_read_under_an_ascii_locale(tmp_path):
    """Templates (and prompt sets, rewrite prompts, judge prompts) are UTF-8 files, whatever the locale."""
    from conftest import run_under_ascii_locale

    from searchlite.evaluation import load_prompts
    from searchlite.judge import Judge

    (tmp_path / "t.txt").write_text("Frage \u2014 {question}\nAntwort:", encoding="utf-8")
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "direct.txt").write_text("Frage \u2014 {question}\nAntwort:", encoding="utf-8")
    (tmp_path / "judge.txt").write_text("\u00bf{question} {golden_answers} {prediction}?", encoding="utf-8")
    script = ("import sys; from searchlite.protocol import get_protocol; from searchlite.evaluation import "
              "load_prompts; from searchlite.judge import Judge; "
              "print(ascii(get_protocol('search_r1', sys.argv[1]).template)); "
              "print(ascii(load_prompts(sys.argv[2])['direct'])); "
              "print(ascii(Judge('http://x', 'm', sys.argv[3]).template))")
    done = run_under_ascii_locale(script, *(str(tmp_path / name) for name in ("t.txt", "set", "judge.txt")))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [ascii(get_protocol("search_r1", str(tmp_path / "t.txt")).template),
                                        ascii(load_prompts(str(tmp_path / "set"))["direct"]),
                                        ascii(Judge("http://x", "m", str(tmp_path / "judge.txt")).template)]
    assert "Frage \\u2014 " in done.stdout and "\\xbf" in done.stdout  # ascii() of the em dash and of the "¿"


def test_default_templates_follow_the_papers():
    text = SR1.prompt("Who?")
    for tag in ("<think>", "<search>", "</search>", "<information>", "<answer>"):
        assert tag in text
    assert text.rstrip().endswith("Question: Who?")
    assert "\\boxed{" in PP.prompt("Who?") and "<|begin_external_search|>" in PP.prompt("Who?")


def test_template_sets():
    assert get_protocol("search_r1", "toy").template.startswith("Search with <search> query </search>")
    assert "<|begin_external_search|>" in get_protocol("r1_searcher_pp", "toy").template
    assert get_protocol("search_r1", "").template == SR1.template
    with pytest.raises(FileNotFoundError, match=r"nosuch_search_r1.txt does not exist; give a prompt file with "
                                                r"\{question\}, or a set here: fewshot, toy, '' \(the paper's\)"):
        get_protocol("search_r1", "nosuch")  # what evaluate.py prints for a mistyped --template


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def hits_of(n, text="x"):
    """n hits, ids "1".."n", titled T1..Tn."""
    return [Hit(id=str(k), title=f"T{k}", text=text, score=1.0) for k in range(1, n + 1)]


def test_max_tokens_below_the_two_tags_gives_the_tags_alone(byte_tokenizer):
    """A max_tokens smaller than the opening and closing tags together yields exactly the two tags,
    with no passage token between them, for every such budget (0 included)."""
    head, tail = encode(byte_tokenizer, "\n<information>"), encode(byte_tokenizer, "</information>\n")
    for max_tokens in range(0, len(head) + len(tail) + 1):
        assert SR1.observation_ids(byte_tokenizer, hits_of(2, "abcdefgh"), max_tokens) == head + tail


def test_observation_block_is_head_passages_tail_exactly(byte_tokenizer):
    """The uncut block is "\\n<information>" + the formatted passages + "</information>\\n", and a cut one keeps
    exactly max_tokens ids: the head, the first passage ids, the tail."""
    hits = hits_of(2, "about it")
    head, tail = encode(byte_tokenizer, "\n<information>"), encode(byte_tokenizer, "</information>\n")
    body = encode(byte_tokenizer, "Doc 1(Title: T1) about it\nDoc 2(Title: T2) about it\n")
    assert SR1.observation_ids(byte_tokenizer, hits, 10_000) == head + body + tail
    assert SR1.observation_ids(byte_tokenizer, hits, len(head) + len(tail) + 7) == head + body[:7] + tail


def test_a_passage_cut_before_its_opening_parenthesis_is_not_shown(byte_tokenizer):
    """A passage counts as shown from its "Doc k(" start on: a block cut right after "Doc 2" shows only the
    first hit."""
    hits = hits_of(2)
    cut = encode(byte_tokenizer, "\n<information>Doc 1(Title: T1) x\nDoc 2</information>\n")
    assert [h.id for h in SR1.shown(byte_tokenizer, hits, cut)] == ["1"]
    whole = encode(byte_tokenizer, "\n<information>Doc 1(Title: T1) x\nDoc 2(Tit</information>\n")
    assert [h.id for h in SR1.shown(byte_tokenizer, hits, whole)] == ["1", "2"]


def test_every_latex_space_command_in_a_boxed_answer_is_a_space():
    """LaTeX's medium space \\: (like \\, \\; and \\ ) separates words of a \\boxed{} answer, and between digit
    groups of three it is a thousands separator."""
    assert PP.parse(r"\boxed{New\:York}") == Action("answer", "New York")
    assert PP.parse(r"\boxed{\text{Rio\:de\;Janeiro}}") == Action("answer", "Rio de Janeiro")
    assert PP.parse(r"\boxed{2\:500}") == Action("answer", "2,500")


def test_an_action_ends_at_its_first_closing_tag():
    """The content of an answer or a search runs to the first closing tag after its opening one, not the last."""
    assert SR1.parse("<answer> a </answer> b </answer>") == Action("answer", "a")
    assert SR1.parse("<search> q </search> r </search>") == Action("search", "q")
    assert PP.parse("<|begin_external_search|> q <|end_external_search|> r <|end_external_search|>") == \
        Action("search", "q")


def test_an_answer_written_inside_a_search_belongs_to_the_search():
    """The action that opens first wins: an <answer> inside an open <search> is part of the query (as Search-R1's
    `<(search|answer)>(.*?)</\\1>` scan reads it)."""
    assert SR1.parse("<search> q <answer> a </answer> </search>") == Action("search", "q <answer> a </answer>")


def test_digits_split_by_a_latex_space_are_grouped_only_by_three():
    """A LaTeX space between digits is a thousands separator only before exactly three digits: 3\\,1415 stays
    two numbers."""
    assert PP.parse(r"\boxed{3\,1415}") == Action("answer", "3 1415")
    assert PP.parse(r"\boxed{3\,141}") == Action("answer", "3,141")


def test_queries_up_to_a_thousand_characters_are_kept_whole():
    """A query of 1000 characters reaches the retriever unchanged; one of 1001 loses its last character."""
    query = "where " * 166 + "is i"  # 1000 characters, several words
    assert SR1.parse(f"<search> {query} </search>") == Action("search", query)
    assert SR1.parse(f"<search> {query}z </search>") == Action("search", query)
