"""Render rollouts as one self-contained HTML page: reading the searches is how you debug this.

    write_html("runs/x/trajectories/step00010.html", ro, tokenizer, rewards, golds)
    python -m searchlite.view --model toy/model --n 6 --out view.html     # fresh rollouts (toy template)
    python -m searchlite.view --model runs/toy-grpo --greedy              # a train.py run, as it was trained
    python -m searchlite.view --model runs/x --retriever_url http://127.0.0.1:8000   # another retriever

Each trajectory shows its reward (the command's: exact match, or for a `--reward r1pp` run
R_format + R_answer, with no R_group as it samples one rollout a question), gold answers,
searches and turns; the response is split
at every change of `loss_mask`, so the tokens trained on (those the policy sampled) and the
rest (retrieved passages, injected messages) get different colours; with `mask_retrieved`
false, Search-R1's ablation, passages are trained on and coloured so. The prompt is folded.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

from .config import ArgumentParser, HelpFormatter, at_least, bool_arg, plain_warnings

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; }
.traj { border: 1px solid #ccc; border-radius: 6px; margin: 1em 0; padding: 0.6em 1em; }
.head { font-size: 0.9em; color: #333; margin-bottom: 0.4em; }
.ok { color: #0a7a2f; font-weight: bold; } .bad { color: #b3261e; font-weight: bold; }
pre { white-space: pre-wrap; word-break: break-word; font-size: 0.85em; margin: 0; }
.policy { background: #e3f4e6; } .other { background: #e8ecf6; color: #445; }
.legend span { padding: 0 0.4em; margin-right: 1em; }
details { color: #666; font-size: 0.85em; }
"""


