"""The HTML trajectory view: policy and retrieved tokens in different colours, nothing lost."""

import html
import re

import pytest
import torch
from conftest import free_port, run_under_ascii_locale
from test_rollout import SCRIPTS, FakeRetriever, ScriptedSampler

from searchlite.protocol import get_protocol
from searchlite.rollout import Rollout, rollout
from searchlite.view import STYLE, render, segments, write_html


def test_segments():
    assert segments([1, 2, 3, 4, 5], [1, 1, 0, 0, 1]) == [(1, [1, 2]), (0, [3, 4]), (1, [5])]
    assert segments([], []) == []


def test_render_colours_and_content(byte_tokenizer, tmp_path):
    tok, protocol = byte_tokenizer, get_protocol("search_r1")
    qs = ["q-search", "q-invalid"]
    ro = rollout(ScriptedSampler(tok, SCRIPTS), FakeRetriever(), tok, protocol, qs, topk=2, max_turns=2)
    page = render(ro, tok, [1.0, 0.0], [["Paris"], ["Rome"]], title="t")
    body = page.split("</p>", 1)[1]  # after the legend
    policy = [html.unescape(s) for s in re.findall(r"<span class='policy'>(.*?)</span>", body, re.S)]
    other = [html.unescape(s) for s in re.findall(r"<span class='other'>(.*?)</span>", body, re.S)]
    # every sampled reply is shown as policy text, every passage and message as other text
    assert policy[:2] == SCRIPTS["q-search"][:2]
    assert any("Doc 1(Title: T0) about france capital 0" in s for s in other)
    assert any("My previous action is invalid" in s for s in other)
    assert "<search>" not in body and "&lt;search&gt;" in body  # model text is escaped, never raw HTML
    assert "searches 1" in page and "reward <span class='ok'>1</span>" in page
    path = write_html(tmp_path / "sub" / "v.html", ro, tok, [1.0, 0.0], [["Paris"], ["Rome"]])
    assert path.read_text() == render(ro, tok, [1.0, 0.0], [["Paris"], ["Rome"]])
    # a reward of 0 (R1-Searcher++'s: also negative) is not shown as a success
    assert "reward <span class='bad'>0</span>" in page and "reward <span class='bad'>-2</span>" in render(
        ro, tok, [1.0, -2.0], [["Paris"], ["Rome"]])
    # the first trajectory's text after its prompt, exactly: no prompt token in it, none lost
    first = page.split("<div class='traj'>")[1]
    shown = html.unescape("".join(re.findall(r"<span class='(?:policy|other)'>(.*?)</span>", first.split("</details>")[1],
                                             re.S)))
    p, n = int(ro.prompt_len[0]), int(ro.attention_mask[0].sum())
    assert shown == tok.decode(ro.input_ids[0, p:n].tolist(), skip_special_tokens=False)
    assert render(ro, tok, [1.0, 0.0], [["Paris"], ["Rome"]], limit=1).count("<div class='traj'>") == 1
    ro.answers[0] = "<b>Paris</b>"  # the model's answer is its text, never markup
    assert "answer <b>&lt;b&gt;Paris&lt;/b&gt;</b>" in render(ro, tok, [1.0, 0.0], [["Paris"], ["Rome"]])


def test_the_command_prompts_the_toy_model_with_the_toy_template(tmp_path):
    """`python -m searchlite.view` rolls the toy model out under the prompt it was trained and is
    evaluated with, not the paper's, which it never saw."""
    from searchlite.protocol import TEMPLATE_DIR
    from searchlite.view import main

    out = tmp_path / "view.html"
    main(["--n", "2", "--greedy", "--out", str(out)])
    page = out.read_text()
    toy = (TEMPLATE_DIR / "toy_search_r1.txt").read_text().split("{question}")[0]
    paper = (TEMPLATE_DIR / "search_r1.txt").read_text().split("{question}")[0]
    assert page.count(html.escape(toy)) == 2 and html.escape(paper) not in page


def test_the_command_renders_eight_questions_unless_told(tmp_path):
    """--n's default, as its help says (without it, every question of the set was rolled out)."""
    from searchlite.protocol import TEMPLATE_DIR
    from searchlite.view import main

    out = tmp_path / "view.html"
    main(["--max_turns", "0", "--max_new_tokens", "1", "--out", str(out)])
    toy = (TEMPLATE_DIR / "toy_search_r1.txt").read_text().split("{question}")[0]
    assert out.read_text().count(html.escape(toy)) == 8


