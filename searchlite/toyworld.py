"""The embedded toy world: a seeded generator of fictional people, companies and cities, a
passage corpus about them, and 1-hop / 2-hop / comparison questions with a train/test split.

    world = build_world(seed=0)            # deterministic: same seed, same bytes
    write_world(world, "searchlite/assets/toyworld")
    python -m searchlite.toyworld build --seed 0 --out searchlite/assets/toyworld

Why it exists: no model or dataset can be downloaded where this project is built, and a first
run on a laptop CPU should show RL teaching a tiny model to search. Names come from a syllable
generator, so no pretrained model knows a fact; every entity has one short passage (BM25 finds
it by its name), and confusable distractors (a shared first name, a last name or city one
letter off, a company stem under another kind) punish sloppy queries and careless copying.
People twins always differ in their facts; a city and its twin may share a region (seed 0:
1 pair of 9), so a sloppy query for those goes unpunished.

Relations (6): person born_in city, person birth_year; org founded_by person, org
founded_year, org headquartered_in city; city in_region region (regions have no passage).
Questions: 1hop (one relation), 2hop (a bridge: "Where was the founder of X born?") and
comparison ("Who was born first, A or B?"), mixed 45/40/15 (`MIX`). Default sizes: 260 people,
150 companies, 40 cities, 8 regions (450 passages); 3,600 train and 400 test questions. Each
question's `hops` ({"query", "doc_id", "answer", "famous"}) script a teacher: query the entity's
name, read the answer from that passage; the last hop's answer is the gold one (a comparison
looks up two years, then the gold answer is the name that wins).

Famous facts: ~18% of people, companies and cities are *famous* (`famous_frac`). The warm-start
data is meant to show their facts often, so a model can answer them without searching
(R1-Searcher++ needs internal knowledge to matter). Every hop carries `famous`; a question is
famous when all its hops are. `FAMOUS_SHARE` sets the famous share of each question type.

The split is by fact: each (entity, relation) fact of a non-famous entity is dealt to the
train or the test part (`test_frac`), and a question belongs to the part of its non-famous
facts (test if any is). So no non-famous test fact is asked in train, yet nearly every
entity's name is seen in training (seed 0: all but 3 people, whose every fact went to test;
14 test questions name them): a test question asks a new fact about a known name, which the
model must look up, not recall. Famous questions may be in both splits (never with the same
text). Left out on purpose: aliases, dates finer than years, questions with several valid
answers.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .config import TOY_DIR, ArgumentParser, HelpFormatter

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "tr", "th", "sk", "vr"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "", "n", "r", "l", "s", "m", "k", "th"]
KINDS = ["Guild", "Company", "Works", "Society", "Press", "Foundry", "Bank", "Club"]
OCCUPATIONS = ["weaver", "painter", "merchant", "sailor", "poet", "engineer", "singer", "scholar", "brewer", "architect", "doctor", "judge"]
# A few real words the syllables can spell; skipped so that no name is a real one.
REAL = {"paris", "rome", "maria", "lima", "mali", "peru", "dora", "sara", "nora", "mona", "lisa", "tina", "vera",
        "dana", "lena", "rosa", "nina", "kara", "tara", "boston", "london", "berlin", "milan", "sudan", "oman", "tokyo",
        "nike", "sony", "bali", "fiji", "togo", "kobe", "soda", "pasta", "data", "beta", "zeta", "theta", "sofa"}

MIX = {"1hop": 0.45, "2hop": 0.40, "comparison": 0.15}  # share of each question type
FAMOUS_SHARE = {"1hop": 0.25, "2hop": 0.10, "comparison": 0.15}  # famous questions within a type

# relation -> (subject kind, question templates); the entity's field of that name is the answer
RELATIONS = {
    "born_in": ("person", ["Where was {x} born?", "In which city was {x} born?", "What is the birthplace of {x}?"]),
    "birth_year": ("person", ["In what year was {x} born?", "When was {x} born?", "What year was {x} born in?"]),
    "founded_by": ("org", ["Who founded {x}?", "Who was the founder of {x}?", "Which person founded {x}?"]),
    "founded_year": ("org", ["In what year was {x} founded?", "When was {x} founded?", "What year was {x} established?"]),
    "headquartered_in": ("org", ["Where is {x} headquartered?", "In which city is {x} based?", "Where are the headquarters of {x}?"]),
    "in_region": ("city", ["In which region is {x}?", "What region is {x} in?", "{x} lies in which region?"]),
}
# 2-hop chain -> (first relation, second relation, templates); hop 1's answer is the bridge
CHAINS = {
    "founder_born_in": ("founded_by", "born_in", ["Where was the founder of {x} born?", "In which city was the person who founded {x} born?", "What is the birthplace of the founder of {x}?"]),
    "founder_birth_year": ("founded_by", "birth_year", ["In what year was the founder of {x} born?", "When was the founder of {x} born?", "What year was the person who founded {x} born in?"]),
    "birth_region": ("born_in", "in_region", ["In which region was {x} born?", "{x} was born in which region?", "What region is the birthplace of {x} in?"]),
    "headquarters_region": ("headquartered_in", "in_region", ["In which region is {x} headquartered?", "In what region are the headquarters of {x}?", "{x} is based in which region?"]),
}
# comparison -> (relation compared, min or max wins, templates)
COMPARISONS = {
    "born_first": ("birth_year", min, ["Who was born first, {a} or {b}?", "Who was born earlier, {a} or {b}?"]),
    "born_later": ("birth_year", max, ["Who was born later, {a} or {b}?"]),
    "founded_first": ("founded_year", min, ["Which was founded first, {a} or {b}?", "Which was founded earlier, {a} or {b}?"]),
    "founded_later": ("founded_year", max, ["Which was founded later, {a} or {b}?"]),
}
# One sentence per passage, every word of it a fact or a relation word: each token costs
# compute in every rollout and every SFT step, and filler would only lengthen what the tiny
# model must read past. Templates vary the order, so reading means matching relation words.
PERSON_TEXT = ["{name} was {a_occupation} born in {birth_year} in {born_in}.",
               "{name} (born {birth_year} in {born_in}) was {a_occupation}.",
               "Born in {born_in} in {birth_year}, {name} worked as {a_occupation}."]
ORG_TEXT = ["{name} is a {kind} founded in {founded_year} by {founded_by} and based in {headquartered_in}.",
            "{name} was founded by {founded_by} in {founded_year} and has its headquarters in {headquartered_in}.",
            "Founded in {founded_year} by {founded_by}, {name} is a {kind} headquartered in {headquartered_in}."]
CITY_TEXT = ["{name} is a city in the region of {in_region}.",
             "{name} is a {size} city in {in_region}."]


@dataclass
class World:
    seed: int
    entities: list[dict]  # {"kind": person|org|city, "name", "famous", "test_facts", "doc_id", relation fields}
    passages: list[dict]  # {"id", "title", "text"}; corpus line contents = '"title"\ntext'
    train: list[dict]  # FlashRAG rows: id, question, golden_answers, type, relation, famous, bridge, hops
    test: list[dict]


# ---------------------------------------------------------------------------- names


class _Names:
    """Unique invented words; `variant` makes a one-letter-off twin of a word (a distractor)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set(REAL)

    def _take(self, w: str) -> str | None:
        if w.lower() in self.used:
            return None
        self.used.add(w.lower())
        return w

    def word(self, syllables: tuple[int, int], suffix: str = "") -> str:
        while True:
            n = self.rng.randint(*syllables)
            w = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(n)) + self.rng.choice(CODAS)
            w = w.rstrip("aeiou") + suffix if suffix else w
            if len(w) >= 4 and self._take(w.capitalize()):
                return w.capitalize()

    def variant(self, w: str) -> str | None:
        spots = [i for i, c in enumerate(w) if c in "aeiou"]
        for _ in range(20):
            i = self.rng.choice(spots)
            v = w[:i] + self.rng.choice([c for c in "aeiou" if c != w[i]]) + w[i + 1:]
            if self._take(v):
                return v
        return None


