"""The fused QLoRA layers compute what peft + bitsandbytes compute: outputs and gradients, with LoRA dropout on
(the same seed draws the same mask), on the tiny model in fp32 on the CPU (bitsandbytes dequantizes there too). On a
machine with a GPU (a learner's `make test`) the same tests run there: the model loads onto it, so the token ids
follow the model."""

import pytest
import torch

from nb_helpers.fast import fused_lora


def _model(tiny_cfg, patched: bool, dtype: str = "float32", dropout: float = 0.1):
    from nb_helpers.fast.options import FastOptions
    from nb_helpers.models import ModelChoice, load_4bit
    from nb_helpers.lora import attach_lora

    cfg = tiny_cfg.replace(compute_dtype=dtype, lora_dropout=dropout)
    torch.manual_seed(0)  # the same random A in both models
    model = attach_lora(load_4bit(cfg, ModelChoice(cfg.model, "tiny", "test")), cfg,
                        fast=FastOptions(lean=True, kernels=False, nomask=False, fused_lora=False))  # peft's own
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; a random B makes the LoRA branch count in the check
            torch.nn.init.normal_(param, std=0.5)
    model.train()
    if patched:
        assert fused_lora.install(model) > 0
    return model


def _loss_and_grads(model, ids):
    ids = ids.to(model.device)
    torch.manual_seed(7)  # the same dropout masks in both models
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    return loss.detach(), embeds.grad, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_fused_layers_match_peft_and_bitsandbytes(tiny_cfg):
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_dx, ref_grads = _loss_and_grads(_model(tiny_cfg, False), ids)
    loss, dx, grads = _loss_and_grads(_model(tiny_cfg, True), ids)
    assert torch.allclose(loss, ref_loss, rtol=1e-5), (loss, ref_loss)
    assert torch.allclose(dx, ref_dx, rtol=1e-4, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name in grads:
        assert torch.allclose(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6), name


def test_fused_layers_fall_back_when_adapters_are_disabled(tiny_cfg):
    model = _model(tiny_cfg, True)
    ids = torch.randint(0, 1000, (1, 8)).to(model.device)
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
    assert not torch.allclose(base, tuned)  # the LoRA branch counts only when the adapters are on


def test_without_autograd_the_fused_layers_give_the_same_outputs_and_draw_the_same_masks(tiny_cfg):
    """Under no_grad (a checkpoint's first forward) the layers skip their autograd Function: the same logits as with
    gradients on and as peft's, dropout on, and the generator left where the Function leaves it (the recompute's
    masks depend on that)."""
    fused, peft_model = _model(tiny_cfg, True), _model(tiny_cfg, False)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0)).to(fused.device)
    runs = []
    for model, grad in ((fused, False), (fused, True), (peft_model, False)):
        torch.manual_seed(3)
        with torch.set_grad_enabled(grad):
            runs.append((model(input_ids=ids).logits.detach(), torch.rand(1)))
    (no_grad, after), (with_grad, after_grad), (reference, after_ref) = runs
    assert torch.equal(no_grad, with_grad) and torch.equal(after, after_grad) and torch.equal(after, after_ref)
    assert torch.allclose(no_grad, reference, rtol=1e-5, atol=1e-6)


def test_install_counts_every_4bit_layer(tiny_cfg):
    import bitsandbytes as bnb

    model = _model(tiny_cfg, False)
    four_bit = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert fused_lora.install(model) == four_bit  # LoRA wrappers replace their base layer's call, one per layer


@pytest.mark.gpu
def test_fused_layers_match_on_the_gpu_in_bf16(tiny_cfg):
    """The same check on CUDA in bf16, where the fast path uses it: bitsandbytes' CUDA dequantization, bf16 GEMMs
    (one rounding in addmm_ against peft's three, hence a tolerance). Without dropout: peft drops out x cast to its
    adapters' dtype (fp32 here), the fused layer bf16 x, so the same seed draws other masks (with dropout on, device
    call 32 saw lora_A's gradients differ)."""
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    cfg = tiny_cfg.replace(compute_dtype="bfloat16")
    ref_loss, _, ref_grads = _loss_and_grads(_model(cfg, False, dtype="bfloat16", dropout=0.0), ids)
    loss, _, grads = _loss_and_grads(_model(cfg, True, dtype="bfloat16", dropout=0.0), ids)
    assert abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item()
    for name in grads:
        cos = torch.nn.functional.cosine_similarity(grads[name].float().flatten(), ref_grads[name].float().flatten(),
                                                    dim=0)
        assert cos > 0.99, (name, cos.item())


def test_direct_dequantize_falls_back_without_cuda_kernels_and_says_so_once(capsys, monkeypatch):
    """Where the probe finds no kernels (a CPU build of bitsandbytes has no CUDA backend; a changed one fails
    nb_helpers.compat's check) it says so once, and the public dequantize_4bit runs. The probe is made to fail here, so
    the test means the same on a machine with a GPU."""
    from nb_helpers import compat, frontend

    def no_kernels():
        raise RuntimeError("no CUDA backend in this build of bitsandbytes")

    monkeypatch.setattr(frontend, "_SAID", set())
    monkeypatch.setattr(fused_lora, "_KERNELS", [])
    monkeypatch.setattr(compat, "dequantize_kernels", no_kernels)
    assert not fused_lora.direct_dequant_available() and not fused_lora.direct_dequant_available()
    assert fused_lora._direct_kernels() is None and fused_lora.direct_kernels_unavailable_reason()
    assert capsys.readouterr().out.count("dequantize kernels are not reachable directly") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False])