def test_the_command_samples_as_the_run_did(tmp_path, monkeypatch):
    """The toy warm start is sampled as the [toy] preset samples it (0.7, 64 tokens a turn), a
    train.py run as its config.json says, any other model at 1.0 and 500, and the flags win."""
    import json
    import shutil

    import searchlite.sampler
    from searchlite.config import TOY_DIR
    from searchlite.view import main

    seen = []
    real = searchlite.sampler.HFSampler.__init__

    def record(self, *a, **kw):
        seen.append((kw["temperature"], kw["max_new_tokens"]))
        real(self, *a, **kw)

    monkeypatch.setattr(searchlite.sampler.HFSampler, "__init__", record)
    out = str(tmp_path / "view.html")
    main(["--n", "1", "--max_turns", "0", "--out", out])
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    shutil.copytree(TOY_DIR / "model", run / "checkpoint" / "policy")
    (run / "config.json").write_text(json.dumps({"protocol": "search_r1", "template": "toy", "chat_template": True,
                                                 "temperature": 0.9, "max_new_tokens": 20}))
    main(["--model", str(run), "--n", "1", "--max_turns", "0", "--out", out])
    main(["--model", str(run), "--n", "1", "--max_turns", "0", "--temperature", "1", "--max_new_tokens", "8",
          "--out", out])
    shutil.copytree(TOY_DIR / "model", tmp_path / "plain")  # a model folder of no run: HFSampler's defaults
    main(["--model", str(tmp_path / "plain"), "--n", "1", "--max_turns", "0", "--out", out])
    assert seen == [(0.7, 64), (0.9, 20), (1.0, 8), (1.0, 500)]


def test_unmasked_passages_are_shown_as_trained_on(byte_tokenizer):
    """With mask_retrieved false (Search-R1's ablation) passages are in the loss: the page colours
    them as trained on, and its legend says colour means "in the loss", not "sampled"."""
    tok, protocol = byte_tokenizer, get_protocol("search_r1")
    ro = rollout(ScriptedSampler(tok, SCRIPTS), FakeRetriever(), tok, protocol, ["q-search"], topk=2, max_turns=2,
                 mask_retrieved=False)
    page = render(ro, tok, [1.0], [["Paris"]])
    legend, body = page.split("</p>", 1)
    policy = [html.unescape(s) for s in re.findall(r"<span class='policy'>(.*?)</span>", body, re.S)]
    assert any("Doc 1(Title: T0) about france capital 0" in s for s in policy)
    assert "in the loss (loss_mask 1)" in legend and "not in the loss (loss_mask 0)" in legend


def test_the_command_names_a_bad_protocol_or_template_and_takes_temperature_0_as_greedy(tmp_path, capsys):
    """An unknown protocol or template, or --temperature 0, ended in tracebacks; a --pooling outside
    its choices is a usage error."""
    from searchlite.view import main

    with pytest.raises(SystemExit, match=r"^error: unknown protocol 'searchr1' \(valid: search_r1, r1_searcher_pp\)$"):
        main(["--protocol", "searchr1"])
    with pytest.raises(SystemExit, match=r"^error: .*nosuch_search_r1.txt does not exist"):
        main(["--template", "nosuch"])
    with pytest.raises(SystemExit):
        main(["--temperature", "-1"])
    assert "argument --temperature: must be at least 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (without its choices, test_view passed)
        main(["--pooling", "max"])
    assert "argument --pooling: invalid choice: 'max'" in capsys.readouterr().err
    main(["--n", "2", "--temperature", "0", "--out", str(tmp_path / "zero.html")])
    main(["--n", "2", "--greedy", "--out", str(tmp_path / "greedy.html")])
    assert (tmp_path / "zero.html").read_text() == (tmp_path / "greedy.html").read_text()


@pytest.mark.parametrize("flag, value, least", [("--n", "0", 1), ("--topk", "0", 1), ("--max_obs_tokens", "0", 1),
                                                ("--max_len", "0", 1), ("--max_new_tokens", "0", 1),
                                                ("--max_turns", "-1", 0)])
def test_the_command_refuses_counts_below_their_least_by_name(capsys, tmp_path, flag, value, least):
    from searchlite.view import main

    with pytest.raises(SystemExit):
        main([flag, value, "--out", str(tmp_path / "never.html")])
    assert f"argument {flag}: must be at least {least}, got {value}" in capsys.readouterr().err


