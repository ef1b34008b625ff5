"""GGUF export, checked in a real runtime: every file is loaded by llama.cpp (llama-cpp-python, pinned in
requirements-test.txt) and must answer as transformers answers on the merged model.

Models: the embedded SmolLM2-135M with a random LoRA adapter merged into it (real weights, real tokenizer), and tiny
random models (hidden 64) of every family the course trains, built from tests/families.py. The Hub is out of reach
here. Qwen2.5 and Qwen3 carry Qwen2's real tokenizer, from llama.cpp's own vocabulary file in the pinned
llama-cpp-python source archive (families.real_tokenizer_dir); Llama's is SmolLM2's own (a Llama-architecture model).
Gemma 3, Phi-4-mini and SmolLM3 carry the embedded SmolLM2 tokenizer (byte-level BPE, llama.cpp's "smollm"
pre-tokenizer) as a stand-in: no package within reach ships theirs.
"""

import json
import resource
import shutil
import subprocess
import sys

import pytest

from nb_helpers.export import (ExportError, chat_format, check_file, merge_lora, ollama_modelfile, open_gguf,
                               plain_byte_level, quantize_gguf, reference_tokens, write_adapter_gguf, write_gguf)

# TinyLlama-1.1B-Chat's template (Zephyr style), the GPU default's: written out, since tests never reach the Hub
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
N_TOKENS = 32  # the first 32 answer tokens are compared
SYSTEM = "You turn shop orders into JSON."


@pytest.fixture(scope="module")
def llama_cpp():
    from nb_helpers.export.runtime import llama_cpp_missing, require_llama_cpp

    if llama_cpp_missing():
        pytest.skip(llama_cpp_missing())
    return require_llama_cpp()  # imported here: it sets llama.cpp's OpenMP threads to wait without spinning first


@pytest.fixture(scope="module")
def prompts():
    from nb_helpers.config import RunConfig
    from nb_helpers.data import load_rows

    return [r["prompt"] for r in load_rows("data/eval.jsonl", RunConfig(), 5)]


