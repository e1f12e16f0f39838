"""LLM-as-judge (R1-Searcher++'s LasJ, arXiv 2505.17005 §5.1): a second model reads the
question, the gold answer(s) and the prediction and says True or False.

    judge = Judge("http://127.0.0.1:8000/v1", model="gpt-4o-mini")   # any OpenAI-compatible server
    judge.check()                    # raises JudgeError if the endpoint does not answer
    judge.score(records)             # sets r["judge"] (1.0 / 0.0), r["judge_reply"], r["judge_model"]

The prompt is a file with `{question}`, `{golden_answers}` and `{prediction}` placeholders
(default: searchlite/templates/judge.txt; pass `prompt=` to replace it). Requests are
`POST {url}/chat/completions` with temperature 0, run `workers` at a time; connection errors,
timeouts, 429 and 5xx are retried with exponential backoff. A reply counts as True when its
first "true"/"false" word is "true"; a reply with neither is False (and kept in
`judge_reply` to read). A question without a prediction is False without asking.
The API key is read from the environment variable `key_env` (default OPENAI_API_KEY), if set.
Left out on purpose: streaming, logprob-based scores, and batching many questions per request.
"""

from __future__ import annotations

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

_VERDICT = re.compile(r"\b(true|false)\b", re.I)


class JudgeError(RuntimeError):
    """The judge endpoint failed or answered something that is not a chat completion."""


def verdict(reply: str) -> bool:
    """True when the first "true"/"false" word of `reply` is "true".

    >>> verdict("True."), verdict("**False**, it is Lyon"), verdict("I cannot tell")
    (True, False, False)
    """
    m = _VERDICT.search(reply or "")
    return bool(m) and m.group(1).lower() == "true"


class Judge:
    def __init__(self, url: str, model: str, prompt=None, key_env: str = "OPENAI_API_KEY", timeout: float = 60.0,
                 retries: int = 3, backoff: float = 1.0, workers: int = 8, max_tokens: int = 8):
        url = url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model, self.key = model, os.environ.get(key_env, "")
        self.prompt_path = Path(prompt) if prompt else TEMPLATE_DIR / "judge.txt"
        self.template = self.prompt_path.read_text()
        missing = [p for p in ("{question}", "{golden_answers}", "{prediction}") if p not in self.template]
        if missing:
            raise ValueError(f"{self.prompt_path}: the judge prompt needs the placeholder(s) {', '.join(missing)}")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.workers, self.max_tokens = workers, max_tokens

    def prompt(self, question: str, golds: list[str], prediction: str) -> str:
        values = {"question": question, "golden_answers": " | ".join(golds), "prediction": prediction}
        return re.sub(r"\{(question|golden_answers|prediction)\}", lambda m: values[m.group(1)], self.template)

    def ask(self, text: str, retries: int | None = None) -> str:
        """The judge model's reply to one user message."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                           "temperature": 0, "max_tokens": self.max_tokens}).encode("utf-8")
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.key}"} if self.key else {})
        retries = self.retries if retries is None else retries
        cause = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                cause = f"HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace')}"
                if e.code < 500 and e.code != 429:
                    break  # a bad request, key or model name: retrying will not help
                continue
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                cause = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            try:
                return json.loads(raw)["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError):
                raise JudgeError(f"judge endpoint {self.url} sent no chat completion: {raw[:200]!r}") from None
        raise JudgeError(f"judge endpoint {self.url} does not answer ({attempt + 1} attempt(s)): {cause}")

    def check(self) -> None:
        """One short request, no retries, so a wrong URL fails at once and clearly."""
        self.ask(self.prompt("What is 1 + 1?", ["2"], "2"), retries=0)

    def judge(self, question: str, golds: list[str], prediction: str | None) -> tuple[float, str]:
        """(1.0 or 0.0, the raw reply) for one prediction."""
        if prediction is None:
            return 0.0, ""
        reply = self.ask(self.prompt(question, golds, prediction))
        return float(verdict(reply)), reply

    def score(self, records: list[dict]) -> None:
        """Judge each record in place (`workers` requests at a time)."""
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            results = list(pool.map(lambda r: self.judge(r["question"], r["golden_answers"], r["prediction"]),
                                    records))
        for r, (score, reply) in zip(records, results):
            r["judge"], r["judge_reply"], r["judge_model"] = score, reply, self.model
