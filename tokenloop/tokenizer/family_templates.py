"""Chat templates for families whose GGUF files often ship none (llama.cpp falls back to built-in ones
the same way). A registry row names its family's template here; a file's own template always wins."""

from __future__ import annotations

# Gemma's turns: <start_of_turn>user|model, the text, <end_of_turn>. Gemma has no system role: system text
# opens the next user turn.
GEMMA = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' + ns.system"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

TEMPLATES: dict[str, str] = {"gemma": GEMMA}
