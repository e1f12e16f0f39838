"""Peak memory of a few training steps under each memory lever, from one run, as a Markdown table.

    python bench/memory_bench.py                                 # the toy world's [toy] preset, 2 steps
    python bench/memory_bench.py --model random:768x12           # same, a ~90M-parameter random Llama
    python bench/memory_bench.py --variants adamw,adamw8bit -- --batch_size 8   # train.py flags after --

Each variant is `train.py` (the [toy] preset, `--steps`, evaluation on 4 questions, 2 with
`--model random:...`, the variant's flags) in a subprocess of its own, so no variant's memory
shows in another's. The child reports its peak resident memory (`VmHWM` in /proc/self/status:
its own high-water mark since exec, Python, torch and every model included; getrusage's ru_maxrss
would not do, as on Linux it carries the parent's peak across fork + exec), on a GPU the peak CUDA
memory allocated, and the bytes of optimizer state. Every child imports bitsandbytes and peft
(when installed), so the baseline of loaded libraries is the same for all.

The toy model has 1.4M parameters: AdamW's fp32 states are ~10 MiB of a process that peaks near
840 MiB on CPU (README), so its rows differ by little. `--model random:HIDDENxLAYERS` builds a random
Llama of that size over the toy tokenizer (saved to a temporary folder; MLP 8/3 x hidden,
64-wide heads), where optimizer states, gradients, the reference copy and activations are large
enough to compare. A random model's rollouts are noise that runs every turn to
--max_new_tokens, so with --model random the batch is 4 questions x 2 rollouts of 16 tokens a
turn, one search turn (then the forced answer), all 8 in one micro-batch; flags after -- change that.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from searchlite.config import HelpFormatter, local_path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> train.py flags
    "adamw": [],
    "adamw8bit": ["--optimizer", "adamw8bit"],
    "adamw+gc": ["--grad_checkpointing"],
    "adamw8bit+gc": ["--optimizer", "adamw8bit", "--grad_checkpointing"],
    "lora": ["--lora_rank", "16"],
    "ref_offload": ["--ref_offload"],
    "bf16": ["--dtype", "bfloat16"],  # float32 master weights computing in bf16
    "bf16-weights": ["--dtype", "bfloat16", "--master_weights", "false"],  # the weights themselves in bf16
}
DEFAULT_VARIANTS = "adamw,adamw8bit,adamw+gc,adamw8bit+gc,lora"  # + ref_offload on a GPU
RANDOM_MODEL_FLAGS = ["--batch_size", "4", "--group", "2", "--max_new_tokens", "16", "--max_turns", "1",
                      "--micro_batch_size", "8", "--eval_size", "2"]


# ---------------------------------------------------------------------------- child: one train.py run


def peak_rss_bytes(status: str = "/proc/self/status") -> int:
    """This process's peak resident memory in bytes: `VmHWM` (Linux; reset on exec, so a child's
    own), else getrusage's ru_maxrss (macOS, where /proc is missing; Linux's ru_maxrss would include
    the parent's peak, inherited across fork + exec)."""
    if os.path.exists(status):
        with open(status) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:    14916 kB"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def child(report: str, train_args: list[str]) -> None:
    """Run train.main(train_args) in this process and write its peak memory to `report` (JSON)."""
    import importlib

    import torch

    sys.path.insert(0, str(ROOT))
    import train
    from searchlite.memory import optimizer_state_bytes

    for name in ("bitsandbytes", "peft"):  # the same libraries loaded in every variant
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    optimizers = []
    make = train.make_optimizer

    def recording(*args, **kwargs):  # keep the optimizers to measure their state at the end
        opt, sched = make(*args, **kwargs)
        optimizers.append(opt)
        return opt, sched

    train.make_optimizer = recording
    train.main(train_args)
    out = {
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "opt_state_mib": sum(optimizer_state_bytes(o) for o in optimizers) / 2**20,
        "trainable": sum(p.numel() for o in optimizers for g in o.param_groups for p in g["params"]),
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }
    Path(report).write_text(json.dumps(out))


# ---------------------------------------------------------------------------- parent