def test_the_command_asks_for_a_server_address_as_train_py_does():
    """view --retriever http without --retriever_url said "--retriever_url : ... URL '' needs its scheme"."""
    from searchlite.view import main

    with pytest.raises(SystemExit, match=r"^error: --retriever http needs --retriever_url \(a Search-R1-compatible"):
        main(["--retriever", "http"])


def test_the_command_names_a_bad_or_missing_file_in_one_line(tmp_path, monkeypatch):
    """A bad JSON line or a missing file ended in a DataError or FileNotFoundError traceback, after
    the model had loaded; now it is one line naming the file (and line), before the model loads."""
    import searchlite.model_spec
    from searchlite.view import main

    def never(*args, **kw):
        raise AssertionError("the model was loaded before the files were read")

    monkeypatch.setattr(searchlite.model_spec, "load_model", never)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "golden_answers": ["x"]}\n{"question": \n')
    with pytest.raises(SystemExit, match=f"^error: {re.escape(str(bad))}:2: bad JSON"):
        main(["--data", str(bad)])
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(SystemExit, match=f"^error: {re.escape(str(missing))}: No such file or directory$"):
        main(["--data", str(missing)])
    with pytest.raises(SystemExit, match=f"^error: {re.escape(str(missing))}: No such file or directory$"):
        main(["--corpus", str(missing)])
    bad.write_text('{"id": "0", "contents": "\\"T\\"\\nx"}\n{"id": "1", "contents": 5}\n')  # a corpus, line 2 bad
    with pytest.raises(SystemExit, match=f"^error: {re.escape(str(bad))}:2: field 'contents' must be a string"):
        main(["--corpus", str(bad)])


def test_the_command_names_an_out_that_cannot_be_written(tmp_path, monkeypatch, capsys):
    """--out a folder ended in an IsADirectoryError traceback after every rollout had run."""
    import searchlite.model_spec
    from searchlite.view import main

    monkeypatch.setattr(searchlite.model_spec, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path)])
    assert e.value.code == 2 and f"argument --out: {tmp_path} is a folder; give the HTML file" in capsys.readouterr().err
    monkeypatch.undo()
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match=rf"^error: --out: {re.escape(str(tmp_path / 'afile'))}: File exists$"):
        main(["--n", "1", "--max_new_tokens", "2", "--out", str(tmp_path / "afile" / "v.html")])


def test_the_command_searches_with_the_runs_retriever_unless_told_otherwise(tmp_path, monkeypatch):
    """view searched BM25 over the toy corpus, and asked toy questions, whatever the run had trained
    on; it now takes a run's test set, retriever settings (corpus, index, encoder, server) and
    lengths as it takes its prompt, and its flags win (a retriever flag: the run's others go too).
    Its --max_turns, --chat_template and --greedy reach the rollout (each dropped from the call,
    test_view passed)."""
    import json
    import shutil

    import searchlite.data
    import searchlite.retrieval
    import searchlite.rollout
    from searchlite.config import TOY_DIR
    from searchlite.view import main

    seen, asked, lengths = [], [], []
    real, real_qa, real_rollout = searchlite.retrieval.build_retriever, searchlite.data.read_qa, searchlite.rollout.rollout

    def record(kind, corpus=None, **kw):
        seen.append((kind, corpus, kw.get("index"), kw.get("url")))
        return real(kind, corpus, **kw)

    def rollout(*a, **kw):
        lengths.append((kw["topk"], kw["max_obs_tokens"], kw["max_len"], kw.get("max_turns"), kw.get("chat_template"),
                        kw.get("greedy")))
        return real_rollout(*a, **kw)

    monkeypatch.setattr(searchlite.retrieval, "build_retriever", record)
    monkeypatch.setattr(searchlite.data, "read_qa", lambda path: asked.append(path) or real_qa(path))
    monkeypatch.setattr(searchlite.rollout, "rollout", rollout)
    run, out = tmp_path / "run", str(tmp_path / "view.html")
    shutil.copytree(TOY_DIR / "model", run / "checkpoint" / "policy")
    corpus, test = tmp_path / "c.jsonl", tmp_path / "t.jsonl"
    shutil.copy(TOY_DIR / "corpus.jsonl", corpus)
    shutil.copy(TOY_DIR / "test.jsonl", test)
    (run / "config.json").write_text(json.dumps({"protocol": "search_r1", "template": "toy", "retriever": "rank_bm25",
                                                 "corpus": str(corpus), "test_data": str(test), "topk": 2,
                                                 "max_obs_tokens": 100, "max_len": 900}))
    main(["--model", str(run), "--n", "1", "--max_turns", "0", "--out", out])
    main(["--model", str(run), "--n", "1", "--max_turns", "1", "--retriever", "bm25", "--topk", "1", "--out", out,
          "--chat_template", "false"])
    main(["--n", "1", "--max_turns", "0", "--out", out, "--greedy"])  # the warm start: the toy world
    toy = str(TOY_DIR / "corpus.jsonl")
    assert seen == [("rank_bm25", str(corpus), None, None), ("bm25", toy, None, None), ("bm25", toy, None, None)]
    assert asked == [str(test), str(test), str(TOY_DIR / "test.jsonl")]
    assert lengths == [(2, 100, 900, 0, True, False), (1, 100, 900, 1, False, False), (3, 500, 4096, 0, True, True)]
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit, match=re.escape(f"error: --retriever_url {dead}: the retrieval server does not")):
        main(["--model", str(run), "--n", "1", "--retriever_url", dead, "--out", out])


