"""`Tokenizer`: a Hugging Face tokenizer without transformers (which imports torch).

The one tokenizer of the daemon and of `LLM`: prompts encode and outputs decode the same
way offline and online.

Loads `tokenizer.json` with the `tokenizers` library and renders the chat
template from `tokenizer_config.json` (or `chat_template.jinja`) with jinja2's
sandbox, the way transformers' `apply_chat_template` does: the same extensions (loop controls,
the `{% generation %}` tag), `tojson` without HTML escaping, `raise_exception` and
`strftime_now`, so the templates of Qwen, Gemma, Phi and OLMo render as they do there.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

from base.errors import UserError
from engine.core.detokenizer import Stepper, byte_level_stepper


class TokenizerError(UserError):
    """The model directory has no usable tokenizer, or a chat cannot be rendered."""


def _token_text(value: Any) -> str | None:
    """Special tokens appear as strings or as {"content": str, ...} in tokenizer_config.json."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _byte_chars() -> list[str]:
    """The character that stands for each byte in a byte-level vocabulary (GPT-2's scheme):
    the printable Latin-1 bytes stand for themselves, the others, in byte order, for the
    characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


ByteTable = tuple[list[str | None], dict[int, bytes]]


def byte_level_table(tokenizer: HFTokenizer) -> ByteTable | None:
    """The table `byte_level_stepper` reads, for a tokenizer whose decoder is byte-level
    alone (None for any other). A token is its characters' bytes, or, with a character
    outside the byte alphabet (an added token's), its UTF-8, as the decoder takes it; a
    special token is skipped. Each token's text is checked against the tokenizer's own
    decode of it: any difference, and there is no table."""
    if not isinstance(tokenizer.decoder, ByteLevel):
        return None
    chars = _byte_chars()
    to_latin1 = str.maketrans({c: chr(b) for b, c in enumerate(chars)})
    outside = str.maketrans(dict.fromkeys(chars))  # deletes the alphabet: what remains is not
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    pieces = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        if i not in special:
            bytewise = not token.translate(outside)
            pieces[i] = token.translate(to_latin1).encode("latin-1") if bytewise else token.encode()
    decoded = tokenizer.decode_batch([[i] for i in range(len(pieces))], skip_special_tokens=True)
    texts: list[str | None] = []
    partial: dict[int, bytes] = {}
    for i, (piece, text) in enumerate(zip(pieces, decoded, strict=True)):
        if piece.decode("utf-8", "replace") != text:
            return None
        try:
            texts.append(piece.decode())
        except UnicodeDecodeError:
            texts.append(None)
            partial[i] = piece
    return texts, partial


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: plain json.dumps (jinja's own escapes <, > and &)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's tokens for training
    masks in transformers; renders its body as it is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a set)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    """A sandbox configured as transformers configures the one it renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a chat is rendered, beyond its messages (transformers' `apply_chat_template`
    arguments, vLLM's request fields)."""

    add_generation_prompt: bool = True
    """End with the assistant's turn opened, for the answer to follow."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI's tool objects, for a template that describes them to its model."""
    continue_final_message: bool = False
    """End with the last message's content, unclosed, for the answer to continue it."""
    template_kwargs: dict[str, Any] | None = None
    """Extra template variables (`enable_thinking`, `reasoning_effort`, ...)."""


def has_tokenizer(model_dir: Path) -> bool:
    """The model directory ships a fast tokenizer (tokenizer.json)."""
    return (model_dir / "tokenizer.json").is_file()


class Tokenizer:
    """encode / decode / apply_chat_template for one model directory. `decode` skips special
    tokens by default, so a Tokenizer is the scheduler's `Detokenizer`."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"{model_dir} has no tokenizer.json; the daemon needs a fast tokenizer "
                "(save one with transformers' tokenizer.save_pretrained)."
            )
        self._tokenizer = HFTokenizer.from_file(str(path))
        self._tokenizer.no_padding()  # a file that pads (all-MiniLM's: to 128) adds no tokens
        self._tokenizer.no_truncation()
        self._one: dict[int, str] = {}
        """The text of single tokens, decoded once each (at most the vocabulary): logprobs
        name each sampled and top candidate token on its own."""
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.pad_token = _token_text(config.get("pad_token"))
        self.unk_token = _token_text(config.get("unk_token"))
        self.tokenizer_class = str(config.get("tokenizer_class") or "PreTrainedTokenizerFast")
        template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        self._template = _environment().from_string(template) if template else None

    def info(self) -> dict[str, Any]:
        """What vLLM's GET /tokenizer_info tells: the class, special tokens, template."""
        return {
            "tokenizer_class": self.tokenizer_class,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token else None

    def token_to_id(self, token: str) -> int | None:
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A cross-encoder's input (`[CLS] first [SEP] second [SEP]` for BERT): its token ids
        and their token type ids (0 for `first`'s, 1 for `second`'s)."""
        encoding = self._tokenizer.encode(first, second)
        return list(encoding.ids), list(encoding.type_ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(token_ids) == 1 and skip_special_tokens:
            text = self._one.get(token_ids[0])
            if text is None:
                text = self._one[token_ids[0]] = str(self._tokenizer.decode(list(token_ids)))
            return text
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def stepper(self, skip_special_tokens: bool = True) -> Stepper:
        """A new incremental decode of one output, skipping special tokens (or keeping their
        text): a byte-level vocabulary's table (a token's text looked up) when the tokenizer
        has one, else tokenizers' `DecodeStream` (in Rust, about five times the time a
        token)."""
        table = self._byte_table
        if table is None:
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            return functools.partial(stream.step, self._tokenizer)
        step = byte_level_stepper(*table)
        if skip_special_tokens:
            return step
        specials = self._special_texts

        def keeping(token_id: int) -> str | None:
            """A special token's own text; any other token's as the table has it."""
            text = specials.get(token_id)
            return step(token_id) if text is None else text

        return keeping

    @functools.cached_property
    def _special_texts(self) -> dict[int, str]:
        """Special token id -> its text."""
        added = self._tokenizer.get_added_tokens_decoder()
        return {i: t.content for i, t in added.items() if t.special}

    @functools.cached_property
    def _byte_table(self) -> ByteTable | None:
        """`byte_level_table`, built when a stepper is first asked for."""
        return byte_level_table(self._tokenizer)

    def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> str:
        """The chat as text, per the model's template and `options` (ChatOptions)."""
        if self._template is None:
            raise TokenizerError(
                "this model's tokenizer has no chat template; use /v1/completions instead"
            )
        options = options or ChatOptions()
        if options.continue_final_message and options.add_generation_prompt:
            raise TokenizerError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        variables = dict(options.template_kwargs or {})
        variables.update(
            messages=messages,
            tools=options.tools,
            add_generation_prompt=options.add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        try:
            text = self._template.render(**variables)
        except TemplateError as e:
            raise TokenizerError(f"the chat template refused these messages: {e}") from e
        if options.continue_final_message:
            final = str(messages[-1].get("content") or "").strip() if messages else ""
            at = text.rfind(final) if final else -1
            if at < 0:
                raise TokenizerError(
                    "continue_final_message needs a last message with text the template keeps"
                )
            text = text[: at + len(final)]
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens."""
        return self.encode(self.render_chat(messages, options), add_special_tokens=False)
