"""Prompt templates and action parsing for the two tag protocols.

- `search_r1` (Search-R1, arXiv 2503.09516 §3 and Table 1): the model reasons in
  `<think>`, searches with `<search> q </search>`, reads `<information> … </information>`
  and answers with `<answer> … </answer>`.
- `r1_searcher_pp` (R1-Searcher++, arXiv 2505.17005 §4.1): the model answers a
  sub-question from its own knowledge inside `<|begin_internal_answer|> …
  <|end_internal_answer|>` or searches with `<|begin_external_search|> q
  <|end_external_search|>`, reads `<|begin_search_result|> … <|end_search_result|>`, and
  gives the final answer as `\\boxed{…}`.

`parse` never raises, whatever the model wrote:

    >>> p = get_protocol("search_r1")
    >>> p.parse("<think> hmm </think> <search> capital of France </search>")
    Action(kind='search', content='capital of France')
    >>> p.parse("<answer> Paris </answer>")
    Action(kind='answer', content='Paris')
    >>> p.parse("<search> unclosed").kind
    'invalid'
    >>> get_protocol("r1_searcher_pp").parse("so it is \\\\boxed{Paris}")
    Action(kind='answer', content='Paris')

Left out on purpose: tool-call JSON formats; this project studies the two papers' tags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
MAX_QUERY_CHARS = 1000  # longer queries are cut: no retriever needs more, and servers bound it


@dataclass(frozen=True)
class Action:
    kind: str  # "search" | "answer" | "invalid"
    content: str = ""


@dataclass(frozen=True)
class Protocol:
    name: str
    template: str  # prompt text with a {question} placeholder
    stop: tuple[str, ...]  # a turn ends at the first of these (or EOS)
    info_open: str  # wraps retrieved passages
    info_close: str
    invalid_message: str  # appended (loss_mask 0) after a turn with no valid action
    search_re: re.Pattern
    answer_re: re.Pattern | None  # None: answers are \boxed{} (brace-matched, \text{} unwrapped: _last_boxed)
    question_mark: bool = False  # end each question with "?" in every prompt, as Search-R1's data do

    def ask(self, question: str) -> str:
        """The question as a prompt puts it: stripped and, where the protocol's paper does so, ended
        with "?". Search-R1's data scripts (scripts/data_process/qa_search_{train,test}_merge.py)
        add one to every question lacking it, in training and test prompts and in its baselines';
        NQ's questions have none ("who sings does he love me with reba"). R1-Searcher++ says nothing.

        >>> get_protocol("search_r1").ask(" who wrote hamlet ")
        'who wrote hamlet?'
        >>> get_protocol("r1_searcher_pp").ask(" who wrote hamlet ")
        'who wrote hamlet'
        """
        question = question.strip()
        return question + "?" if self.question_mark and question and not question.endswith("?") else question

    def prompt(self, question: str) -> str:
        return self.template.replace("{question}", self.ask(question))

    def parse(self, text: str) -> Action:
        """The action of one generated segment: the first complete search or answer (for
        R1-Searcher++, the last `\\boxed{}` closed before the first search tag, else the search).

        An empty answer or query is an invalid action (the model is told so and may go on), where
        Search-R1's `postprocess_predictions` ends the trajectory on an empty answer (reward 0)
        and searches for an empty query."""
        try:
            return self._parse(text)
        except Exception:  # parsing must never stop a rollout; a bug here is an invalid action
            return Action("invalid")

    def _parse(self, text: str) -> Action:
        search = self.search_re.search(text)
        if self.answer_re is not None:
            answer = self.answer_re.search(text)
            answer_at = answer.start() if answer else None
            answer_text = answer.group(1) if answer else None
        else:  # the last \boxed{} closed before the first search opens; with no search, the last of all
            answer_at, answer_text = _last_boxed(text[:search.start()] if search else text)
        if search and (answer_at is None or search.start() < answer_at):
            query = " ".join(search.group(1).split())[:MAX_QUERY_CHARS]
            return Action("search", query) if query else Action("invalid")
        if answer_text is not None and answer_text.strip():
            return Action("answer", answer_text.strip())
        return Action("invalid")

    def format_passages(self, hits) -> str:
        """Search-R1's `Doc i(Title: t) text` lines, one per hit, each ending in a newline.

        >>> from searchlite.data import Passage
        >>> get_protocol("search_r1").format_passages([Passage("1", "Paris", "Capital of France.")])
        'Doc 1(Title: Paris) Capital of France.\\n'

        It differs from Search-R1's `_passages2string` (search_r1/llm_agent/generation.py), which
        splits the raw wiki-18 `contents` itself, in the title: Search-R1 keeps the first line as
        it is, quotes and all (`Title: "Paris"`), where `Passage.title` has them stripped by
        `data.split_contents` (`Title: Paris`); and for `contents` without a newline Search-R1
        makes it all title and the text empty, where here it is all text and the title empty.
        The block around it differs too (`observation_ids`, on purpose): Search-R1 appends
        `"\\n\\n<information>" + passages.strip() + "</information>\\n\\n"`; this project writes
        `"\\n" + info_open + passages + info_close + "\\n"`, single newlines, nothing stripped,
        so the last passage's newline stays inside, before the closing tag (unless the cut to
        `max_tokens` takes it).
        """
        return "".join(f"Doc {i + 1}(Title: {h.title}) {h.text}\n" for i, h in enumerate(hits))

    def observation_ids(self, tokenizer, hits, max_tokens: int) -> list[int]:
        """Token ids of a search result block, passages cut to fit `max_tokens` in total.

        Tokenised once here and appended as ids; the closing tag always survives the cut (Search-R1's
        `_process_next_obs` cuts the whole block, so an overlong one loses its closing tag), and so does
        the opening one: a `max_tokens` smaller than the two tags gives the tags alone, longer than it.
        """
        head = tokenizer.encode(f"\n{self.info_open}", add_special_tokens=False)
        tail = tokenizer.encode(f"{self.info_close}\n", add_special_tokens=False)
        body = tokenizer.encode(self.format_passages(hits), add_special_tokens=False)
        room = max(0, max_tokens - len(head) - len(tail))
        return head + body[:room] + tail

    def shown(self, tokenizer, hits, obs_ids: list[int]) -> list:
        """The hits whose passage the observation `obs_ids` (`observation_ids`, maybe cut by
        max_obs_tokens or max_len) shows, at least its `Doc k(` start: what the model read."""
        text = tokenizer.decode(obs_ids, skip_special_tokens=False)
        return [h for k, h in enumerate(hits, 1) if f"Doc {k}(" in text]

    def format_ok(self, response: str) -> bool:
        """Whether a whole response is well formed (R1-Searcher++'s format reward, §4.2.1). For
        R1-Searcher++: one tag span open at a time, each closed by its own tag, and one non-empty
        `\\boxed{}` after which no span opens (a search written after the answer is never run)."""
        if self.answer_re is not None:
            answers = self.answer_re.findall(response)
            opens = response.count("<answer>")
            return len(answers) == 1 and opens == 1 and response.count("<search>") == len(
                self.search_re.findall(response)
            )
        pairs = {"<|begin_internal_answer|>": "<|end_internal_answer|>",
                 "<|begin_external_search|>": "<|end_external_search|>"}
        if not _spans_ok(response, pairs):
            return False
        at, boxed = _last_boxed(response)
        if boxed is None or not boxed.strip() or response.count("\\boxed{") != 1:
            return False
        return not any(tag in response[at:] for tag in pairs)  # the answer is the last action: nothing opens after it


def _spans_ok(text: str, pairs: dict[str, str]) -> bool:
    """Each open tag of `pairs` is closed by its own close tag before any other tag of them
    appears: one span at a time, none nested in another, of the same kind or not."""
    marks = sorted((m.start(), tag) for tag in (*pairs, *pairs.values()) for m in re.finditer(re.escape(tag), text))
    open_tag = None
    for _, tag in marks:
        if tag in pairs:  # an open tag: no span may be open already
            if open_tag is not None:
                return False
            open_tag = tag
        elif open_tag is None or pairs[open_tag] != tag:  # a close tag: it must close the open span
            return False
        else:
            open_tag = None
    return open_tag is None


def _last_boxed(text: str) -> tuple[int | None, str | None]:
    """Start and content of the last complete `\\boxed{...}`, braces matched; (None, None) if none.

    The content has its text-style wrappers removed (`_unwrap_text`): `\\boxed{\\text{Paris}}`
    gives "Paris", which normalizes to "paris", where "\\text{Paris}" would give "textparis".
    """
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return start, _unwrap_text(text[i + 1:j])
        start = text.rfind("\\boxed{", 0, start)
    return None, None


# LaTeX commands that only style their argument; models answering in LaTeX put them in \boxed{}:
# \text and its font forms (\textbf, \textsc, ...), \mathrm and its kin, \emph, \mbox, \operatorname
_TEXT_WRAPPER = re.compile(r"\\(?:text(?:bf|it|rm|sf|tt|sc|sl|up|md|normal)?|math(?:rm|bf|it|sf|tt|normal)"
                           r"|emph|mbox|operatorname)\s*\{")
# LaTeX spaces: a tie (~) and the spacing commands \ , \, \; \: are a space in the answer, where
# normalisation would delete them as punctuation and join the words ("Barack~Obama")
_LATEX_SPACE = re.compile(r"~|\\[ ,;:]")
# ...except between digit groups: 1\,000 is a thousands separator, one number as 1{,}000 is
_DIGIT_GROUP = re.compile(r"(?<=\d)(?:~|\\[ ,;:])(?=\d{3}(?!\d))")


def _unwrap_text(s: str) -> str:
    """`s` with every style wrapper (`_TEXT_WRAPPER`: `\\text{x}`, `\\textbf{x}`, `\\emph{x}`,
    `\\mathrm{x}`, ...) replaced by x, nested ones too, and LaTeX's spaces (`~`, `\\,`, ...) by a
    space (by a comma between digit groups: `1\\,000` is 1,000); other braces are kept. Braces
    are matched as in `_last_boxed` (one pass with a stack, no recursion); `s` unchanged if a
    wrapper is unclosed.

    >>> _unwrap_text("\\\\text{New} \\\\textbf{\\\\mathrm{York}} {x}")
    'New York {x}'
    >>> _unwrap_text("\\\\emph{Barack~Obama}")
    'Barack Obama'
    """
    out, stack, i = [], [], 0  # stack: per open brace, whether it opened a wrapper
    while i < len(s):
        m = _TEXT_WRAPPER.match(s, i) if s[i] == "\\" else None
        if m:
            stack.append(True)
            i = m.end()
            continue
        if s[i] == "{":
            stack.append(False)
        elif s[i] == "}" and stack and stack.pop():
            i += 1  # the wrapper's closing brace
            continue
        out.append(s[i])
        i += 1
    return s if any(stack) else _LATEX_SPACE.sub(" ", _DIGIT_GROUP.sub(",", "".join(out)))


def _read_template(path: str | Path, name: str) -> str:
    if not Path(path).exists():
        raise FileNotFoundError(missing_template(path, name))
    text = Path(path).read_text(encoding="utf-8")
    if "{question}" not in text:
        raise ValueError(f"{path}: a prompt template needs a {{question}} placeholder")
    return text.rstrip("\n") + "\n"


def template_path(name: str, template: str = "") -> Path:
    """The template file: `template` if it is a path; a bare word W picks the set W,
    searchlite/templates/W_<protocol>.txt (e.g. "toy"), or the file W here when there is no
    such set; empty = the protocol's own."""
    if not template:
        return TEMPLATE_DIR / f"{name}.txt"
    if "/" not in template and "." not in template and not (
            Path(template).is_file() and not (TEMPLATE_DIR / f"{template}_{name}.txt").exists()):  # not a file here
        return TEMPLATE_DIR / f"{template}_{name}.txt"
    return Path(template)


def template_sets(name: str) -> list[str]:
    """The template set names for protocol `name` (files W_<name>.txt), and '' for its own."""
    return sorted(p.name.removesuffix(f"_{name}.txt") for p in TEMPLATE_DIR.glob(f"*_{name}.txt")) + [
        "'' (the paper's)"] * (TEMPLATE_DIR / f"{name}.txt").exists()


def missing_template(path, name: str) -> str:
    sets = ", ".join(template_sets(name))
    return f"{path} does not exist; give a prompt file with {{question}}, or a set here: {sets}"


def rewrite_path(name: str, template: str = "") -> Path:
    """R1-Searcher++'s rewrite prompt for protocol `name`: templates/<set>_<name>_rewrite.txt for a
    template set (e.g. "toy"), else the paper-style templates/<name>_rewrite.txt: a prompt file,
    also one named by a bare word in the working folder (`template_path`'s reading), is no set."""
    is_set = bool(template) and template_path(name, template) == TEMPLATE_DIR / f"{template}_{name}.txt"
    return template_path(f"{name}_rewrite", template if is_set else "")


def get_protocol(name: str, template: str = "") -> Protocol:
    """The protocol `name` with its template (see `template_path`)."""
    if name == "search_r1":
        return Protocol(
            name=name,
            template=_read_template(template_path(name, template), name),
            stop=("</search>", "</answer>"),
            info_open="<information>",
            info_close="</information>",
            invalid_message=(
                "\nMy previous action is invalid. If I want to search, I should put the query "
                "between <search> and </search>. If I want to give the final answer, I should "
                "put the answer between <answer> and </answer>. Let me try again.\n"
            ),
            search_re=re.compile(r"<search>(.*?)</search>", re.S),
            answer_re=re.compile(r"<answer>(.*?)</answer>", re.S),
            question_mark=True,
        )
    if name == "r1_searcher_pp":
        return Protocol(
            name=name,
            template=_read_template(template_path(name, template), name),
            stop=("<|end_external_search|>",),
            info_open="<|begin_search_result|>",
            info_close="<|end_search_result|>",
            invalid_message=(
                "\nMy previous step is invalid. To search I should write the query between "
                "<|begin_external_search|> and <|end_external_search|>; to finish I should give "
                "the answer as \\boxed{answer}. Let me try again.\n"
            ),
            search_re=re.compile(r"<\|begin_external_search\|>(.*?)<\|end_external_search\|>", re.S),
            answer_re=None,
        )
    raise ValueError(f"unknown protocol '{name}' (valid: search_r1, r1_searcher_pp)")