def test_the_command_scores_an_r1pp_run_by_its_own_reward(tmp_path, monkeypatch):
    """A `--reward r1pp` run was trained on R_format (0 or -2) + R_answer (cover-EM); view showed
    exact match for it, so a malformed trajectory read as 0 and an answer that covers the gold in
    more words as wrong. The rollouts are replaced by hand-written ones with known rewards."""
    import dataclasses
    import json
    import shutil

    import searchlite.rollout
    import searchlite.view
    from searchlite.config import TOY_DIR

    written = [
        "<|begin_internal_answer|> I know it. <|end_internal_answer|> \\boxed{the city of Paris}",  # 0 + 1 (EM 0)
        "<|begin_internal_answer|> I know it. <|end_internal_answer|> \\boxed{Lyon}",  # well formed, wrong: 0 + 0
        "<|begin_internal_answer|> I know it. \\boxed{Paris}",  # a span never closed: -2 + 1 (EM 1)
        "I do not know.",  # no answer: -2 + 0
        "<|begin_internal_answer|> I know it. <|end_internal_answer|> \\boxed{Paris}",  # 0 + 1 (EM 1)
    ]  # five, an odd count: each is scored on its own (no R_group, so no groups of two or more)
    real = searchlite.rollout.rollout

    def rollout(*args, **kwargs):
        ro = real(*args, **kwargs)
        return dataclasses.replace(ro, responses=written, answers=["the city of Paris", "Lyon", "Paris", None, "Paris"])

    shown = {}
    monkeypatch.setattr(searchlite.rollout, "rollout", rollout)
    monkeypatch.setattr(searchlite.view, "write_html", lambda path, ro, tok, rewards, golds, title: shown.update(
        rewards=rewards, title=title))
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"id": str(i), "question": f"q{i}?", "golden_answers": ["Paris"]}) + "\n"
                          for i in range(5)))
    run = tmp_path / "run"
    shutil.copytree(TOY_DIR / "model", run / "checkpoint" / "policy")
    config = {"protocol": "r1_searcher_pp", "template": "toy", "reward": "r1pp"}
    (run / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(run), "--data", str(qa), "--max_turns", "0", "--max_new_tokens", "4", "--greedy",
            "--out", str(tmp_path / "v.html")]
    searchlite.view.main(argv)
    assert shown["rewards"] == [1.0, 0.0, -1.0, -2.0, 1.0] and "R_format + R_answer" in shown["title"]
    (run / "config.json").write_text(json.dumps({**config, "reward": "em"}))  # an EM run: exact match, as before
    searchlite.view.main(argv)
    assert shown["rewards"] == [0.0, 0.0, 1.0, 0.0, 1.0] and "exact match" in shown["title"]


def test_a_page_is_written_in_utf8_under_an_ascii_locale(tmp_path):
    """The page declares UTF-8; a passage or answer outside the locale's charset must not stop a run."""
    script = r"""
import sys, torch
from searchlite.view import write_html
text = "Z\u00fcrich \u2014 \u6771\u4eac"
ids = torch.tensor([[ord(c) for c in text]])  # (1, T): one id per code point
class Ro:
    input_ids, attention_mask, loss_mask, prompt_len = ids, torch.ones_like(ids), torch.ones_like(ids), [2]
    answers, searches, turns = ["Z\u00fcrich"], [0], [1]
    def __len__(self):
        return 1
class Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))
write_html(sys.argv[1], Ro(), Tok(), [1.0], [["Z\u00fcrich"]])
"""
    done = run_under_ascii_locale(script, str(tmp_path / "p.html"))
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "p.html").read_bytes().decode("utf-8")
    assert "<meta charset='utf-8'>" in page
    assert "answer <b>Zürich</b>" in page and "gold Zürich" in page and "rich — 東京</span>" in page