def segments(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """Runs of equal mask value: [(mask, ids), ...]."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def render(ro, tokenizer, rewards, golds, title: str = "rollouts", limit: int = 0) -> str:
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title><style>{STYLE}</style>",
             f"<h2>{html.escape(title)}</h2>",
             "<p class='legend'><span class='policy'>in the loss (loss_mask 1): sampled by the policy</span>"
             "<span class='other'>not in the loss (loss_mask 0): retrieved or injected</span></p>"]
    n = len(ro) if not limit else min(limit, len(ro))
    for i in range(n):
        length = int(ro.attention_mask[i].sum())
        p = int(ro.prompt_len[i])
        ids, mask = ro.input_ids[i, :length].tolist(), ro.loss_mask[i, :length].tolist()
        prompt = tokenizer.decode(ids[:p], skip_special_tokens=False)
        body = "".join(
            f"<span class='{'policy' if m else 'other'}'>"
            f"{html.escape(tokenizer.decode(seg, skip_special_tokens=False))}</span>"
            for m, seg in segments(ids[p:], mask[p:]))
        r, a = rewards[i], ro.answers[i]
        answer = "<i>none</i>" if a is None else f"<b>{html.escape(a)}</b>"  # not the word "None" answered
        parts.append(
            f"<div class='traj'><div class='head'>#{i} &nbsp; reward <span class='{'ok' if r > 0 else 'bad'}'>"
            f"{r:g}</span> &nbsp; answer {answer} &nbsp; gold "
            f"{html.escape(' | '.join(golds[i]))} &nbsp; searches {int(ro.searches[i])} &nbsp; turns "
            f"{int(ro.turns[i])}</div><details><summary>prompt ({p} tokens)</summary><pre>{html.escape(prompt)}"
            f"</pre></details><pre>{body}</pre></div>")
    return "\n".join(parts) + "\n"


def write_html(path, ro, tokenizer, rewards, golds, title: str = "rollouts", limit: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(ro, tokenizer, rewards, golds, title, limit), encoding="utf-8")  # as the page declares
    return path


def main(argv=None) -> None:
    ap = ArgumentParser(description="Roll out a model on a few questions and render them to HTML.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default="toy/model", help="policy: a Hugging Face folder, a train.py run or checkpoint "
                    "folder, a .gguf file or smollm2 (toy/model = the embedded warm start)")
    ap.add_argument("--data", default=None, help="QA JSONL to take questions from (default: a train.py run's "
                    "test_data, else toy/test.jsonl)")
    ap.add_argument("--retriever", default=None, help="bm25 | rank_bm25 | dense | http (default: a train.py run's, "
                    "with its --corpus, --index, --encoder, --pooling, --query_prefix and --retriever_url, each of which a flag "
                    "replaces; given, the run's are left out; else bm25)")
    ap.add_argument("--corpus", default=None, help="passages JSONL (default: a train.py run's, else toy/corpus.jsonl)")
    ap.add_argument("--index", default=None, help="a saved index folder (retrieve.py build), or with --retriever "
                    "dense a FAISS file over --corpus (default: a train.py run's)")
    ap.add_argument("--encoder", default=None, help="dense retriever: encoder folder or name (default: a "
                    "train.py run's)")
    ap.add_argument("--pooling", default=None, choices=("mean", "cls"), help="dense retriever built here: mean (E5) "
                    "| cls (BGE) (default: a train.py run's, else mean)")
    ap.add_argument("--query_prefix", default=None, help="dense retriever: text before each query, e.g. 'query: ' "
                    "for an E5 index (default: a train.py run's, else an index folder's, else by the encoder's name)")
    ap.add_argument("--retriever_url", default=None, help="a Search-R1-compatible retrieval server (implies "
                    "--retriever http)")
    ap.add_argument("--protocol", default=None, help="search_r1 | r1_searcher_pp (default: the one a train.py run "
                    "given as --model was trained with, else search_r1)")
    ap.add_argument("--template", default=None, help="prompt template: a file with {question}, or a set name "
                    "(toy = templates/toy_<protocol>.txt, the toy model's); '' = the paper's, for real models "
                    "(default: a train.py run's own, else toy)")
    ap.add_argument("--chat_template", type=bool_arg, default=None, help="wrap prompts in the tokenizer's chat "
                    "template when it has one (false: plain text, for few-shot templates; default: a train.py "
                    "run's own, else true)")
    ap.add_argument("--n", type=at_least(1), default=8, help="number of questions")
    ap.add_argument("--topk", type=at_least(1), default=None, help="passages per search (default: a train.py "
                    "run's, else 3)")
    ap.add_argument("--max_obs_tokens", type=at_least(1), default=None, help="retrieved tokens shown per search "
                    "(default: a train.py run's, else 500)")
    ap.add_argument("--max_len", type=at_least(1), default=None, help="cap on prompt + response tokens (default: "
                    "a train.py run's, else 4096)")
    ap.add_argument("--max_turns", type=at_least(0), default=None, help="search budget (default: a train.py run's "
                    "own, else 4)")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature, 0 = greedy (default: a "
                    "train.py run's own; the toy warm start's [toy] preset, 0.7; else 1)")
    ap.add_argument("--max_new_tokens", type=at_least(1), default=None, help="tokens sampled a turn at most "
                    "(default: a train.py run's own; the toy warm start's [toy] preset, 64; else 500)")
    ap.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--out", default="trajectories.html", help="output HTML file")
    args = ap.parse_args(argv)
    if args.temperature is not None and not args.temperature >= 0:
        ap.error(f"argument --temperature: must be at least 0 (0 = greedy, as --greedy), got {args.temperature}")
    if Path(args.out).is_dir():  # known before the model loads and the rollouts run, not after
        ap.error(f"argument --out: {args.out} is a folder; give the HTML file to write, e.g. {Path(args.out) / 'v.html'}")

    from .config import DEFAULT_PRESETS, TOY_DIR, ConfigError, read_presets, resolve_path
    from .data import DataError, os_error_text, read_qa
    from .evaluation import QUESTION_STOP
    from .model_spec import ModelError, fill_prompt_settings, fill_run_settings, load_model, run_defaults
    from .protocol import get_protocol
    from .r1pp import reward_terms
    from .retrieval import config_retriever
    from .rewards import exact_match
    from .rollout import rollout
    from .sampler import HFSampler

    # the files first, so that a bad one is named before the model loads; a missing one, or a bad line
    # (DataError names its file and line), is one line, not a traceback
    try:
        run_config = fill_prompt_settings(args)  # a train.py run's config.json, else None (reads no model)
        # sampled and searched as the run was; the toy warm start as the [toy] preset samples it (temperature
        # 1 garbles its names); any other model at temperature 1 with 500 tokens a turn (HFSampler's defaults)
        toy = Path(resolve_path(args.model)).resolve() == (TOY_DIR / "model").resolve()
        saved = (json.loads(run_config.read_text(encoding="utf-8")) if run_config else
                 read_presets(DEFAULT_PRESETS)["toy"] if toy else {})
        fill_run_settings(args, run_config, run_defaults())  # the run's test set, retriever and lengths
        qa = read_qa(resolve_path(args.data))[: args.n]
        if args.retriever_url:
            args.retriever = "http"
        retriever = config_retriever(args)
    except (DataError, ConfigError, ModelError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: {os_error_text(e)}") from None
    try:
        protocol = get_protocol(args.protocol, args.template)  # an unknown protocol, a template without {question}
        model, tok = load_model(args.model)
    except (ModelError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    temperature = args.temperature if args.temperature is not None else saved.get("temperature", 1.0)
    max_new_tokens = args.max_new_tokens or saved.get("max_new_tokens", 500)
    greedy = args.greedy or temperature == 0  # (transformers refuses temperature 0)
    sampler = HFSampler(model, tok, seed=args.seed, temperature=temperature if not greedy else 1.0,
                        max_new_tokens=max_new_tokens)
    protocol = dataclasses.replace(protocol, stop=protocol.stop + QUESTION_STOP)  # as evaluate.py asks
    ro = rollout(sampler, retriever, tok, protocol, [q.question for q in qa], max_turns=args.max_turns,
                 topk=args.topk, max_obs_tokens=args.max_obs_tokens, max_len=args.max_len,
                 chat_template=args.chat_template, greedy=greedy)
    if saved.get("reward") == "r1pp":  # scored as the run was: R_format + R_answer (no R_group: one rollout each)
        terms = reward_terms(ro, qa, protocol, group=1, use_group=False)
        rewards, scored = (terms["format"] + terms["answer"]).tolist(), "reward R_format + R_answer (cover-EM)"
    else:
        rewards, scored = [exact_match(a, q.answers) for a, q in zip(ro.answers, qa)], "reward exact match"
    try:
        print(write_html(args.out, ro, tok, rewards, [q.answers for q in qa],
                         title=f"{args.model} on {args.data}, {scored}"))
    except OSError as e:  # a file where its folder should be, no room, no permission
        raise SystemExit(f"error: --out: {os_error_text(e)}") from None


if __name__ == "__main__":
    plain_warnings(__file__)
    main()
