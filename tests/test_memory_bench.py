"""bench/memory_bench.py: each variant's train.py command, the figures its child reports (peak RSS,
optimizer state, trainable parameters, the CUDA peak) and the table it prints, from stubbed children;
and its argument handling. Nothing here trains."""

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import load_bench


@pytest.fixture
def memory_bench():
    return load_bench("memory_bench")


def test_peak_rss_reads_vmhwm_and_falls_back_to_ru_maxrss(memory_bench, monkeypatch, tmp_path):
    """VmHWM in kB from /proc; without /proc, getrusage's ru_maxrss: KiB on Linux, bytes on macOS."""
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  99999 kB\nVmHWM:\t   14916 kB\nVmRSS:\t   1000 kB\n")
    assert memory_bench.peak_rss_bytes(str(status)) == 14916 * 1024
    monkeypatch.setattr(memory_bench.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=1000))
    monkeypatch.setattr(sys, "platform", "linux")
    assert memory_bench.peak_rss_bytes(str(tmp_path / "missing")) == 1000 * 1024
    monkeypatch.setattr(sys, "platform", "darwin")
    assert memory_bench.peak_rss_bytes(str(tmp_path / "missing")) == 1000


def fake_train(calls: list):
    """A stand-in `train` module: main() builds a 256x256 Linear with its bias in a second param group
    and takes one SGD-with-momentum step (state: one fp32 buffer per parameter)."""
    train = types.ModuleType("train")

    def make_optimizer(model):
        groups = [{"params": [model.weight]}, {"params": [model.bias]}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9), None

    def main(args):
        calls.append(args)
        model = torch.nn.Linear(256, 256)
        opt, _ = train.make_optimizer(model)
        model(torch.ones(1, 256)).sum().backward()
        opt.step()

    train.make_optimizer, train.main = make_optimizer, main
    return train


