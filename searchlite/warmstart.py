"""Build the toy world's warm-start policy from a seed: world, tokenizer, teacher data, SFT.

    python -m searchlite.warmstart --seed 0          # rewrites searchlite/assets/toyworld/

Steps: (1) generate the world and its tokenizer (searchlite.toyworld); (2) roll out the
scripted teacher (searchlite.teacher) on every train question in Search-R1's protocol (the
teacher also writes R1-Searcher++'s, for that method's own cold start), with real BM25
retrieval, famous questions repeated so their facts are memorised, each pass with a fresh seed
so it shows new draws of the teacher's choices; (3) SFT a tiny Llama from random
initialisation on those trajectories, retrieved tokens masked (searchlite.sft), in two phases
at lr 3e-3, batch 4: first `--read_passes` passes of a careful teacher that never guesses,
stops early or misreads (it searches every question but the famous ones it recalls), then
`--epochs` passes of the imperfect one (guesses, stops early, copies wrong spans), which sets
the habits RL must fix; a phase of 0 passes is skipped. Reading a value out of a passage appears
suddenly, after about 2,000 updates: batches of 32 (900 updates in the time budget) never got
there, batches of 4 do, and the imperfect teacher's guesses, trained on from the start, drown
the few tokens where a value is read; (4) save it as a Hugging Face folder, `toy/model`.
Everything is seeded and runs on a fixed number of threads with deterministic algorithms, so
the same machine rebuilds the same bytes. Ctrl-C finishes the SFT step and saves the phase's
state (OUT/warmstart_state_*.pt, also at each phase's end); the same command with `--resume`
continues there and writes the same bytes as a build never stopped.
Left out on purpose: any pretrained weights; the world is fictional so none would help.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import torch

from .config import TOY_DIR, ArgumentParser, ConfigError, HelpFormatter, at_least

MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True)


def make_model(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **MODEL)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


CAREFUL = dict(p_guess=0.0, p_stop=0.0, p_verbatim=0.0, p_wrong_span=0.0)  # no mistakes; famous ones recalled


def teacher_data(tokenizer, qa, retriever, seeds, famous_repeats: int, protocols=("search_r1",),
                 template: str = "toy", teacher: dict | None = None):
    """Teacher rollouts on `qa` (famous questions repeated) in each protocol, once per seed in
    `seeds` (each seed draws the teacher's choices afresh), as one right-padded batch.
    `teacher` overrides the Teacher's mistake rates (e.g. `CAREFUL`)."""
    from .protocol import get_protocol
    from .rollout import rollout
    from .teacher import Teacher

    questions = [q.question for q in qa] + [q.question for q in qa if q.meta.get("famous")] * famous_repeats
    rows = []
    for seed in seeds:
        for k, name in enumerate(protocols):
            protocol = get_protocol(name, template)
            ro = rollout(Teacher(tokenizer, protocol, qa, seed=seed * len(protocols) + k, **(teacher or {})), retriever, tokenizer,
                         protocol, questions, max_turns=4, topk=3)
            rows += [(ro.input_ids[i, :int(ro.attention_mask[i].sum())], ro.loss_mask[i, :int(ro.attention_mask[i].sum())])
                     for i in range(len(ro))]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # (N, T)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (N, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (N, T)
    for i, (ids, m) in enumerate(rows):
        input_ids[i, :len(ids)], loss_mask[i, :len(ids)], attention_mask[i, :len(ids)] = ids, m, 1
    return input_ids, loss_mask, attention_mask


def main(argv=None) -> None:
    ap = ArgumentParser(prog="python -m searchlite.warmstart", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="seed for the world, the teacher, init and SFT (default 0)")
    ap.add_argument("--out", default=None, help="toy world folder; the model goes to OUT/model (default: the "
                    "package's searchlite/assets/toyworld, which only the build with every other flag at its "
                    "default may rewrite)")
    ap.add_argument("--read_passes", "--read-passes", type=at_least(0), default=6,
                    help="first SFT phase: passes with a careful teacher that never guesses, stops early or "
                         "misreads (default 6; 0 skips the phase)")
    ap.add_argument("--epochs", type=at_least(0), default=4,
                    help="second SFT phase: passes with the imperfect teacher, each over fresh trajectories "
                         "(default 4; 0 skips the phase)")
    ap.add_argument("--lr", type=float, default=3e-3, help="SFT peak learning rate (default 3e-3)")
    ap.add_argument("--batch_size", "--batch-size", type=at_least(1), default=4,
                    help="SFT batch size (default 4: reading emerges after ~2,000 updates, and small batches fit more)")
    ap.add_argument("--famous_repeats", "--famous-repeats", type=at_least(0), default=1,
                    help="extra passes over famous questions (default 1)")
    ap.add_argument("--questions", type=at_least(0), default=0,
                    help="teach on the first N train questions only, for a quick small build (default 0: all)")
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch threads; fixed so a rebuild is bit-for-bit (default 2)")
    ap.add_argument("--resume", action="store_true",
                    help="continue a build stopped by Ctrl-C from its SFT state (OUT/warmstart_state_*.pt); it "
                         "ends with the bytes an uninterrupted build writes")
    args = ap.parse_args(argv)
    if args.out is None and (changed := ap.changed(args, keep=("out", "resume"))):  # the shipped model: defaults
        ap.error(f"{', '.join(changed)} would rewrite the shipped toy world and model in {TOY_DIR}, which only the "
                 "default build makes: give --out a folder of its own")
    args.out = args.out or str(TOY_DIR)
    if args.read_passes + args.epochs == 0:
        ap.error("--read_passes 0 and --epochs 0 leave nothing to train on")
    try:
        build(args)
    except ConfigError as e:
        sys.exit(f"error: {e}")


def build(args) -> None:
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()

    from . import toyworld
    from .data import read_qa
    from .models import GracefulStop, load_tokenizer
    from .retrieval import build_retriever
    from .sft import sft

    out = Path(args.out)
    toyworld.main(["build", "--seed", str(args.seed), "--out", str(out)])
    tokenizer = load_tokenizer(str(out))
    qa = read_qa(out / "train.jsonl")[:args.questions or None]
    retriever = build_retriever("bm25", str(out / "corpus.jsonl"))
    model = make_model(tokenizer, args.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    # Reading first: the imperfect teacher's guesses are noise a tiny model must fit, and they
    # drown the few tokens where a value is read from a passage; learnt first, reading stays.
    phases = [("careful", args.read_passes, CAREFUL), ("imperfect", args.epochs, None)]
    # Each phase's SFT state: saved at its end and on Ctrl-C, so --resume redoes nothing trained.
    states = {name: out / f"warmstart_state_{name}.pt" for name, _, _ in phases}
    if not args.resume:
        for path in states.values():
            path.unlink(missing_ok=True)
    seed = args.seed * 1000
    # the flags a resumed phase must share besides sft's own: they change its rows (--threads: its bytes)
    run = {f"--{k}": vars(args)[k] for k in ("seed", "questions", "famous_repeats", "read_passes", "epochs", "threads")}
    with GracefulStop() as stop:  # Ctrl-C: the SFT step finishes, the phase's state is saved, the build stops
        for k, (name, passes, teacher) in enumerate(phases):
            if not passes:
                continue
            seeds, seed = list(range(seed, seed + passes)), seed + passes
            input_ids, loss_mask, attention_mask = teacher_data(tokenizer, qa, retriever, seeds, args.famous_repeats,
                                                                teacher=teacher)
            print(f"{name} teacher: {len(input_ids)} trajectories, {int(attention_mask.sum())} tokens "
                  f"({int(loss_mask.sum())} trained on)", flush=True)
            losses = sft(model, input_ids, loss_mask, attention_mask=attention_mask, epochs=1, lr=args.lr,
                         batch_size=args.batch_size, warmup=50, seed=args.seed + k, state_path=states[name],
                         stop=stop, run=run, flags={"lr": "--lr", "batch_size": "--batch_size",
                                                    "seed": None})  # the phase's seed: --seed + its number
            if stop.requested:
                break
    stop.exit_if_requested(f"stopped after step {len(losses)} of the {name} phase, its state saved in "
                           f"{states[name]}: rerun the same command with --resume to continue")
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    for path in states.values():
        path.unlink(missing_ok=True)
    digest = hashlib.sha256((out / "model" / "model.safetensors").read_bytes()).hexdigest()[:16]
    tail = losses[-20:]
    print(f"final sft loss {sum(tail) / len(tail):.4f}; wrote {out / 'model'} (sha256 {digest}) "
          f"in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
