"""API drift: every keyword our code and notebooks pass to transformers, peft, trl and bitsandbytes must exist
in the installed (pinned) versions. Fails, never skips: these libraries rename arguments often (TRL moved
max_seq_length -> max_length; transformers 5 dropped load_in_4bit= and torch_dtype= from from_pretrained)."""

import ast
import inspect
import json

import pytest

from nb_helpers.config import PROJECT_ROOT


def tracked_callables():
    import bitsandbytes.functional as bnbf
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, GenerationMixin, PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    return {
        "BitsAndBytesConfig": BitsAndBytesConfig.__init__,
        "LoraConfig": LoraConfig,
        "SFTConfig": SFTConfig,
        "SFTTrainer": SFTTrainer.__init__,
        "DPOConfig": DPOConfig,
        "DPOTrainer": DPOTrainer.__init__,
        "prepare_model_for_kbit_training": prepare_model_for_kbit_training,
        "get_peft_model": get_peft_model,
        "PeftModel.from_pretrained": PeftModel.from_pretrained,
        "apply_chat_template": PreTrainedTokenizerBase.apply_chat_template,
        "quantize_4bit": bnbf.quantize_4bit,
        "from_pretrained": PreTrainedModel.from_pretrained,
        "generate": GenerationMixin.generate,
    }


REMOVED_FROM_PRETRAINED = {"load_in_4bit", "load_in_8bit", "torch_dtype"}  # transformers 5


def call_name(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return None if f.id == "generate" else f.id  # a bare generate() is ours (task_metric); the model's is model.generate
    if isinstance(f, ast.Attribute):
        if f.attr == "from_pretrained" and isinstance(f.value, ast.Name) and f.value.id == "PeftModel":
            return "PeftModel.from_pretrained"
        return f.attr
    return None


def sources():
    for path in sorted((PROJECT_ROOT / "nb_helpers").glob("*.py")):
        yield str(path.relative_to(PROJECT_ROOT)), path.read_text()
    for path in sorted((PROJECT_ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        yield str(path.relative_to(PROJECT_ROOT)), code


def collect_calls():
    tracked = set(tracked_callables())
    for name, code in sources():
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Call) and call_name(node) in tracked:
                for kw in node.keywords:
                    if kw.arg is not None:  # **kwargs expansions are checked where the dict is built
                        yield name, call_name(node), kw.arg, node.lineno


CALLS = list(collect_calls())


def test_the_scan_sees_our_library_calls():
    seen = {c[1] for c in CALLS}
    assert {"BitsAndBytesConfig", "LoraConfig", "SFTConfig", "SFTTrainer", "DPOConfig", "DPOTrainer", "from_pretrained",
            "prepare_model_for_kbit_training", "generate", "apply_chat_template"} <= seen


@pytest.mark.parametrize("where, callee, keyword, line", CALLS, ids=[f"{c[1]}-{c[2]}-{c[0]}" for c in CALLS])
def test_keyword_exists_in_pinned_version(where, callee, keyword, line):
    target = tracked_callables()[callee]
    if callee == "from_pretrained":
        # from_pretrained takes **kwargs and consumes them inside: the name must appear in its source.
        assert keyword not in REMOVED_FROM_PRETRAINED, f"{where}:{line}: {keyword}= was removed in transformers 5"
        source = inspect.getsource(target)
        assert keyword in inspect.signature(target).parameters or f'"{keyword}"' in source, \
            f"{where}:{line}: from_pretrained no longer handles {keyword}="
        return
    if callee == "generate":
        from transformers import GenerationConfig

        valid = set(inspect.signature(target).parameters) | set(GenerationConfig().to_dict()) | {"input_ids", "attention_mask"}
        assert keyword in valid, f"{where}:{line}: generate() has no {keyword}="
        return
    params = inspect.signature(target).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    assert keyword in named, f"{where}:{line}: {callee}() has no keyword {keyword!r} in the pinned version"


def test_sft_config_builds_with_every_knob(tmp_path):
    from nb_helpers.config import RunConfig
    from nb_helpers.training import TrainingRun
    from nb_helpers.trainer_setup import sft_config

    args = sft_config(TrainingRun(RunConfig(), run_dir=tmp_path))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 8)
    assert (args.optim, args.learning_rate, args.max_grad_norm) == ("paged_adamw_8bit", 2e-4, 0.3)
    assert args.gradient_checkpointing and args.max_length == 512 and args.completion_only_loss
