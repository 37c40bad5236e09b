"""Chat templates as models ship them, read from the packages in the lock, and their oracles.

Each template comes unmodified from an installed package (none is written here):
- qwen3: vLLM's `template_minicpmv45.jinja`, Qwen3's template logic (last_query_index, think
  blocks after the last query, reasoning dropped from history, newline trimming);
- chatml: vLLM's `template_chatml.jinja` (no end token after a final assistant turn);
- deepseek: vLLM's `template_deepseek_vl2.jinja` (plain-text headers, eos_token ends a turn);
- llama4: transformers' Llama-4 processor template (header tokens, `<|eot|>`);
- mistral, mistral-v7: the templates mistral_common generates for a v11 (Mistral-Small-3.x) and
  a v7 tokenizer (calls after the content: `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`, and
  `[TOOL_CALLS][{"name": ..., "arguments": ..., "id": ...}]`);
- qwen3-0.6b, llama3, gpt_oss, mistral-small-3.2: the templates of Qwen3-0.6B (every Qwen3's),
  Llama-3.3-70B-Instruct (Llama-3.1's text), gpt-oss-120b and Mistral-Small-3.2-24B-Instruct-2506
  as their Hub repositories ship them, in llama.cpp's verbatim copies that llama-cpp-python's
  source archive carries (requirements/templates.txt; `make venv` downloads it to .venv/wheels,
  never builds or installs it, and they are read out of the archive).
`oracle(name, ...)` is a copy with `{% generation %}` placed around each assistant turn's
content and end token (a text edit of the shipped template; every edit must apply exactly once,
so a changed upstream template fails loudly), read through transformers'
`return_assistant_tokens_mask`. The qwen3 copy leaves an empty think block outside the block
unless it is kept, and a think opener the generation prompt writes (enable_thinking) too.
`tokenizer(name, dir)` is the tiny test BPE with that family's special and added tokens (the
ones the family's own tokenizer has, so the rule sees `[TOOL_CALLS]` or `<|python_tag|>` as the
model does).
"""

from __future__ import annotations

import functools
import sys
import tarfile
from pathlib import Path

from eagle_fast import tiny

SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))
SPECIALS = {
    "qwen3": (["<|im_start|>", "<|im_end|>"], ["<think>", "</think>", "<tool_call>", "</tool_call>"],
              {"eos_token": "<|im_end|>"}),
    "chatml": (["<|im_start|>", "<|im_end|>"], [], {"eos_token": "<|im_end|>"}),
    "deepseek": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"], [],
                 {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}),
    "llama4": (["<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|python_start|>",
                "<|python_end|>"], [],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>"}),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]", "[TOOL_RESULTS]", "[TOOL_CONTENT]",
                 "[/TOOL_RESULTS]"], [], {"bos_token": "<s>", "eos_token": "</s>"}),
    "mistral-v7": (["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[TOOL_CONTENT]", "[/TOOL_RESULTS]"], [],
                   {"bos_token": "<s>", "eos_token": "</s>"}),
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"], [], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "gpt_oss": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"],
                [], {"eos_token": "<|return|>"}),
    "qwen3-0.6b": (["<|im_start|>", "<|im_end|>"], ["<think>", "</think>", "<tool_call>", "</tool_call>",
                                                    "<tool_response>", "</tool_response>"], {"eos_token": "<|im_end|>"}),
    "mistral-small-3.2": (["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
                           "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]", "[TOOL_RESULTS]",
                           "[TOOL_CONTENT]", "[/TOOL_RESULTS]", "[IMG]"], [], {"bos_token": "<s>", "eos_token": "</s>"}),
}
LLAMA_CPP_TEMPLATES = {"qwen3-0.6b": "Qwen-Qwen3-0.6B.jinja", "llama3": "meta-llama-Llama-3.3-70B-Instruct.jinja",
                       "gpt_oss": "openai-gpt-oss-120b.jinja",
                       "mistral-small-3.2": "Mistral-Small-3.2-24B-Instruct-2506.jinja"}