def _words(names: _Names, n: int, syllables: tuple[int, int], twin_frac: float, suffix: str = "") -> list[str]:
    """`n` unique words, about `twin_frac` of them one-letter twins of an earlier word."""
    out: list[str] = []
    while len(out) < n:
        twin = names.variant(names.rng.choice(out)) if out and names.rng.random() < twin_frac else None
        out.append(twin or names.word(syllables, suffix))
    return out


# ---------------------------------------------------------------------------- the world


def build_world(seed: int = 0, n_people: int = 260, n_orgs: int = 150, n_cities: int = 40, n_regions: int = 8,
                n_train: int = 3600, n_test: int = 400, famous_frac: float = 0.18, test_frac: float = 0.15) -> World:
    """Generate the whole world from `seed` (see the module docstring for what it holds)."""
    rng = random.Random(seed)
    names = _Names(rng)
    regions = [names.word((2, 3), "ia") for _ in range(n_regions)]
    cities = [{"kind": "city", "name": w} for w in _words(names, n_cities, (2, 3), 0.2)]
    firsts = _words(names, n_people // 4, (2, 2), 0.0)
    people = [{"kind": "person", "name": f"{rng.choice(firsts)} {w}", "last": w} for w in _words(names, n_people, (2, 3), 0.3)]
    stems = _words(names, int(n_orgs * 0.8), (2, 3), 0.2)
    org_names = sorted({f"{rng.choice(stems)} {rng.choice(KINDS)}" for _ in range(n_orgs * 3)})
    orgs = [{"kind": "org", "name": n} for n in rng.sample(org_names, n_orgs)]

    # famous entities; every fact of the others is dealt to train or test below
    for group in (people, orgs, cities):
        famous = set(rng.sample(range(len(group)), round(famous_frac * len(group))))
        for i, e in enumerate(group):
            e["famous"] = i in famous
            e["test_facts"] = [] if e["famous"] else sorted(r for r, (kind, _) in RELATIONS.items()
                                                             if kind == e["kind"] and rng.random() < test_frac)

    def pick(pool: list[dict], e: dict) -> dict:
        """An object for `e`'s relation; famous entities lean towards famous objects."""
        fam = [o for o in pool if o["famous"]]
        return rng.choice(fam if e["famous"] and rng.random() < 0.6 else pool)

    for i, c in enumerate(cities):
        c["in_region"] = regions[i % n_regions]  # every region has cities
        c["size"] = rng.choice(["small", "large", "busy", "quiet", "old"])
    for p in people:
        p["born_in"], p["birth_year"] = pick(cities, p)["name"], rng.randint(1720, 1960)
        occupation = rng.choice(OCCUPATIONS)
        p["a_occupation"] = ("an " if occupation[0] in "aeiou" else "a ") + occupation
    # a one-letter twin must differ in its facts, or it would not mislead anyone
    for p in people:
        twins = [q for q in people if q is not p and _one_off(p["last"], q["last"])]
        while any(p["birth_year"] == q["birth_year"] or p["born_in"] == q["born_in"] for q in twins):
            p["born_in"], p["birth_year"] = pick(cities, p)["name"], rng.randint(1720, 1960)
    for o in orgs:
        founder = pick(people, o)
        o["founded_by"], o["founded_year"] = founder["name"], founder["birth_year"] + rng.randint(20, 55)
        o["headquartered_in"] = pick(cities, o)["name"]
        o["kind_word"] = o["name"].split()[-1].lower()
    by_name = {e["name"]: e for e in people + orgs + cities}

    # one passage per person, org and city, in a shuffled order
    entities = people + orgs + cities
    order = list(range(len(entities)))
    rng.shuffle(order)
    passages = []
    for i, j in enumerate(order):
        e = entities[j]
        e["doc_id"] = str(i)
        passages.append({"id": str(i), "title": e["name"], "text": _passage_text(e, rng)})

    train, test = _questions(entities, by_name, rng, n_train, n_test)
    return World(seed, entities, passages, train, test)


def _one_off(a: str, b: str) -> bool:
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def _passage_text(e: dict, rng: random.Random) -> str:
    if e["kind"] == "person":
        return rng.choice(PERSON_TEXT).format(**e)
    if e["kind"] == "org":
        return rng.choice(ORG_TEXT).format(**{**e, "kind": e["kind_word"]})
    return rng.choice(CITY_TEXT).format(**e)


# ---------------------------------------------------------------------------- questions


def _fact_part(e: dict, relation: str) -> str:
    """Where the fact (e, relation) may be asked: both splits (famous), train or test."""
    return "both" if e["famous"] else "test" if relation in e["test_facts"] else "train"


def _hop(e: dict, relation: str) -> dict:
    return {"query": e["name"], "doc_id": e["doc_id"], "answer": str(e[relation]), "famous": e["famous"],
            "part": _fact_part(e, relation)}


def _candidates(entities: list[dict], by_name: dict, rng: random.Random, n_cmp: int) -> dict[str, list[dict]]:
    """Every 1hop and 2hop question (all templates) and `n_cmp` sampled comparisons per part,
    each as {"type", "relation", "question", "hops", "bridge", "key", "part"}."""
    out = defaultdict(list)
    for e in entities:
        for rel, (kind, templates) in RELATIONS.items():
            if e["kind"] == kind:
                for t in templates:
                    out["1hop"].append({"type": "1hop", "relation": rel, "question": t.format(x=e["name"]),
                                        "hops": [_hop(e, rel)], "bridge": None, "key": (e["name"], rel)})
        for chain, (r1, r2, templates) in CHAINS.items():
            if e["kind"] == RELATIONS[r1][0]:
                bridge = by_name[e[r1]]
                for t in templates:
                    out["2hop"].append({"type": "2hop", "relation": chain, "question": t.format(x=e["name"]),
                                        "hops": [_hop(e, r1), _hop(bridge, r2)], "bridge": bridge["name"],
                                        "key": (e["name"], chain)})
    for part in ("train", "test"):
        for comp, (rel, best, templates) in COMPARISONS.items():
            pool = [e for e in entities if e["kind"] == RELATIONS[rel][0] and _fact_part(e, rel) in (part, "both")]
            for _ in range(n_cmp):
                a, b = rng.sample(pool, 2)
                if a[rel] == b[rel]:
                    continue
                winner = best((a, b), key=lambda e: e[rel])
                out["comparison"].append({"type": "comparison", "relation": comp,
                                          "question": rng.choice(templates).format(a=a["name"], b=b["name"]),
                                          "hops": [_hop(a, rel), _hop(b, rel)], "bridge": None,
                                          "answer": winner["name"], "key": (a["name"], b["name"], comp)})
    for cands in out.values():
        for c in cands:
            parts = {h["part"] for h in c["hops"] if not h["famous"]}
            c["part"] = "both" if not parts else "test" if "test" in parts else "train"
            c["famous"] = all(h["famous"] for h in c["hops"])
    return out


def _select(cands: list[dict], n: int, famous_share: float, rng: random.Random, taken: set[str]) -> list[dict]:
    """`n` questions, `famous_share` of them famous, none with a text in `taken`: distinct facts
    first, other phrasings of a fact only when the facts run out."""
    cands = list(cands)
    rng.shuffle(cands)
    texts, phrasings, ranked = set(taken), defaultdict(int), []
    for c in cands:
        if c["question"] not in texts:
            texts.add(c["question"])
            ranked.append((phrasings[c["key"]], len(ranked), c))  # (earlier phrasings of this fact, tie-break, c)
            phrasings[c["key"]] += 1
    ranked = [c for _, _, c in sorted(ranked, key=lambda r: r[:2])]
    famous, plain = [c for c in ranked if c["famous"]], [c for c in ranked if not c["famous"]]
    # famous_share of them famous, more when plain questions run short (some seeds deal few plain facts here)
    n_famous = min(len(famous), max(round(n * famous_share), n - len(plain)))
    chosen = famous[:n_famous] + plain[:n - n_famous]
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} distinct {cands[0]['type']} questions ({len(famous)} famous, "
                         f"{len(plain)} plain) for the {n} wanted; try another --seed")
    return chosen


