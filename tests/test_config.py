"""Config precedence (defaults < preset < CLI) and the errors for bad keys and values."""

import json
import re
import warnings
from pathlib import Path

import pytest
from conftest import pretend_installed

import searchlite.config
from searchlite.config import (TOY_DIR, Config, ConfigError, field_help, parse_args, plain_warnings, resolve_path,
                               save_config)

PRESETS = """
[small]
algo = "ppo"
group = 1
lr = 2e-6

[badkey]
grop = 4

[badtype]
group = "four"
"""


@pytest.fixture()
def presets(tmp_path):
    p = tmp_path / "configs.toml"
    p.write_text(PRESETS)
    return p


def test_precedence(presets):
    assert parse_args([], presets).algo == Config().algo  # no [toy] in this file: nothing applied
    cfg = parse_args(["--preset", "small"], presets)
    assert (cfg.algo, cfg.group, cfg.lr, cfg.topk) == ("ppo", 1, 2e-6, Config().topk)
    cfg = parse_args(["--preset", "small", "--group", "5", "--lr=1e-5"], presets)
    assert (cfg.algo, cfg.group, cfg.lr) == ("ppo", 5, 1e-5)
    # the CLI wins wherever the flag stands relative to --preset
    assert parse_args(["--group", "3", "--preset", "small"], presets).group == 3


def test_bool_flags(presets):
    assert parse_args(["--resume"], presets).resume is True
    assert parse_args(["--resume", "--group", "2"], presets).resume is True
    assert parse_args(["--mask_retrieved", "false"], presets).mask_retrieved is False
    for word, value in (("TRUE", True), ("Yes", True), ("1", True), ("False", False), ("NO", False), ("0", False)):
        assert parse_args(["--mask_retrieved", word], presets).mask_retrieved is value, word
    with pytest.raises(ConfigError, match="mask_retrieved"):
        parse_args(["--mask_retrieved", "maybe"], presets)


def test_bool_arg_flags_of_the_scripts(capsys):
    """evaluate.py's and view's boolean flags (--progress, --chat_template) read the same words as
    train.py's; another word is a usage error naming the flag, not a silent false."""
    from searchlite.config import ArgumentParser, bool_arg

    ap = ArgumentParser(prog="evaluate.py")
    ap.add_argument("--progress", type=bool_arg, default=True)
    for word, value in (("TRUE", True), ("Yes", True), ("1", True), ("False", False), ("NO", False), ("0", False)):
        assert ap.parse_args(["--progress", word]).progress is value, word
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--progress", "maybe"])
    assert e.value.code == 2 and "argument --progress: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_a_bad_value_from_a_preset_is_named_by_its_preset_line(tmp_path):
    """temperature = -0.7 in [toy] was reported as '--temperature -0.7', a flag nobody typed."""
    from searchlite.config import check_config

    presets = tmp_path / "configs.toml"
    presets.write_text('[toy]\ntemperature = -0.7\nalgo = "grp"\n')
    with pytest.raises(ConfigError, match=r"^configs.toml \[toy\] algo = 'grp': not one of grpo, ppo, reinforce_pp"):
        check_config(parse_args([], presets))
    with pytest.raises(ConfigError, match=r"^configs.toml \[toy\] temperature = -0.7: must be in \(0, inf\)$"):
        check_config(parse_args(["--algo", "grpo"], presets))
    with pytest.raises(ConfigError, match=r"^--temperature -1.0: must be in"):  # typed: its flag
        check_config(parse_args(["--algo", "grpo", "--temperature", "-1"], presets))


def test_errors_name_key_and_closest(presets):
    with pytest.raises(ConfigError, match=r"--grop.*did you mean 'group'"):
        parse_args(["--grop", "5"], presets)
    with pytest.raises(ConfigError, match=r"'group' expects int, got 'five'"):
        parse_args(["--group", "five"], presets)
    with pytest.raises(ConfigError, match=r"^command line: 'lr' expects float, got 'abc'$"):
        parse_args(["--lr", "abc"], presets)
    with pytest.raises(ConfigError, match=r"\[badkey\]: unknown key 'grop'; did you mean 'group'"):
        parse_args(["--preset", "badkey"], presets)
    with pytest.raises(ConfigError, match=r"\[badtype\]: 'group' expects int"):
        parse_args(["--preset", "badtype"], presets)
    with pytest.raises(ConfigError, match=r"no preset \[smal\]; did you mean 'small'"):
        parse_args(["--preset", "smal"], presets)
    with pytest.raises(ConfigError, match=r"no preset \[small-ppo\]; did you mean --preset small --algo ppo\?"):
        parse_args(["--preset", "small-ppo"], presets)  # a preset and an algo, not the closest name
    with pytest.raises(ConfigError, match=r"^command line: --group needs a value$"):  # the last argument
        parse_args(["--group"], presets)
    with pytest.raises(ConfigError, match="expected --key value"):
        parse_args(["group", "5"], presets)


def test_a_flag_is_not_the_value_of_the_flag_before_it(presets):
    """`--out_dir $RUN --resume` with RUN empty: an error, not a fresh run in a folder '--resume'."""
    with pytest.raises(ConfigError, match=r"^command line: --out_dir needs a value, got the flag --resume"):
        parse_args(["--out_dir", "--resume"], presets)
    with pytest.raises(ConfigError, match=r"--group needs a value, got the flag --seed"):
        parse_args(["--group", "--seed", "1"], presets)
    with pytest.raises(ConfigError, match=r"--preset needs a value, got the flag --algo"):
        parse_args(["--preset", "--algo", "ppo"], presets)
    with pytest.raises(ConfigError, match=r"unknown flag --grop; did you mean 'group'"):
        parse_args(["--grop", "--resume"], presets)  # the unknown flag is the error worth naming
    cfg = parse_args(["--lr", "-1e-6", "--seed", "-3", "--resume"], presets)  # a negative number is a value
    assert (cfg.lr, cfg.seed, cfg.resume) == (-1e-6, -3, True)
    assert parse_args(["--out_dir=--resume"], presets).out_dir == "--resume"  # asked for with '='
    cfg = parse_args(["--out_dir", "", "--resume"], presets)  # RUN empty but quoted: the default folder
    assert (cfg.out_dir, cfg.resume) == (f"runs/none-{Config().algo}", True)