def test_memory_bench_child_reports_mib_optimizer_state_and_trainable_params(memory_bench, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(sys.modules, "train", fake_train(calls))
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    monkeypatch.setitem(sys.modules, "peft", types.ModuleType("peft"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(memory_bench, "peak_rss_bytes", lambda: 1536 * 2**20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    memory_bench.child(str(tmp_path / "cpu.json"), ["--steps", "1"])
    assert calls == [["--steps", "1"]]
    assert json.loads((tmp_path / "cpu.json").read_text()) == {
        "peak_rss_mib": 1536.0, "opt_state_mib": (256 * 256 + 256) * 4 / 2**20, "trainable": 256 * 256 + 256,
        "cuda_peak_mib": None}  # None on CPU: the table then has no CUDA columns
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    memory_bench.child(str(tmp_path / "gpu.json"), [])
    assert json.loads((tmp_path / "gpu.json").read_text())["cuda_peak_mib"] == 3072.0


def test_memory_bench_random_model_rounds_mlp_up_to_64_ties_embeddings_and_holds_a_tokenizer(memory_bench, tmp_path):
    """The toy tokenizer is saved beside the weights, where train.py loads it from; the same spec
    gives the same weights whatever torch's RNG held, so variants and reruns measure one model."""
    import torch

    from searchlite.models import load_tokenizer

    path = memory_bench.random_model("random:128x1", tmp_path / "m")
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (128, 1, 384)  # 341 -> 384
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (2, 2, True)
    assert len(load_tokenizer(path)) == cfg["vocab_size"]
    wide = json.loads((Path(memory_bench.random_model("random:192x1", tmp_path / "w")) / "config.json").read_text())
    assert wide["intermediate_size"] == 512  # 8 x 192 / 3, a multiple of 64 already: not rounded up
    torch.manual_seed(123)
    again = memory_bench.random_model("random:128x1", tmp_path / "again")
    assert (Path(again) / "model.safetensors").read_bytes() == (Path(path) / "model.safetensors").read_bytes()


@pytest.mark.parametrize("spec, message", [("random:96x1", "multiple of 64"), ("random:128x1x", "expected a folder"),
                                           ("random:128", "expected a folder")])
def test_memory_bench_random_model_rejects_a_bad_spec(memory_bench, tmp_path, spec, message):
    with pytest.raises(SystemExit, match=message):
        memory_bench.random_model(spec, tmp_path / "m")


def test_memory_bench_variant_runs_train_with_base_then_its_own_flags(memory_bench, monkeypatch, tmp_path, capsys):
    seen = []

    def call(cmd, cwd, stdout, stderr):
        seen.append(cmd)
        assert (Path(cwd) / "train.py").is_file()  # it runs where train.py is, whatever the caller's directory
        Path(cmd[3]).write_text('{"peak_rss_mib": 1.0}')
        return 0

    monkeypatch.setattr(memory_bench.subprocess, "call", call)
    monkeypatch.chdir(tmp_path)
    assert memory_bench.run_variant("lora", ["--lora_rank", "16"], ["--steps", "1"], tmp_path) == {"peak_rss_mib": 1.0}
    assert seen[0][2:] == ["--child", str(tmp_path / "lora.json"), "--", "--steps", "1",
                           "--out_dir", str(tmp_path / "lora"), "--lora_rank", "16"]
    assert f"=== lora: train.py --steps 1 --out_dir {tmp_path / 'lora'} --lora_rank 16\n" in capsys.readouterr().out


def test_memory_bench_failed_variant_shows_its_output_not_a_deleted_log(memory_bench, monkeypatch, tmp_path):
    """A variant that exits non-zero fails, even after writing its report; the error holds the last 20
    lines of its output, not the path of a log deleted with the work folder."""
    def call(cmd, cwd, stdout, stderr):  # the report written, then a crash on the way out
        Path(cmd[3]).write_text('{"peak_rss_mib": 1.0}')
        stdout.write("".join(f"line {i}\n" for i in range(30)))
        return 1

    monkeypatch.setattr(memory_bench.subprocess, "call", call)
    with pytest.raises(SystemExit) as e:
        memory_bench.run_variant("adamw", [], [], tmp_path)
    assert "exit 1" in str(e.value) and str(e.value).endswith("".join(f"line {i}\n" for i in range(10, 30)))
    assert "line 9\n" not in str(e.value) and str(tmp_path) not in str(e.value)


ROW = dict(peak_rss_mib=1234.4, opt_state_mib=10.5, trainable=1_400_000, cuda_peak_mib=None)


def test_memory_bench_table_on_cpu_compares_to_adamw_and_has_no_cuda_columns(memory_bench):
    rows = {"adamw": ROW, "lora": dict(ROW, peak_rss_mib=1100.0, opt_state_mib=0.25, trainable=12_345)}
    assert memory_bench.table(rows, memory_bench.VARIANTS).splitlines() == [
        "| variant | train.py flags | peak RSS MiB | vs adamw | optimizer state MiB | trainable params |",
        "|---|---|---|---|---|---|",
        "| adamw | (none) | 1,234 | +0 | 10.50 | 1,400,000 |",
        "| lora | --lora_rank 16 | 1,100 | -134 | 0.25 | 12,345 |"]


def test_memory_bench_table_on_gpu_adds_cuda_peak_and_its_difference(memory_bench):
    rows = {"adamw": dict(ROW, cuda_peak_mib=2048.0), "adamw+gc": dict(ROW, peak_rss_mib=1300.0, cuda_peak_mib=1536.0)}
    lines = memory_bench.table(rows, memory_bench.VARIANTS).splitlines()
    assert lines[0] == ("| variant | train.py flags | peak RSS MiB | vs adamw | peak CUDA MiB | vs adamw "
                        "| optimizer state MiB | trainable params |")
    assert lines[1] == "|---|---|---|---|---|---|---|---|"
    assert lines[3] == "| adamw+gc | --grad_checkpointing | 1,300 | +66 | 1,536 | -512 | 10.50 | 1,400,000 |"


def test_memory_bench_table_without_adamw_leaves_the_comparison_blank(memory_bench):
    rows = {"lora": ROW, "adamw8bit": dict(ROW, peak_rss_mib=1000.0)}
    lines = memory_bench.table(rows, memory_bench.VARIANTS).splitlines()
    assert lines[2] == "| lora | --lora_rank 16 | 1,234 |  | 10.50 | 1,400,000 |"
    assert lines[3] == "| adamw8bit | --optimizer adamw8bit | 1,000 |  | 10.50 | 1,400,000 |"
    on_gpu = {"lora": dict(ROW, cuda_peak_mib=2048.0)}  # and both comparisons on a GPU
    assert memory_bench.table(on_gpu, memory_bench.VARIANTS).splitlines()[2] == \
        "| lora | --lora_rank 16 | 1,234 |  | 2,048 |  | 10.50 | 1,400,000 |"


def test_memory_bench_variant_flags_match_their_names(memory_bench):
    for name, flags in memory_bench.VARIANTS.items():
        joined = " ".join(flags)
        assert ("8bit" in name) == ("--optimizer adamw8bit" in joined), name
        assert ("+gc" in name) == ("--grad_checkpointing" in joined), name
        assert (name == "lora") == ("--lora_rank 16" in joined), name
        assert (name == "ref_offload") == (flags == ["--ref_offload"]), name
        assert name.startswith("bf16") == ("--dtype bfloat16" in joined), name
    assert memory_bench.VARIANTS["bf16-weights"][-2:] == ["--master_weights", "false"]


@pytest.fixture
def memory_main(memory_bench, monkeypatch, tmp_path):
    """memory_bench.main(*argv) in tmp_path on a CPU, each variant's run stubbed: returns the runs asked
    for, as (name, its flags, the flags every variant shares)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runs = []

    def run_variant(name, flags, base, work):
        runs.append((name, flags, base))
        gpu = 100.0 if torch.cuda.is_available() else None
        return dict(peak_rss_mib=1000.0 + len(runs), opt_state_mib=1.0, trainable=10, cuda_peak_mib=gpu)

    monkeypatch.setattr(memory_bench, "run_variant", run_variant)

    def main(*argv):
        monkeypatch.setattr(sys, "argv", ["memory_bench.py", *argv])
        memory_bench.main()
        return runs

    return main


BASE = ["--eval_size", "4", "--log_trajectories_every", "0", "--save_every", "1000000"]


def test_memory_bench_defaults_run_five_variants_two_steps_on_the_toy_model(memory_main, capsys, tmp_path):
    runs = memory_main("--out", "table.md")
    assert [name for name, _, _ in runs] == ["adamw", "adamw8bit", "adamw+gc", "adamw8bit+gc", "lora"]
    assert all(base == ["--model", "toy/model", "--steps", "2", *BASE] for _, _, base in runs)
    assert runs[4][1] == ["--lora_rank", "16"]
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| variant |") and table.endswith("| 1,005 | +4 | 1.00 | 10 |\n")
    out = capsys.readouterr().out
    assert table in out + "\n" and "\nmodel: toy/model, 2 steps, device: cpu\n| variant |" in out


def test_memory_bench_adds_ref_offload_on_a_gpu(memory_main, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [name for name, _, _ in memory_main()][-2:] == ["lora", "ref_offload"]
    assert "\nmodel: toy/model, 2 steps, device: cuda\n" in capsys.readouterr().out


def test_memory_bench_flags_after_double_dash_go_last_to_every_variant(memory_main):
    runs = memory_main("--variants", "bf16,bf16-weights", "--steps", "3", "--", "--batch_size", "8")
    assert [(name, base) for name, _, base in runs] == [
        (name, ["--model", "toy/model", "--steps", "3", *BASE, "--batch_size", "8"])
        for name in ("bf16", "bf16-weights")]


def test_memory_bench_random_model_flags_come_before_the_users(memory_main, memory_bench, monkeypatch):
    monkeypatch.setattr(memory_bench, "random_model", lambda spec, folder: "/tmp/random-model")
    runs = memory_main("--model", "random:64x1", "--variants", "adamw", "--", "--batch_size", "2")
    assert runs[0][2] == ["--model", "/tmp/random-model", "--steps", "2", *BASE, *memory_bench.RANDOM_MODEL_FLAGS,
                          "--batch_size", "2"]


def test_memory_bench_model_folder_is_taken_from_the_current_directory(memory_main, memory_bench, tmp_path):
    """A folder here goes to train.py (run from the project's folder) as an absolute path; toy/model
    as it is, which train.py resolves."""
    (tmp_path / "mymodel").mkdir()
    assert memory_main("--model", "mymodel", "--variants", "adamw")[0][2][:2] == ["--model", str(tmp_path / "mymodel")]
    assert memory_bench.local_path("toy/model") == "toy/model"


def test_memory_bench_unknown_variant_is_refused_before_any_run(memory_main):
    with pytest.raises(SystemExit, match=r"unknown variant\(s\) adam; valid: adamw, adamw8bit"):
        memory_main("--variants", "adamw,adam")


def test_memory_bench_child_mode_passes_the_flags_after_double_dash(memory_bench, monkeypatch):
    seen = []
    monkeypatch.setattr(memory_bench, "child", lambda report, args: seen.append((report, args)))
    monkeypatch.setattr(sys, "argv", ["memory_bench.py", "--child", "r.json", "--", "--steps", "1"])
    memory_bench.main()
    assert seen == [("r.json", ["--steps", "1"])]
