"""Export refuses a damaged adapter before writing anything: one message naming the file, the problem and the fix.

Each test copies the shared tiny run (adapter/ and checkpoints/checkpoint-2, -3), damages the copy the way testers
found adapters damaged, and runs `python -m nb_helpers export` on it: exit code 2, no traceback, nothing written.
"""

import json
import shutil

import pytest

ADAPTER_WEIGHTS = "adapter/adapter_model.safetensors"


@pytest.fixture
def run_copy(shared_run, tmp_path):
    return shutil.copytree(shared_run[1], tmp_path / "run")  # the shared run stays as other tests expect it


def files_in(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(cli, run_dir) -> str:
    """Export the run; assert it was refused with a message and left the folder exactly as it was; the message."""
    before = files_in(run_dir)
    result = cli("export", "--run", run_dir, "--gguf", "f16", "--prompts", "0")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert files_in(run_dir) == before  # no merged/ nor gguf/, and nothing saved earlier replaced
    return result.stderr


def rewrite_tensors(path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def edit_json(path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_nan_values_are_refused_with_the_tensor_and_count(run_copy, cli):
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"

    def poison(tensors):
        tensors[name][0, :3] = float("nan")
        tensors[name][1, 0] = float("inf")

    rewrite_tensors(run_copy / ADAPTER_WEIGHTS, poison)
    message = refused(cli, run_copy)
    total = 64 // 4 * 2 * 8  # v_proj's lora_B: (kv heads x head dim) x r on the tiny model
    assert f"{run_copy / ADAPTER_WEIGHTS}: tensor {name} has 3 NaN and 1 infinite values out of {total}" in message
    assert "(tensors with such values: 1 of " in message
    checkpoint = run_copy / "checkpoints" / "checkpoint-3"
    assert f"Fix: {checkpoint} holds a good adapter (the weights of step 3)" in message
    assert f"into {run_copy / 'adapter'} and export again, or retrain" in message


def test_a_truncated_file_is_refused_not_a_traceback(run_copy, cli):
    weights = run_copy / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = refused(cli, run_copy)
    assert f"{weights}: safetensors cannot read it" in message and "truncated or damaged" in message


def test_an_empty_file_is_refused(run_copy, cli):
    (run_copy / ADAPTER_WEIGHTS).write_bytes(b"")
    assert f"{run_copy / ADAPTER_WEIGHTS}: empty (0 bytes)" in refused(cli, run_copy)


@pytest.mark.parametrize("lost, problem", [(ADAPTER_WEIGHTS, "missing"), ("adapter/adapter_config.json", "missing"),
                                           ("adapter", "no such folder")])
def test_a_missing_file_is_refused(run_copy, cli, lost, problem):
    if (run_copy / lost).is_dir():
        shutil.rmtree(run_copy / lost)
    else:
        (run_copy / lost).unlink()
    message = refused(cli, run_copy)
    assert f"{run_copy / lost}: {problem}" in message and "checkpoint-3 holds a good adapter" in message


def test_a_config_that_is_not_json_is_refused(run_copy, cli):
    (run_copy / "adapter" / "adapter_config.json").write_text('{"r": 8, "target_modules": ')
    assert "adapter_config.json: not valid JSON" in refused(cli, run_copy)


def test_a_rank_other_than_the_configs_is_refused(run_copy, cli):
    edit_json(run_copy / "adapter" / "adapter_config.json", r=16)
    message = refused(cli, run_copy)
    assert "its rank is 8 where adapter_config.json says r=16: the two files come from different adapters" in message


def test_target_modules_other_than_the_configs_are_refused(run_copy, cli):
    edit_json(run_copy / "adapter" / "adapter_config.json", target_modules=["q_proj", "v_proj"])
    message = refused(cli, run_copy)
    assert "but adapter_config.json targets ['q_proj', 'v_proj'] — the two files come from different" in message


def test_weights_missing_for_targeted_layers_are_refused(run_copy, cli):
    rewrite_tensors(run_copy / ADAPTER_WEIGHTS,
                    lambda tensors: [tensors.pop(k) for k in list(tensors) if "layers.1." in k])
    message = refused(cli, run_copy)
    assert "no weights for 8 of the 16 LoRA matrices adapter_config.json puts on" in message
    assert "(first: model.layers.1.self_attn.q_proj.lora_A)" in message


def test_an_adapter_made_for_another_base_is_refused(run_copy, cli, tmp_path, tiny_model_dir):
    """The run's config points at a model of another hidden size: its own checkpoints do not fit it either."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.pop("head_dim", None)  # derived from the hidden size again: 32 / 4 heads
    other = LlamaConfig(**{**config, "hidden_size": 32, "intermediate_size": 64})
    LlamaForCausalLM(other).to(torch.bfloat16).save_pretrained(tmp_path / "other-base")
    edit_json(run_copy / "config.json", model=str(tmp_path / "other-base"))
    message = refused(cli, run_copy)
    assert "expected [8, 32]" in message and "'s model.layers.0.self_attn.k_proj maps 32 to 16 features" in message
    assert "made for another base model (a different hidden size)" in message
    assert f"none of the 2 checkpoints in {run_copy / 'checkpoints'} holds a good adapter either" in message


def test_a_good_adapter_passes_and_pickled_weights_are_never_read(run_copy, tiny_model_dir):
    from nb_helpers.faults.adapter_check import AdapterError, check_adapter, linear_layers

    layers = linear_layers(str(tiny_model_dir))
    check_adapter(run_copy / "adapter", layers)  # the shared run's own adapter is fine
    weights = run_copy / ADAPTER_WEIGHTS
    weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(AdapterError, match="adapter_model.bin is there, but pickled weights are never loaded"):
        check_adapter(run_copy / "adapter", layers)