@pytest.mark.parametrize("line, said", [
    ('lr = "abc"', "'lr' expects float, got 'abc'"),  # text that is no number
    ("lr = true", "'lr' expects float, got True"),  # a bool is an int to Python, not a learning rate
    ("lr = [1]", "'lr' expects float, got [1]"),  # neither a number nor text
    ("model = 5", "'model' expects str, got 5"),  # a number where text is expected
])
def test_a_preset_value_of_another_type_is_named_with_its_preset(tmp_path, line, said):
    presets = tmp_path / "p.toml"
    presets.write_text(f"[p]\n{line}\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--preset", "p"], presets)
    assert str(e.value) == f"{presets} [p]: {said}"


@pytest.mark.parametrize("flag, hint", [
    ("--temp", "did you mean one of 'temperature', 'template'?"),  # was 'template' alone
    ("--kl", "did you mean one of 'kl_coef', 'kl_kind'?"),  # was 'lr'
    ("--lora", "did you mean one of 'lora_alpha', 'lora_rank', 'lora_targets'?"),  # was 'lr'
    ("--learning_rate", "did you mean 'lr'?"),  # its initials; was 'lora_rank'
    ("--epochs", "did you mean one of 'ppo_epochs', 'sft_epochs'?"),
    ("--batch", "did you mean one of 'batch_size', 'gen_batch_size', 'micro_batch_size'?"),  # three at most
    ("--grop", "did you mean 'group'?"),  # a misspelling: difflib
    ("--temprature", "did you mean 'temperature'?"),
    ("--config", "no flag is close to it (python train.py --help lists them)"),  # was 'pooling'
    ("--", "no flag is close to it (python train.py --help lists them)"),  # no name: every flag starts with it
])
def test_an_unknown_flag_is_named_with_the_close_ones_or_none(presets, flag, hint):
    with pytest.raises(ConfigError) as e:
        parse_args([flag, "1"], presets)
    assert str(e.value) == f"command line: unknown flag {flag}; {hint}"


def test_suggestions_for_presets_keys_and_values_name_only_close_ones(presets, tmp_path):
    from searchlite.config import check_config

    with pytest.raises(ConfigError, match=r"no preset \[foo\] \(have: small, badkey, badtype\)"):
        parse_args(["--preset", "foo"], presets)  # was: did you mean 'small'?
    with pytest.raises(ConfigError, match=r"no preset \[bad\]; did you mean one of 'badkey', 'badtype'\? \(have"):
        parse_args(["--preset", "bad"], presets)
    junk = tmp_path / "junk.toml"
    junk.write_text("[junk]\nxyzzy = 1\n")
    with pytest.raises(ConfigError, match=r"\[junk\]: unknown key 'xyzzy'; no key is close to it \(python train.py "
                                          r"--help lists them\)"):
        parse_args(["--preset", "junk"], junk)
    with pytest.raises(ConfigError, match=r"not one of float32, bfloat16, float16 \(did you mean one of 'float16', "
                                          r"'float32'\?\)$"):
        check_config(parse_args(["--dtype", "float"]))
    with pytest.raises(ConfigError, match=r"--kl_kind 'k2': not one of k1, k3$"):
        check_config(parse_args(["--kl_kind", "k2"]))


def test_train_py_refuses_and_hides_stage_1_settings():
    """train.py ran with --sft_epochs 3 and ignored it (a preset that sets it was already refused)."""
    from searchlite.config import STAGE1_ONLY, usage

    with pytest.raises(ConfigError, match=r"python train.py does not read --sft_epochs: it is a setting of "
                                          r"R1-Searcher\+\+'s stage 1"):
        parse_args(["--sft_epochs", "3"])
    assert not any(f"--{k} " in usage("train.py") for k in STAGE1_ONLY)


def test_a_program_that_reads_a_few_fields_suggests_only_those(capsys):
    from searchlite.r1pp import STAGE1_FIELDS

    with pytest.raises(ConfigError, match=r"unknown flag --epochs; did you mean 'sft_epochs'\?$"):
        parse_args(["--epochs", "2"], prog="-m searchlite.r1pp stage1", reads=STAGE1_FIELDS)  # not ppo_epochs
    with pytest.raises(ConfigError, match=r"no flag is close to it \(python -m searchlite.r1pp stage1 --help"):
        parse_args(["--config", "x"], prog="-m searchlite.r1pp stage1", reads=STAGE1_FIELDS)


def test_stage_1_help_says_what_its_batch_group_and_out_dir_mean(capsys):
    """Stage 1 reads --batch_size, --group and --out_dir otherwise than train.py; its --help says how."""
    from searchlite.r1pp import STAGE1_FIELDS, STAGE1_HELP

    with pytest.raises(SystemExit):
        parse_args(["--help"], prog="-m searchlite.r1pp stage1", reads=STAGE1_FIELDS, helps=STAGE1_HELP)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")}
    assert "questions per rejection-sampling round" in lines["--batch_size"]
    assert "trajectories sampled per question" in lines["--group"]
    assert "rejection_sampling.jsonl" in lines["--out_dir"] and "metrics.jsonl" not in lines["--out_dir"]
    assert lines["--seed"].split(None, 2)[2].startswith(field_help()["seed"])  # the others keep train.py's


