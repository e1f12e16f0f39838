"""Every program runs as its users start it: `python train.py`, `python -m searchlite.r1pp`,
`python bench/r1pp_table.py`. The other tests call each program's main() in their own process,
which a script whose `if __name__ == "__main__":` block lost its main() call would pass while it
did nothing; here each file that has such a block is started in a process of its own, with
--help, from another folder than the repo root."""
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for folder in (ROOT, ROOT / "searchlite", ROOT / "bench") for p in folder.glob("*.py")
                 if re.search(r'^if __name__ == "__main__":', p.read_text(encoding="utf-8"), re.M))


def command(path: Path) -> list[str]:
    """How a user starts it: a package module with -m, any other file by its path."""
    if path.parent.name == "searchlite":
        return [sys.executable, "-m", f"searchlite.{path.stem}"]
    return [sys.executable, str(path)]


def started(path: Path, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*command(path), "--help"], cwd=tmp, capture_output=True, text=True, timeout=120)


def test_each_program_prints_its_help_when_started_as_a_script(tmp_path):
    names = {str(p.relative_to(ROOT)) for p in SCRIPTS}
    assert {"train.py", "evaluate.py", "retrieve.py", "searchlite/r1pp.py", "bench/r1pp_table.py"} <= names
    with ThreadPoolExecutor(3) as pool:  # each imports torch: about 2 s apiece, on two cores
        results = dict(zip(SCRIPTS, pool.map(lambda p: started(p, tmp_path), SCRIPTS)))
    server = results.pop(ROOT / "searchlite" / "server.py")  # no program of its own: it says which is
    assert server.returncode == 1
    assert "the server runs from retrieve.py: python retrieve.py serve --help" in server.stderr
    failed = {str(p.relative_to(ROOT)): (r.returncode, r.stdout[:80], r.stderr[-300:]) for p, r in results.items()
              if r.returncode != 0 or not r.stdout.startswith("usage:")}
    assert not failed, failed
