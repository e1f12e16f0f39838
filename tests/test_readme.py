"""The README's commands against the code: each flag a command line in it passes is one its
command's --help lists, each preset it names is in configs.toml, each setup.sh option it gives
is one setup.sh takes. A renamed flag then fails here rather than in a user's first run. And each
command's --help itself: it says what the command does, and each flag's default."""
import argparse
import importlib
import inspect
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import load_bench

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SUBCOMMANDS = {"retrieve.py", "-m searchlite.memory", "-m searchlite.toyworld", "-m searchlite.r1pp"}
OTHERS = {"-m pytest", "-m pip"}  # not ours: their flags are not checked


def command_lines(text: str) -> list[str]:
    """The lines of the README's code blocks, a `\\` continuation joined, each comment cut."""
    out = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        line = ""
        for raw in block.splitlines():
            raw = re.sub(r"\s+#.*$", "", raw).strip()
            line = f"{line} {raw}".strip()
            if line.endswith("\\"):
                line = line[:-1]
                continue
            if line:
                out.append(line)
            line = ""
    return out


def parse(line: str) -> tuple[str, list[str]] | None:
    """('train.py' | '-m searchlite.view' | 'retrieve.py build' ..., its arguments) of the first
    `python` or `torchrun` command in a line, or None if it has none."""
    m = re.search(r"(?:^|[\s;&|])(?:\S*/)?(python|torchrun)\s+(.*)", line)
    if not m:
        return None
    args = shlex.split(re.split(r"\s(?:&&|;|\|)\s", m.group(2))[0])
    if m.group(1) == "torchrun":  # torchrun's own flags, each with a value, come first
        while args and args[0].startswith("--"):
            args = args[2:]
    if args[:1] == ["-m"]:
        command, args = f"-m {args[1]}", args[2:]
    else:
        command, args = args[0], args[1:]
    if command in SUBCOMMANDS and args and not args[0].startswith("-"):
        command, args = f"{command} {args[0]}", args[1:]
    return command, args


def help_text(command: str, monkeypatch, capsys) -> str:
    """What `python <command> --help` prints, run in this process."""
    script, *sub = command.split()[1:] if command.startswith("-m ") else command.split()
    if command.startswith("-m "):
        main = importlib.import_module(script).main
    elif script.startswith("bench/"):
        main = load_bench(Path(script).stem).main
    else:
        main = importlib.import_module(Path(script).stem).main
    argv = [*sub, "--help"]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as exit_:
        main(argv) if inspect.signature(main).parameters else main()
    assert exit_.value.code in (0, None), command
    return capsys.readouterr().out


COMMANDS = [c for c in map(parse, command_lines(README)) if c and c[0] not in OTHERS]


def test_the_readme_has_its_commands():
    """The parser reads the README's main lines; an empty list would pass every test below."""
    names = {command for command, _ in COMMANDS}
    assert {"train.py", "evaluate.py", "retrieve.py build", "retrieve.py serve", "-m searchlite.view",
            "bench/rollout_bench.py"} <= names
    assert ("train.py", ["--algo", "grpo", "--group", "5"]) in COMMANDS
    assert parse("torchrun --nnodes 2 --node_rank 0 train.py --preset x") == ("train.py", ["--preset", "x"])
    assert parse("./setup.sh serve && python retrieve.py serve --port 8000") == ("retrieve.py serve",
                                                                              ["--port", "8000"])


@pytest.mark.parametrize("command", sorted({command for command, _ in COMMANDS}))
def test_each_flag_the_readme_passes_is_in_its_commands_help(command, monkeypatch, capsys):
    text = help_text(command, monkeypatch, capsys)
    flags = {a.split("=")[0] for c, args in COMMANDS if c == command for a in args if a.startswith("--")}
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert not missing, f"README passes {missing} to `python {command}`, whose --help does not list them"


def test_each_preset_the_readme_names_is_in_configs_toml():
    presets = tomllib.loads((ROOT / "configs.toml").read_text(encoding="utf-8"))
    named = set(re.findall(r"--preset[ =]([\w.-]+)", README))
    assert "qwen2.5-3b-grpo" in named
    assert named <= set(presets), sorted(named - set(presets))


def test_each_setup_option_the_readme_gives_is_one_setup_sh_takes():
    setup = (ROOT / "setup.sh").read_text(encoding="utf-8")
    valid = set(re.search(r"\(valid: ([^)]*)\)", setup).group(1).replace(",", " ").split())
    given = {w for m in re.findall(r"\./setup\.sh((?: [a-z0-9]+)+)", README) for w in m.split()}
    assert {"dev", "vllm", "serve"} <= given
    assert given <= valid, sorted(given - valid)


EVERY_COMMAND = ["train.py", "evaluate.py", "retrieve.py build", "retrieve.py query", "retrieve.py serve",
                 "-m searchlite.r1pp stage1", "-m searchlite.memory merge", "-m searchlite.toyworld build",
                 "-m searchlite.warmstart", "-m searchlite.view", "-m searchlite.plot",
                 *(f"bench/{p.name}" for p in sorted((ROOT / "bench").glob("*.py")))]
HF_FLAGS = {"--repo-type", "--local-dir", "--include"}  # `hf download`'s, in the 3B walkthrough


def test_each_commands_help_says_what_it_does_before_its_flags(monkeypatch, capsys):
    """Between the usage and the first flag, a sentence: train.py's and stage 1's --help, and merge's and
    build's, went from the usage line straight to the flags."""
    for command in EVERY_COMMAND:
        blocks = help_text(command, monkeypatch, capsys).split("\n\n")
        said = blocks[1].splitlines()[0]
        assert blocks[0].startswith("usage:") and len(said.split()) >= 5 and "--" not in said \
            and not said.endswith(":"), (command, said)


def test_each_flag_with_a_default_names_it_in_help(monkeypatch, capsys):
    """A flag that takes a value and has one unless given says which in --help (r1pp_recall's --limit,
    rollout_bench's and sampler_bench's --seed did not); train.py's and stage 1's list each field's."""
    parsers, show = [], argparse.ArgumentParser.print_help
    monkeypatch.setattr(argparse.ArgumentParser, "print_help",
                        lambda ap, file=None: parsers.append(ap) or show(ap, file))
    for command in EVERY_COMMAND:
        help_text(command, monkeypatch, capsys)
    assert len(parsers) == len(EVERY_COMMAND) - 2  # train.py and stage 1 print config.usage
    for ap in parsers:
        for action in ap._actions:
            default = action.default
            none = default is None or default is False or default in ("", argparse.SUPPRESS)  # as HelpFormatter
            if action.option_strings and not none:
                said = ap._get_formatter()._format_action(action)
                assert "default" in said, (ap.prog, said)


def test_each_flag_the_readme_names_anywhere_is_one_of_a_command(monkeypatch, capsys):
    """Flags named in the prose too (`--lora_rank`, `--group_reward false`), each in the --help of
    one of the project's commands, torchrun's or `hf download`'s."""
    from torch.distributed.run import get_args_parser

    helps = get_args_parser().format_help() + "".join(help_text(c, monkeypatch, capsys) for c in EVERY_COMMAND)
    named = set(re.findall(r"--[a-z][\w-]*(?<![_-])(?![\w*])", README)) - HF_FLAGS
    assert {"--lora_rank", "--group_reward", "--judge_url", "--nproc_per_node"} <= named
    missing = sorted(f for f in named if not re.search(re.escape(f) + r"(?![\w-])", helps))
    assert not missing, f"the README names {missing}, which no command's --help lists"
