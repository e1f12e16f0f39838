"""A scripted, deliberately imperfect teacher for the toy world's SFT warm start.

    teacher = Teacher(tokenizer, protocol, qa_list, seed=0)
    ro = rollout(teacher, retriever, tokenizer, protocol, questions)   # real retrieval, loss_mask built

The teacher is a sampler: it reads each trajectory so far (prompt, its own earlier turns,
the passages the real retriever returned) and writes the next turn in either protocol. It
knows each question's hops (toy-world `meta["hops"]`) but reads values only from the
passages it was shown, like a model would. Its mistakes are the ones RL should fix
(R1-Searcher++ §4.1 cold start; the README's "The toy world"):

- answers without searching (`p_guess`): a random value of the answer's kind. A famous
  question is first answered from memory, rightly, with `p_famous_internal`, so it takes
  such a guess with (1 - p_famous_internal) * p_guess,
- stops after the first hop (`p_stop`): a 2-hop question is answered with the bridge
  entity, a comparison with a coin flip between its two names,
- searches the whole question verbatim instead of the entity (`p_verbatim`),
- copies the wrong span from the passages (`p_wrong_span`). A comparison's answer reads the
  first passage again, with a fresh draw, so now and then (3% of two-lookup comparisons) it
  contradicts the year its thought wrote; the shipped warm start was taught with that.

Each decision is drawn per turn from one seeded stream, so the same seed and questions give
the same trajectories. Left out on purpose: any learned component.
"""

from __future__ import annotations

import random
import re

from .config import ConfigError

YEAR = re.compile(r"^\d{3,4}$")


class Teacher:
    def __init__(self, tokenizer, protocol, qa: list, *, seed: int = 0, p_guess: float = 0.3,
                 p_famous_internal: float = 0.9, p_stop: float = 0.45, p_verbatim: float = 0.05,
                 p_wrong_span: float = 0.05):
        lacking = next((q for q in qa if "hops" not in q.meta), None)
        if lacking is not None:
            raise ConfigError(f"--cold_start_sampler teacher: question {lacking.id!r} has no 'hops'; the teacher "
                              "scripts its trajectories from the toy world's hops. For other data, sample from the "
                              "model: --cold_start_sampler policy --sft_rewrites 0")
        self.tok, self.protocol, self.rng = tokenizer, protocol, random.Random(seed)
        self.by_question = {protocol.ask(q.question): q for q in qa}
        self.p = dict(guess=p_guess, famous=p_famous_internal, stop=p_stop, verbatim=p_verbatim, wrong=p_wrong_span)
        values = {a for q in qa for h in q.meta["hops"] for a in [h["answer"]]} | {a for q in qa for a in q.answers}
        self.years = sorted(v for v in values if YEAR.match(v))
        self.names = sorted(v for v in values if not YEAR.match(v))
        self.pp = protocol.name == "r1_searcher_pp"

    # -------------------------------------------------------------- sampler interface
    def generate(self, prompts, stop=(), greedy=False, max_new_tokens=None, budget=None) -> list[list[int]]:
        """A scripted turn for each prompt, whole: the rollout cuts one that runs past its budget."""
        return [self.tok.encode(self.turn(self.tok.decode(p, skip_special_tokens=False)), add_special_tokens=False)
                for p in prompts]

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]  # JSON turns the state's tuples into lists
        self.rng.setstate((version, tuple(internal), gauss))

    # -------------------------------------------------------------- one turn
    def turn(self, context: str) -> str:
        q = self._question(context)
        results = self._results(context)
        hops = q.meta["hops"]
        kind = q.meta.get("type", "1hop")
        answer_now = None
        if not results:  # first turn: answer from memory, or search
            if all(h.get("famous") for h in hops) and self.rng.random() < self.p["famous"]:
                return self._internal(hops, q.answers[0])
            if self.rng.random() < self.p["guess"]:
                return self._internal(hops, self._guess(q.answers[0]))
            query = q.question if self.rng.random() < self.p["verbatim"] else hops[0]["query"]
            return self._search(query)
        hop = hops[min(len(results), len(hops)) - 1]
        found = self._read(results[-1], hop)
        said = f"I found {found}"  # what the thought says it read
        if len(results) < len(hops):  # a second hop (bridge) or a second lookup (comparison) remains
            if kind == "2hop":
                if self.rng.random() < self.p["stop"]:
                    return self._answer(said, found)  # answers the bridge entity: wrong
                return self._search(found, note=said)
            if self.rng.random() < self.p["stop"]:
                return self._answer(said, self._pick(q))  # compares after one lookup: a coin flip
            return self._search(hops[1]["query"], note=said)
        if kind == "comparison" and len(hops) == 2:
            a = self._read(results[0], hops[0])
            answer_now = self._compare(q, a, found)
        return self._answer(said, answer_now or found)

    # -------------------------------------------------------------- reading the context
    def _question(self, context: str):
        for line in reversed(context.split("Question:")):
            key = line.split("\n")[0].strip()
            if key in self.by_question:
                return self.by_question[key]
        raise KeyError(f"teacher: no known question in context: {context[:200]!r}")

    def _results(self, context: str) -> list[str]:
        p = self.protocol
        body = context.split("Question:")[-1]
        return re.findall(re.escape(p.info_open) + r"(.*?)" + re.escape(p.info_close), body, re.S)

    def _read(self, result: str, hop: dict) -> str:
        """The hop's value as the passages show it; a wrong span now and then, a guess if absent."""
        wrong = [v for v in (self.years if YEAR.match(hop["answer"]) else self.names)
                 if v != hop["answer"] and v in result]
        if hop["answer"] in result and not (wrong and self.rng.random() < self.p["wrong"]):
            return hop["answer"]
        return self.rng.choice(wrong) if wrong else self._guess(hop["answer"])

    def _guess(self, like: str) -> str:
        return self.rng.choice(self.years if YEAR.match(like) else self.names)

    def _pick(self, q) -> str:
        names = re.findall(r", (.+?) or (.+?)\?$", q.question)
        return self.rng.choice(list(names[0])) if names else self._guess(q.answers[0])

    def _compare(self, q, a: str, b: str) -> str:
        names = re.findall(r", (.+?) or (.+?)\?$", q.question)
        if not names or not (YEAR.match(a) and YEAR.match(b)):
            return self._pick(q)
        first, second = names[0]
        later = any(w in q.question for w in ("later", "more recently"))
        a_wins = int(a) > int(b) if later else int(a) < int(b)
        return first if a_wins else second

    # -------------------------------------------------------------- writing a turn
    def _search(self, query: str, note: str | None = None) -> str:
        said = f"{note}. " if note else ""
        if self.pp:
            return f"{said}I need to search {query}. <|begin_external_search|> {query} <|end_external_search|>"
        return f"<think> {said}I need to search {query}. </think>\n<search> {query} </search>"

    def recall(self, answer: str) -> str:
        """A whole response that answers `answer` from memory, in the teacher's words and protocol."""
        return self._internal([], answer)

    def _internal(self, hops, answer: str) -> str:
        if self.pp:
            return (f"I know this. <|begin_internal_answer|> {answer} <|end_internal_answer|>\n"
                    f"So the answer is \\boxed{{{answer}}}.{self.tok.eos_token}")
        return f"<think> I know this. </think>\n<answer> {answer} </answer>"

    def _answer(self, said: str, answer: str) -> str:
        if self.pp:
            return f"{said}. So the answer is \\boxed{{{answer}}}.{self.tok.eos_token}"
        return f"<think> {said}. </think>\n<answer> {answer} </answer>"