def random_model(spec: str, folder: Path) -> str:
    """Save a random Llama `HIDDENxLAYERS` with the toy tokenizer into `folder`; its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from searchlite.config import TOY_DIR
    from searchlite.models import load_tokenizer

    m = re.fullmatch(r"random:(\d+)x(\d+)", spec)
    if not m:
        raise SystemExit(f"--model {spec!r}: expected a folder or random:HIDDENxLAYERS, e.g. random:768x12")
    hidden, layers = int(m.group(1)), int(m.group(2))
    if hidden % 64:
        raise SystemExit(f"--model {spec!r}: hidden size must be a multiple of 64 (the head width)")
    tok = load_tokenizer(str(TOY_DIR))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    print(f"random Llama {spec}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {folder}",
          flush=True)
    return str(folder)


def run_variant(name: str, flags: list[str], base: list[str], work: Path) -> dict:
    report = work / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(report), "--",
           *base, "--out_dir", str(work / name), *flags]
    print(f"\n=== {name}: train.py {' '.join(cmd[5:])}", flush=True)
    log = work / f"{name}.log"  # in a temporary folder, gone by the time the error is read: show its tail
    with open(log, "w") as f:
        code = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0 or not report.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"variant {name} failed (exit {code}); the last lines of its output:\n{tail}")
    return json.loads(report.read_text())


def table(rows: dict, flags: dict) -> str:
    base = rows.get("adamw")
    gpu = any(r["cuda_peak_mib"] is not None for r in rows.values())
    head = ["variant", "train.py flags", "peak RSS MiB", "vs adamw"] + (["peak CUDA MiB", "vs adamw"] if gpu else []) \
        + ["optimizer state MiB", "trainable params"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        cells = [name, " ".join(flags[name]) or "(none)", f"{r['peak_rss_mib']:,.0f}",
                 f"{r['peak_rss_mib'] - base['peak_rss_mib']:+,.0f}" if base else ""]
        if gpu:
            cuda, cuda0 = r["cuda_peak_mib"], base["cuda_peak_mib"] if base else None
            cells += [f"{cuda:,.0f}", f"{cuda - cuda0:+,.0f}" if base else ""]
        cells += [f"{r['opt_state_mib']:,.2f}", f"{r['trainable']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if "--child" in sys.argv[1:2]:
        rest = sys.argv[3:]
        return child(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                 usage="%(prog)s [options] [-- TRAIN.PY FLAGS ...]",
                                 epilog="Flags after -- go to every variant's train.py run, e.g. "
                                        "-- --max_new_tokens 32 --batch_size 4.")
    ap.add_argument("--model", default="toy/model", help="policy folder, or random:HIDDENxLAYERS (default: toy/model)")
    ap.add_argument("--variants", default="", help=f"comma-separated, of: {', '.join(VARIANTS)} "
                    f"(default: {DEFAULT_VARIANTS}, and ref_offload on a GPU)")
    ap.add_argument("--steps", type=int, default=2, help="RL steps per variant (default 2)")
    ap.add_argument("--out", default="", help="also write the table to this Markdown file")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    import torch

    names = args.variants.split(",") if args.variants else DEFAULT_VARIANTS.split(",") + (
        ["ref_offload"] if torch.cuda.is_available() else [])
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="memory_bench-") as tmp:
        work = Path(tmp)
        model = random_model(args.model, work / "model") if args.model.startswith("random:") else local_path(args.model)
        base = ["--model", model, "--steps", str(args.steps), "--eval_size", "4", "--log_trajectories_every", "0",
                "--save_every", "1000000", *(RANDOM_MODEL_FLAGS if args.model.startswith("random:") else []), *extra]
        print(f"train.py {' '.join(base)}  (+ each variant's flags; [toy] preset)", flush=True)
        rows = {n: run_variant(n, VARIANTS[n], base, work) for n in names}
    md = table(rows, VARIANTS)
    print(f"\nmodel: {args.model}, {args.steps} steps, device: {'cuda' if torch.cuda.is_available() else 'cpu'}\n"
          f"{md}")
    if args.out:
        Path(args.out).write_text(md + "\n")


if __name__ == "__main__":
    main()
