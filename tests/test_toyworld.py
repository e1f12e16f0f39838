"""The toy world: reproducible, answerable, split honestly, searchable, and tokenized exactly."""

import json
import math
import random
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from searchlite.data import Passage
from searchlite.protocol import get_protocol
from searchlite.toytokenizer import (EOS, PAD, TAGS, TEMPLATE_DIR, build_tokenizer, format_result, length_report,
                                     read_templates, world_texts)
from searchlite.toyworld import COMPARISONS, MIX, _one_off, _select, build_world, main, write_world

ASSETS = Path(__file__).resolve().parents[1] / "searchlite" / "assets" / "toyworld"
FILES = ["corpus.jsonl", "train.jsonl", "test.jsonl", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def world():
    return build_world(0)


@pytest.fixture(scope="module")
def tok(world):
    return build_tokenizer(world_texts(world))


def _contents(p: dict) -> str:
    return f'"{p["title"]}"\n{p["text"]}'


def _files(folder: Path) -> dict[str, bytes]:
    return {f: (folder / f).read_bytes() for f in FILES if (folder / f).exists()}


# ---------------------------------------------------------------------------- the world


def test_same_seed_same_bytes_other_seed_other_world(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        write_world(build_world(seed), tmp_path / name)
    a, b, c = (_files(tmp_path / n) for n in "abc")
    assert set(a) == {"corpus.jsonl", "train.jsonl", "test.jsonl"}
    assert a == b
    assert all(a[f] != c[f] for f in a)


def test_files_have_the_shared_formats(world, tmp_path):
    from searchlite.data import read_corpus, read_qa

    write_world(world, tmp_path)
    assert [(p.id, p.title, p.text) for p in read_corpus(tmp_path / "corpus.jsonl")] == [
        (p["id"], p["title"], p["text"]) for p in world.passages]
    qa = read_qa(tmp_path / "test.jsonl")
    assert [(q.id, q.question, q.answers, q.meta["hops"]) for q in qa] == [
        (q["id"], q["question"], q["golden_answers"], q["hops"]) for q in world.test]
    raw = (tmp_path / "corpus.jsonl").read_bytes()
    assert raw.isascii() and b"\r" not in raw and raw.endswith(b"\n")
    corpus = [json.loads(line) for line in raw.decode().splitlines()]
    assert corpus[0] == {"id": "0", "contents": _contents(world.passages[0])}
    assert [list(c) for c in corpus] == [["id", "contents"]] * len(world.passages)
    for split, rows in (("train", world.train), ("test", world.test)):
        lines = (tmp_path / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows
        assert list(rows[0])[:3] == ["id", "question", "golden_answers"]


def test_sizes_mix_and_famous_share(world):
    assert len(world.passages) == len(world.entities) == 450
    assert len({p["id"] for p in world.passages}) == 450
    assert len({e["name"] for e in world.entities}) == 450
    assert (len(world.train), len(world.test)) == (3600, 400)
    for rows in (world.train, world.test):
        types = Counter(q["type"] for q in rows)
        assert {t: n / len(rows) for t, n in types.items()} == pytest.approx(MIX, abs=0.01)
        assert 0.1 <= sum(q["famous"] for q in rows) / len(rows) <= 0.25
    famous = sum(e["famous"] for e in world.entities) / len(world.entities)
    assert 0.15 <= famous <= 0.2
    for p in world.passages:
        assert 6 <= len(p["text"].split()) <= 20 and p["text"].count(".") == 1, p  # one short sentence


@pytest.mark.parametrize("seed", [51, 53, 57])
def test_a_seed_short_of_plain_questions_takes_more_famous_ones(seed):
    """These seeds deal too few plain 2-hop facts to train for its 90% plain share: the world
    still builds, with its sizes and mix, topping up with famous questions."""
    w = build_world(seed)
    assert (len(w.train), len(w.test)) == (3600, 400)
    two_hop = [q for q in w.train if q["type"] == "2hop"]
    assert len(two_hop) == 1440 and 0.1 < sum(q["famous"] for q in two_hop) / len(two_hop) <= 0.15


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_question_is_answerable_from_its_passages(world, split):
    docs = {p["id"]: p for p in world.passages}
    for q in getattr(world, split):
        assert q["id"].startswith(split) and len(q["golden_answers"]) == 1
        for hop in q["hops"]:
            doc = docs[hop["doc_id"]]
            assert doc["title"] == hop["query"]
            assert re.search(rf"\b{re.escape(hop['answer'])}\b", doc["text"]), (q, doc)
        gold = q["golden_answers"][0]
        if q["type"] == "comparison":
            relation, best, _ = COMPARISONS[q["relation"]]
            a, b = q["hops"]
            assert a["answer"] != b["answer"] and re.fullmatch(r"\d{4}", a["answer"])
            assert gold == best((a, b), key=lambda h: int(h["answer"]))["query"]
        else:
            assert gold == q["hops"][-1]["answer"]
            assert len(q["hops"]) == {"1hop": 1, "2hop": 2}[q["type"]]
        if q["type"] == "2hop":
            assert q["bridge"] == q["hops"][0]["answer"] == q["hops"][1]["query"]
        else:
            assert q["bridge"] is None
        assert q["famous"] == all(h["famous"] for h in q["hops"])


def test_train_and_test_are_disjoint(world):
    famous_names = {e["name"] for e in world.entities if e["famous"]}
    for q in world.train + world.test:
        for hop in q["hops"]:
            assert hop["famous"] == (hop["query"] in famous_names)
    assert not {q["question"] for q in world.train} & {q["question"] for q in world.test}
    train_facts = {(h["doc_id"], h["answer"]) for q in world.train for h in q["hops"]}
    test_facts = {(h["doc_id"], h["answer"]) for q in world.test for h in q["hops"] if not h["famous"]}
    assert len(test_facts - train_facts) > 100
    # every non-famous test question needs a fact that no train question asks (a 2-hop test
    # question may share its other hop with train)
    for q in world.test:
        if not q["famous"]:
            assert any((h["doc_id"], h["answer"]) not in train_facts for h in q["hops"] if not h["famous"]), q
    # famous facts are the ones allowed in both, and they are
    famous_test = {(h["doc_id"], h["answer"]) for q in world.test for h in q["hops"] if h["famous"]}
    assert famous_test & train_facts
    # the split is by fact, not by entity: test questions ask new facts about names seen in train
    train_names = {h["query"] for q in world.train for h in q["hops"]}
    test_names = {h["query"] for q in world.test for h in q["hops"] if not h["famous"]}
    assert len(test_names & train_names) > 0.8 * len(test_names)


def _bm25_top(passages: list[dict], queries: list[str], k1: float = 1.5, b: float = 0.75) -> list[str]:
    """Plain Okapi BM25 over title + text (Lucene idf), the best passage id per query."""
    words = [re.findall(r"\w+", f"{p['title']} {p['text']}".lower()) for p in passages]
    tfs, avg = [Counter(w) for w in words], sum(map(len, words)) / len(words)
    df = Counter(t for tf in tfs for t in tf)
    idf = {t: math.log(1 + (len(words) - n + 0.5) / (n + 0.5)) for t, n in df.items()}
    best = []
    for q in queries:
        terms = re.findall(r"\w+", q.lower())
        scores = [sum(idf.get(t, 0) * tf[t] * (k1 + 1) / (tf[t] + k1 * (1 - b + b * len(w) / avg)) for t in terms)
                  for tf, w in zip(tfs, words)]
        best.append(passages[max(range(len(scores)), key=scores.__getitem__)]["id"])
    return best


def test_a_query_naming_the_entity_finds_its_passage_first(world):
    hops = {(h["query"], h["doc_id"]) for q in world.train + world.test for h in q["hops"]}
    titles = {p["id"]: p["title"] for p in world.passages}
    assert all(query.split() == titles[doc].split() for query, doc in hops)
    hops = sorted(hops)
    assert _bm25_top(world.passages, [q for q, _ in hops]) == [d for _, d in hops]


def test_confusable_distractors_with_different_facts(world):
    people = [e for e in world.entities if e["kind"] == "person"]
    firsts = Counter(p["name"].split()[0] for p in people)
    assert sum(n for n in firsts.values() if n > 1) > len(people) / 2
    twins = [(p, q) for p in people for q in people if _one_off(p["last"], q["last"])]
    assert len(twins) > 30
    for p, q in twins:
        assert p["born_in"] != q["born_in"] and p["birth_year"] != q["birth_year"]
    cities = [e["name"] for e in world.entities if e["kind"] == "city"]
    assert any(_one_off(a, b) for a in cities for b in cities)
    stems = Counter(e["name"].split()[0] for e in world.entities if e["kind"] == "org")
    assert max(stems.values()) > 1


# ---------------------------------------------------------------------------- the tokenizer


def test_tokenizer_round_trips_world_text_and_templates(world, tok):
    texts = [_contents(p) for p in world.passages] + [q["question"] for q in world.train + world.test]
    texts += read_templates() + [t.replace("{question}", world.test[0]["question"]) for t in read_templates()]
    texts += [format_result([(p["title"], p["text"]) for p in world.passages[:3]]), "Ünïcode 東京 ✓ \\boxed{x}"]
    for text, ids in zip(texts, tok(texts, add_special_tokens=False)["input_ids"]):
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(read_templates()) >= 2


def test_tags_are_single_tokens_kept_by_decode(tok):
    assert len(tok) == 2400
    ids = {t: tok.encode(t, add_special_tokens=False) for t in TAGS + [EOS, PAD]}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == len(ids)
    assert tok.eos_token_id == ids[EOS][0] and tok.pad_token_id == ids[PAD][0] and tok.bos_token_id is None
    text = "<think> a </think>\n<search> Varo Kelmin </search><|begin_external_search|>q<|end_external_search|>"
    enc = tok.encode(text, add_special_tokens=False)
    assert ids["<search>"][0] in enc and ids["<|end_external_search|>"][0] in enc
    assert tok.decode(enc, skip_special_tokens=False) == text
    assert tok.decode(enc, skip_special_tokens=True) == text  # tags are not "special"
    assert tok.decode(enc + ids[EOS], skip_special_tokens=True) == text


def test_tokenizer_is_small_and_deterministic(world, tok):
    again = build_tokenizer(world_texts(world))
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    # every word of the world, names and years included, is one token: passages stay short and
    # a name or a year is copied as one token
    words = sorted({w for p in world.passages for w in re.findall(r"\w+", f"{p['title']} {p['text']}")})
    single = [len(ids) == 1 for ids in tok([" " + w for w in words], add_special_tokens=False)["input_ids"]]
    assert sum(single) > 0.99 * len(words)
    lengths = [len(ids) for ids in tok([_contents(p) for p in world.passages], add_special_tokens=False)["input_ids"]]
    assert max(lengths) <= 48


def test_saved_tokenizer_loads_with_autotokenizer(world, tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = [_contents(p) for p in world.passages[:50]] + [q["question"] for q in world.test[:50]] + read_templates()
    assert loaded(texts, add_special_tokens=False)["input_ids"] == tok(texts, add_special_tokens=False)["input_ids"]
    assert loaded.padding_side == "left" and loaded.eos_token == EOS and loaded.pad_token == PAD
    batch = loaded(["a", "a b c"], padding=True)["input_ids"]
    assert batch[0][0] == loaded.pad_token_id and batch[1][0] != loaded.pad_token_id


# ---------------------------------------------------------------------------- the shipped files


def test_shipped_files_are_what_build_writes_with_its_defaults(tmp_path, monkeypatch, capsys):
    """`python -m searchlite.toyworld build` (seed 0, the package's toy folder, here moved to tmp_path)."""
    from searchlite import toyworld

    monkeypatch.setattr(toyworld, "TOY_DIR", tmp_path)
    main(["build"])
    assert "train: 3600" in capsys.readouterr().out
    fresh, shipped = _files(tmp_path), _files(ASSETS)
    assert set(fresh) == set(FILES)
    for name in FILES:
        assert shipped.get(name) == fresh[name], f"{name} differs: rebuild with python -m searchlite.toyworld build"


def test_another_build_does_not_overwrite_the_shipped_world(capsys):
    """The shipped model is the default build's: another seed, or any other flag away from its default
    (warmstart's --questions 20 "for a quick small build" wrote a barely trained model over it), into the
    default folder is refused before anything is written; with --out it goes there."""
    from searchlite import toyworld, warmstart
    from searchlite.config import TOY_DIR

    before = {p.name: p.stat().st_mtime_ns for p in TOY_DIR.iterdir() if p.is_file()}
    for run, flags in ((toyworld.main, ["build", "--seed", "1"]), (toyworld.main, ["build", "--vocab_size", "900"]),
                       (warmstart.main, ["--seed", "1"]), (warmstart.main, ["--epochs", "1", "--questions", "20"]),
                       (warmstart.main, ["--threads", "1", "--resume"])):
        with pytest.raises(SystemExit):
            run(flags)
        err = capsys.readouterr().err
        named = " ".join(f for f in flags if f not in ("build", "--resume"))
        named = ", ".join(" ".join(pair) for pair in zip(named.split()[::2], named.split()[1::2]))
        assert f"error: {named} would" in err and err.rstrip().endswith("give --out a folder of its own")
    assert {p.name: p.stat().st_mtime_ns for p in TOY_DIR.iterdir() if p.is_file()} == before


def test_build_with_out_writes_the_seed_asked_for_into_a_new_nested_folder(tmp_path, capsys):
    """`build --seed 1 --out a/b` writes seed 1's world (the seed read as an int: as the string "1" it
    seeded another world), making the folders on the way; a command is required. Each passed the
    other tests of this file when dropped from the parser or the mkdir."""
    out = tmp_path / "a" / "b"
    main(["build", "--seed", "1", "--out", str(out), "--vocab_size", "900"])
    assert f"wrote {out}" in capsys.readouterr().out
    write_world(build_world(1), tmp_path / "ref")
    data = FILES[:3]  # corpus, train and test: the tokenizer files are its own
    assert set(_files(out)) == set(FILES) and [(out / f).read_bytes() for f in data] == [
        (tmp_path / "ref" / f).read_bytes() for f in data]
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and "the following arguments are required: cmd" in capsys.readouterr().err


def test_comparison_gold_follows_the_words_first_earlier_later(world):
    """The gold is worked out from the question's words ("later": the larger year), not from COMPARISONS,
    which a wrong max / min there would change with it; the question names its hops in order."""
    seen = set()
    for q in world.train + world.test:
        if q["type"] != "comparison":
            continue
        (a, ya), (b, yb) = ((h["query"], int(h["answer"])) for h in q["hops"])
        text = q["question"]
        assert text.index(a) < text.index(b)  # "..., A or B?" in hop order
        word = "later" if " later, " in text else "first" if (" first, " in text or " earlier, " in text) else None
        assert word, text
        want = (a if ya > yb else b) if word == "later" else (a if ya < yb else b)
        assert q["golden_answers"] == [want], q
        seen.add((word, "born" if " born " in text else "founded"))
    assert seen == {("later", "born"), ("first", "born"), ("later", "founded"), ("first", "founded")}


def test_a_company_is_founded_after_its_founder_is_born(world):
    people = {e["name"]: e for e in world.entities if e["kind"] == "person"}
    orgs = [e for e in world.entities if e["kind"] == "org"]
    assert orgs and all(o["founded_year"] >= people[o["founded_by"]]["birth_year"] + 20 for o in orgs)


def test_no_question_text_is_asked_twice_in_a_split(world):
    for rows in (world.train, world.test):
        texts = [q["question"] for q in rows]
        assert len(set(texts)) == len(texts)


def test_selection_takes_a_text_once_other_facts_first_and_refuses_to_run_short():
    """Sampled comparisons can repeat a pair in the same words: the selection keeps one copy, takes
    another phrasing of a fact only when the facts run out, and skips texts taken by the other split
    (without the repeat check, or without the refusal, the other tests here passed)."""
    def cand(text, pair):
        return {"type": "comparison", "question": text, "key": pair, "famous": False}

    cands = [cand("A or B?", "AB"), cand("A or B?", "AB"), cand("B or A?", "AB"), cand("C or D?", "CD")]
    for seed in range(4):  # (the order drawn depends on the seed)
        rng = random.Random(seed)
        assert sorted(q["question"] for q in _select(cands, 3, 0.0, rng, set())) == ["A or B?", "B or A?", "C or D?"]
        assert sorted(q["key"] for q in _select(cands, 2, 0.0, rng, set())) == ["AB", "CD"]
        assert sorted(q["question"] for q in _select(cands, 2, 0.0, rng, {"C or D?"})) == ["A or B?", "B or A?"]
    with pytest.raises(ValueError, match=r"only 3 distinct comparison questions \(0 famous, 3 plain\) for the 4 "
                                         "wanted; try another --seed"):
        _select(cands, 4, 0.0, random.Random(0), set())


@pytest.mark.parametrize("name", ["search_r1", "r1_searcher_pp"])
def test_a_result_block_is_the_one_the_rollout_appends(byte_tokenizer, name):
    """format_result writes a search result exactly as a protocol's observation shows it (tags,
    newlines and 'Doc i(Title: t) text' lines), so the tokenizer is fitted on what the model reads."""
    protocol = get_protocol(name)
    hits = [Passage("7", "Paris", "Capital of France."), Passage("9", "Lyon", "A city.")]
    shown = byte_tokenizer.decode(protocol.observation_ids(byte_tokenizer, hits, 10_000), skip_special_tokens=False)
    docs = [(h.title, h.text) for h in hits]
    assert format_result(docs, protocol.info_open, protocol.info_close) == shown
    if name == "search_r1":
        assert format_result(docs) == shown
    assert format_result(docs).startswith("\n<information>Doc 1(Title: Paris) Capital of France.\nDoc 2(Title: Lyon)")


class CharTokenizer:
    """One token a character; like a Hugging Face tokenizer, it adds a BOS unless told not to."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[0] * add_special_tokens + [ord(c) for c in t] for t in texts]}


def test_summary_counts_entities_by_kind_and_fame_and_questions_by_split_and_type():
    from searchlite.toyworld import summary

    entities = [{"kind": "person", "famous": True}, {"kind": "person", "famous": False},
                {"kind": "city", "famous": False}, {"kind": "person", "famous": False}]
    train = [{"type": "2hop", "famous": True}, {"type": "comparison", "famous": False},
             {"type": "2hop", "famous": False}, {"type": "2hop", "famous": True}]
    test = [{"type": "1hop", "famous": True}]
    w = SimpleNamespace(entities=entities, passages=[{}] * 5, train=train, test=test)
    assert summary(w) == ("entities: {'city': 1, 'person': 2, 'person*': 1} (* = famous), passages: 5\n"
                          "train: 4 = 2hop 3 (2 famous), comparison 1 (0 famous)\n"
                          "test: 1 = 1hop 1 (1 famous)")


def test_length_report_gives_mean_and_max_over_every_text():
    """Mean (one decimal) and max token lengths, over all passages, every train and test question,
    the Search-R1 prompt of each, and a block of three passages."""
    passages = [{"title": "A", "text": "xx"}, {"title": "CCCC", "text": "xx"}, {"title": "BB", "text": "xx"}]
    world = SimpleNamespace(passages=passages, train=[{"question": "ab?"}], test=[{"question": "abcd?"},
                                                                               {"question": "x?"}])
    # a passage line 'Doc 1(Title: t) x\n' is 16 characters besides t and x: 19, 22, 20
    # the three-passage block adds '\n<information>' (14) and '</information>\n' (15) to 61: 90
    prompt = len((TEMPLATE_DIR / "search_r1.txt").read_text(encoding="utf-8")) - len("{question}")
    assert length_report(CharTokenizer(), world).split("\n") == [
        "passage 'Doc i(Title: t) text': mean 20.3, max 22 tokens (n=3)",
        "question: mean 3.3, max 5 tokens (n=3)",
        f"search_r1 prompt: mean {prompt + 10 / 3:.1f}, max {prompt + 5} tokens (n=3)",
        "3-passage <information> block: mean 90.0, max 90 tokens (n=1000)"]