def test_every_field_has_help_and_help_prints(presets, capsys):
    helps = field_help()
    for name in Config.__dataclass_fields__:
        assert helps.get(name), f"field {name} has no comment"
    with pytest.raises(SystemExit):
        parse_args(["--help"], presets)
    out = capsys.readouterr().out
    assert "--group" in out and helps["group"] in out and "small" in out
    with pytest.raises(SystemExit):  # the values that run without --preset are shown beside the defaults
        parse_args(["--help"], presets, default_preset="small")
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")}
    assert lines["--algo"].endswith("(default: 'grpo'; with no --preset: 'ppo')")
    assert lines["--lr"].endswith("(default: 1e-06; with no --preset: 2e-06)")
    assert lines["--seed"].endswith("(default: 0)")


def test_default_preset_and_out_dir(tmp_path):
    from searchlite.config import DEFAULT_PRESET

    p = tmp_path / "configs.toml"
    p.write_text(f"[{DEFAULT_PRESET}]\ngroup = 9\n[other]\ngroup = 2\n")
    assert parse_args([], p).group == 9  # applied when no --preset is given
    assert parse_args(["--preset", "other"], p).group == 2
    cfg = parse_args(["--preset", "none", "--algo", "ppo"], p)
    assert cfg.group == Config().group and cfg.out_dir == "runs/none-ppo"
    assert parse_args(["--algo", "ppo"], p).out_dir == f"runs/{DEFAULT_PRESET}-ppo"
    assert parse_args(["--out_dir", "x"], p).out_dir == "x"


def test_saved_config_round_trips(tmp_path):
    cfg = Config(group=7)
    save_config(cfg, tmp_path / "runs" / "run" / "config.json")  # its folder made with its parents
    assert Config(**json.loads((tmp_path / "runs" / "run" / "config.json").read_text())) == cfg


def test_toy_paths_resolve():
    assert resolve_path("toy/corpus.jsonl").endswith("searchlite/assets/toyworld/corpus.jsonl")
    assert resolve_path("/data/x.jsonl") == "/data/x.jsonl"


def repo_presets() -> list[str]:
    """The names of the presets in the repo's configs.toml."""
    from searchlite.config import DEFAULT_PRESETS
    import tomllib

    with open(DEFAULT_PRESETS, "rb") as f:
        return list(tomllib.load(f))


def test_repo_presets_are_valid():
    from searchlite.config import load_preset

    names = repo_presets()
    assert names, "configs.toml has no presets"
    for name in names:
        Config(**load_preset(name))


def test_every_preset_masks_retrieved_tokens_and_uses_the_chat_template():
    """The method's point: retrieved tokens get no loss unless `--mask_retrieved false` asks for
    Search-R1's ablation; a prompt goes in the tokenizer's chat template when it has one, as Search-R1
    builds its prompts; a run starts fresh unless told to --resume; and the memory levers are off
    where the model fits. With no --preset, with `--preset none` (the dataclass defaults) and with
    every preset in configs.toml."""
    from searchlite.config import load_preset

    configs = {"no --preset": parse_args([]), "none": parse_args(["--preset", "none"])}
    configs.update({name: Config(**load_preset(name)) for name in repo_presets()})
    for name, cfg in configs.items():
        assert (cfg.mask_retrieved, cfg.chat_template, cfg.resume) == (True, True, False), name
        # the memory levers: off where the model fits (they only slow a run), activation checkpointing on
        # for the 3B and 7B presets, as Search-R1's verl config has it; --ref_offload is the user's call
        toy = name in ("no --preset", "none") or name.startswith("toy")
        assert (cfg.grad_checkpointing, cfg.ref_offload) == (not toy, False), name
    assert parse_args(["--mask_retrieved", "false"]).mask_retrieved is False


def test_the_defaults_and_the_paper_presets_carry_the_papers_settings():
    """The built-in defaults follow Search-R1's released scripts, with verl's clip ranges and gradient
    clip they keep (verl's top-p, entropy bonus and weight decay are the presets'); the 3B and 7B
    presets follow the scripts with their batch shape and schedule; r1pp-qwen2.5-7b holds
    R1-Searcher++'s Appendix A, and toy-r1pp its mu and eta. Doubling one of config.py's passed
    test_config, and no test read the real-model presets' values."""
    from searchlite.config import load_preset

    def settings(cfg, want):
        return {k: getattr(cfg, k) for k in want}

    search_r1 = dict(lr=1e-6, critic_lr=1e-5, clip_eps=0.2, value_clip_eps=0.5, grad_clip=1.0, kl_coef=1e-3,
                     gamma=1.0, lam=1.0, topk=3, max_turns=4, max_obs_tokens=500, temperature=1.0, eta=2.0)
    assert settings(Config(), search_r1) == search_r1
    plain = dict(top_p=1.0, entropy_coef=0.0, weight_decay=0.0)  # verl's top-p, entropy bonus and decay: presets
    assert settings(Config(), plain) == plain
    scripts = search_r1 | dict(batch_size=512, mini_batch_size=256, steps=1005, warmup_steps=286, max_new_tokens=500,
                               max_len=4096, top_p=0.95, entropy_coef=1e-3, weight_decay=0.01)
    for size in ("3b", "7b"):
        grpo, ppo = (Config(**load_preset(f"qwen2.5-{size}-{algo}")) for algo in ("grpo", "ppo"))
        want = scripts | dict(algo="grpo", group=5, kl_kind="k3")
        assert settings(grpo, want) == want, size
        want = scripts | dict(algo="ppo", group=1, critic_warmup_steps=15)
        assert settings(ppo, want) == want, size
    r1pp = dict(algo="reinforce_pp", reward="r1pp", group_reward=True, mem_coef=0.1, eta=2.0)
    appendix_a = r1pp | dict(group=16, lr=2e-6, temperature=1.0, top_p=0.95, max_turns=8, kl_coef=1e-4)
    assert settings(Config(**load_preset("r1pp-qwen2.5-7b")), appendix_a) == appendix_a
    assert settings(Config(**load_preset("toy-r1pp")), r1pp) == r1pp