def shipped(name: str) -> str:
    """The template text as its package ships it."""
    if name in ("qwen3", "chatml", "deepseek"):
        file = {"qwen3": "template_minicpmv45.jinja", "chatml": "template_chatml.jinja",
                "deepseek": "template_deepseek_vl2.jinja"}[name]
        return (SITE / "vllm" / "transformers_utils" / "chat_templates" / file).read_text()
    if name == "llama4":
        from transformers.models.llama4 import processing_llama4

        return processing_llama4.chat_template
    if name in ("mistral", "mistral-v7"):
        from mistral_common.integrations.chat_templates.chat_templates import generate_chat_template
        from mistral_common.tokens.tokenizers.base import TokenizerVersion

        return generate_chat_template(
            spm=False, tokenizer_version=TokenizerVersion.v11 if name == "mistral" else TokenizerVersion.v7,
            image_support=False, audio_support=False,
            thinking_support=False, default_system_prompt=None, plain_thinking_support=False,
            use_special_token_variables=True, model_settings_fields=None, reasoning_effort_values=None,
            reasoning_effort_default=None)
    if name in LLAMA_CPP_TEMPLATES:
        return _from_llama_cpp()[LLAMA_CPP_TEMPLATES[name]]
    raise KeyError(name)


@functools.lru_cache(maxsize=1)
def _from_llama_cpp() -> dict[str, str]:
    """The templates of LLAMA_CPP_TEMPLATES, read out of llama-cpp-python's source archive."""
    archives = sorted((Path(sys.prefix) / "wheels").glob("llama_cpp_python-*.tar.gz"))
    assert archives, f"no llama-cpp-python archive in {Path(sys.prefix) / 'wheels'}: run `make venv` (requirements/templates.txt)"
    want, found = set(LLAMA_CPP_TEMPLATES.values()), {}
    with tarfile.open(archives[-1]) as archive:
        for member in archive:
            folder, _, file = member.name.rpartition("/")
            if folder.endswith("/vendor/llama.cpp/models/templates") and file in want:
                found[file] = archive.extractfile(member).read().decode("utf-8")
    assert set(found) == want, f"{archives[-1].name} lacks {sorted(want - set(found))}"
    return found


def tokenizer(name: str, directory: Path):
    """The tiny BPE with the family's special tokens (and added ones, as Qwen3's <think>)."""
    tok = tiny.build_tokenizer(directory, 600)
    specials, added, roles = SPECIALS[name]
    tok.add_special_tokens({"additional_special_tokens": specials, **roles})
    if added:
        tok.add_tokens(added)
    tok.chat_template = shipped(name)
    return tok


def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the shipped template changed: {old[:60]!r} found {text.count(old)} times"
    return text.replace(old, new)


def _mark_after(t: str, head: str, start: str, end: str, after: str) -> str:
    """`t` with what it writes between `start` and `end` (the text before `after`) captured, and
    all of it after its first len(head) characters (the header) in a generation block."""
    t = _edit(t, start, start + "{%- set body %}")
    n = len(head)
    return _edit(t, end + after, end + f"{{%- endset %}}{{{{- body[:{n}] }}}}{{%- generation %}}{{{{- body[{n}:] }}}}"
                 "{%- endgeneration %}" + after)


_QWEN_FULL = ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + REASONING.strip('\\n') + '\\n</think>\\n\\n' "
              "+ content.lstrip('\\n') }}")
_QWEN_PLAIN = "{{- '<|im_start|>' + message.role + '\\n' + content }}"