def test_direct_dequantize_gives_bitsandbytes_bits(dtype, quant_type, nested):
    """The direct call runs bitsandbytes' own kernels, so every element must be bitwise what dequantize_4bit gives,
    with and without double quantization."""
    import types

    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    assert fused_lora._direct_kernels() is not None  # on CUDA the kernels must be reachable, or this tests nothing
    w = torch.randn(1000, 704, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(0))
    packed, state = quantize_4bit(w, quant_type=quant_type, compress_statistics=nested)
    weight = types.SimpleNamespace(data=packed, quant_state=state)
    assert torch.equal(fused_lora._dequantize(weight, direct=True), dequantize_4bit(packed, state))


@pytest.mark.gpu
def test_the_absmax_kept_decoded_gives_the_same_bits_without_decoding_again(monkeypatch):
    """keep_decoded_absmax decodes each double-quantized absmax once: later dequantizes decode nothing and give
    bitsandbytes' own bits; a kept value on another device than its weight is decoded afresh instead of read."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    model = torch.nn.Sequential(bnb.nn.Linear4bit(704, 1000, bias=False, compute_dtype=torch.bfloat16,
                                                  compress_statistics=True, quant_type="nf4"),
                                bnb.nn.Linear4bit(64, 64, bias=False, compress_statistics=False)).cuda()
    weight, plain = model[0].weight, model[1].weight
    assert weight.quant_state.nested and not plain.quant_state.nested
    assert fused_lora.keep_decoded_absmax(model) == 1  # the weight without double quantization has nothing to decode
    decoded = []
    real = fused_lora._decoded_absmax
    monkeypatch.setattr(fused_lora, "_decoded_absmax", lambda *a: decoded.append(1) or real(*a))
    expected = dequantize_4bit(weight.data, weight.quant_state)
    assert torch.equal(fused_lora._dequantize(weight, direct=True), expected) and not decoded
    setattr(weight.quant_state, fused_lora.DECODED_ABSMAX, torch.zeros(3))  # as if the weight had moved since
    assert torch.equal(fused_lora._dequantize(weight, direct=True), expected) and len(decoded) == 1


def test_no_absmax_is_kept_for_weights_off_the_gpu(tiny_cfg, no_gpu):
    """On the CPU path (bitsandbytes dequantizes there through its own code) nothing is decoded ahead or kept, and the
    memory breakdown counts exactly the quantization constants bitsandbytes holds."""
    from nb_helpers.models import memory_breakdown

    model = _model(tiny_cfg, patched=False)
    before = memory_breakdown(model)["quant_constants"]
    assert fused_lora.keep_decoded_absmax(model) == 0
    states = [m.weight.quant_state for m in model.modules() if getattr(getattr(m, "weight", None), "quant_state", None)]
    assert states and not any(hasattr(s, fused_lora.DECODED_ABSMAX) for s in states)
    assert memory_breakdown(model)["quant_constants"] == before


def test_the_absmax_is_not_kept_over_its_share_of_the_budget_and_that_is_said_once(tiny_cfg, no_gpu, monkeypatch,
                                                                                    capsys):
    """keep_decoded_absmax's decision, with the GPU's parts stood in for (the tiny model's double-quantized weights
    live on the CPU here): over 2% of the budget nothing is decoded or kept and one line says so; without a budget
    every weight keeps its decoded absmax."""
    from nb_helpers import frontend

    model = _model(tiny_cfg, patched=False)
    states = [m.weight.quant_state for m in model.modules()
              if getattr(getattr(m, "weight", None), "quant_state", None) is not None]
    assert states and all(s.nested for s in states)
    weights = sum(s.shape.numel() for s in states)
    monkeypatch.setattr(frontend, "_SAID", set())
    monkeypatch.setattr(fused_lora, "_direct_kernels", lambda: (None, {}, lambda index: None))
    monkeypatch.setattr(fused_lora, "_double_quantized_on_gpu", lambda model: states)
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    decoded = []
    monkeypatch.setattr(fused_lora, "_decoded_absmax", lambda state, *a: decoded.append(state) or torch.zeros(1))
    too_small = 0.5 * (4 * weights / 64) / 0.02 / 2**30  # a budget twice too small for the share
    assert fused_lora.keep_decoded_absmax(model, too_small) == 0
    assert fused_lora.keep_decoded_absmax(model, too_small) == 0
    assert decoded == [] and not any(hasattr(s, fused_lora.DECODED_ABSMAX) for s in states)
    assert capsys.readouterr().out.count("absmax_once off") == 1
    assert fused_lora.keep_decoded_absmax(model, None) == len(states) == len(decoded)
    assert all(hasattr(s, fused_lora.DECODED_ABSMAX) for s in states)
