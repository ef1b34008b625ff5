"""Every private or internal API of another library that nb_helpers leans on, in one place, each with a probe.

The course and its fast path reach past the public surface of torch, transformers, peft, bitsandbytes, TRL, gguf and
liger-kernel, none of it promised across versions. Each use is a Check whose probe verifies the name AND the shape we
rely on: an upgrade that moves one fails in CI (tests/test_compat.py), and at run time its lever falls back with one
line (fallback_note). Uses outside fast/ carry the pseudo-lever "course": the check must pass, and where a stock
fallback exists (adapter_keys) its accessor takes it with one line. The bottom layer: it imports nothing of nb_helpers
but frontend, and no library eagerly. How the probes read a library (signatures from source, bitsandbytes' ctypes
kernels) is compat.probes; the peft key matching the adapter check uses is compat.adapter_keys."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import re
import sys
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Callable

from nb_helpers.compat.probes import (ADAM_8BIT, ADAM_32BIT, BNB_OPS, DEQUANT_4BIT, QUANTS,  # noqa: F401
                                     _at, _c_binding, _in_source, _kernels, _nf4_layout, _optimizer, _peft_keys,
                                     _quant_state, _resolve, _source)

COURSE = "course"
OPTIONAL, DISTRIBUTIONS = {"liger_kernel"}, {"liger_kernel": "liger-kernel"}  # a GPU extra: absent, its lever is off


@dataclass(frozen=True)
class Check:
    api: str  # the dotted name a maintainer greps for
    library: str  # its import name
    levers: tuple[str, ...]  # the FastOptions fields that depend on it, or "course"
    probe: Callable[[], str | None]  # None when fine, else a short reason


# --- the inventory: one Check per private use ---------------------------------------------------------------------
def _check(api: str, levers: str, *probes, **at) -> Check:  # at: _at's checks of the api's own path, run first
    probes = (_at(re.split(r"[(,: ]", api)[0], **at), *probes) if at else probes
    return Check(api, api.split(".")[0], tuple(levers.split()), lambda: next(filter(None, (p() for p in probes)), None))


LLAMA, PTM = "transformers.models.llama.modeling_llama", "transformers.modeling_utils.PreTrainedModel"
CUDNN_SDPA = "torch.ops.aten._scaled_dot_product_cudnn_attention"  # fast.saved_attention calls it and its backward
TRAINER, ARGS = "transformers.trainer.Trainer", "transformers.training_args.TrainingArguments"
GC_LAYER, TRL_UTILS = "transformers.modeling_layers.GradientCheckpointingLayer", "trl.trainer.utils"
OPT, L4, LORA = "bitsandbytes.optim.optimizer", "bitsandbytes.nn.Linear4bit", "peft.tuners.lora.LoraLayer"
RMS, ADD_RMS = "liger_kernel.ops.rms_norm", "liger_kernel.ops.fused_add_rms_norm"
PEFT_KEYS = ("peft.tuners.tuners_utils.check_target_module_exists(config, key), "
             "peft.utils.other.get_pattern_key(pattern_keys, key_to_match)")
ADD_RMS_BACKWARD = tuple("dY_ptr dY_row_stride dS_out_ptr dS_out_row_stride dX_ptr dX_row_stride X_ptr X_row_stride X_dtype "
                         "W_ptr W_row_stride RSTD_ptr RSTD_row_stride dW_ptr dW_row_stride n_rows n_cols offset "
                         "rows_per_program casting_mode BLOCK_SIZE has_dS_out COMPUTE_DW".split())  # as we pass them

CHECKS: tuple[Check, ...] = (
    _check("torch.cuda.memory._set_allocator_settings", "expandable", params=("env",)),
    _check("torch._C._cuda_getCurrentRawStream", "direct_dequant", lambda: _c_binding("_cuda_getCurrentRawStream")),
    _check("torch._C._cuda_hasPrimaryContext", COURSE, lambda: _c_binding("_cuda_hasPrimaryContext")),
    _check("torch.utils._pytree.tree_flatten, tree_unflatten", "graphs", _at("torch.utils._pytree.tree_unflatten"),
           kind=callable),
    _check("torch.nn.Module._parameters", "graphs",
           _at("torch.nn.Module.register_parameter", says=("self._parameters[name] = param",))),
    _check("torch.native_dropout, torch.ops.aten.native_dropout_backward", "fused_lora",
           _at("torch.ops.aten.native_dropout.default._schema", text="(Tensor input, float p, bool? train)"),
           _at("torch.ops.aten.native_dropout_backward.default._schema", text="Tensor mask, float scale)")),
    _check("torch.ops.aten._scaled_dot_product_cudnn_attention, _scaled_dot_product_cudnn_attention_backward",
           "saved_attention", _at(f"{CUDNN_SDPA}.default._schema", text="(Tensor query, Tensor key, Tensor value, Tensor? "
                                  "attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, bool "
                                  "return_debug_mask=False, *, float? scale=None) -> (Tensor output, Tensor logsumexp, "
                                  "Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor philox_seed, "
                                  "Tensor philox_offset, Tensor debug_attn_mask)"),
           _at(f"{CUDNN_SDPA}_backward.default._schema", text="(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
               "Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, Tensor attn_bias, Tensor "
               "cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, float? "
               "scale=None)")),
    _check("torch.cuda.CUDAGraph.capture_begin(pool, capture_error_mode), torch.cuda.default_generators", "graphs",
           _at("torch.cuda.default_generators", kind=tuple), params=("pool", "capture_error_mode")),
    _check("torch.ops.mkldnn._is_mkldnn_bf16_supported, torch.cpu._is_avx512_bf16_supported, _is_amx_tile_supported",
           COURSE, _at("torch.cpu", attrs=("_is_avx512_bf16_supported", "_is_amx_tile_supported")), kind=callable),
    _check(f"{GC_LAYER}._gradient_checkpointing_func", "offload graphs",
           _at(GC_LAYER, attrs=("gradient_checkpointing",)), _at(f"{GC_LAYER}.__call__", says=(
               "self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)",)),
           _at(f"{PTM}._set_gradient_checkpointing", says=("_gradient_checkpointing_func",)),
           lambda: None if issubclass(_resolve(f"{LLAMA}.LlamaDecoderLayer"), _resolve(GC_LAYER)) else "Llama left it"),
    _check(f"{PTM}.gradient_checkpointing_enable(gradient_checkpointing_kwargs)", "offload graphs reentrant",
           params=("gradient_checkpointing_kwargs",)),
    _check(f"{LLAMA}.LlamaRMSNorm, LlamaMLP, apply_rotary_pos_emb", "kernels",
           _at(LLAMA, attrs=("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"))),
    _check(f"{LLAMA}.LlamaModel.forward(attention_mask, past_key_values), base_model_prefix, layers", "nomask",
           _at(f"{LLAMA}.LlamaPreTrainedModel.base_model_prefix", value="model"),
           _at(f"{LLAMA}.LlamaModel.__init__", says=("self.layers",)), params=("attention_mask", "past_key_values")),
    _check(f"{ARGS}._setup_devices", COURSE, _at(f"{ARGS}.device.fget", says=("self._setup_devices",)),
           kind=functools.cached_property),
    _check(f"{ARGS}._n_gpu", COURSE, _at(f"{ARGS}.n_gpu.fget", says=("self._n_gpu",))),
    _check(f"{TRAINER}._save_checkpoint(model, trial)", COURSE, first=("self", "model", "trial")),
    _check("transformers.trainer_utils.rotate_checkpoints", COURSE, params=("output_dir", "save_total_limit")),
    _check(PEFT_KEYS, COURSE, _peft_keys,  # compat.adapter_keys falls back to the rules these follow
           _at("peft.utils.other.get_pattern_key", first=("pattern_keys", "key_to_match")), first=("config", "key")),
    _check("huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE", COURSE,  # set by safety/hub
           _at("datasets.config.HF_HUB_OFFLINE", kind=bool), kind=bool),
    _check(f"{TRAINER}.floating_point_ops(inputs)", COURSE, first=("self", "inputs")),
    _check(f"{TRAINER}._clip_grad_norm(model), model.zero_grad() in its step loop (_run_epoch)", "trainable_grads",
           _in_source("transformers.trainer", "Trainer._run_epoch", says=(
               "grad_norm = self._clip_grad_norm(model)", "model.zero_grad()")),
           first=("self", "model"), says=(
               "return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)",)),
    _check("accelerate.data_loader.DataLoaderShard.__iter__: self.base_dataloader.__iter__()", "rows_ahead",
           _in_source("transformers.trainer", "Trainer._inner_training_loop", says=(
               "train_dataloader = self.get_train_dataloader()",)),
           _at("transformers.trainer_callback.TrainerCallback", attrs=("on_optimizer_step",)),
           says=("dataloader_iter = self.base_dataloader.__iter__()",)),
    _check(f"{TRAINER}.create_optimizer", "direct_optim",
           _at(f"{TRAINER}.create_optimizer_and_scheduler", says=("self.create_optimizer()",))),
    _check(f"{PTM}.hf_quantizer", COURSE, _at(f"{PTM}.save_pretrained", says=("getattr(self, 'hf_quantizer', None)",))),
    _check(f"{LORA}: lora_A, lora_B, lora_dropout, scaling, lora_variant, get_base_layer", "fused_lora",
           lambda: None if {"lora_A", "lora_B", "scaling", "lora_dropout"} <= {*_resolve(LORA).adapter_layer_names,
                                                                              *_resolve(LORA).other_param_names}
           else "no longer per-adapter attributes (peft's own registries)", _at(f"{LORA}.__init__", says=(
               "self.lora_variant",)), attrs=("get_base_layer", "active_adapters", "disable_adapters", "merged")),
    _check("peft.tuners.lora.bnb.Linear4bit.forward(x, *args, **kwargs)", "fused_lora", params=("args", "kwargs"),
           first=("self", "x")),
    _check("bitsandbytes.cextension.lib._lib.cdequantize_blockwise_{bf16,fp16,fp32}_{nf4,fp4}, "
           "cdequantize_blockwise_fp32 (7 args)", "direct_dequant", _at("bitsandbytes.cextension.lib", attrs=("_lib",)),
           _kernels("_dequantize_4bit_impl", DEQUANT_4BIT, 7),
           _kernels("_dequantize_blockwise_impl", ["cdequantize_blockwise_fp32"], 7)),
    _check(f"{BNB_OPS}.str2optimizer8bit_blockwise['adam'] (19 args), str2optimizer32bit['adam'] (18 args)",
           "direct_optim", _kernels("_optimizer_update_8bit_blockwise_impl", ADAM_8BIT, 19,
                                    "str2optimizer8bit_blockwise"),
           _kernels("_optimizer_update_32bit_impl", ADAM_32BIT, 18, "str2optimizer32bit")),
    _check(f"{OPT}.Optimizer2State: optimizer.state keys, mng.pid2config, mng.index2config, args.max_unorm, "
           "args.skip_zeros, initialized; paged only from 1e5 values (state1.is_paged)", "direct_optim", _optimizer,
           _at(f"{OPT}.Optimizer2State.update_step", says=("state['step'] += 1",)),
           _at(f"{OPT}.Optimizer8bit.get_state_buffer", says=("p.numel() < 1e5",)),
           _at("bitsandbytes.functional.get_paged", says=("out.is_paged = True",))),
    _check(f"{OPT}.Optimizer2State(min_8bit_size=4096), 256-value blocks", COURSE,
           _at(f"{OPT}.Optimizer2State.init_state", says=("blocksize = 256",)), lambda: None if inspect.signature(
               _resolve(f"{OPT}.Optimizer2State")).parameters["min_8bit_size"].default == 4096 else "not 4096"),
    _check("bitsandbytes.functional.QuantState: absmax, code, offset, state2, nested, blocks of 64 and 256",
           "fused_lora direct_dequant course", _quant_state),
    _check("bitsandbytes.functional.dequantize_4bit: NF4 as code[nibble] x absmax, the high nibble first",
           "nf4_kernel", _nf4_layout),
    _check(f"{L4}.forward(x), Params4bit.quant_state, QuantState.packing_format_for_cpu", "fused_lora",
           _at("bitsandbytes.nn.Params4bit.__new__", says=("self.quant_state = quant_state",)),
           _at("bitsandbytes.functional._convert_weight_packed_for_cpu",
               says=("quant_state.packing_format_for_cpu = True",)), first=("self", "x")),
    _check(f"{L4}.support_avx512bf16_for_cpu", COURSE,
           _at(f"{L4}.__init__", says=("self.support_avx512bf16_for_cpu",))),
    _check("bitsandbytes.backends.cpu.ops.logger.name", COURSE, value="bitsandbytes.backends.cpu.ops"),
    _check(f"{TRL_UTILS}.add_fused_lm_head(model, outputs), model(..., fused_lm_head=True)", COURSE,
           _in_source(TRL_UTILS, "add_fused_lm_head._fused_forward", params=("fused_lm_head",)),
           _at(f"{TRL_UTILS}.FusedCausalLMOutput", attrs=("log_probs", "entropy", "is_top1")),
           params=("outputs",), first=("model",)),
    _check(f"trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, {TRL_UTILS}._CHUNKED_LOGPROB_CHUNK_SIZE", COURSE,
           _at("trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE", kind=int, value=4096),  # the planner's tiles
           _at(f"{TRL_UTILS}._CHUNKED_LOGPROB_CHUNK_SIZE", kind=int, value=32768)),
    _check("liger_kernel.ops.LigerRMSNormFunction.apply(X, W, eps, offset, casting_mode, in_place, row_mode)",
           "kernels", _in_source("liger_kernel.ops.rms_norm", "LigerRMSNormFunction.forward",
                                 ("ctx", "X", "W", "eps", "offset", "casting_mode", "in_place", "row_mode"))),
    _check("liger_kernel.ops.LigerSiLUMulFunction.apply(a, b, gate_multiplier, down_multiplier), swiglu_forward(a, b, "
           "gate_multiplier), swiglu_backward(a, b, dc, gate_multiplier)", "kernels fused_block",
           _in_source("liger_kernel.ops.swiglu", "LigerSiLUMulFunction.forward",
                      ("ctx", "a", "b", "gate_multiplier", "down_multiplier")),
           _in_source("liger_kernel.ops.swiglu", "swiglu_forward", ("a", "b", "gate_multiplier"),  # we take its [2]
                      says=("return a, b, c.view(*ori_shape)",)),
           _in_source("liger_kernel.ops.swiglu", "swiglu_backward", ("a", "b", "dc", "gate_multiplier"))),
    _check("liger_kernel.ops.LigerFusedAddRMSNormFunction.apply(X, R, W, eps, offset, casting_mode, in_place)",
           "fused_block", _in_source("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction.forward",
                                     ("ctx", "X", "R", "W", "eps", "offset", "casting_mode", "in_place"))),
    _check(f"{RMS}.rms_norm_forward, {ADD_RMS}.fused_add_rms_norm_forward, ._fused_add_rms_norm_backward_kernel",
           "frozen_norms", _in_source(RMS, "rms_norm_forward", ("X", "W", "eps", "offset", "casting_mode", "row_mode"),
                                      says=("return (Y.view(*shape), X, RSTD, BLOCK_SIZE, num_warps, casting_mode)",)),
           _in_source(ADD_RMS, "fused_add_rms_norm_forward", ("X", "R", "W", "eps", "offset", "casting_mode"), says=(
               "return (Y.view(*shape), S.view(*shape), RSTD, BLOCK_SIZE, num_warps, num_stages, casting_mode)",)),
           _in_source(ADD_RMS, "_fused_add_rms_norm_backward_kernel", ADD_RMS_BACKWARD)),
    _check(f"{LLAMA}.LlamaDecoderLayer.forward (fast.fused_block runs a copy)", "fused_block", says=(
        "hidden_states = residual + hidden_states", "hidden_states = self.post_attention_layernorm(hidden_states)")),
    _check(f"{LLAMA}.LlamaAttention.forward, config._attn_implementation (fast.fused_block runs a copy)",
           "saved_attention",
           _at(LLAMA, attrs=("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward", "apply_rotary_pos_emb")), says=(
               "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
               "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
               "self.config._attn_implementation, eager_attention_forward", "attn_output = self.o_proj(attn_output)"),
           params=("hidden_states", "position_embeddings", "attention_mask", "past_key_values")),
    _check("liger_kernel.transformers.apply_liger_kernel_to_llama(rope, rms_norm, swiglu, ..., model)", "kernels",
           _in_source("liger_kernel.transformers.monkey_patch", "apply_liger_kernel_to_llama", params=(
               "rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy", "model")),
           _at(f"{LLAMA}.apply_rotary_pos_emb", first=("q", "k"))),  # fast.kernels.rope_by_device wraps it
    _check("gguf.get_tensor_name_map, TensorNameMap.get_name(try_suffixes), quants.quantize, SpecialVocab(n_vocab)"
           ".add_to_gguf(quiet), GGUFWriter.add_tensor(raw_dtype), ReaderField.contents", COURSE,
           _at("gguf.TensorNameMap.get_name", params=("try_suffixes",)), _at("gguf.quants.quantize", first=("data",)),
           _at("gguf.SpecialVocab.__init__", params=("n_vocab",)), _at("gguf.GGUFWriter.add_tensor", params=(
               "raw_dtype",)), _at("gguf.SpecialVocab.add_to_gguf", params=("quiet",)),
           _at("gguf.gguf_reader.ReaderField.contents"), kind=callable),
)


# --- running the checks -------------------------------------------------------------------------------------------
def _absent(check: Check) -> bool:
    return check.library in OPTIONAL and importlib.util.find_spec(check.library) is None


def _reason(check: Check) -> str | None:
    try:
        return None if _absent(check) else check.probe()
    except Exception as e:  # noqa: BLE001 - whatever a moved API raises is the reason
        return f"{type(e).__name__}: {str(e)[:160]}"


def run_checks(levers=None) -> list[tuple[Check, str | None]]:
    """Each check (of `levers` only) with None or why it failed; an absent optional library's lever is off anyway."""
    return [(c, _reason(c)) for c in CHECKS if levers is None or set(c.levers) & set(levers)]


