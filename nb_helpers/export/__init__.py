"""Taking the trained model out of Python, into the runtimes people use (llama.cpp, Ollama, LM Studio):

  merge        the adapter folded into its base, one weight at a time (host RAM: one matrix, not the model)
  convert      GGUF files by llama.cpp's own scripts (F16, Q8_0) and quantizer (Q4_K_M); the adapter as a GGUF
  llama_cpp_code  where those scripts come from: the llama-cpp-python source archive of the installed version
  runtime      llama.cpp itself (llama-cpp-python) loading a file, with or without the adapter, answering greedily
  check        llama.cpp's answers against transformers' on the merged model
  ollama       the Modelfile: the chat template in Go syntax, stop tokens, the trained system prompt
  pipeline     all of it, as `python -m nb_helpers export` and notebook 05 run it
"""

from nb_helpers.export.check import Agreement, check_file, reference_tokens
from nb_helpers.export.convert import (GGUF_KINDS, plain_byte_level, quantize_gguf, write_adapter_gguf,
                                       write_gguf)
from nb_helpers.export.errors import ExportError
from nb_helpers.export.merge import merge_adapter, merge_lora
from nb_helpers.export.ollama import ChatFormat, chat_format, ollama_modelfile
from nb_helpers.export.pipeline import ExportResult, export_gguf, trained_system_prompt
from nb_helpers.export.runtime import llama_cpp_answers, llama_cpp_missing, open_gguf

__all__ = ["Agreement", "ChatFormat", "ExportError", "ExportResult", "GGUF_KINDS", "chat_format", "check_file",
           "export_gguf", "llama_cpp_answers", "llama_cpp_missing", "merge_adapter", "merge_lora", "ollama_modelfile",
           "open_gguf", "plain_byte_level", "quantize_gguf", "reference_tokens", "trained_system_prompt",
           "write_adapter_gguf", "write_gguf"]
