"""Ollama Modelfile for a written .gguf (and a VLM's mmproj): FROM, TEMPLATE (Go template) and stop PARAMETERs.

The HF chat template (Jinja) is recognised by its markers and replaced by the equivalent Ollama
template; an unrecognised template is left out with a comment (Ollama then uses the GGUF's own
tokenizer.chat_template when it can).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    name: str
    markers: tuple[str, ...]  # all must occur in the Jinja template
    template: str
    stops: tuple[str, ...]


CHATML = ChatFormat(
    "chatml", ("<|im_start|>", "<|im_end|>"),
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
    ("<|im_start|>", "<|im_end|>"),
)
LLAMA3 = ChatFormat(
    "llama3", ("<|start_header_id|>", "<|eot_id|>"),
    "{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
)
MISTRAL = ChatFormat(
    "mistral", ("[INST]", "[/INST]"),
    "{{- range .Messages }}{{- if eq .Role \"user\" }}[INST] {{ .Content }} [/INST]"
    "{{- else if eq .Role \"assistant\" }} {{ .Content }}</s>{{- end }}{{- end }}",
    ("[INST]", "[/INST]"),
)
TOY = ChatFormat(  # quantkit.toy.CHAT_TEMPLATE
    "quantkit-toy", ("<|{{ m['role'] }}|>", "<|assistant|>"),
    "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}</s>\n{{ end }}<|assistant|>\n",
    ("</s>", "<|user|>", "<|system|>"),
)
FORMATS = (CHATML, LLAMA3, MISTRAL, TOY)


def detect_format(chat_template: str | None) -> ChatFormat | None:
    if not chat_template:
        return None
    for fmt in FORMATS:
        if all(m in chat_template for m in fmt.markers):
            return fmt
    return None


def render(gguf_filename: str, chat_template: str | None, projector: str | None = None) -> str:
    """The Modelfile text (FROM is relative to the Modelfile's directory); a VLM's multimodal
    projector (mmproj .gguf) is a second FROM, which Ollama recognises by its `clip` architecture."""
    lines = [f"FROM ./{gguf_filename}", *([f"FROM ./{projector}"] if projector else []), ""]
    fmt = detect_format(chat_template)
    if fmt is None:
        note = "no chat template" if not chat_template else "chat template not recognised"
        lines.append(f"# TEMPLATE omitted: {note}; Ollama falls back to the GGUF's tokenizer.chat_template")
        return "\n".join(lines) + "\n"
    lines.append(f"# chat format: {fmt.name} (converted from the Hugging Face chat template)")
    lines.append(f'TEMPLATE """{fmt.template}"""')
    lines.append("")
    lines += [f'PARAMETER stop "{s}"' for s in fmt.stops]
    return "\n".join(lines) + "\n"


def read_chat_template(model_dir) -> str | None:
    """chat_template.jinja, or tokenizer_config.json's chat_template (string or default of a list)."""
    import json
    from pathlib import Path

    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template") if cfg.is_file() else None
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    return tpl
