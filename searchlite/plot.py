"""Learning curves from metrics.jsonl: train reward and EM, test EM, searches, response length, KL.

    python -m searchlite.plot runs/toy-grpo runs/toy-ppo --out curves.png

The analogue of Search-R1's Figure 2 (training reward, valid search calls and response
length over steps), one line per run, labelled by its folder, plus train EM and held-out
test EM. The reward is the run's own: EM under Search-R1's reward, format + answer + group
terms under `--reward r1pp`; train EM is plotted apart for that reason. A panel shows only
when some run logged its key. Needs matplotlib (`pip install matplotlib`, or the `plot` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .config import ArgumentParser, HelpFormatter
from .data import DataError, os_error_text, read_log

PANELS = [("reward", "train reward"), ("em", "train EM"), ("eval/all", "held-out test EM"),
          ("searches", "valid searches / rollout"), ("response_len", "response length (policy tokens)"),
          ("kl", "KL to reference")]


def read_metrics(run: str | Path) -> list[dict]:
    """A run's metrics.jsonl rows; a line still being written by a running train.py is left out.
    A row without a numeric `step` is a DataError naming its file and line, not skipped: train.py
    logs `step` in every row, so such a row means some other JSONL file was given, and a plot that
    quietly left its rows out would mislead."""
    path = metrics_path(run)
    if not path.is_file():
        raise DataError(f"{run}: no metrics.jsonl (give a train.py out_dir or the file itself)")
    return read_log(path, cut=False, check=_no_step)


def metrics_path(run: str | Path) -> Path:
    """The file a run argument names: a folder's metrics.jsonl, or the file given."""
    return Path(run) / "metrics.jsonl" if Path(run).is_dir() else Path(run)


def _no_step(row: dict) -> str | None:
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        why = "no 'step'" if step is None else f"'step' is {step!r}, not a number"
        return f"{why}; every row train.py logs has its step: is this a run's metrics.jsonl?"
    return None


def labels(runs: list[str | Path]) -> list[str]:
    """The runs' names in the legend: each one's folder, also when given as its metrics.jsonl; a file
    of another name (metrics.previous.jsonl, a run set aside) adds it; names still alike are paths."""
    names = []
    for run in runs:
        path = Path(run).resolve()
        names.append(path.name if not path.is_file() else path.parent.name if path.name == "metrics.jsonl"
                     else f"{path.parent.name}/{path.name}")
    return [name if names.count(name) == 1 else str(run) for name, run in zip(names, runs)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, dict):  # evaluation rows: {"em": ..., ...} per question type
            v = v.get("em")
        if v is not None:
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot(runs: list[str], out: str) -> Path:
    seen = {}
    for run in runs:  # two lines of one colour each, under one name, would look like two runs that agree
        path = metrics_path(run).resolve()
        if path in seen:
            raise DataError(f"{seen[path]} and {run} are the same run ({path}): give each run once")
        seen[path] = run
    metrics = [read_metrics(run) for run in runs]  # a missing or bad file is named before matplotlib loads
    panels = [(key, title) for key, title in PANELS if any(series(rows, key)[0] for rows in metrics)]
    if not panels:
        raise DataError(f"{', '.join(runs)}: no step logged any of {', '.join(key for key, _ in PANELS)} yet")

    try:
        import matplotlib
    except ImportError as e:
        raise DataError(f"plotting needs matplotlib ({e}): ./setup.sh plot (or pip install matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()  # png, pdf, svg, ...
    if Path(out).suffix.lower().lstrip(".") not in kinds:  # else matplotlib added .png, or raised a ValueError
        raise DataError(f"--out {out}: give a file ending in one of .{', .'.join(sorted(kinds))}")
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    names = labels(runs)
    for i, rows in enumerate(metrics):  # a run keeps its colour in every panel, also where another logged nothing
        for ax, (key, title) in zip(axes[0], panels):
            xs, ys = series(rows, key)
            if xs:
                # evaluations are a few points, and one step's point has no line to show it: both get markers
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") or len(xs) == 1 else None, ms=3,
                        color=f"C{i % 10}", label=names[i])
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
    from matplotlib.lines import Line2D

    axes[0][0].legend(handles=[Line2D([], [], color=f"C{i % 10}", label=name) for i, name in enumerate(names)],
                      fontsize=8)  # every run, also one the first panel lacks
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)  # as view's --out: a new folder for the figure is made
    fig.savefig(out, dpi=110)
    plt.close(fig)  # a caller plotting again and again keeps no figure open
    return Path(out)


def main(argv=None) -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl) or metrics.jsonl files; "
                    "the legend names each by its folder (and a file not named metrics.jsonl by its name)")
    ap.add_argument("--out", default="curves.png", help="PNG to write (default curves.png)")
    args = ap.parse_args(argv)
    try:
        print(plot(args.runs, args.out))
    except DataError as e:  # a missing file, or a bad line (its file and line)
        sys.exit(f"error: {e}")
    except OSError as e:  # a file that does not read (permissions)
        sys.exit(f"error: {os_error_text(e)}")


if __name__ == "__main__":
    main()