# ---------------------------------------------------------------------------- check_config: before anything loads

def checked(*flags):
    """parse_args + check_config on the toy preset with `flags`; the ConfigError's message, or None."""
    from searchlite.config import check_config

    try:
        check_config(parse_args(list(flags)))
    except ConfigError as e:
        return str(e)
    return None


def test_the_toy_run_and_the_repo_presets_pass_the_checks():
    assert checked() is None
    assert checked("--algo", "ppo", "--device", "cpu", "--dtype", "bfloat16", "--retriever", "rank_bm25") is None
    assert checked("--protocol", "r1_searcher_pp", "--reward", "r1pp", "--mem_coef", "0.1") is None
    assert checked("--top_p", "1", "--gamma", "0", "--lam", "1", "--kl_coef", "0", "--eta", "0") is None  # the ends


@pytest.mark.parametrize("flags, message", [
    (("--algo", "grp"), "--algo 'grp': not one of grpo, ppo, reinforce_pp (did you mean 'grpo'?)"),
    (("--kl_kind", "k2"), "--kl_kind 'k2': not one of k1, k3"),
    (("--loss_agg", "seq_mean"), "--loss_agg 'seq_mean': not one of token_mean, seq_mean_token_mean"),
    (("--dtype", "fp16"), "--dtype 'fp16': not one of float32, bfloat16, float16"),
    (("--dtype", "float16"), "--dtype float16: training in float16 needs loss scaling"),  # AdamW's states hit 0 / 0
    (("--device", "gpu"), "--device 'gpu': not one of auto, cpu, cuda, cuda:N"),
    (("--reward", "f1"), "--reward 'f1': not one of em, r1pp"),
    (("--group", "0"), "--group 0: must be at least 1"),
    (("--batch_size", "0"), "--batch_size 0: must be at least 1"),
    (("--steps", "-1"), "--steps -1: must be at least 0"),
    (("--max_obs_tokens", "-5"), "--max_obs_tokens -5: must be at least 1"),
    (("--temperature", "0"), "--temperature 0.0: must be in (0, inf)"),  # HF would fail only after the model loads
    (("--top_p", "1.5"), "--top_p 1.5: must be in (0, 1]"),
    (("--lr", "-1e-6"), "--lr -1e-06: must be in (0, inf)"),
    (("--gamma", "1.01"), "--gamma 1.01: must be in [0, 1]"),
    (("--kl_coef", "-0.001"), "--kl_coef -0.001: must be in [0, inf)"),
    (("--eta", "nan"), "--eta nan: must be in [0, inf)"),
    (("--temperature", "inf"), "--temperature inf: must be in (0, inf)"),
    (("--seed", "-1"), "--seed -1: must be in [0, 2**32)"),  # numpy refused it only after config.json was written
    (("--seed", str(2**32)), "--seed 4294967296: must be in [0, 2**32)"),
    (("--train_data", "nowhere/train.jsonl"), "--train_data nowhere/train.jsonl: no such file"),
    (("--index", "nowhere/index"), "--index nowhere/index: no such file"),
    (("--corpus", "searchlite"), "--corpus searchlite is a folder; expected a JSONL file"),  # run in the repo root
    (("--out_dir", "configs.toml"), "--out_dir configs.toml is a file; expected a folder"),
    (("--out_dir", "configs.toml/run"), "--out_dir configs.toml/run is within configs.toml, which is a file; "
                                        "expected a folder"),  # was a NotADirectoryError traceback
    (("--model", "toy/modell"), "--model toy/modell: no such folder; expected a Hugging Face model folder"),
    (("--model", "toy/model/.."), "--model toy/model/..: no config.json or adapter_config.json in that folder; the model is in "),
    (("--model", "bench"), "--model bench: no config.json or adapter_config.json in that folder; expected a Hugging "
                           "Face model folder or a hub name (org/name)"),  # none in bench/policy or bench/model either
    (("--model", "toy/train.jsonl"), "--model toy/train.jsonl is a file; expected a Hugging Face model folder"),
    (("--retriever", "http"), "--retriever http needs --retriever_url"),
    (("--retriever", "bm25", "--retriever_url", "http://127.0.0.1:9"),
     "--retriever_url http://127.0.0.1:9 is searched only with --retriever http, not --retriever bm25"),
    (("--retriever", "dense"), "--retriever dense needs --encoder"),
    (("--retriever", "rank_bm25", "--index", "toy/model"), "--retriever rank_bm25 with --index toy/model: rank_bm25"),
    (("--template", "toyy"), "toyy_search_r1.txt does not exist; give a prompt file with {question}, or a set here: "
                             "fewshot, toy, '' (the paper's)"),
    (("--template", "searchlite/templates"), "--template 'searchlite/templates' is a folder; give a prompt file"),
    (("--template", "configs.toml"), "configs.toml: a prompt template needs a {question}"),  # run in the repo root
    (("--mem_coef", "0.1"), "--mem_coef 0.1: the memorization loss needs a rewrite prompt: "),
    (("--mem_coef", "0.1"), "search_r1_rewrite.txt does not exist: no rewrite prompt for protocol 'search_r1' "
                            "(R1-Searcher++ runs with --protocol r1_searcher_pp; --mem_coef 0 goes without)"),
])
def test_a_value_no_run_can_use_is_named_with_its_flag(flags, message):
    got = checked(*flags)
    assert got is not None and message in got, got


