"""Chat templates render as transformers renders them: templates written the way the Qwen 3,
Gemma, Phi and OLMo 2 ones are (namespaces, reversed loops, loop controls, `tojson`, `trim`,
`raise_exception`, the `{% generation %}` tag, a system message folded into the first turn),
against transformers' `apply_chat_template` on the same tokenizer; and a refusal is one
TokenizerError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from engine.core.tokenizer import Tokenizer, TokenizerError

TEMPLATES = {
    # Qwen 3's shape: a namespace over the reversed messages, tools as JSON, thinking switch
    "qwen3-like": (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}"
        "{{- tool | tojson }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- set ns = namespace(last_user=messages|length - 1) %}"
        "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
        "{%- if message.role == 'user' %}{%- set ns.last_user = index %}{%- break %}{%- endif %}"
        "{%- endfor %}"
        "{%- for message in messages %}{%- set content = message.content %}"
        "{%- if message.role == 'assistant' and '</think>' in content %}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- if loop.index0 == ns.last_user %}{{- '<!-- last user -->' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
    ),
    # Gemma 3's shape: the system message folded into the first user turn, roles must alternate
    "gemma-like": (
        "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
        "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for message in turns -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
        "{%- endif -%}{%- set role = 'model' if message['role'] == 'assistant' "
        "else message['role'] -%}"
        "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}"
        "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
    ),
    # Phi's shape: role tags, the assistant's turns marked for training masks
    "phi-like": (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}"
        "{{ '<|assistant|>' }}{% generation %}{{ message['content'] }}{% endgeneration %}"
        "{{ '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + "
        "'<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
    ),
    # OLMo 2's shape: bos, newline-separated roles, the prompt after the last message
    "olmo-like": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
        "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% else %}"
        "{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}{% endif %}"
        "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
        "{% endfor %}"
    ),
}
CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "Be terse & <exact>."},
        {"role": "user", "content": "  Hi  "},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
        {"role": "user", "content": "Again?"},
    ],
]


def _write_tokenizer(directory: Path, template: str) -> None:
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "there": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>", "</s>"])
    raw.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_templates_render_as_transformers_renders_them(tmp_path: Path, name: str) -> None:
    from transformers import PreTrainedTokenizerFast

    _write_tokenizer(tmp_path, TEMPLATES[name])
    ours = Tokenizer(tmp_path)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    for chat in CHATS:
        want = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(chat) == want


def test_a_template_that_refuses_the_roles_is_one_clear_error(tmp_path: Path) -> None:
    _write_tokenizer(tmp_path, TEMPLATES["gemma-like"])
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TokenizerError, match=r"refused these messages: .*roles must alternate"):
        Tokenizer(tmp_path).render_chat(two_users)
