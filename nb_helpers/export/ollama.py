"""Ollama's Modelfile: the chat template in Go's template syntax, read off the tokenizer's own Jinja template and
checked against it, the stop tokens, the system prompt the model was trained with, and FROM (a GGUF) or FROM and
ADAPTER (the base's GGUF and the GGUF adapter over it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from nb_helpers.export.errors import ExportError

_PROBE = "\x00{}\x00"  # contents no template would write itself


@dataclass
class ChatFormat:
    """A chat template reduced to what Ollama's Go template needs: per-role text around each message's content,
    the text that opens the assistant's answer, and the system message inserted when none is given."""
    prefix: dict[str, str]
    suffix: str
    generation_prompt: str
    default_system: str | None = None
    stops: list[str] = field(default_factory=list)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """What the Go template produces, written in Python so it can be compared with the tokenizer's."""
        if self.default_system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}, *messages]
        text = "".join(self.prefix[m["role"]] + m["content"] + self.suffix for m in messages)
        return text + (self.generation_prompt if add_generation_prompt else "")


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_format(tokenizer) -> ChatFormat:
    """Read the per-message wrapping off the tokenizer's own chat template by rendering probe conversations, then
    check that wrapping reproduces the template on other conversations. Raises ExportError for templates that are
    not one fixed wrapping per message (those need a hand-written TEMPLATE)."""
    probe = {role: _PROBE.format(role) for role in ("system", "user", "assistant")}
    convo = [{"role": r, "content": probe[r]} for r in ("system", "user", "assistant")]
    try:
        text = _render(tokenizer, convo)
        with_prompt = _render(tokenizer, convo[:2], add_generation_prompt=True)
        without_system = _render(tokenizer, convo[1:])
    except Exception as e:  # noqa: BLE001 - a template that refuses the probe (e.g. no system role)
        raise ExportError(f"the chat template did not render a system/user/assistant conversation ({e}); write "
                          "the Modelfile's TEMPLATE by hand") from None
    by_hand = ("the chat template is not one fixed wrapping per message (it depends on position, role or content); "
               "write the Modelfile's TEMPLATE by hand")
    pieces = re.split("|".join(map(re.escape, probe.values())), text)
    if len(pieces) != 4 or [p for p in probe.values() if p in text] != list(probe.values()):
        raise ExportError(by_hand)
    head, after_system, after_user, suffix = pieces
    if not (after_system.startswith(suffix) and after_user.startswith(suffix)):
        raise ExportError(by_hand)
    prefix = {"system": head, "user": after_system[len(suffix):], "assistant": after_user[len(suffix):]}
    generation_prompt = with_prompt[len(_render(tokenizer, convo[:2])):]
    default_system = None
    if not without_system.startswith(prefix["user"]):  # the template inserts its own system message
        inserted = without_system[:without_system.index(prefix["user"] + probe["user"])]
        if inserted.startswith(prefix["system"]) and inserted.endswith(suffix):
            default_system = inserted[len(prefix["system"]):len(inserted) - len(suffix)]
    special = {t for t in tokenizer.all_special_tokens if t}
    stops = [t for t in special if t in suffix or prefix["user"].startswith(t)]
    fmt = ChatFormat(prefix, suffix, generation_prompt, default_system, sorted(stops))
    checks = [[{"role": "user", "content": "Hi"}],
              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]]
    for messages in checks:
        if fmt.render(messages) != _render(tokenizer, messages, add_generation_prompt=True):
            raise ExportError(by_hand)
    return fmt


def _go_string(text: str) -> str:
    """Literal text inside a Go template: only "{{" would be read as an action."""
    return text.replace("{{", '{{ "{{" }}')


def ollama_modelfile(tokenizer, gguf_name: str, system: str | None = None, adapter_name: str | None = None,
                     temperature: float = 0.0) -> str:
    """An Ollama Modelfile whose TEMPLATE is the tokenizer's chat template in Go template syntax. `system`: the
    system prompt the model was trained with (else the one the template inserts, if any); `adapter_name`: a GGUF
    adapter applied over `gguf_name`, which is then the base model's GGUF."""
    fmt = chat_format(tokenizer)
    roles = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{_go_string(fmt.prefix[role])}'
                    for i, role in enumerate(("system", "user", "assistant")))
    template = ("{{- range .Messages }}" + roles + "{{ end }}{{ .Content }}" + _go_string(fmt.suffix)
                + "{{ end }}" + _go_string(fmt.generation_prompt))
    lines = [f"FROM ./{gguf_name}"]
    if adapter_name:
        lines.append(f"ADAPTER ./{adapter_name}")
    lines.append(f'TEMPLATE """{template}"""')
    system = system if system is not None else fmt.default_system
    if system is not None:
        lines.append(f'SYSTEM """{system}"""')
    lines += [f'PARAMETER stop "{stop}"' for stop in fmt.stops]
    lines += ["# 0 is greedy, as the course scores answers; raise it for varied answers",  # Modelfile comments: own line
              f"PARAMETER temperature {temperature:g}"]
    return "\n".join(lines) + "\n"