def test_the_corpus_is_checked_unless_a_server_searches(tmp_path):
    """A retrieval server searches its own corpus: a --corpus beside --retriever http is not read, and
    one that is not here does not stop the run. Beside an --index (a folder, or a FAISS file) a --corpus
    named is read, and one that is not here is named with its flag before anything loads (it failed
    later, in the retriever, as "nowhere/corpus.jsonl: No such file or directory", naming no flag)."""
    from searchlite.indexing import build_bm25_folder

    url = ("--retriever", "http", "--retriever_url", "http://127.0.0.1:9")
    assert checked(*url, "--corpus", "nowhere/corpus.jsonl") is None
    build_bm25_folder(str(TOY_DIR / "corpus.jsonl"), tmp_path / "index")
    for index in (("--index", str(tmp_path / "index")), ()):
        assert checked(*index, "--corpus", "nowhere/corpus.jsonl") == "--corpus nowhere/corpus.jsonl: no such file"
    assert checked("--index", str(tmp_path / "index")) is None  # the default corpus: the folder's own is read


def test_a_program_is_checked_only_on_the_fields_it_reads():
    """Stage 1 reads no test set: a preset whose test file is missing does not stop it."""
    from searchlite.config import check_config
    from searchlite.r1pp import STAGE1_FIELDS

    cfg = parse_args(["--test_data", "nowhere/test.jsonl", "--mem_coef", "0.1", "--algo", "grp"])
    check_config(cfg, STAGE1_FIELDS)
    with pytest.raises(ConfigError, match="--algo 'grp'"):
        check_config(cfg)
    cfg.algo = "grpo"
    with pytest.raises(ConfigError, match="--test_data nowhere/test.jsonl: no such file"):
        check_config(cfg)


def test_a_preset_for_the_other_program_is_refused():
    """train.py --preset toy-r1pp-sft ran a 1,005-step GRPO run that ignored every SFT setting (and set
    stage 1's own out_dir aside); each preset of configs.toml parses for one program and not the other."""
    from searchlite.config import DEFAULT_PRESETS, read_presets
    from searchlite.r1pp import STAGE1_FIELDS

    stage1 = dict(prog="-m searchlite.r1pp stage1", reads=STAGE1_FIELDS)
    with pytest.raises(ConfigError, match=r"--preset toy-r1pp-sft sets cold_start_sampler, .*which python train.py "
                                          r"does not read: it is a preset for python -m searchlite.r1pp stage1"):
        parse_args(["--preset", "toy-r1pp-sft"])
    with pytest.raises(ConfigError, match=r"--preset toy-r1pp sets algo, .*it is a preset for python train.py"):
        parse_args(["--preset", "toy-r1pp"], **stage1)
    programs = {}
    for name in read_presets(DEFAULT_PRESETS):
        ok = []
        for program, kw in (("train", {}), ("stage1", stage1)):
            try:
                parse_args(["--preset", name], **kw)
                ok.append(program)
            except ConfigError:
                pass
        programs[name] = ok
    assert programs["toy-r1pp-sft"] == programs["r1pp-qwen2.5-7b-sft"] == ["stage1"]
    assert all(len(ok) == 1 for ok in programs.values()), programs


def test_a_missing_stage_1_model_says_to_run_stage_1(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where no stage 1 has run
    got = checked("--preset", "toy-r1pp", "--model", "runs/never-ran/model")
    assert got.startswith("--model runs/never-ran/model: no such folder (an earlier run's output")
    assert "python -m searchlite.r1pp stage1 --preset toy-r1pp-sft, or r1pp-qwen2.5-7b-sft for the 7B)" in got
    # a stage-1 preset's own output folder names that preset
    assert "stage1 --preset r1pp-qwen2.5-7b-sft)" in checked("--preset", "r1pp-qwen2.5-7b")
    assert "stage1 --preset toy-r1pp-sft)" in checked("--preset", "toy-r1pp", "--model", "runs/toy-r1pp-sft/model")


def test_a_hub_name_is_left_to_transformers():
    from searchlite.config import is_hub_name

    assert is_hub_name("Qwen/Qwen2.5-3B") and not is_hub_name("toy/model") and not is_hub_name("runs/a/model")
    assert checked("--model", "Qwen/Qwen2.5-3B") is None


def test_a_missing_run_in_a_folder_here_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    from searchlite.config import is_hub_name

    monkeypatch.chdir(tmp_path)
    assert not is_hub_name("runs/typo")  # no runs/ yet (a fresh clone): still where train.py writes, not the hub
    assert is_hub_name("other/typo")  # a folder that is not here could be a hub model
    (tmp_path / "other").mkdir()
    assert not is_hub_name("other/typo")
    assert "--model runs/typo: no such folder" in checked("--model", "runs/typo")


def test_a_run_folder_as_model_and_a_missing_vllm_are_named(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "checkpoint" / "policy").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"protocol": "search_r1", "template": "toy"}))
    assert f"--model {run} is a run's folder, not a model: give {run / 'checkpoint' / 'policy'}" in checked(
        "--model", str(run))
    pretend_installed(monkeypatch, vllm=False)
    assert "--sampler vllm needs vLLM: ./setup.sh vllm" in checked("--sampler", "vllm")


def test_cuda_without_a_gpu_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert "sees no CUDA GPU here; use --device cpu" in checked("--device", "cuda:0")


def test_a_broken_presets_file_is_named(tmp_path):
    bad = tmp_path / "configs.toml"
    bad.write_text('[toy]\nsteps = 60\nlr = 3e-4e\n')
    with pytest.raises(ConfigError, match=r"configs.toml: not valid TOML: .*line 3"):
        parse_args(["--steps", "1"], presets=bad)
    bad.write_text('top = 1\n[toy]\nsteps = 60\n')
    with pytest.raises(ConfigError, match=r"configs.toml: 'top = 1' is outside any \[preset\] table"):
        parse_args(["--preset", "toy"], presets=bad)