def _questions(entities, by_name, rng, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    cands = _candidates(entities, by_name, rng, n_cmp=round(n_train * MIX["comparison"]))
    splits = {"test": [], "train": []}
    for kind in MIX:
        taken: set[str] = set()
        for split, total in (("test", n_test), ("train", n_train)):  # test first: train avoids its texts
            n = round(total * MIX[kind])
            pool = [c for c in cands[kind] if c["part"] in (split, "both")]
            chosen = _select(pool, n, FAMOUS_SHARE[kind], rng, taken)
            taken |= {c["question"] for c in chosen}
            splits[split] += chosen
    out = []
    for split in ("train", "test"):
        rows = splits[split]
        rng.shuffle(rows)
        out.append([{"id": f"{split}_{i}", "question": c["question"],
                     "golden_answers": [c.get("answer", c["hops"][-1]["answer"])], "type": c["type"],
                     "relation": c["relation"], "famous": c["famous"], "bridge": c["bridge"],
                     "hops": [{k: v for k, v in h.items() if k != "part"} for h in c["hops"]]}
                    for i, c in enumerate(rows)])
    return out[0], out[1]


# ---------------------------------------------------------------------------- files and CLI


def _write_jsonl(path: Path, rows) -> None:
    """One JSON object a line, ASCII, keys in insertion order, '\\n' endings: stable bytes."""
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def write_world(world: World, folder) -> None:
    """Write corpus.jsonl (Search-R1 form), train.jsonl and test.jsonl (FlashRAG form)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_jsonl(folder / "corpus.jsonl", ({"id": p["id"], "contents": f'"{p["title"]}"\n{p["text"]}'} for p in world.passages))
    _write_jsonl(folder / "train.jsonl", world.train)
    _write_jsonl(folder / "test.jsonl", world.test)


def summary(world: World) -> str:
    """Counts of entities, passages and questions by split, type and famous."""
    kinds = defaultdict(int)
    for e in world.entities:
        kinds[f"{e['kind']}{'*' if e['famous'] else ''}"] += 1
    lines = [f"entities: {dict(sorted(kinds.items()))} (* = famous), passages: {len(world.passages)}"]
    for split, rows in (("train", world.train), ("test", world.test)):
        by = defaultdict(lambda: [0, 0])
        for r in rows:
            by[r["type"]][0] += 1
            by[r["type"]][1] += r["famous"]
        lines.append(f"{split}: {len(rows)} = " + ", ".join(f"{t} {n} ({f} famous)" for t, (n, f) in by.items()))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = ArgumentParser(prog="python -m searchlite.toyworld", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="generate the world and its tokenizer into a folder",
                       description="Generate the toy world (corpus, questions, train/test split) and its tokenizer.",
                       formatter_class=HelpFormatter)
    b.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same bytes (default 0)")
    b.add_argument("--out", default=None, help="output folder (default: the package's searchlite/assets/"
                   "toyworld, the embedded toy world that toy/ paths read, wherever the command runs; only the "
                   "default build, the shipped model's, may rewrite it)")
    b.add_argument("--vocab_size", "--vocab-size", type=int, default=2400,
                   help="tokenizer vocabulary size, tags included (default 2400)")
    args = ap.parse_args(argv)
    if args.out is None and (changed := ap.changed(args, b, keep=("out",))):  # the shipped model learned seed 0's
        ap.error(f"{', '.join(changed)} would replace the shipped toy world and tokenizer in {TOY_DIR} under its "
                 "model, which the default build made: give --out a folder of its own")
    args.out = args.out or str(TOY_DIR)

    from searchlite.toytokenizer import build_tokenizer, length_report, world_texts  # tokenizers only here

    world = build_world(args.seed)
    write_world(world, args.out)
    tok = build_tokenizer(world_texts(world), vocab_size=args.vocab_size)
    tok.save_pretrained(args.out)
    print(summary(world))
    print(length_report(tok, world))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