def make_rollout(tok, rows):
    """A right-padded Rollout from rows of (prompt, [(loss_mask, text), ...], answer, searches, turns)."""
    seqs, masks, plens = [], [], []
    for prompt, pieces, *_ in rows:
        ids = tok.encode(prompt, add_special_tokens=False)
        mask = [0] * len(ids)
        plens.append(len(ids))
        for m, text in pieces:
            piece = tok.encode(text, add_special_tokens=False)
            ids, mask = ids + piece, mask + [m] * len(piece)
        seqs.append(ids)
        masks.append(mask)
    width = max(map(len, seqs))
    pad = lambda xs, v: xs + [v] * (width - len(xs))  # noqa: E731
    return Rollout(input_ids=torch.tensor([pad(s, tok.pad_token_id) for s in seqs]),
                   attention_mask=torch.tensor([pad([1] * len(s), 0) for s in seqs]),
                   loss_mask=torch.tensor([pad(m, 0) for m in masks]),
                   prompt_len=torch.tensor(plens),
                   searches=torch.tensor([r[3] for r in rows]), turns=torch.tensor([r[4] for r in rows]),
                   answered=torch.tensor([r[2] is not None for r in rows]), answers=[r[2] for r in rows],
                   responses=["".join(t for _, t in r[1]) for r in rows])


ROWS = [("Q: capital of France?\n", [(1, "<search> france </search>"), (0, "\n<information>Doc 1</information>\n"),
                                     (1, "<answer> Paris </answer>")], "Paris", 1, 2),
        ("Q: 2+2?\n", [(1, "<answer> 4 </answer>")], "4", 0, 1),
        ("Q: who?\n", [(1, "I do not know")], None, 0, 3)]


class NoRollouts:
    """A rollout of no trajectories: the page is its title and legend."""

    def __len__(self):
        return 0


def heads(page: str) -> list[str]:
    return re.findall(r"<div class='head'>(.*?)</div>", page, re.S)


def test_the_head_shows_each_trajectorys_fields_in_order(byte_tokenizer):
    """Each head: its index, reward, answer, every gold answer joined by ' | ', searches, turns,
    and the prompt's length in tokens (the byte tokenizer: one token a character)."""
    ro = make_rollout(byte_tokenizer, ROWS[:2])
    page = render(ro, byte_tokenizer, [1.0, 0.0], [["Paris", "City of Paris"], ["4", "four"]])
    assert heads(page) == [
        "#0 &nbsp; reward <span class='ok'>1</span> &nbsp; answer <b>Paris</b> &nbsp; gold Paris | City of Paris"
        " &nbsp; searches 1 &nbsp; turns 2",
        "#1 &nbsp; reward <span class='bad'>0</span> &nbsp; answer <b>4</b> &nbsp; gold 4 | four"
        " &nbsp; searches 0 &nbsp; turns 1"]
    assert re.findall(r"<summary>prompt \((\d+) tokens\)</summary>", page) == ["22", "8"]
    # no answer is told apart from a model that answered the word "None"
    rows = [ROWS[2], ("Q: who?\n", [(1, "<answer> None </answer>")], "None", 0, 1)]
    page = render(make_rollout(byte_tokenizer, rows), byte_tokenizer, [0.0, 0.0], [["Bob"], ["Bob"]])
    assert [h.split(" &nbsp; ")[2] for h in heads(page)] == ["answer <i>none</i>", "answer <b>None</b>"]


def test_a_fractional_reward_is_shown_as_it_is_and_positive_is_success(byte_tokenizer):
    """An r1pp run's reward adds fractional group terms: 0.25 and 1.5 are successes, -0.5 is not,
    and each is written as its value, not rounded."""
    ro = make_rollout(byte_tokenizer, ROWS)
    page = render(ro, byte_tokenizer, [0.25, 1.5, -0.5], [["Paris"], ["4"], ["Bob"]])
    got = [re.search(r"reward <span class='(\w+)'>(.*?)</span>", h).groups() for h in heads(page)]
    assert got == [("ok", "0.25"), ("ok", "1.5"), ("bad", "-0.5")]