@pytest.fixture(scope="module")
def smol(embedded_dir, tmp_path_factory, prompts):
    """The embedded SmolLM2 with a random rank-8 adapter on q/v merged in, its transformers answers (fp32)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nb_helpers.models import load_tokenizer

    folder = tmp_path_factory.mktemp("smol")
    base = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # B starts at 0; a nonzero B makes the adapter change answers
    model.save_pretrained(folder / "adapter")
    load_tokenizer(str(embedded_dir)).save_pretrained(folder / "adapter")
    merged = merge_lora(embedded_dir, folder / "adapter", folder / "merged")
    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    tokens = reference_tokens(reference, load_tokenizer(str(merged)), prompts, N_TOKENS)
    return {"folder": folder, "merged": merged, "reference": tokens}


@pytest.fixture(scope="module")
def smol_files(smol, llama_cpp):
    gguf = smol["folder"] / "gguf"
    files = {"f16": write_gguf(smol["merged"], gguf / "smol-f16.gguf", "f16", log=lambda *a: None)}
    for kind in ("q8_0", "q4_k_m"):  # as notebook 05 and the CLI make them: from the F16 file
        files[kind] = quantize_gguf(files["f16"], gguf / f"smol-{kind}.gguf", kind)
    return files


@pytest.mark.slow
def test_f16_and_q8_0_run_in_llama_cpp_as_the_merged_model_runs_in_transformers(smol, smol_files, prompts):
    """F16: the same first 32 tokens on at least 4 of 5 prompts; Q8_0: at least 90% of the tokens. Both: the file's
    tokenizer and chat template give the prompt tokens transformers gives."""
    f16 = check_file(smol["reference"], smol_files["f16"], prompts)
    assert f16.same_prompt_tokens == 5 and f16.same_answers >= 4, f16.line()
    q8 = check_file(smol["reference"], smol_files["q8_0"], prompts)
    assert q8.same_prompt_tokens == 5 and q8.token_rate >= 0.9, q8.line()
    assert f16.passed("f16") and q8.passed("q8_0")
    llm = open_gguf(smol_files["f16"])
    try:  # what llama.cpp's converter decides for SmolLM2's tokenizer (hash of its output), not "gpt2"
        assert (llm.metadata["tokenizer.ggml.model"], llm.metadata["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
        assert "<|im_start|>" in llm.metadata["tokenizer.chat_template"]
    finally:
        llm.close()


@pytest.mark.slow
def test_q4_k_m_is_llama_cpps_quantizer_output_smaller_than_q8_0_and_answers(smol, smol_files, prompts):
    sizes = {kind: path.stat().st_size for kind, path in smol_files.items()}
    assert sizes["q4_k_m"] < 0.8 * sizes["q8_0"] < 0.8 * sizes["f16"], sizes
    q4 = check_file(smol["reference"], smol_files["q4_k_m"], prompts)
    assert q4.same_prompt_tokens == 5 and q4.passed("q4_k_m") is None  # reported, not required
    assert q4.token_rate > 0.3, q4.line()  # 4-bit rounding changes answers, not into noise


@pytest.mark.slow
def test_the_adapter_as_gguf_over_the_base_answers_as_the_merged_model(smol, smol_files, embedded_dir, prompts):
    gguf = smol["folder"] / "gguf"
    base = write_gguf(embedded_dir, gguf / "base-f16.gguf", "f16", log=lambda *a: None)
    adapter = write_adapter_gguf(smol["folder"] / "adapter", embedded_dir, gguf / "adapter-f16.gguf",
                                 log=lambda *a: None)
    assert adapter.stat().st_size < 0.05 * base.stat().st_size  # rank 8 on q/v: about 1% of the model
    over_base = check_file(smol["reference"], base, prompts, lora_path=adapter)
    assert over_base.passed("adapter"), over_base.line()
    alone = check_file(smol["reference"], base, prompts)  # the base without it answers otherwise: the adapter acts
    assert alone.same_answers < over_base.same_answers, (alone.line(), over_base.line())


def tiny_family_model(family: str, tokenizer_dir, folder):
    """A tiny random model of the family (bf16, as training saves it) with the family's real tokenizer where a package
    ships one (families.REAL_TOKENIZERS), else the SmolLM2 tokenizer at `tokenizer_dir`."""
    import torch
    from transformers import AutoTokenizer

    from families import REAL_TOKENIZERS, build, real_tokenizer_dir, tiny_config

    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_dir(family) if family in REAL_TOKENIZERS else tokenizer_dir)
    changes = {}
    if family == "gemma3_text":  # Gemma 3's real pattern, five sliding-window layers then one global: llama.cpp
        changes = {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    torch.manual_seed(0)
    model = build(tiny_config(family, vocab=len(tokenizer), **changes), "cpu").to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if family == "phi3":  # Phi-4-mini's tokenizer_config says GPT2Tokenizer, which llama.cpp reads as byte-level BPE
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    return model.float(), tokenizer


ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3", "phi3": "phi3",
        "smollm3": "smollm3"}
STAND_IN = "qwen2-with-smollm2-tokenizer"  # a tokenizer llama.cpp does not know, in a qwen2 folder


@pytest.fixture(scope="module")
def family_exports(llama_cpp, tokenizer_dir, tmp_path_factory):
    """Every family's tiny model and its F16 GGUF (or the converter's ExportError). The models are built one after
    the other; llama.cpp's converter, a Python process that mostly imports, runs for all of them at once, one per core."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from transformers import AutoTokenizer

    from families import build, tiny_config

    folder = tmp_path_factory.mktemp("families")
    built = {family: tiny_family_model(family, tokenizer_dir, folder / family) for family in ARCH}
    stand_in = AutoTokenizer.from_pretrained(tokenizer_dir)  # SmolLM2's vocabulary, which transformers 5 gives
    build(tiny_config("qwen2", vocab=len(stand_in)), "cpu").to(torch.bfloat16).save_pretrained(folder / STAND_IN)
    stand_in.save_pretrained(folder / STAND_IN)  # Qwen2's own pre-tokenizer split in a qwen2 folder

    def convert(name):
        try:
            return write_gguf(folder / name, folder / f"{name}.gguf", "f16", log=lambda *a: None)
        except ExportError as e:
            return e

    names = [*ARCH, STAND_IN]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        files = dict(zip(names, pool.map(convert, names)))
    return {name: (*built.get(name, (None, None)), files[name]) for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(ARCH))