def failure(api: str) -> str | None:
    """Why the check of `api` (a Check.api) fails, or None: for an accessor with a stock fallback of its own."""
    return _reason(next(c for c in CHECKS if c.api == api))


def failed(levers=None) -> dict[str, str]:
    """lever -> "API: reason" for each lever with a failed check."""
    out: dict[str, str] = {}
    for check, reason in run_checks(levers):
        for lever in (x for x in check.levers if reason and (levers is None or x in levers)):
            out[lever] = "; ".join(filter(None, (out.get(lever), f"{check.api}: {reason}")))
    return out


def version(library: str) -> str:
    try:
        return metadata.version(DISTRIBUTIONS.get(library, library))
    except metadata.PackageNotFoundError:
        return "(not installed)"


def fallback_note(lever: str, api: str, reason: str | None = None) -> str:
    """The one line said at run time when a lever falls back; `api` may be failed()'s "API: reason" alone."""
    api, reason = (api, reason) if reason is not None else api.split(": ", 1)
    library = next((c.library for c in CHECKS if c.api == api), api.split(".")[0])
    return (f"[fast] {lever} off: {api} changed in {DISTRIBUTIONS.get(library, library)} {version(library)} "
            f"({reason}); using the stock layers")


def report_lines() -> list[str]:
    return [f"{'absent' if _absent(c) else 'FAIL' if r else 'ok':<6} {c.api} ({c.library} {version(c.library)}; "
            f"levers {', '.join(c.levers)})" + (f": {r}" if r else "") for c, r in run_checks()]


