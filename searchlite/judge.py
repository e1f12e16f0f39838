"""LLM-as-judge (R1-Searcher++'s LasJ, arXiv 2505.17005 §5.1): a second model reads the
question, the gold answer(s) and the prediction and says True or False.

    judge = Judge("http://127.0.0.1:8000/v1", model="gpt-4o-mini")   # any OpenAI-compatible server
    judge.check()                    # raises JudgeError unless it judges a right and a wrong answer
    judge.score(records)             # sets r["judge"] (1.0 / 0.0), r["judge_reply"] and judge.stamp
    no_verdict(records)              # the judged records whose reply held no verdict

The prompt is a file with `{question}`, `{golden_answers}` and `{prediction}` placeholders
(default: searchlite/templates/judge.txt; pass `prompt=` to replace it). Requests are
`POST {url}/chat/completions` with temperature 0 and `max_tokens` (a reasoning model needs
room to close its </think>), run `workers` at a time; connection errors, timeouts, 429 and
5xx are retried with exponential backoff; a request refused for what one prediction holds
(400, 413, 422) scores it 0.0 with "ERROR: ..." as its reply. `verdict` reads a reply (its
rule is there); a reply without a verdict scores 0.0 and stays in `judge_reply` to read. A
question without a prediction is 0.0 without asking. Each judged record carries
`judge.stamp`: the model name and a hash of the URL, max_tokens, prompt and `verdict`'s rule
version, so a verdict from another judge setup can be told apart. A reply cut off at max_tokens
(finish_reason "length") is marked `judge_cut`: only a verdict it opens with counts, as the rest
may be a thought that was still going (a reasoning judge whose <think> was in the prompt).
The API key is read from the environment variable `key_env` (default OPENAI_API_KEY), if set.
Left out on purpose: streaming, logprob-based scores, and batching many questions per request.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .protocol import TEMPLATE_DIR

# verdict()'s readings. A "not" (or "cannot be") before the word flips it ("Not true.", "isn't
# true", "**Not** correct"); a hedge before it makes it False ("Partially true": not all of it is
# right), and so does a "not" with a degree word ("Not entirely true", "Not entirely false": part
# of it is wrong); "true" before answer/gold/value or after the/a/its is a noun phrase, not a verdict.
VERDICT_RULE = "7"  # in Judge.stamp: a change of rule re-judges the stored replies' records
_HEDGES = "partially|partly|mostly|largely|somewhat|half"
_DEGREES = "entirely|quite|really|exactly|necessarily|completely|fully|totally|wholly|strictly|precisely"  # after a not
_NOT = rf"((?:\bnot|n't|\bcannot\s+be|\b(?:{_HEDGES}))[\s*_-]+(?:(?:{_DEGREES})[\s*_-]+)?)?"
_HEDGE = re.compile(rf"\b(?:{_HEDGES}|{_DEGREES})\b", re.I)
_WORD = (r"(?<!\bthe )(?<!\ban )(?<!\ba )(?<!\bits )(?<!\bhis )(?<!\bher )(?<!\btheir )"
         r"\b(true|false)\b(?![\s*_]+(?:answer|gold|value)s?\b)")
# an echoed label before the verdict: "True/False:", "True or False?", "[False|True] -", ...
_LABEL = re.compile(r"\W*(?:true\s*(?:/|\||\bor\b)\s*false|false\s*(?:/|\||\bor\b)\s*true)\b\W*", re.I)
# or a label of the judge's own ("Verdict:", "Final answer:", "Prediction -"), or the prompt's question
# echoed ("Correct?", "Is the predicted answer correct?")
_OWN_LABEL = re.compile(r"[\W_]*(?:(?:final|my|the|short|overall)\s+)?(?:verdict|answer|judge?ment|result|evaluation|"
                        r"assessment|decision|output|conclusion|response|label|prediction)[\s*_]*(?::|-+|–|—)\s*|"
                        r"[\W_]*(?:is\s+(?:it|this|that|the\s+(?:predicted\s+)?(?:answer|prediction))\s+)?"
                        r"(?:correct|right|true)[\s*_]*\?\s*", re.I)
_LEAD = re.compile(r"\W*" + _NOT + _WORD, re.I)
_TRUE_FALSE = re.compile(_NOT + _WORD, re.I)
_FIRST_WORD = re.compile(r"\W*" + _NOT + r"\b(correct|right|yes|incorrect|wrong|no)\b", re.I)
_OPENING_WORD = re.compile(_FIRST_WORD.pattern + r"(?=[\s*_]*(?:[.,:;!)\n]|$))", re.I)  # "No." not "No doubt"
# a sentence that calls the prediction right or wrong, when there is no true/false: "The prediction
# is correct.", "It is not correct.", "The answer's wrong"
_IS_WORD = re.compile(r"\b(?:prediction|answer|response|it|this|that)(?:[\s*_]+(?:is|was)|'s)[\s*_]*" + _NOT
                      + r"\b(correct|right|incorrect|wrong)\b", re.I)
# the last resort, a first word with words after it ("Correct because ...", "Wrong answer."), but not a
# "correct"/"right"/"yes" that opens a noun phrase going on ("Correct answer: Lyon", "Right answer would
# be") or a hedge ("Yes and no"), nor "No doubt"
_NOT_ALONE = re.compile(r"(?:correct|right|yes)[\s*_]+(?:(?:answers?|responses?|ones?)\b(?![\s*_]*(?:[.!]|$))|"
                        r"(?:and|or|but)\b)|no[\s*_]+doubt\b", re.I)


class JudgeError(RuntimeError):
    """The judge endpoint failed or answered something that is not a chat completion; `status`
    is the HTTP status of a refused request (None otherwise)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


