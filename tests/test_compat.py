"""nb_helpers.compat: every private or internal API of another library that nb_helpers uses has a check, and every
check passes on the pinned stack. Fails, never skips: an upgrade that moves one of them must fail here with the API's
name, and a new private use added without a check must fail here too. compat is the bottom layer: it imports nothing of
nb_helpers but frontend."""

import ast
import inspect
import re
import subprocess
import sys
import types
from dataclasses import fields
from importlib import metadata
from pathlib import Path

import pytest

from nb_helpers import compat
from nb_helpers.compat import adapter_keys

COMPAT = Path(compat.__file__).resolve().parent
PACKAGE = COMPAT.parent
COMPAT_FILES = sorted(COMPAT.glob("*.py"))
SOURCES = [p for p in sorted(PACKAGE.rglob("*.py")) if COMPAT not in p.parents]
API_WORDS = {w for c in compat.CHECKS for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", c.api)}


def test_every_private_api_is_as_we_use_it_on_the_pinned_stack():
    compat.check_all_or_raise()
    assert compat.failed() == {}


def test_the_inventory_is_well_formed():
    from nb_helpers.fast import FastOptions

    levers = {f.name for f in fields(FastOptions)} | {compat.COURSE}
    assert len(compat.CHECKS) >= 30
    assert len({c.api for c in compat.CHECKS}) == len(compat.CHECKS), "one check per API"
    for check in compat.CHECKS:
        assert check.levers and set(check.levers) <= levers, f"{check.api}: unknown lever in {check.levers}"
        assert check.library in {"torch", "transformers", "peft", "bitsandbytes", "trl", "liger_kernel", "gguf",
                                 "huggingface_hub", "accelerate"}
    assert {p.name for p in COMPAT_FILES} == {"__init__.py", "probes.py", "adapter_keys.py"}


def test_importing_compat_imports_no_library_and_no_other_module_of_ours():
    """What importing nb_helpers.compat adds to `import nb_helpers` alone: its own modules and frontend, no library."""
    code = ("import sys, nb_helpers\n"
            "before = set(sys.modules)\n"
            "import nb_helpers.compat, nb_helpers.compat.adapter_keys\n"
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('nb_helpers', 'torch', "
            "'transformers', 'peft', 'bitsandbytes', 'trl', 'liger_kernel', 'gguf', 'accelerate', 'datasets')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    own = {"nb_helpers.compat", "nb_helpers.compat.adapter_keys", "nb_helpers.compat.probes"}
    assert own <= set(ast.literal_eval(out.stdout.strip())) <= own | {"nb_helpers.frontend"}, out.stdout


def test_compat_is_the_bottom_layer():
    """Its imports of nb_helpers, at any depth (inside functions too): frontend and its own modules only."""
    ours = set()
    for path in COMPAT_FILES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                ours.add(f"nb_helpers.compat.{node.module or ''}")
            elif isinstance(node, ast.ImportFrom) and node.module.startswith("nb_helpers"):
                ours |= {node.module} if node.module != "nb_helpers" else {f"nb_helpers.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                ours |= {a.name for a in node.names if a.name.startswith("nb_helpers")}
    assert ours and ours <= {"nb_helpers.frontend", "nb_helpers.compat", "nb_helpers.compat.probes"}, ours


# --- an API that moved fails by name and turns off exactly its levers ---------------------------------------------
def failure() -> str:
    with pytest.raises(RuntimeError) as info:
        compat.check_all_or_raise()
    return str(info.value)


def test_a_removed_torch_api_fails_with_its_name(monkeypatch):
    import torch

    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    assert "torch.cuda.memory._set_allocator_settings" in failure()
    failed = compat.failed()
    assert set(failed) == {"expandable"}
    note = compat.fallback_note("expandable", failed["expandable"])
    assert note.startswith(f"[fast] expandable off: torch.cuda.memory._set_allocator_settings changed in torch "
                           f"{metadata.version('torch')} (AttributeError: ")
    assert note.endswith("; using the stock layers") and "\n" not in note


def test_a_changed_trl_constant_fails_with_its_name(monkeypatch):
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    with monkeypatch.context() as patch:
        patch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", 8192)
        message = failure()
        assert "trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE" in message and "8192" in message and "4096" in message
    monkeypatch.delattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE")
    assert "has no attribute '_CHUNKED_LOGPROB_CHUNK_SIZE'" in compat.failed()["course"]
    assert set(compat.failed()) == {"course"}  # the planner's mirror of TRL's tiles: no lever to fall back


def test_a_bitsandbytes_kernel_called_with_another_argument_count_fails(monkeypatch, tmp_path):
    """The C kernels are not on the CPU build: the check reads how bitsandbytes itself calls them. A bitsandbytes
    that passes one more argument than we do must turn direct_dequant off, naming the symbol and both counts."""
    real = compat._source(compat.BNB_OPS)
    start = real.index("def _dequantize_4bit_impl(")
    call = re.compile(r"fn\(\n(\s+)None,").search(real, start)  # its kernel call: fn(None, A, absmax, out, ...)
    changed = tmp_path / "ops.py"
    changed.write_text(real[:call.end()] + f"\n{call.group(1)}None," + real[call.end():], encoding="utf-8")
    monkeypatch.setitem(sys.modules, compat.BNB_OPS, types.SimpleNamespace(__file__=str(changed)))
    why = compat.failed()["direct_dequant"]
    assert "cdequantize_blockwise_{bf16,fp16,fp32}_{nf4,fp4}" in why and "passes [8] arguments, we pass 7" in why
    assert set(compat.failed()) == {"direct_dequant"}


def test_a_reordered_bitsandbytes_kernel_table_fails(monkeypatch, tmp_path):
    real = compat._source(compat.BNB_OPS)
    fp16, bf16 = "lib.cadam_8bit_blockwise_grad_fp16", "lib.cadam_8bit_blockwise_grad_bf16"
    changed = tmp_path / "ops.py"
    changed.write_text(real.replace(fp16, "@").replace(bf16, fp16).replace("@", bf16), encoding="utf-8")
    monkeypatch.setitem(sys.modules, compat.BNB_OPS, types.SimpleNamespace(__file__=str(changed)))
    assert "str2optimizer8bit_blockwise" in compat.failed()["direct_optim"]


def test_a_removed_bitsandbytes_internal_fails_with_its_name(monkeypatch):
    from bitsandbytes import cextension

    monkeypatch.delattr(cextension.lib, "_lib")
    assert "bitsandbytes.cextension.lib._lib" in failure()
    assert "direct_dequant" in compat.failed()  # on the CUDA build the AdamW kernels' lookup needs it too


def test_a_transformers_hook_that_moved_turns_off_only_its_levers(monkeypatch):
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.training_args import TrainingArguments

    def call(self, *args, **kwargs):  # a transformers whose layers no longer call _gradient_checkpointing_func
        return torch.nn.Module.__call__(self, *args, **kwargs)

    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", call)
    assert "GradientCheckpointingLayer._gradient_checkpointing_func" in failure()
    assert set(compat.failed()) == {"offload", "graphs"}
    monkeypatch.delattr(TrainingArguments, "_setup_devices")
    assert "TrainingArguments._setup_devices" in failure()
    assert set(compat.failed()) == {"offload", "graphs", "course"}


def test_a_peft_layer_without_per_adapter_scaling_turns_off_fused_lora(monkeypatch):
    from peft.tuners.lora import LoraLayer

    monkeypatch.setattr(LoraLayer, "other_param_names", ("r", "lora_alpha", "lora_dropout"))
    assert set(compat.failed()) == {"fused_lora"}
    assert compat.failed()["fused_lora"].startswith("peft.tuners.lora.LoraLayer: ")


NORM_FORWARD = "def rms_norm_forward(X, W, eps, offset, casting_mode, row_mode):\n" \
               "    return (Y.view(*shape), X, RSTD, BLOCK_SIZE, num_warps, casting_mode)\n"
ADD_NORM = ("def fused_add_rms_norm_forward(X, R, W, eps, offset, casting_mode):\n"
            "    return (Y.view(*shape), S.view(*shape), RSTD, BLOCK_SIZE, num_warps, num_stages, casting_mode)\n"
            f"def _fused_add_rms_norm_backward_kernel({', '.join(compat.ADD_RMS_BACKWARD)}):\n    pass\n")


SWIGLU_FORWARD = "def swiglu_forward(a, b, gate_multiplier: float = 1.0):\n    return a, b, c.view(*ori_shape)\n"


def write_liger(root: Path, rms_norm_forward: str, swiglu_backward: str = "a, b, dc, gate_multiplier=1.0",
                norm_forward: str = NORM_FORWARD, swiglu_forward: str = SWIGLU_FORWARD) -> None:
    """A stand-in liger-kernel source tree (the real one needs Triton and a GPU to import; the checks only read it)."""
    files = {"__init__.py": "", "ops/__init__.py": "", "transformers/__init__.py": "",
             "ops/rms_norm.py": f"class LigerRMSNormFunction:\n    @staticmethod\n    def forward({rms_norm_forward}):\n"
                                f"        pass\n{norm_forward}",
             "ops/swiglu.py": "class LigerSiLUMulFunction:\n    @staticmethod\n"
                              "    def forward(ctx, a, b, gate_multiplier=1.0, down_multiplier=1.0):\n        pass\n"
                              f"def swiglu_backward({swiglu_backward}):\n    pass\n{swiglu_forward}",
             "ops/fused_add_rms_norm.py": "class LigerFusedAddRMSNormFunction:\n    @staticmethod\n    def forward(ctx, "
                                          "X, R, W, eps, offset=0.0, casting_mode='llama', in_place=False):\n"
                                          f"        pass\n{ADD_NORM}",
             "transformers/monkey_patch.py": "def apply_liger_kernel_to_llama(rope=True, cross_entropy=False, "
                                             "fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, "
                                             "model=None):\n    pass\n"}
    for name, text in files.items():
        (root / "liger_kernel" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "liger_kernel" / name).write_text(text, encoding="utf-8")


def fake_liger_on_path(monkeypatch, folder: Path) -> None:
    """liger_kernel imported from `folder` (write_liger's files) for this test, whatever was imported before."""
    for name in [m for m in sys.modules if m.startswith("liger_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(folder))


def test_liger_signatures_are_read_from_source(monkeypatch, tmp_path):
    fake_liger_on_path(monkeypatch, tmp_path)
    write_liger(tmp_path, "ctx, X, W, eps, offset=0.0, casting_mode='llama', in_place=True, row_mode=None")
    assert compat.failed(["kernels"]) == {}
    write_liger(tmp_path, "ctx, X, W, eps, offset=0.0, casting_mode='llama', row_mode=None")  # in_place dropped
    why = compat.failed(["kernels"])["kernels"]
    assert why.startswith("liger_kernel.ops.LigerRMSNormFunction.apply") and "in_place" in why
    assert compat.failed(["fused_block"]) == {}  # the layer blocks do not use liger's RMSNorm function
    write_liger(tmp_path, "ctx, X, W, eps, offset=0.0, casting_mode='llama', in_place=True, row_mode=None",
                swiglu_backward="a, b, dc")  # gate_multiplier dropped: both levers that call it fall back
    assert set(compat.failed(["kernels", "fused_block"])) == {"kernels", "fused_block"}


@pytest.mark.parametrize("forward, says", [
    ("def swiglu_forward(a, b):\n    return a, b, c.view(*ori_shape)\n", "swiglu_forward takes ['a', 'b'], we pass"),
    ("def swiglu_forward(a, b, gate_multiplier=1.0):\n    return c.view(*ori_shape)\n", "no longer does `return"),
    ("def swiglu_forward(b, a, gate_multiplier=1.0):\n    return a, b, c.view(*ori_shape)\n", "takes ['b', 'a', 'gate_multiplier'], we pass"),
    ("", "swiglu.swiglu_forward is gone")])
def test_a_changed_liger_swiglu_forward_turns_off_the_levers_that_call_it(monkeypatch, tmp_path, forward, says):
    """fast.fused_block calls swiglu_forward(gate, up, 1.0)[2]: its arguments by position and what it returns."""
    fake_liger_on_path(monkeypatch, tmp_path)
    stock = "ctx, X, W, eps, offset=0.0, casting_mode='llama', in_place=True, row_mode=None"
    write_liger(tmp_path, stock)
    assert compat.failed(["kernels", "fused_block", "frozen_norms"]) == {}
    write_liger(tmp_path, stock, swiglu_forward=forward)
    why = compat.failed(["kernels", "fused_block", "frozen_norms"])
    assert set(why) == {"kernels", "fused_block"} and says in why["fused_block"], why
    assert why["fused_block"].startswith("liger_kernel.ops.LigerSiLUMulFunction.apply")


def test_a_changed_liger_norm_internal_turns_off_only_frozen_norms(monkeypatch, tmp_path):
    fake_liger_on_path(monkeypatch, tmp_path)
    stock = "ctx, X, W, eps, offset=0.0, casting_mode='llama', in_place=True, row_mode=None"
    write_liger(tmp_path, stock)
    assert compat.failed(["kernels", "fused_block", "frozen_norms"]) == {}
    write_liger(tmp_path, stock, norm_forward=NORM_FORWARD.replace("num_warps, casting_mode", "num_warps, mode, x"))
    why = compat.failed(["kernels", "fused_block", "frozen_norms"])  # a value more in what the forward returns
    assert set(why) == {"frozen_norms"} and "rms_norm_forward no longer does `return" in why["frozen_norms"]


def test_fallback_note_is_the_one_line_the_brief_names():
    import bitsandbytes

    api = "bitsandbytes.backends.cuda.ops.str2optimizer8bit_blockwise['adam'] (19 args), str2optimizer32bit['adam'] (18 args)"
    assert api in {c.api for c in compat.CHECKS}
    expected = (f"[fast] direct_optim off: {api} changed in bitsandbytes {bitsandbytes.__version__} (it moved); "
                "using the stock layers")
    assert compat.fallback_note("direct_optim", api, "it moved") == expected
    assert compat.fallback_note("direct_optim", f"{api}: it moved") == expected



# --- peft's key matching, which the adapter check uses, and its fallback -----------------------------------------
def lora_configs():
    from peft import LoraConfig

    return [LoraConfig(target_modules=["q_proj", "v_proj"]),
            LoraConfig(target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 4, "layers.1.self_attn.q_proj": 2}),
            LoraConfig(target_modules=r".*\.(q|k)_proj", exclude_modules=r".*layers\.1\..*"),
            LoraConfig(target_modules=["q_proj", "k_proj", "up_proj"], exclude_modules=["layers.0.self_attn.q_proj"]),
            LoraConfig(target_modules=["q_proj", "o_proj"], layers_to_transform=[0, 2]),
            LoraConfig(target_modules=["q_proj", "o_proj"], layers_to_transform=1, layers_pattern="layers"),
            LoraConfig(target_modules="all-linear"),
            LoraConfig(target_modules=["q_proj", "lm_head"], modules_to_save=["lm_head"])]


KEYS = [f"model.layers.{i}.{part}" for i in (0, 1, 2, 10) for part in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")]
KEYS += ["lm_head", "q_proj", "model.embed_tokens"]


def test_the_adapter_key_fallback_follows_peft():
    """Where peft's matchers fail their check, adapter_keys' own rules answer: the same answers, key by key."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    answers = set()
    for config in lora_configs():
        for key in KEYS:
            answer = bool(check_target_module_exists(config, key))
            assert adapter_keys.targeted(config, key) == answer, (config.target_modules, key)
            answers.add(answer)
            assert adapter_keys.pattern_key(config.rank_pattern, key) == get_pattern_key(config.rank_pattern, key)
    assert answers == {True, False}
    config = lora_configs()[1]
    assert {adapter_keys.pattern_key(config.rank_pattern, k) for k in KEYS} >= {"v_proj", "layers.1.self_attn.q_proj"}


def test_key_matchers_use_peft_while_its_check_passes(monkeypatch, capsys):
    from peft.tuners import tuners_utils

    calls = []
    real = tuners_utils.check_target_module_exists
    monkeypatch.setattr(tuners_utils, "check_target_module_exists", lambda config, key: calls.append(key) or real(
        config, key))
    config = lora_configs()[1]
    targeted, rank = adapter_keys.key_matchers(config)
    assert targeted("model.layers.1.self_attn.q_proj") and not targeted("model.layers.1.self_attn.k_proj")
    assert "model.layers.1.self_attn.k_proj" in calls  # peft's own function answered
    assert (rank("model.layers.1.self_attn.q_proj"), rank("model.layers.0.self_attn.v_proj")) == (2, 4)
    assert rank("model.layers.0.self_attn.q_proj") == 8
    assert "[compat]" not in capsys.readouterr().out


@pytest.mark.parametrize("change, says", [("signature", "check_target_module_exists takes ('key', 'config') first"),
                                          ("answers", "check_target_module_exists answers otherwise for"),
                                          ("pattern", "get_pattern_key gives"), ("gone", "has no attribute")])
def test_a_changed_peft_matcher_falls_back_with_one_line(monkeypatch, capsys, change, says):
    from peft.tuners import tuners_utils
    from peft.utils import other

    from nb_helpers import frontend

    real = tuners_utils.check_target_module_exists
    if change == "signature":
        monkeypatch.setattr(tuners_utils, "check_target_module_exists", lambda key, config: real(config, key))
    elif change == "answers":  # a peft that no longer matches a name against the key's last part
        monkeypatch.setattr(tuners_utils, "check_target_module_exists", lambda config, key: key in config.target_modules)
    elif change == "pattern":
        monkeypatch.setattr(other, "get_pattern_key", lambda pattern_keys, key_to_match: key_to_match)
    else:
        monkeypatch.delattr(tuners_utils, "check_target_module_exists")
    why = compat.failure(compat.PEFT_KEYS)
    assert why and says in why, why
    assert compat.failed()["course"].startswith(compat.PEFT_KEYS) and set(compat.failed()) == {"course"}
    monkeypatch.setattr(frontend, "_SAID", set())
    for _ in range(2):
        targeted, rank = adapter_keys.key_matchers(lora_configs()[1])
        assert targeted("model.layers.1.self_attn.q_proj") and not targeted("model.layers.1.self_attn.k_proj")
        assert (rank("model.layers.1.self_attn.q_proj"), rank("model.layers.0.self_attn.v_proj")) == (2, 4)
    out = capsys.readouterr().out
    assert out.count(f"[compat] {compat.PEFT_KEYS} changed in peft {metadata.version('peft')} ({why})") == 1, out
    assert out.count("\n") == 1 and "the adapter check matches keys by the rules peft 0.21 applies" in out

# --- the accessors ----------------------------------------------------------------------------------------------
def package_constants() -> dict:
    """Module-level int constants of nb_helpers, wherever the planner keeps its mirrors of library values."""
    found = {}
    for path in SOURCES:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and type(node.value.value) is int:
                found.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return found


def test_the_planners_mirrors_of_library_values_match_the_libraries():
    import torch
    from bitsandbytes.functional import quantize_4bit
    from bitsandbytes.optim.optimizer import Optimizer2State

    mirrors = package_constants()
    assert (mirrors["LOGPROB_TOKEN_TILE"], mirrors["LOGPROB_VOCAB_TILE"]) == compat.logprob_tiles()
    assert mirrors["BNB_8BIT_MIN_SIZE"] == inspect.signature(Optimizer2State).parameters["min_8bit_size"].default
    _, state = quantize_4bit(torch.ones(64, 64, dtype=torch.bfloat16), quant_type="nf4", compress_statistics=True)
    assert (mirrors["BLOCK"], mirrors["DOUBLE_QUANT_BLOCK"]) == (state.blocksize, state.state2.blocksize)


def test_accessors_on_the_cpu(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.device.type == "cpu"
    compat.set_trainer_device(types.SimpleNamespace(args=args), torch.device("meta"))
    assert args.device == torch.device("meta")
    compat.set_gpu_count(args, 3)
    assert args.n_gpu == 3
    units = compat.cpu_bf16_units()
    assert set(units) == {"avx512_bf16", "amx", "onednn_bf16"} and all(type(v) is bool for v in units.values())
    if not torch.cuda.is_available():
        assert compat.has_primary_context(0) is None  # the CPU build has no such binding

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert compat.checkpointed_layers(model) == []
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    layers = compat.checkpointed_layers(model)
    assert set(model.model.layers) <= set(layers)
    calls = []
    for layer in layers:
        compat.set_checkpoint_function(layer, lambda function, *a, **k: calls.append(1) or function(*a, **k))
    model.train()
    model(input_ids=torch.randint(0, 32, (1, 8))).logits.sum().backward()
    assert len(calls) == 2  # each decoder layer went through the function we set
    if not torch.cuda.is_available():
        assert compat.use_expandable_segments() is False  # nothing to set


@pytest.mark.gpu
def test_accessors_on_the_gpu():
    """The direct kernels give bitsandbytes' own bits; the AdamW tables hold a kernel per gradient dtype."""
    import torch
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    absmax_kernel, weight_kernels, raw_stream = compat.dequantize_kernels()
    weight = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    packed, state = quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    stream, nested = raw_stream(weight.device.index), state.state2
    scales = torch.empty(state.absmax.shape, dtype=torch.float32, device="cuda")
    absmax_kernel(nested.code.data_ptr(), state.absmax.data_ptr(), nested.absmax.data_ptr(), scales.data_ptr(),
                  nested.blocksize, state.absmax.numel(), stream)
    out = torch.empty(state.shape, dtype=state.dtype, device="cuda")
    weight_kernels[torch.bfloat16, "nf4"](None, packed.data_ptr(), scales.add_(state.offset).data_ptr(),
                                          out.data_ptr(), state.blocksize, out.numel(), stream)
    assert torch.equal(out, dequantize_4bit(packed, state))
    eight, thirty_two = compat.adam_kernels()
    assert set(eight) == set(thirty_two) == {torch.float32, torch.float16, torch.bfloat16}


# --- every private use in the package has a check ---------------------------------------------------------------
def defined_in_package() -> set[str]:
    """Every name nb_helpers defines itself: functions, classes, arguments, variables, and attributes set on self
    (our own privates like _say_once, _decoder, _nb_fast are ours, not another library's)."""
    names = set()
    for path in [*SOURCES, *COMPAT_FILES]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    getattr(node.value, "id", None) == "self":
                names.add(node.attr)
    return names


def private(name: str) -> bool:
    return bool(re.fullmatch(r"_[A-Za-z][A-Za-z0-9_]*", name)) and not name.endswith("__")


def foreign_private_uses(sources=SOURCES) -> list[tuple[str, int, str]]:
    """(file, line, name) for each private name our code reaches on something else: an attribute (`torch._C`), a
    string naming one (`__dict__["_setup_devices"]`, getattr(torch.cpu, "_is_amx_tile_supported")), a module path
    (`torch.utils._pytree`). Docstrings, comments and f-string pieces are not code."""
    ours, uses = defined_in_package(), []
    for path in sources:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                found = [node.attr]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces:
                found = [node.value]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith("nb_helpers"):
                found = [*node.module.split("."), *(a.name for a in node.names)]
            else:
                continue
            uses += [(path.name, node.lineno, name) for name in found
                     if private(name) and name not in ours and not name.startswith("_nb")]
    return uses


def test_the_scan_finds_foreign_private_names(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from torch.utils._pytree import tree_flatten\n"
                      "import torch\n"
                      "stream = torch._C._cuda_getCurrentRawStream(0)\n"
                      "probe = getattr(torch.cpu, '_is_amx_tile_supported', None)\n"
                      "trainer.args.__dict__['_setup_devices'] = device\n"
                      "def _say_once(key): return f'{key}_{stream}'\n"  # ours, and an f-string piece
                      "model._nb_fast = _say_once('x')\n", encoding="utf-8")
    found = [name for _, _, name in foreign_private_uses([sample])]
    assert sorted(found) == sorted(["_pytree", "_C", "_cuda_getCurrentRawStream", "_is_amx_tile_supported",
                                    "_setup_devices"])


def test_every_foreign_private_name_in_the_package_has_a_check():
    missing = [f"{where}:{line}: {name}" for where, line, name in foreign_private_uses() if name not in API_WORDS]
    assert not missing, ("private APIs of other libraries used without a check in nb_helpers/compat/ "
                         "(add a Check naming each, or call a compat accessor):\n" + "\n".join(missing))


# Internal APIs whose names carry no underscore: a pattern in our source -> the words a check's api must hold.
INTERNAL = {
    r"\bstr2optimizer8bit_blockwise\b": "str2optimizer8bit_blockwise", r"\bstr2optimizer32bit\b": "str2optimizer32bit",
    r"\bcdequantize_blockwise_": "cdequantize_blockwise_fp32", r"backends\.cuda\b.*\bops\b": "cuda.ops",
    r"\.mng\.(pid2config|index2config)": "mng.pid2config", r"\.args\.(max_unorm|skip_zeros)": "args.max_unorm",
    r"\bis_paged\b": "is_paged", r"\bOptimizer2State\b": "Optimizer2State", r"\bmin_8bit_size\b": "min_8bit_size",
    r"\bquant_state\b": "quant_state", r"\bpacking_format_for_cpu\b": "packing_format_for_cpu",
    r"\bsupport_avx512bf16_for_cpu\b": "support_avx512bf16_for_cpu", r"\bhf_quantizer\b": "hf_quantizer",
    r"\blora_variant\b": "lora_variant", r"\blora_dropout\[": "lora_dropout", r"\.scaling\[": "scaling",
    r"\bget_base_layer\(": "get_base_layer", r"\bLigerRMSNormFunction\b": "LigerRMSNormFunction",
    r"\bLigerSiLUMulFunction\b": "LigerSiLUMulFunction", r"\bapply_liger_kernel_to_llama\b": "apply_liger_kernel_to_llama",
    r"modeling_llama\.Llama(RMSNorm|MLP)": "LlamaRMSNorm", r"\badd_fused_lm_head\b": "add_fused_lm_head",
    r"\bfused_lm_head=": "fused_lm_head", r"\bTOKEN_CHUNK_SIZE\b": "TOKEN_CHUNK_SIZE",
    r"\.floating_point_ops\s*=": "floating_point_ops", r"\.create_optimizer\s*=": "create_optimizer",
    r"\bgradient_checkpointing_kwargs=": "gradient_checkpointing_kwargs", r"\"past_key_values\"": "past_key_values",
    r"bitsandbytes\.backends\.cpu\.ops": "bitsandbytes.backends.cpu.ops", r"\btry_suffixes=": "try_suffixes",
    r"\bgguf\.quants\.quantize\b": "quants.quantize", r"\bSpecialVocab\b": "SpecialVocab",
    r"\.contents\(\)": "ReaderField.contents", r"\braw_dtype=": "raw_dtype", r"\bdefault_generators\b": "default_generators",
    r"\brotate_checkpoints\b": "rotate_checkpoints", r"\.HF_HUB_OFFLINE\s*=": "HF_HUB_OFFLINE",
    r"\brms_norm_forward\(": "rms_norm_forward", r"\bfused_add_rms_norm_forward\(": "fused_add_rms_norm_forward",
    r"\.capture_begin\(": "capture_begin", r"\bnative_dropout": "native_dropout", r"\bbase_model_prefix\b": "base_model_prefix",
    r"\bswiglu_forward\b": "swiglu_forward", r"\bswiglu_backward\b": "swiglu_backward",
    r"\bcheck_target_module_exists\b": "check_target_module_exists", r"\bget_pattern_key\b": "get_pattern_key",
    r"peft\.tuners\.tuners_utils\b": "peft.tuners.tuners_utils", r"peft\.utils\.other\b": "peft.utils.other",
}


def test_every_internal_api_in_the_package_has_a_check():
    apis = " ".join(c.api for c in compat.CHECKS)
    missing = []
    for pattern, word in INTERNAL.items():
        for path in SOURCES:
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if re.search(pattern, line) and word not in apis:
                    missing.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {word} ({pattern})")
    assert not missing, "internal APIs used without a check in nb_helpers/compat/:\n" + "\n".join(missing)