def test_a_missing_presets_file_is_named(tmp_path, capsys):
    """--preset toy without configs.toml was a FileNotFoundError traceback; no --preset ran on the
    built-in defaults (batch_size 512, lr 1e-6) without a word."""
    gone = tmp_path / "configs.toml"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(gone))}: cannot read the presets \(No such file or "
                                          r"directory\); it comes with searchlite \(git checkout configs.toml"):
        parse_args(["--preset", "toy"], presets=gone)
    cfg = parse_args(["--steps", "1"], presets=gone)
    assert (cfg.batch_size, cfg.lr) == (Config.batch_size, Config.lr)
    assert capsys.readouterr().err == (f"note: no {gone}: the run takes the built-in defaults (python train.py --help "
                                       "lists them), not the [toy] preset\n")
    with pytest.raises(SystemExit):  # which it does, with no presets line and no blank line for a preamble
        parse_args(["--help"], presets=gone)
    assert capsys.readouterr().out.splitlines()[:3] == [
        "usage: python train.py [--preset NAME] [--field value ...]", "",
        f"  --out_dir                  str   {field_help()['out_dir']} (default: '')"]


def test_script_parsers_name_the_closest_flag_of_any_subcommand(capsys):
    from searchlite.config import ArgumentParser

    ap = ArgumentParser(prog="retrieve.py")
    build = ap.add_subparsers(dest="cmd").add_parser("build")
    build.add_argument("--corpus")
    with pytest.raises(SystemExit):
        ap.parse_args(["build", "--corpuss", "x.jsonl"])
    assert "unrecognized arguments: --corpuss (did you mean '--corpus'?) x.jsonl" in capsys.readouterr().err
    build.add_argument("--corpus_format")
    build.add_argument("--query_format")
    build.add_argument("--methods", "--method")
    with pytest.raises(SystemExit):  # an alias is not a second suggestion
        ap.parse_args(["build", "--metods", "x"])
    assert "unrecognized arguments: --metods (did you mean '--methods'?) x" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (argparse itself completes a prefix: --corp is --corpus or ambiguous)
        ap.parse_args(["build", "--format", "x.jsonl", "--config=y"])
    assert ("unrecognized arguments: --format (did you mean one of '--corpus_format', '--query_format'?) x.jsonl "
            "--config=y (no flag is close to it; see --help)") in capsys.readouterr().err


def test_a_gguf_model_is_taken_as_its_converted_folder(tmp_path, monkeypatch, capsys):
    """evaluate.py and view take --model smollm2 or a .gguf file; train.py and stage 1 refused them
    ("no such folder", "is a file"). They now take the folder it converts to (here, a cached one)."""
    import hashlib

    from searchlite.config import check_config

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("SEARCHLITE_CACHE", str(tmp_path / "cache"))
    st = gguf.stat()
    digest = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    cached = tmp_path / "cache" / "gguf" / f"tiny-{digest}"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    cfg = parse_args(["--model", str(gguf)])
    check_config(cfg)
    assert cfg.model == str(cached) and f"--model {gguf}: the safetensors folder" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="does not exist"):
        check_config(parse_args(["--model", str(tmp_path / "gone.gguf")]))
    # a folder holding one .gguf (and no config.json), as evaluate.py takes it: refused as 'no config.json'
    (tmp_path / "gg").mkdir()
    inner = gguf.rename(tmp_path / "gg" / "tiny.gguf")
    st = inner.stat()
    digest = hashlib.sha1(f"{inner.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    cached.rename(tmp_path / "cache" / "gguf" / f"tiny-{digest}")
    cfg = parse_args(["--model", str(tmp_path / "gg")])
    check_config(cfg)
    assert cfg.model == str(tmp_path / "cache" / "gguf" / f"tiny-{digest}")


def test_the_toy_preset_applied_to_another_model_is_said(tmp_path, capsys):
    """With no --preset, [toy] applies: lr 3e-4 (300 times the default) and the toy prompt for any
    --model, which nothing said. A model of the toy's shape (the warm start, a run trained from it)
    takes it quietly, as does a run that names a preset."""
    import shutil

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"vocab_size": 49152, "hidden_size": 576}))
    parse_args(["--model", str(other), "--lr", "1e-6"])
    err = capsys.readouterr().err
    assert err.startswith("note: no --preset: [toy], made for the toy world's tiny model, sets temperature 0.7, "
                          "template 'toy', max_new_tokens 64 for --model") and "lr" not in err.split("sets")[1][:20]
    trained = tmp_path / "trained"
    shutil.copytree(TOY_DIR / "model", trained / "checkpoint" / "policy")
    for argv in ([], ["--model", str(trained)], ["--preset", "toy", "--model", str(other)]):
        parse_args(argv)
        assert capsys.readouterr().err == "", argv