REFUSED_RECORD = (400, 413, 422)  # a request refused for what one prediction holds (length, a content filter)
REFUSED_REPLY = "ERROR: "  # what such a record's judge_reply starts with


def verdict(reply: str, cut: bool = False) -> bool | None:
    """The judge's verdict in `reply`, None when it gives none.

    The answer is what follows the reasoning's </think> (its <think> may have been in the
    prompt); a reply still inside <think> has no answer. An answer that opens with a verdict
    word (after an echoed "True/False:" label, a label of its own such as "Verdict:", or the
    prompt's question echoed, "Correct?") is that verdict, whatever an explanation after it
    says: "true" or "false", or correct, right, yes (True) or incorrect, wrong, no (False) standing
    alone ("No." or "Incorrect, the true answer is Lyon", not "No doubt" or "Correct answer is").
    Otherwise the verdict is its last "true" or "false", where a judge that explains first ends,
    failing that its last sentence calling the prediction right or wrong ("The prediction is
    correct.", "It is not correct."), and failing that its first word ("Correct because ..."),
    unless that word opens a noun phrase or a hedge ("Correct answer: Lyon", "Yes and no": no
    verdict). A "not" before the word flips it, a hedge ("partially", "mostly", ...) makes it
    False, and "true" before answer, gold or value is no verdict. Only the prompt's words count
    there ("False. The correct answer is Lyon" is False). A reply `cut` off at max_tokens has only
    the verdict it opens with: the rest may be a thought cut short, its last "true" no verdict.

    >>> verdict("True."), verdict("Not true."), verdict("True/False: **False**"), verdict("Yes")
    (True, False, False, True)
    >>> verdict("True. Saying they differ would be false."), verdict("They are the same city, so True")
    (True, True)
    >>> verdict("Incorrect. The true answer is Lyon."), verdict("No. True answer: Paris"), verdict("**Not** true")
    (False, False, False)
    >>> verdict("<think>Lyon is not Paris.</think> False"), verdict("<think>Okay, let me"), verdict("Hmm")
    (False, None, None)
    >>> verdict("**Correct answer**: Lyon"), verdict("- Yes and no"), verdict("**No doubt** Lyon")  # in markup too
    (None, None, None)
    """
    answer = (reply or "").rsplit("</think>", 1)[-1].split("<think>", 1)[0]
    for label in (_LABEL, _OWN_LABEL):
        if found := label.match(answer):
            answer = answer[found.end():]
    found = _LEAD.match(answer) or _OPENING_WORD.match(answer)
    if not found and cut:
        return None
    if not found:
        for found in _TRUE_FALSE.finditer(answer):  # the last one: an explanation ends with it
            pass
    if not found:
        for found in _IS_WORD.finditer(answer):  # the last one too
            pass
    if not found and (first := _FIRST_WORD.match(answer)) and not _NOT_ALONE.match(answer, first.start(2)):
        found = first
    if not found:
        return None
    if _HEDGE.search(found.group(1) or ""):
        return False  # "Partially true": a judge that will not call it right has not
    return (found.group(2).lower() in ("true", "correct", "right", "yes")) != bool(found.group(1))


def no_verdict(records: list[dict]) -> list[dict]:
    """The records asked of a judge whose reply held no verdict (each scored 0.0); a request the
    endpoint refused (`refused`) is not among them."""
    return [r for r in records if r.get("prediction") is not None and not refused(r)
            and verdict(r.get("judge_reply", ""), r.get("judge_cut", False)) is None]


def refused(record: dict) -> bool:
    """Whether the judge endpoint refused to judge `record` (HTTP 400, 413, 422): scored 0.0."""
    return str(record.get("judge_reply", "")).startswith(REFUSED_REPLY)