def test_every_family_exports_with_its_own_architecture_and_runs_in_llama_cpp(family, family_exports):
    """llama.cpp's logits at every prompt position within 0.01 of transformers' (random weights: the logits spread
    about 0.16, so 0.01 is 6% of it; measured gaps are 3e-4 to 1.2e-3) and the same prompt tokens."""
    import numpy as np
    import torch

    from nb_helpers.export.runtime import chat_tokens, prompt_logits

    model, tokenizer, path = family_exports[family]
    if isinstance(path, Exception):
        raise path
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Order 12 mugs, größe L, Tunis."}]
    llm = open_gguf(path, logits_all=True)
    try:
        assert llm.metadata["general.architecture"] == ARCH[family]
        if family in ("qwen2", "qwen3"):  # Qwen2's real tokenizer, recognized by llama.cpp's own hash table
            assert (len(tokenizer), llm.metadata["tokenizer.ggml.pre"]) == (151936, "qwen2")
        ours = chat_tokens(llm, messages)
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]
        assert ours == ids
        cpp = prompt_logits(llm, ours)
    finally:
        llm.close()
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(cpp - hf).max() < 0.01, f"{family}: largest logit gap {np.abs(cpp - hf).max():.4f}"


@pytest.mark.slow
def test_a_tokenizer_llama_cpp_does_not_know_is_refused_by_its_own_check(family_exports):
    """SmolLM2's vocabulary in a qwen2 folder: transformers 5 gives any tokenizer there Qwen2's own pre-tokenizer
    split, a tokenizer no model ships. llama.cpp's converter identifies tokenizers by a hash of their output and
    refuses one it does not know (Qwen2's real one is in its table as "qwen2": the test above exports it): the export
    stops with its words, not with a file that would tokenize wrongly."""
    refused = family_exports[STAND_IN][2]
    assert isinstance(refused, ExportError) and "pre-tokenizer was not recognized" in str(refused), refused


def test_the_byte_level_rewrite_encodes_and_decodes_exactly_as_the_saved_tokenizer(tokenizer_dir, tmp_path):
    """The embedded tokenizer.json (made by transformers' GGUF reader) carries SentencePiece's byte fallback; the
    converter is given the plain byte-level version, which must be the same tokenizer."""
    from tokenizers import Tokenizer

    saved = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    plain = plain_byte_level(saved)
    assert plain is not None and plain["model"]["byte_fallback"] is False and plain_byte_level(plain) is None
    before, after = Tokenizer.from_str(json.dumps(saved)), Tokenizer.from_str(json.dumps(plain))
    texts = ["Order 12 mugs, größe L.", "  two  spaces\n\nand\ttabs ", "émoji 🙂 漢字 ▁ <0x41>", "<|im_start|>user\nHi",
             (tokenizer_dir / "tokenizer_config.json").read_text()]
    for text in texts:
        ids = before.encode(text).ids
        assert after.encode(text).ids == ids and after.decode(ids) == before.decode(ids), text