def check_all_or_raise() -> None:
    """For CI: RuntimeError naming every private API that no longer looks as we use it."""
    if bad := [line for line in report_lines() if line.startswith("FAIL")]:
        raise RuntimeError("private APIs changed:\n" + "\n".join(bad))


# --- accessors: the risky calls themselves, so call sites go through here ----------------------------------------
def use_expandable_segments() -> bool:
    """Whether the allocator grows segments in place (Linux CUDA; a PYTORCH_CUDA_ALLOC_CONF naming it wins)."""
    import torch
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if not torch.cuda.is_available() or sys.platform != "linux":
        return False
    if "expandable_segments" in setting:
        return "expandable_segments:true" in setting
    try:
        with warnings.catch_warnings():  # torch 2.11+ names a newer private spelling; this one is the one measured
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except Exception as e:  # noqa: BLE001 - its check passed but the call failed here: train as before
        print(fallback_note("expandable", "torch.cuda.memory._set_allocator_settings", str(e)[:120]), flush=True)
        return False
    return True


def dequantize_kernels():
    """(absmax kernel, {(dtype, quant): weight kernel}, raw stream getter), typed as bitsandbytes types them."""
    if why := failed(["direct_dequant"]):
        raise RuntimeError(fallback_note("direct_dequant", why["direct_dequant"]))
    import bitsandbytes.backends.cuda.ops  # noqa: F401 - declares the kernels' ctypes argument types
    import torch
    from bitsandbytes.cextension import lib
    weights = {(getattr(torch, dtype), quant): getattr(lib._lib, f"cdequantize_blockwise_{name}_{quant}")
               for dtype, name in (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")) for quant in QUANTS}
    return lib._lib.cdequantize_blockwise_fp32, weights, torch._C._cuda_getCurrentRawStream


def adam_kernels() -> tuple[dict, dict]:
    """({grad dtype: 8-bit blockwise AdamW kernel}, {grad dtype: 32-bit one}), as bitsandbytes indexes them."""
    if why := failed(["direct_optim"]):
        raise RuntimeError(fallback_note("direct_optim", why["direct_optim"]))
    import torch
    from bitsandbytes.backends.cuda import ops
    dtypes = (torch.float32, torch.float16, torch.bfloat16)  # ADAM_8BIT's order, checked above
    return dict(zip(dtypes, ops.str2optimizer8bit_blockwise["adam"])), dict(zip(dtypes, ops.str2optimizer32bit["adam"]))


def add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1")) -> None:
    """TRL's chunked log-prob head, the loss SFTTrainer trains through: model(..., fused_lm_head=True)."""
    from trl.trainer.utils import add_fused_lm_head as add
    add(model, outputs=outputs)


def logprob_tiles() -> tuple[int, int]:
    """(tokens, vocabulary) of one tile of TRL's chunked log-prob kernel, which the planner's loss term models."""
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
    return TOKEN_CHUNK_SIZE, _CHUNKED_LOGPROB_CHUNK_SIZE


def set_trainer_device(trainer, device) -> None:
    """TrainingArguments.device reads the cached property _setup_devices: once computed, only its cache changes it."""
    trainer.args.__dict__["_setup_devices"] = device


def set_gpu_count(args, count: int) -> None:
    """TrainingArguments.n_gpu reads _n_gpu: what the Trainer wraps the model over (1: no nn.DataParallel)."""
    args._n_gpu = count


def clip_these_grads(trainer, parameters: list) -> None:
    """The Trainer clips the gradients of `parameters` (a list), through accelerate as it does model.parameters(); on
    one process and with DDP those are the same tensors that have a gradient."""
    trainer._clip_grad_norm = lambda model: trainer.accelerator.clip_grad_norm_(parameters, trainer.args.max_grad_norm)


def iterate_batches_through(loader, epoch) -> bool:
    """accelerate's DataLoaderShard iterates its torch DataLoader as `self.base_dataloader.__iter__()`: have each such
    iterator handed out as epoch(the DataLoader's own iterator). False for any other loader (left as it is)."""
    from accelerate.data_loader import DataLoaderShard

    base = loader.__dict__.get("base_dataloader")
    if base is None or not issubclass(type(loader), DataLoaderShard):  # type(): its __class__ answers the base's
        return False
    stock = type(base).__iter__
    base.__iter__ = lambda: epoch(stock(base))
    return True


def save_checkpoint(trainer) -> None:
    """The Trainer's own checkpoint save (model, optimizer, scheduler, RNG, trainer state) at its current step."""
    trainer._save_checkpoint(trainer.model, None)


def has_primary_context(index: int) -> bool | None:
    """Whether this process created its CUDA context on `index`; None where torch's build has no such binding."""
    import torch
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return None if probe is None else bool(probe(index))


def cpu_bf16_units() -> dict[str, bool]:
    """What torch knows of this CPU's bf16 hardware: AVX-512 BF16, AMX tiles, and whether oneDNN uses bf16."""
    import torch
    return {"avx512_bf16": bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()),
            "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
            "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}


def checkpointed_layers(model) -> list:
    """The layers transformers checkpoints; each calls its _gradient_checkpointing_func (set_checkpoint_function)."""
    return [m for m in model.modules()
            if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]


def set_checkpoint_function(layer, function) -> None:
    layer._gradient_checkpointing_func = function