class Judge:
    def __init__(self, url: str, model: str, prompt=None, key_env: str = "OPENAI_API_KEY", timeout: float = 60.0,
                 retries: int = 3, backoff: float = 1.0, workers: int = 8, max_tokens: int = 8):
        url = url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model, self.key_env, self.key = model, key_env, os.environ.get(key_env, "")
        self.prompt_path = Path(prompt) if prompt else TEMPLATE_DIR / "judge.txt"
        self.template = self.prompt_path.read_text(encoding="utf-8")
        missing = [p for p in ("{question}", "{golden_answers}", "{prediction}") if p not in self.template]
        if missing:
            raise ValueError(f"{self.prompt_path}: the judge prompt needs the placeholder(s) {', '.join(missing)}")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.workers, self.max_tokens = workers, max_tokens
        # what a verdict depends on besides the question: another endpoint serving the same model
        # name, another prompt or a cut-off reply can judge otherwise (evaluation.py re-judges on change)
        setup = f"{self.url}\n{max_tokens}\n{self.template}\n{VERDICT_RULE}"  # and how a reply is read
        self.stamp = {"judge_model": model, "judge_setup": hashlib.sha1(setup.encode()).hexdigest()[:12]}

    def judged(self, record: dict) -> bool:
        """Whether `record` holds this judge setup's verdict (its stamp), so need not be judged again."""
        return all(record.get(k) == v for k, v in self.stamp.items())

    def prompt(self, question: str, golds: list[str], prediction: str) -> str:
        values = {"question": question, "golden_answers": " | ".join(golds), "prediction": prediction}
        return re.sub(r"\{(question|golden_answers|prediction)\}", lambda m: values[m.group(1)], self.template)

    def ask(self, text: str, retries: int | None = None) -> tuple[str, bool]:
        """(the reply, whether it was cut off at max_tokens) to one user message."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                           "temperature": 0, "max_tokens": self.max_tokens}).encode("utf-8")
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.key}"} if self.key else {})
        retries = self.retries if retries is None else retries
        cause, status = None, None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                cause, status = f"HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace')}", e.code
                if e.code < 500 and e.code != 429:
                    break  # a bad request, key or model name: retrying will not help
                continue
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                cause = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            try:
                choice = json.loads(raw)["choices"][0]
                return choice["message"]["content"] or "", choice.get("finish_reason") == "length"
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                raise JudgeError(f"judge endpoint {self.url} sent no chat completion: {raw[:200]!r}") from None
        if status is None:
            raise JudgeError(f"judge endpoint {self.url} does not answer ({attempt + 1} attempt(s)): {cause}")
        key = ""
        if status in (401, 403):
            key = (f"; its API key is read from ${self.key_env}, which is {'set' if self.key else 'not set'} "
                   "(--judge_key_env names another variable)")
        what = ("refused the request" if status < 500 and status != 429
                else "failed the request every time (busy, or a server error)")
        raise JudgeError(f"judge endpoint {self.url} {what} ({attempt + 1} attempt(s)): {cause}{key}", status)

    def check(self) -> None:
        """A right and a wrong answer to one easy question, no retries: a wrong URL fails at once,
        and so does a judge whose replies give no verdict (every score would be 0.0)."""
        for prediction, expected in (("2", True), ("3", False)):
            reply, cut = self.ask(self.prompt("What is 1 + 1?", ["2"], prediction), retries=0)
            got = verdict(reply, cut)
            if got is None:
                raise JudgeError(f"judge {self.model} at {self.url} gave no verdict on a test question: "
                                 f"{reply[:200]!r}; a reasoning model needs a larger max_tokens (now "
                                 f"{self.max_tokens}) to finish thinking")
            if got != expected:
                raise JudgeError(f"judge {self.model} at {self.url} judged a {'right' if expected else 'wrong'} answer "
                                 f"{got}: {reply[:200]!r} (asked whether 1 + 1 = {prediction}); check its prompt")

    def judge(self, question: str, golds: list[str], prediction: str | None) -> tuple[float, str, bool]:
        """(1.0 or 0.0, the raw reply, whether it was cut off at max_tokens) for one prediction; a
        reply without a verdict is 0.0. A
        request the endpoint refuses for its content (HTTP 400, 413, 422: a prediction past the
        judge's context, a content filter; `check` has passed the same request shape) is 0.0 with
        "ERROR: ..." as its reply, so one such record does not stop every rerun."""
        if prediction is None:
            return 0.0, "", False
        try:
            reply, cut = self.ask(self.prompt(question, golds, prediction))
        except JudgeError as e:
            if e.status not in REFUSED_RECORD:
                raise
            return 0.0, f"{REFUSED_REPLY}{e}", False
        return float(verdict(reply, cut) is True), reply, cut

    def score(self, records: list[dict]) -> None:
        """Judge each record in place (`workers` requests at a time). A request that fails leaves
        its record unjudged; the first failure is raised once the others have answered, so their
        verdicts are kept."""
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            asked = [(r, pool.submit(self.judge, r["question"], r["golden_answers"], r["prediction"])) for r in records]
        failures = [f.exception() for _, f in asked if f.exception() is not None]
        for r, f in asked:
            if f.exception() is None:
                score, reply, cut = f.result()
                r.update(judge=score, judge_reply=reply, **self.stamp)
                if cut:
                    r["judge_cut"] = True
                else:
                    r.pop("judge_cut", None)  # a verdict from before, re-judged
        if failures:
            raise failures[0]