def oracle(name: str, *, keep_empty_think: bool = False, prompt_think: bool = False) -> str:
    """The marked copy of `shipped(name)`; prompt_think: the generation prompt writes <think>\\n."""
    t = shipped(name)
    if name in ("qwen3", "qwen3-0.6b"):
        var = "reasoning" if name == "qwen3" else "reasoning_content"  # what each calls the think text
        empty = f"not {var}.strip('\\n')" if not keep_empty_think else "false"
        block, opener = len("<think>\n\n</think>\n\n"), len("<think>\n") if prompt_think else 0
        cut = f"({block} if ({empty}) else {opener})"
        t = _edit(t, _QWEN_FULL.replace("REASONING", var),
                  f"{{%- set ns.full = '<think>\\n' + {var}.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') %}}"
                  f"{{%- set ns.head = '<|im_start|>' + message.role + '\\n' + ns.full[:{cut}] %}}"
                  f"{{%- set ns.body = ns.full[{cut}:] %}}")
        t = t.replace(_QWEN_PLAIN, "{%- set ns.head = '<|im_start|>' + message.role + '\\n' %}{%- set ns.body = content %}")
        t = _edit(t, "        {%- if message.tool_calls %}",
                  "        {{- ns.head }}{%- generation %}{{- ns.body }}\n        {%- if message.tool_calls %}")
        return _edit(t, "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
                     "        {{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}")
    if name == "chatml":
        return _edit(t, "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] -}}\n"
                        "    {%- if (loop.last and add_generation_prompt) or not loop.last -%}\n"
                        "        {{- '<|im_end|>' + '\\n' -}}\n    {%- endif -%}",
                     "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
                     "{%- set body -%}{{- message['content'] -}}{%- if (loop.last and add_generation_prompt) or "
                     "not loop.last -%}{{- '<|im_end|>' -}}{%- endif -%}{%- endset -%}"
                     "{%- if message['role'] == 'assistant' -%}{%- generation -%}{{- body -}}{%- endgeneration -%}"
                     "{%- else -%}{{- body -}}{%- endif -%}"
                     "{%- if (loop.last and add_generation_prompt) or not loop.last -%}{{- '\\n' -}}{%- endif -%}")
    if name == "deepseek":
        return _edit(t, "{{ '<|Assistant|>: ' + message['content'] + eos_token + '\\n\\n' }}",
                     "{{ '<|Assistant|>: ' }}{% generation %}{{ message['content'] + eos_token }}"
                     "{% endgeneration %}{{ '\\n\\n' }}")
    if name == "llama4":
        start = "        {%- if message['content'] is string %}\n            {{- message['content'] }}"
        end = "        {{- \"<|eot|>\" }}\n    {%- elif 'tool_calls' in message"
        i, j = t.index(start), t.index(end) + len("        {{- \"<|eot|>\" }}")
        assert t.count(start) == 2, "the shipped template changed"
        body = t[i:j]
        t = (t[:i] + "{%- set body %}" + body + "{%- endset %}{%- if message['role'] == 'assistant' %}"
             "{%- generation %}{{- body }}{%- endgeneration %}{%- else %}{{- body }}{%- endif %}" + t[j:])
        # a turn that calls tools: from its <|python_start|> through its calls and <|eot|>
        t = _edit(t, "       {{- '<|python_start|>' }}", "       {%- generation %}{{- '<|python_start|>' }}")
        return _edit(t, "       {{- \"<|eot|>\" }}\n    {%- elif message.role == \"tool\"",
                     "       {{- \"<|eot|>\" }}{%- endgeneration %}\n    {%- elif message.role == \"tool\"")
    if name in ("mistral", "mistral-v7"):
        t = _edit(t, "        {%- if message['content'] %}\n            {{- render_content(content=message['content'], "
                     "context_name='assistant message contents') -}}",
                  "        {%- generation %}{%- if message['content'] %}\n            {{- render_content("
                  "content=message['content'], context_name='assistant message contents') -}}")
        return _edit(t, "        {{- eos_token }}\n", "        {{- eos_token }}{%- endgeneration %}\n")
    if name == "llama3":
        # a text turn: its content and <|eot_id|> after the header
        t = _edit(t, "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
                     "+ '<|eot_id|>' }}",
                  "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
                  "{%- if message['role'] == 'assistant' %}{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
                  "{%- endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}")
        # a call turn: everything after its header, through <|eot_id|> (or <|eom_id|>)
        return _mark_after(t, "<|start_header_id|>assistant<|end_header_id|>\n\n",
                           "{%- set tool_call = message.tool_calls[0].function %}",
                           "        {%- endif %}", "\n    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}")
    if name == "gpt_oss":
        # an assistant turn: all it writes after `<|start|>assistant`, the generation prompt (its
        # analysis, its call or final message, and the <|start|>assistant between them)
        return _mark_after(t, "<|start|>assistant", "    {%- if message.role == 'assistant' -%}", "",
                           "\n    {%- elif message.role == 'tool' -%}")
    if name == "mistral-small-3.2":
        # an assistant turn: all it writes (no header): its content or its calls, and </s>
        t = _edit(t, "    {%- elif message['role'] == 'assistant' %}",
                  "    {%- elif message['role'] == 'assistant' %}{%- generation %}")
        return _edit(t, "\n    {%- elif message['role'] == 'tool_results' or message['role'] == 'tool' %}",
                     "{%- endgeneration %}\n    {%- elif message['role'] == 'tool_results' or message['role'] == 'tool' %}")
    raise KeyError(name)


def oracle_mask(tok, messages: list[dict], template: str, **kwargs) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kwargs)
    return list(out["input_ids"]), [int(bool(v)) for v in out["assistant_masks"]]
