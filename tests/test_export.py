"""GGUF export: the file must read back (transformers, gguf_file=) as the same model, tokenizer and answers."""

import json
import shutil

import pytest

from nb_helpers.export import ExportError, chat_format, load_gguf, ollama_modelfile, write_gguf

# TinyLlama-1.1B-Chat's template (Zephyr style), the GPU default's: written out, since tests never reach the Hub
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")


@pytest.mark.slow
def test_f16_gguf_of_the_embedded_model_round_trips(embedded_dir, tmp_path):
    """Same weights, same tokens, same chat template and the same greedy answers, read back by transformers alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from nb_helpers.config import RunConfig
    from nb_helpers.data import load_rows
    from nb_helpers.export import greedy_agreement
    from nb_helpers.task_metric import generate
    from nb_helpers.models import load_tokenizer

    path = write_gguf(embedded_dir, tmp_path / "gguf" / "smollm2-f16.gguf", "f16")  # a folder not made yet, as in 05
    model, tokenizer = load_gguf(path)
    reference = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    theirs = model.state_dict()
    for name, weight in reference.state_dict().items():  # q/k too: transformers undoes the rotary reordering
        assert torch.equal(weight, theirs[name]), f"{name} changed in the GGUF"
    ours = load_tokenizer(str(embedded_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Order 12 mugs, größe L."}]
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert tokenizer(text)["input_ids"] == ours(text)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.pad_token) == (ours.eos_token, ours.pad_token)
    prompts = [r["prompt"] for r in load_rows("data/eval.jsonl", RunConfig(), 2)]
    agreement = greedy_agreement(generate(reference, ours, prompts, max_new_tokens=12), (model, tokenizer), prompts,
                                 max_new_tokens=12)
    assert agreement["agree"] == agreement["total"] == 2, agreement["pairs"]


def test_export_command_merges_writes_checks_and_writes_a_modelfile(shared_run, cli, tmp_path):
    run_dir = shutil.copytree(shared_run[1], tmp_path / "run")  # the shared run stays as other tests expect it
    result = cli("export", "--run", run_dir, "--gguf", "q8_0", "--prompts", "2")
    assert result.returncode == 0, result.stderr
    assert (run_dir / "merged" / "model.safetensors").exists()
    gguf_file = run_dir / "gguf" / "run-q8_0.gguf"
    assert gguf_file.exists() and "greedy answers agree with the merged model on" in result.stdout
    # Q8_0 stores 34 bytes per 32 weights where the merged model stores 64 (bf16)
    assert gguf_file.stat().st_size < 0.7 * (run_dir / "merged" / "model.safetensors").stat().st_size
    modelfile = (run_dir / "gguf" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./run-q8_0.gguf") and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert cli("export", "--run", run_dir, "--gguf", "q4_k").returncode == 2


def test_modelfile_template_is_the_tokenizers_chat_template_in_go_syntax(tokenizer_dir):
    from nb_helpers.models import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    modelfile = ollama_modelfile(tokenizer, "m.gguf")
    assert ('TEMPLATE """{{- range .Messages }}{{ if eq .Role "system" }}<|im_start|>system\n'
            '{{ else if eq .Role "user" }}<|im_start|>user\n{{ else if eq .Role "assistant" }}<|im_start|>assistant\n'
            '{{ end }}{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"""') in modelfile
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in modelfile  # what the template inserts
    tokenizer.chat_template = ZEPHYR
    fmt = chat_format(tokenizer)
    assert fmt.prefix == {"system": "<|system|>\n", "user": "<|user|>\n", "assistant": "<|assistant|>\n"}
    assert (fmt.suffix, fmt.default_system, fmt.stops) == (tokenizer.eos_token + "\n", None, [tokenizer.eos_token])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] if loop.first else m['content'] | upper }}{% endfor %}"
    with pytest.raises(ExportError, match="by hand"):
        chat_format(tokenizer)


def test_other_architectures_are_refused_with_the_alternative(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ExportError, match="convert_hf_to_gguf.py"):
        write_gguf(tmp_path, tmp_path / "x.gguf")
    with pytest.raises(ExportError, match="q8_0"):
        write_gguf(tmp_path, tmp_path / "x.gguf", "q4_k")