def test_limit_caps_the_trajectories_shown(byte_tokenizer):
    """limit n shows the first n trajectories; a limit at or above their number shows them all."""
    ro = make_rollout(byte_tokenizer, ROWS)
    golds = [["Paris"], ["4"], ["Bob"]]
    for limit, want in ((0, 3), (1, 1), (2, 2), (3, 3), (8, 3)):
        page = render(ro, byte_tokenizer, [1.0, 1.0, 0.0], golds, limit=limit)
        assert [h.split(" ")[0] for h in heads(page)] == [f"#{i}" for i in range(want)], limit


def test_special_tokens_in_the_prompt_and_response_are_shown(byte_tokenizer):
    """The EOS that ends a response, and special tokens in a (chat-templated) prompt, are shown."""
    rows = [("<|endoftext|>Q: hi\n", [(1, "<answer> x </answer><|endoftext|>")], "x", 0, 1)]
    page = render(make_rollout(byte_tokenizer, rows), byte_tokenizer, [0.0], [["y"]])
    prompt = re.search(r"</summary><pre>(.*?)</pre>", page, re.S).group(1)
    assert html.unescape(prompt) == "<|endoftext|>Q: hi\n"
    spans = re.findall(r"<span class='policy'>(.*?)</span>", page.split("</details>")[1], re.S)
    assert [html.unescape(s) for s in spans] == ["<answer> x </answer><|endoftext|>"]


def test_gold_answers_and_title_are_escaped(byte_tokenizer):
    """Gold answers and the page title are text, never markup."""
    ro = make_rollout(byte_tokenizer, ROWS[1:2])
    page = render(ro, byte_tokenizer, [1.0], [["<i>4</i>", "a & b"]], title="run <x> & y")
    assert "gold &lt;i&gt;4&lt;/i&gt; | a &amp; b &nbsp;" in page
    assert "<title>run &lt;x&gt; &amp; y</title>" in page and "<h2>run &lt;x&gt; &amp; y</h2>" in page
    assert "<i>" not in page and "<x>" not in page


def test_write_html_makes_missing_folders_and_keeps_title_and_limit(byte_tokenizer, tmp_path):
    """train.py writes its pages with a title and limit 8 into folders that may not exist yet."""
    ro = make_rollout(byte_tokenizer, ROWS)
    args = (ro, byte_tokenizer, [1.0, 1.0, 0.0], [["Paris"], ["4"], ["Bob"]])
    path = write_html(tmp_path / "a" / "b" / "v.html", *args, title="step 3", limit=2)
    page = path.read_text(encoding="utf-8")
    assert page == render(*args, title="step 3", limit=2)
    assert page.count("<div class='traj'>") == 2 and "<h2>step 3</h2>" in page


def test_trained_and_untrained_tokens_have_different_colours_and_the_legend_matches():
    """The two classes are drawn in different backgrounds, and the legend labels each class by
    its own meaning: 'policy' is in the loss (loss_mask 1), 'other' is not (loss_mask 0)."""
    backgrounds = dict(re.findall(r"\.(policy|other) \{ background: (#[0-9a-f]{6});", STYLE))
    assert set(backgrounds) == {"policy", "other"} and backgrounds["policy"] != backgrounds["other"]
    legend = render(NoRollouts(), None, [], [], title="t").split("<p class='legend'>")[1].split("</p>")[0]
    assert re.findall(r"<span class='(\w+)'>(.*?) \(", legend) == [("policy", "in the loss"),
                                                                    ("other", "not in the loss")]


def test_the_command_stops_a_turn_at_a_new_question_and_samples_with_its_seed(tmp_path, monkeypatch):
    """As evaluate.py does, a turn stops where the model starts a "Question:" of its own (the
    protocol's stops and "\\nQuestion:"); --seed reaches the sampler."""
    import searchlite.rollout
    import searchlite.sampler
    from searchlite.view import main

    stops, seeds = [], []
    real_rollout, real_init = searchlite.rollout.rollout, searchlite.sampler.HFSampler.__init__

    def rollout(sampler, retriever, tok, protocol, *a, **kw):
        stops.append(protocol.stop)
        return real_rollout(sampler, retriever, tok, protocol, *a, **kw)

    def init(self, *a, **kw):
        seeds.append(kw["seed"])
        real_init(self, *a, **kw)

    monkeypatch.setattr(searchlite.rollout, "rollout", rollout)
    monkeypatch.setattr(searchlite.sampler.HFSampler, "__init__", init)
    main(["--n", "1", "--max_turns", "0", "--max_new_tokens", "2", "--seed", "7", "--out", str(tmp_path / "v.html")])
    assert stops == [get_protocol("search_r1", "toy").stop + ("\nQuestion:",)] and seeds == [7]
