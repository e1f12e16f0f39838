"""Shared fixtures: a byte-level tokenizer with the protocols' tags, tiny random Llamas."""

import contextlib
import json
import os
import signal
import socket
from http.server import BaseHTTPRequestHandler

import pytest
import torch

TAGS = ["<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>",
        "</answer>", "<|begin_internal_answer|>", "<|end_internal_answer|>", "<|begin_external_search|>",
        "<|end_external_search|>", "<|begin_search_result|>", "<|end_search_result|>"]


def load_bench(name: str):
    """bench/<name>.py as a module (bench/ is a folder of scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_under_ascii_locale(script: str, *args: str):
    """Run `python -c script args` under an ASCII locale (C, with neither UTF-8 mode nor locale
    coercion): a file opened without an encoding is then read and written as ASCII."""
    import subprocess
    import sys

    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True)


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_raises():
    """A shell's background job (`pytest > log &`) starts with SIGINT ignored, and Python then never turns
    it into KeyboardInterrupt: the tests that press Ctrl-C (`CtrlC`) saw nothing happen and failed. The
    session gets Python's own handler, as in a terminal, and gives the ignored one back at its end."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class CtrlC:
    """Stands in for `owner.name` (monkeypatched), counting its calls in `calls`; during call
    number `at` (0: none) it sends this process SIGINT, as a Ctrl-C would."""

    def __init__(self, monkeypatch, owner, name: str, at: int = 0):
        self.real, self.calls, self.at = getattr(owner, name), 0, at
        monkeypatch.setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return self.real(*args, **kwargs)


def make_byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) plus the tags as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   padding_side="left")
    fast.add_tokens(TAGS)
    return fast


@pytest.fixture(scope="session")
def byte_tokenizer():
    return make_byte_tokenizer()


def with_special_tags(tokenizer):
    """A copy of `tokenizer` whose protocol tags are special tokens (decoding without special tokens drops them)."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": TAGS})
    return tok


def with_bos(tokenizer):
    """A copy of `tokenizer` that puts a BOS `<s>` before whatever it encodes unless told not to, as
    Llama's tokenizers do (the byte tokenizer adds none, so a missing add_special_tokens=False is unseen)."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = [("<s>", tok.bos_token_id)]
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=bos)
    assert tok.encode("a")[0] == tok.bos_token_id
    return tok


def free_port() -> int:
    """A loopback port no socket holds now: for a server to start on, or for a client to find closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def held_port():
    """A loopback port that a listening socket holds while the block runs, and that never answers:
    taken, for a server that would start there; silent, for a client that connects (it waits in the backlog)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def make_tiny_llama(tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def dropout_copy(model: str, folder) -> str:
    """A copy in `folder` (a Path) of the saved model `model` whose attention drops weights out in training
    (p = 0.2): with it, a run that does not seed or restore torch's RNG ends with other weights."""
    import shutil

    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.2}))
    return str(folder)


def recording_bars(monkeypatch, module, name: str = "tqdm") -> list:
    """Replace the tqdm class `module.name` with a stand-in that records each bar made: its keyword
    arguments (`kw`), the ticks of its updates (or of the items it wrapped, each as it was taken),
    its postfixes and whether it was closed."""
    bars = []

    class Bar:
        def __init__(self, iterable=(), **kw):
            self.iterable, self.kw, self.ticks, self.postfixes, self.closed = iterable, kw, 0, [], False
            bars.append(self)

        def __iter__(self):
            for item in self.iterable:
                yield item
                self.ticks += 1

        def update(self, n):
            self.ticks += n

        def set_postfix(self, **kw):
            self.postfixes.append(kw)

        def close(self):
            self.closed = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(module, name, Bar)
    return bars


def give_lora_an_effect(model):
    """`model` (a peft LoRA model) with random lora_B weights: peft starts them at zero, where the
    adapter changes nothing."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


@pytest.fixture()
def tiny_llama(byte_tokenizer):
    return make_tiny_llama(byte_tokenizer)


def pretend_installed(monkeypatch, **packages: bool):
    """importlib.util.find_spec as if each named package were installed (True) or missing (False);
    every other name is looked up as usual. What a setting's "needs package X" check sees."""
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in packages:
            return object() if packages[name] else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


BROKEN_VLLM = "vLLM did not import: operator torchvision::nms does not exist. A torchvision ..."


@pytest.fixture()
def broken_vllm(monkeypatch) -> list:
    """vLLM installed (find_spec sees it) but failing to import, as beside PyPI's torchvision:
    VLLMSampler raises ImportError(BROKEN_VLLM). Returns the (model, tokenizer) each VLLMSampler
    was asked for."""
    import searchlite.vllm_sampler

    def broken():
        raise ImportError(BROKEN_VLLM)

    asked, init = [], searchlite.vllm_sampler.VLLMSampler.__init__

    def recorded(self, model, tokenizer=None, **kw):
        asked.append((model, tokenizer))
        init(self, model, tokenizer, **kw)

    pretend_installed(monkeypatch, vllm=True)
    monkeypatch.setattr(searchlite.vllm_sampler, "_import_vllm", broken)
    monkeypatch.setattr(searchlite.vllm_sampler.VLLMSampler, "__init__", recorded)
    return asked


class JSONHandler(BaseHTTPRequestHandler):
    """A quiet HTTP handler for fake servers in tests: `send_json(code, obj)` replies with JSON."""

    def send_json(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # a client that timed out has gone: nothing to answer
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama with the toy world's tokenizer, saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from searchlite.config import TOY_DIR
    from searchlite.models import load_tokenizer

    tok = load_tokenizer(str(TOY_DIR))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    folder = tmp_path_factory.mktemp("tiny") / "model"
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def save_bag_of_words_bert(texts, folder, hidden: int, positions: int = 512) -> None:
    """A random 1-layer BERT and a word-level tokenizer over the words of `texts`, saved as an HF
    folder. Its position and token-type embeddings are zeroed: in a random BERT they are shared
    by every text and swamp a mean-pooled embedding, so what is left is a random bag-of-words
    encoder, which ranks by shared words as a trained encoder roughly would. `positions`: as many
    as a real encoder's (512), so the default --max_length fits."""
    import re

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]", t.lower())})
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")
    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=2 * hidden, vocab_size=len(vocab), max_position_embeddings=positions))
    with torch.no_grad():
        model.embeddings.position_embeddings.weight.zero_()
        model.embeddings.token_type_embeddings.weight.zero_()
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
