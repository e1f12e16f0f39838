"""A small byte-level BPE tokenizer for the toy world, trained deterministically on its text.

    tok = build_tokenizer(world_texts(world), vocab_size=2400)   # a PreTrainedTokenizerFast
    tok.save_pretrained(folder)          # AutoTokenizer.from_pretrained(folder) loads it

Why its own tokenizer: the time of a CPU step grows with the vocabulary (the logits) and the
sequence length; a 2,400-token vocabulary fitted to the world's closed set of words keeps
every word of a name (410 of the 450 names have two) and every year after a space one token
(the merges were learned on " 1850": in `\boxed{1850}` many years are two), and a whole
trajectory, passages included, to a few hundred tokens. Byte-level BPE still round-trips any
text exactly, so the model may write words the world never used.

Both protocols' tags (`TAGS`) are added tokens: each is one id, never split, never stripped,
and not "special", so `decode` keeps them even with `skip_special_tokens=True`. EOS is
`<|endoftext|>`, padding `<|pad|>` on the left (generation pads on the left); there is no BOS
and no chat template. Left out on purpose: normalisation (NFKC, lowercasing) — it would break
exact round trips.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
EOS, PAD = "<|endoftext|>", "<|pad|>"
TAGS = ["<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>",
        "<|begin_internal_answer|>", "<|end_internal_answer|>", "<|begin_external_search|>", "<|end_external_search|>",
        "<|begin_search_result|>", "<|end_search_result|>"]
# Phrases a scripted teacher or a policy is likely to write, so that they are short in tokens.
PHRASES = ["I need to search for", "I need to find", "I need to search", "I know the answer", "I know", "I am not sure",
           "Let me search", "The answer is", "So the answer is", "So the final answer is", "Now I know", "I do not know",
           "The founder of", "was born in", "was founded by", "was founded in", "is headquartered in", "is based in",
           "is in the region of", "was born first", "was born earlier", "was born later", "was founded first",
           "was founded earlier", "was founded later", "First I need", "Then I need", "Now I need", "which is earlier",
           "which is later", "The documents say", "The search results say", "the question asks",
           "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
           "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
           "Let me try again.\n",
           "\nMy previous step is invalid. To search I should write the query between <|begin_external_search|> and "
           "<|end_external_search|>; to finish I should give the answer as \\boxed{answer}. Let me try again.\n"]


# The prompt templates the tokenizer is fitted on: a fixed list, so adding another template
# file (an evaluation prompt, say) does not change the tokenizer and orphan the shipped model.
TOKENIZER_TEMPLATES = ("r1_searcher_pp", "search_r1", "toy_r1_searcher_pp", "toy_search_r1")


def read_templates() -> list[str]:
    """The prompt templates named in TOKENIZER_TEMPLATES (searchlite/templates/NAME.txt)."""
    return [(TEMPLATE_DIR / f"{name}.txt").read_text(encoding="utf-8") for name in TOKENIZER_TEMPLATES]


def format_result(docs: list[tuple[str, str]], open_tag: str = "<information>", close_tag: str = "</information>") -> str:
    """A search result block as the rollout appends it: Search-R1's `Doc i(Title: t) text` lines."""
    body = "".join(f"Doc {i + 1}(Title: {t}) {x}\n" for i, (t, x) in enumerate(docs))
    return f"\n{open_tag}{body}{close_tag}\n"


def world_texts(world, seed: int = 0) -> list[str]:
    """Training text for the tokenizer: the corpus, the questions and answers, the prompt
    templates, likely phrases, and synthetic trajectories in both protocols (prompt and response,
    for a quarter of the questions; passages in `Doc i(Title: t) text` lines, as the rollout shows them)."""
    rng = random.Random(seed)
    docs = {p["id"]: (p["title"], p["text"]) for p in world.passages}
    ids = sorted(docs, key=int)
    r1_template, pp_template = ((TEMPLATE_DIR / f"{name}.txt").read_text(encoding="utf-8")
                                for name in ("search_r1", "r1_searcher_pp"))
    texts = [f'"{t}"\n{x}' for t, x in docs.values()] + PHRASES * 10 + read_templates()
    questions = world.train + world.test
    texts += [q["question"] for q in questions] + [a for q in questions for a in q["golden_answers"]]
    # years as passages write them, after a space: each year the world uses comes out one token
    texts += [" ".join(str(y) for y in range(1700, 2030))] * 4
    for q in questions[::4]:  # a quarter is plenty for the statistics of the trajectory words
        r1, pp = [], []
        for hop in q["hops"]:
            result = [docs[hop["doc_id"]]] + [docs[i] for i in rng.sample(ids, 2)]
            rng.shuffle(result)
            r1.append(f"<think> I need to find {hop['query']}. </think>\n<search> {hop['query']} </search>"
                      f"{format_result(result)}<think> The documents say {hop['answer']}. </think>\n")
            if hop["famous"]:
                pp.append(f"I know this. <|begin_internal_answer|> {hop['answer']} <|end_internal_answer|>\n")
            else:
                pp.append(f"I am not sure, so I will search. <|begin_external_search|> {hop['query']} "
                          f"<|end_external_search|>"
                          f"{format_result(result, '<|begin_search_result|>', '<|end_search_result|>')}"
                          f"The search results say {hop['answer']}.\n")
        answer = q["golden_answers"][0]
        texts.append(r1_template.replace("{question}", q["question"]) + "".join(r1) + f"<answer> {answer} </answer>{EOS}")
        texts.append(pp_template.replace("{question}", q["question"]) + "".join(pp)
                     + f"So the final answer is \\boxed{{{answer}}}.{EOS}")
    return texts


def build_tokenizer(texts: list[str], vocab_size: int = 2400):
    """Train a byte-level BPE of `vocab_size` ids in all (BPE + EOS, PAD + `TAGS`) on `texts`.

    Deterministic: the same texts give the same tokenizer.json. Returns a
    `PreTrainedTokenizerFast` with left padding.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TAGS), min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Added tokens are cut out before BPE sees a text (as encode does), so no merge is spent on them.
    cut = re.compile("|".join(re.escape(t) for t in [EOS, PAD] + TAGS))
    tok.train_from_iterator([piece for t in texts for piece in cut.split(t) if piece], trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False, lstrip=False, rstrip=False, single_word=False)
                    for t in TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, padding_side="left",
                                   clean_up_tokenization_spaces=False)


def length_report(tok, world) -> str:
    """Mean and max token lengths of passages, questions, the Search-R1 prompt and a 3-doc result."""
    def stats(name: str, texts: list[str]) -> str:
        n = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
        return f"{name}: mean {sum(n) / len(n):.1f}, max {max(n)} tokens (n={len(n)})"

    questions = [q["question"] for q in world.train + world.test]
    template = (TEMPLATE_DIR / "search_r1.txt").read_text(encoding="utf-8")
    rng = random.Random(0)
    docs = [(p["title"], p["text"]) for p in world.passages]
    return "\n".join([
        stats("passage 'Doc i(Title: t) text'", [f"Doc 1(Title: {t}) {x}\n" for t, x in docs]),
        stats("question", questions),
        stats("search_r1 prompt", [template.replace("{question}", q) for q in questions]),
        stats("3-passage <information> block", [format_result(rng.sample(docs, 3)) for _ in range(1000)]),
    ])