def test_retriever_url_alone_searches_that_server(tmp_path, capsys):
    """--retriever_url alone means --retriever http, as evaluate.py and view read it: train.py searched
    BM25 over the toy corpus and saved the address in config.json as if it had been used."""
    cfg = parse_args(["--retriever_url", "http://127.0.0.1:9"])
    assert (cfg.retriever, cfg.retriever_url) == ("http", "http://127.0.0.1:9")
    assert "searching that server (--retriever http) instead of --retriever bm25" in capsys.readouterr().err
    presets = tmp_path / "p.toml"
    presets.write_text('[remote]\nretriever = "http"\nretriever_url = "http://a:1"\n[dense]\nretriever = "dense"\n')
    assert parse_args(["--preset", "dense", "--retriever_url", "http://b:2"], presets=presets).retriever == "http"
    assert "instead of --retriever dense" in capsys.readouterr().err
    cfg = parse_args(["--preset", "remote", "--retriever_url", "http://b:2"], presets=presets)
    assert (cfg.retriever, cfg.retriever_url) == ("http", "http://b:2")
    assert "note" not in capsys.readouterr().err  # already http: nothing to say
    assert parse_args(["--retriever_url", ""]).retriever == "bm25"  # an empty address names no server
    # a preset's address alone, as a flag's: it trained on BM25 over the toy corpus and kept the address
    presets.write_text('[url]\nretriever_url = "http://a:1"\n[both]\nretriever = "bm25"\nretriever_url = "http://a:1"\n')
    assert parse_args(["--preset", "url"], presets=presets).retriever == "http"
    assert "p.toml [url] retriever_url = 'http://a:1': searching that server" in capsys.readouterr().err
    assert parse_args(["--preset", "url", "--retriever", "bm25"], presets=presets).retriever == "bm25"  # chosen
    with pytest.raises(ConfigError, match=r"p.toml \[both\] retriever_url = 'http://a:1' is searched only with "
                                          r"retriever = \"http\", and the preset has retriever = 'bm25'"):
        parse_args(["--preset", "both"], presets=presets)


def test_a_missing_file_from_a_preset_is_named_by_its_line(tmp_path):
    """--train_data ...: no such file, for a value the user never typed as a flag: it came from a preset."""
    from searchlite.config import check_config

    presets = tmp_path / "p.toml"
    presets.write_text('[qa]\ntrain_data = "data/qa/none.jsonl"\n')
    with pytest.raises(ConfigError, match=r"^p.toml \[qa\] train_data = data/qa/none.jsonl: no such file$"):
        check_config(parse_args(["--preset", "qa"], presets=presets))
    with pytest.raises(ConfigError, match=r"^--train_data data/qa/gone.jsonl: no such file$"):  # a flag's: the flag
        check_config(parse_args(["--preset", "qa", "--train_data", "data/qa/gone.jsonl"], presets=presets))


def test_script_help_ends_with_the_default_only_where_there_is_one(monkeypatch):
    """HelpFormatter (retrieve.py, evaluate.py and the other argparse scripts): a flag's help ends
    with its default, except a switch (False), a flag with no default (None, '') and help that
    already names it."""
    import argparse

    from searchlite.config import HelpFormatter

    monkeypatch.setenv("COLUMNS", "200")  # one line a flag
    ap = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    ap.add_argument("--size", type=int, default=64, help="rows a batch")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--name", default=None, help="a name")
    ap.add_argument("--prefix", default="", help="text before")
    ap.add_argument("--mode", default="flat", help="index kind (the default is flat)")
    ap.add_argument("path", help="a file")
    lines = {line.split()[0]: line.rstrip() for line in ap.format_help().splitlines() if line.startswith("  ")}
    assert lines["--size"].endswith("rows a batch (default: 64)")
    for flag, text in [("--keep", "keep the files"), ("--name", "a name"), ("--prefix", "text before"),
                       ("--mode", "index kind (the default is flat)"), ("path", "a file")]:
        assert lines[flag].endswith("  " + text), lines[flag]


def test_help_reads_the_field_comments_under_any_locale():
    """Under an ASCII locale (LC_ALL=C), --help read config.py in that encoding and died on its '§'."""
    from conftest import run_under_ascii_locale

    done = run_under_ascii_locale("from searchlite.config import field_help; print(len(field_help()))")
    assert done.returncode == 0 and int(done.stdout) > 50, done.stderr


def test_a_query_prefix_is_for_a_dense_retriever():
    """--query_prefix on BM25 or a server would be dropped without a word (a server has its own)."""
    from searchlite.config import check_config

    with pytest.raises(ConfigError, match=r"^--query_prefix 'query: ': only --retriever dense encodes queries .*"
                                          r"not --retriever bm25$"):
        check_config(parse_args(["--query_prefix", "query: "]))


@pytest.mark.parametrize("flags, message", [
    (("--micro_batch_size", "0"), "--micro_batch_size 0: must be at least 1"),
    (("--ppo_epochs", "0"), "--ppo_epochs 0: must be at least 1"),  # no update, then a ZeroDivisionError
    (("--topk", "0"), "--topk 0: must be at least 1"),
    (("--max_new_tokens", "0"), "--max_new_tokens 0: must be at least 1"),
    (("--warmup_steps", "-1"), "--warmup_steps -1: must be at least 0"),
    (("--top_p", "0"), "--top_p 0.0: must be in (0, 1]"),  # nucleus of nothing
    (("--lam", "1.5"), "--lam 1.5: must be in [0, 1]"),
    (("--clip_eps", "0"), "--clip_eps 0.0: must be in (0, inf)"),  # every ratio clipped: no policy gradient
    (("--grad_clip", "-1"), "--grad_clip -1.0: must be in (0, inf)"),
    (("--grad_clip", "0"), "--grad_clip 0.0: must be in (0, inf)"),  # every gradient scaled to zero
    (("--weight_decay", "-0.01"), "--weight_decay -0.01: must be in [0, inf)"),
    (("--algo", "ppo", "--critic_lr", "0"), "--critic_lr 0.0: must be in (0, inf)"),  # a critic that never learns
    (("--algo", "ppo", "--value_clip_eps", "0"), "--value_clip_eps 0.0: must be in (0, inf)"),  # no value gradient
    (("--lora_rank", "8", "--lora_alpha", "0"), "--lora_alpha 0.0: must be in (0, inf)"),  # adapters that add nothing
])
def test_more_values_no_run_can_use_are_refused(flags, message):
    got = checked(*flags)
    assert got is not None and message in got, got