def test_streaming_merge_equals_peft_merge_and_unload(shared_run, tiny_model_dir, tmp_path):
    """W + (alpha/r) B A on every adapted weight, within one bf16 rounding of PEFT's own merge."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter = shared_run[1] / "adapter"
    ours = load_file(merge_lora(tiny_model_dir, adapter, tmp_path / "merged") / "model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    theirs = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    original = load_file(tiny_model_dir / "model.safetensors")
    changed = [n for n in ours if not torch.equal(ours[n], original[n])]
    assert len(changed) == 2 * 4, changed  # 2 layers x q, k, v, o: the shared run's target modules
    for name, weight in ours.items():
        gap = (weight.float() - theirs[name].float()).abs().max() / theirs[name].float().abs().max()
        assert weight.dtype == torch.bfloat16 and gap <= 2 ** -7, name
    assert (tmp_path / "merged" / "tokenizer.json").exists() and (tmp_path / "merged" / "config.json").exists()


@pytest.mark.slow
def test_the_merge_holds_one_weight_not_the_model(embedded_dir, tmp_path):
    """Peak RSS of a merge of the embedded model: torch's import plus little, well under its 257 MiB of bf16 weights
    that PEFT's merge_and_unload holds (and an fp32 check twice that). The process is measured on its own."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(embedded_dir)),
                               LoraConfig(r=8, target_modules="all-linear"))
    model.save_pretrained(tmp_path / "adapter", state_dict={k: torch.zeros(v.shape) for k, v in
                                                           model.state_dict().items() if "lora_" in k})
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "adapter")
    shutil.copy(embedded_dir / "tokenizer_config.json", tmp_path / "adapter")
    code = ("import resource, sys, torch, safetensors, transformers; from nb_helpers.export import merge_lora;"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
            f"merge_lora({str(embedded_dir)!r}, {str(tmp_path / 'adapter')!r}, {str(tmp_path / 'merged')!r});"
            "print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    before_kib, peak_kib = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True).stdout.split()[-2:])
    assert (peak_kib - before_kib) * 1024 < 150 * 2**20, f"the merge added {(peak_kib - before_kib) / 1024:.0f} MiB"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


def test_export_command_merges_writes_checks_in_llama_cpp_and_writes_modelfiles(shared_run, cli, tmp_path,
                                                                                llama_cpp):
    run_dir = shutil.copytree(shared_run[1], tmp_path / "run")  # the shared run stays as other tests expect it
    result = cli("export", "--run", run_dir, "--gguf", "f16,q4_k_m", "--prompts", "2")
    assert (run_dir / "merged" / "model.safetensors").exists()
    gguf = run_dir / "gguf"
    assert (gguf / "run-f16.gguf").exists() and (gguf / "run-q4_k_m.gguf").exists()
    assert (gguf / "run-adapter-f16.gguf").exists() and "in llama.cpp: same answer tokens as transformers" in result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
    modelfile = (gguf / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./run-q4_k_m.gguf") and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert f'SYSTEM """{SYSTEM}"""' in modelfile  # the system prompt it was trained with, not SmolLM's default
    adapter_file = (gguf / "Modelfile.adapter").read_text().splitlines()
    assert adapter_file[0].startswith("FROM ./base-") and adapter_file[1] == "ADAPTER ./run-adapter-f16.gguf"
    assert cli("export", "--run", run_dir, "--gguf", "q4_k").returncode == 2


def test_modelfile_template_is_the_tokenizers_chat_template_in_go_syntax(tokenizer_dir):
    from nb_helpers.models import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    modelfile = ollama_modelfile(tokenizer, "m.gguf")
    assert ('TEMPLATE """{{- range .Messages }}{{ if eq .Role "system" }}<|im_start|>system\n'
            '{{ else if eq .Role "user" }}<|im_start|>user\n{{ else if eq .Role "assistant" }}<|im_start|>assistant\n'
            '{{ end }}{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"""') in modelfile
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in modelfile  # what the template inserts
    assert f'SYSTEM """{SYSTEM}"""' in ollama_modelfile(tokenizer, "m.gguf", system=SYSTEM, adapter_name="a.gguf")
    tokenizer.chat_template = ZEPHYR
    fmt = chat_format(tokenizer)
    assert fmt.prefix == {"system": "<|system|>\n", "user": "<|user|>\n", "assistant": "<|assistant|>\n"}
    assert (fmt.suffix, fmt.default_system, fmt.stops) == (tokenizer.eos_token + "\n", None, [tokenizer.eos_token])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] if loop.first else m['content'] | upper }}{% endfor %}"
    with pytest.raises(ExportError, match="by hand"):
        chat_format(tokenizer)


def test_unsupported_architectures_kinds_and_pickles_are_refused_with_the_fix(tmp_path, llama_cpp):
    from safetensors.torch import save_file
    import torch

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MadeUpForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ExportError, match="no \\*.safetensors files .*pickled .bin weights are never converted"):
        write_gguf(tmp_path, tmp_path / "x.gguf")
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ExportError, match="convert_hf_to_gguf.py stopped: .*MadeUpForCausalLM"):
        write_gguf(tmp_path, tmp_path / "x.gguf")
    with pytest.raises(ExportError, match="q8_0"):
        write_gguf(tmp_path, tmp_path / "x.gguf", "q4_k")