def test_a_dashed_flag_names_its_field(tmp_path):
    """--batch-size is --batch_size (module docstring: flags are field names; dashes as underscores)."""
    p = tmp_path / "configs.toml"
    p.write_text(PRESETS)
    cfg = parse_args(["--batch-size", "4", "--kl-coef=0.5"], p)
    assert (cfg.batch_size, cfg.kl_coef) == (4, 0.5)


def test_a_program_that_reads_a_few_fields_refuses_the_others():
    """Stage 1 does not train with --lr: the flag is refused, not silently ignored."""
    from searchlite.r1pp import STAGE1_FIELDS

    assert "lr" not in STAGE1_FIELDS
    with pytest.raises(ConfigError, match=r"does not read --lr \(it reads: "):
        parse_args(["--lr", "1e-5"], prog="-m searchlite.r1pp stage1", reads=STAGE1_FIELDS)


def test_a_preset_s_false_boolean_stays_false(tmp_path):
    """TOML booleans are taken as they are: `chat_template = false` in a preset turns the template off."""
    p = tmp_path / "configs.toml"
    p.write_text("[p]\nchat_template = false\nmask_retrieved = true\ngroup_reward = false\n")
    cfg = parse_args(["--preset", "p"], p)
    assert (cfg.chat_template, cfg.mask_retrieved, cfg.group_reward) == (False, True, False)


def test_a_dense_retriever_may_take_its_encoder_from_a_saved_index():
    """--retriever dense --index FOLDER needs no --encoder (the index names it): only neither is refused."""
    assert checked("--retriever", "dense", "--index", "toy/model") is None
    assert "--retriever dense needs --encoder" in checked("--retriever", "dense")


def test_plain_warnings_prints_a_warning_of_searchlite_or_the_script_on_one_line(tmp_path, monkeypatch):
    """A script's warning, or searchlite's, is 'warning: ...' alone, as the scripts' errors are; another
    package's keeps Python's form, with its file, line and source."""
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after the test
    script = tmp_path / "tool.py"
    plain_warnings(str(script))
    for where in (searchlite.config.__file__, str(Path(searchlite.config.__file__).parent / "retrieval.py"), script):
        assert warnings.formatwarning("changed", UserWarning, str(where), 7, "x = 1") == "warning: changed\n"
    assert warnings.formatwarning("old", FutureWarning, "/elsewhere/pkg/mod.py", 3, "y = 2") == \
        "/elsewhere/pkg/mod.py:3: FutureWarning: old\n  y = 2\n"
    # numpy's and torch's warnings are attributed to the searchlite line that called them: another category
    # than searchlite's UserWarning keeps its file and line (a NaN's first divide is found by them)
    ours = str(Path(searchlite.config.__file__).parent / "losses.py")
    assert warnings.formatwarning("invalid value encountered in divide", RuntimeWarning, ours, 9, None).startswith(
        f"{ours}:9: RuntimeWarning: invalid value")


def test_a_typed_flag_that_the_other_settings_leave_unread_is_noted(capsys):
    """--lora_alpha without --lora_rank, --critic_lr without PPO's critic and the like were taken without
    a word; a note names each, typed, and none when it is read or comes from a preset."""
    cases = [(["--lora_alpha", "64"], "note: --lora_alpha 64 does nothing without --lora_rank"),
             (["--lora_targets", "q_proj"], "note: --lora_targets q_proj does nothing without --lora_rank"),
             (["--critic_lr", "1e-4", "--lam", "0.9"], "note: --critic_lr 1e-4 does nothing without a critic "
                                                        "(--algo ppo)\nnote: --lam 0.9 does nothing without a critic"),
             (["--master_weights", "false"], "note: --master_weights false does nothing unless --dtype bfloat16 "
                                             "trains every weight (no --lora_rank, or PPO's critic)"),
             (["--dtype", "bfloat16", "--lora_rank", "4", "--master_weights", "true"], "note: --master_weights true"),
             (["--eta", "3"], "note: --eta 3 does nothing without the group reward (--reward r1pp, "
                              "--group_reward true)"),
             (["--reward", "r1pp", "--group_reward", "false", "--group_sigma", "correct"],
              "note: --group_sigma correct"),
             (["--group_reward", "true"], "note: --group_reward true does nothing without --reward r1pp")]
    for flags, note in cases:
        parse_args(flags)
        assert capsys.readouterr().err.startswith(note), flags
    for flags in (["--lora_alpha", "64", "--lora_rank", "8"], ["--algo", "ppo", "--critic_lr", "1e-4", "--lam", "0.9"],
                  ["--dtype", "bfloat16", "--master_weights", "false"], ["--reward", "r1pp", "--eta", "3"],
                  ["--algo", "ppo", "--lora_rank", "8", "--dtype", "bfloat16", "--master_weights", "false"],  # critic
                  ["--preset", "toy-r1pp", "--reward", "em"]):  # the preset's eta and group_reward: not typed
        parse_args(flags)
        assert "does nothing" not in capsys.readouterr().err, flags


def test_an_index_folder_of_the_other_kind_names_the_retriever_flag(tmp_path):
    """--index DENSE_FOLDER with --retriever left at bm25 said '... holds a dense index, not a bm25 one' after
    the config was printed, naming no flag; the other way round too."""
    for kind, other in (("dense", "bm25"), ("bm25", "dense")):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / f"{kind}.json").write_text("{}")
        flags = ["--index", str(tmp_path / kind)] + ["--retriever", other] * (other == "dense")
        assert checked(*flags) == (f"--retriever {other} with --index {tmp_path / kind}, which holds a {kind} index: "
                                   f"give --retriever {kind}")
        assert checked(*flags[:2], "--retriever", kind) is None
