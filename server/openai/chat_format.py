"""A chat as the model's template takes it, in one place: the messages as the template reads
them (content parts, images, earlier tool calls and results), the request's tools in the
prompt, the template options (generation prompt, `continue_final_message`,
`chat_template_kwargs`, `reasoning_effort`), the template applied, and a chat's images read
and their image tokens widened.

A template that never mentions tools (SmolLM2's, the demo model's) would drop them: the
tools are then described in a system message in hermes' format, assistant calls are written
back as `<tool_call>` blocks and tool results as `<tool_response>` user turns, so any
instruct model can take part in a tool round trip. gpt-oss's template renders one call per
assistant message and names a tool result after the call before it, so an assistant turn of
several calls goes to it as one message per call, each followed by its result
(`one_call_each`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from base.errors import UserError
from engine.core.media import ImageError, SeqMedia, VisionSpec, expand_image_tokens
from engine.core.tokenizer import ChatOptions
from engine.runtime.engine_client import EngineClient
from server.openai.errors import invalid_request
from server.openai.media import IMAGE_PARTS, MediaLimits, image_url_of, load_image
from server.openai.parsers.tool_calls import HARMONY
from server.openai.parsers.tool_calls import parser_for_template as tools_for_template
from server.openai.requests import ChatCompletionRequest, ChatMessage, ToolCallIn
from server.openai.tools import ToolPlan

TEXT_ONLY_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image",
        "input_audio",
        "audio",
        "audio_url",
        "file",
        "input_file",
        "video",
        "video_url",
        "image_embeds",
    }
)
"""Content parts of other modalities: refused by name (the served models take text)."""
Images = list[tuple[str, str]]
"""A chat's image parts, (URL, param) each, in order."""


# -- the messages as the template reads them -------------------------------------------------
def template_messages(
    messages: list[ChatMessage], images: Images | None = None
) -> list[dict[str, Any]]:
    """The messages as the template reads them; `images`: as `template_content`."""
    return [template_message(m, i, images) for i, m in enumerate(messages)]


def template_message(
    message: ChatMessage, index: int, images: Images | None = None
) -> dict[str, Any]:
    """The message as chat templates read it (`role`, `content`, and where present
    `name`, `tool_calls`, `tool_call_id`); `images` as `template_content`."""
    content = template_content(message, index, images)
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.role == "function":  # the legacy result of a function
        out["role"] = "tool"
    if message.name is not None:
        out["name"] = message.name
    calls = list(message.tool_calls or [])
    if message.function_call is not None:
        calls.append(ToolCallIn(function=message.function_call))
    if calls:
        out["tool_calls"] = [
            {
                "id": c.id or f"call_{index}_{k}",
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for k, c in enumerate(calls)
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out


def template_content(
    message: ChatMessage, index: int, images: Images | None = None
) -> str | list[dict[str, Any]]:
    """The content as the chat template reads it: its text; for a model that takes images
    (`images` a list, which collects each image part's (URL, param)), a content with
    images is its parts in order, {"type": "text", "text"} and {"type": "image"}."""
    content = message.content
    if images is None or not isinstance(content, list):
        return message_text(message, index)
    if not any(part.get("type") in IMAGE_PARTS for part in content):
        return message_text(message, index)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"messages.{index}.content.{j}"
        if part.get("type") in IMAGE_PARTS:
            images.append((image_url_of(part, where), where))
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": _part_text(part, where)})
    return parts


def message_text(message: ChatMessage, index: int) -> str:
    """The content's text; a part of another modality is a 400 naming it."""
    if not isinstance(message.content, list):
        return message.content or ""
    return "".join(
        _part_text(part, f"messages.{index}.content.{j}") for j, part in enumerate(message.content)
    )


def _part_text(part: dict[str, Any], where: str) -> str:
    """A text content part's text; a part of another modality is a 400 naming it."""
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text", "refusal"):
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise invalid_request(f"a {kind} part needs its text", param=where)
        return text
    if kind in TEXT_ONLY_PARTS:
        raise invalid_request(
            f"The served model takes text only; this message has a content part of "
            f"type {kind!r}. Send text parts (type 'text') or a string.",
            param=where,
            code="unsupported_content_type",
        )
    raise invalid_request(
        f"Unknown content part type {kind!r}; the served model takes text parts (type 'text').",
        param=where,
    )


# -- the template applied ---------------------------------------------------------------------
def chat_options(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> ChatOptions:
    """A chat request's template options: the generation prompt (none when the answer
    continues the last message), the tools it lists, its template variables."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return ChatOptions(
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        tools=tools,
        continue_final_message=req.continue_final_message,
        template_kwargs=kwargs,
    )


def chat_ids(
    engine: EngineClient,
    messages: list[dict[str, Any]],
    template: str | None,
    check_text_bytes: Callable[[list[str], str], None],
    req: ChatCompletionRequest | None = None,
    tools: ToolPlan | None = None,
) -> list[int]:
    """A chat's token ids: its messages rendered with the model's template (`template`, its
    text), with the request's tools and template options (`req`; None: the defaults); a
    template that knows no tools gets them written into the chat. `check_text_bytes` refuses
    a chat whose text cannot fit the context, before it is rendered."""
    native = template_knows_tools(template)
    harmony = tools_for_template(template) == HARMONY
    chat = chat_for_template(messages, tools.tools if tools else None, native, harmony)
    listed = tools.tools if tools and native else None
    if listed and harmony:
        listed = described(listed)
    check_text_bytes([str(m.get("content") or "") for m in chat], "messages")
    try:
        if req is None:
            return engine.apply_chat_template(chat)
        return engine.apply_chat_template(chat, chat_options(req, listed))
    except UserError as e:
        raise invalid_request(str(e), param="messages", code="chat_template_error") from e


def chat_media(
    spec: VisionSpec, limits: MediaLimits, prompt: list[int], images: Images
) -> SeqMedia | None:
    """A chat's images (URL, param each) read and checked against the limits, and its
    prompt's image tokens widened to each image's (`expand_image_tokens`)."""
    if len(images) > limits.max_images:
        raise invalid_request(
            f"this request has {len(images)} images; the limit is {limits.max_images}",
            param="messages",
            code="too_many_images",
        )
    loaded = [load_image(url, limits, param) for url, param in images]
    try:
        return expand_image_tokens(prompt, spec, [(i.data, i.width, i.height) for i in loaded])
    except ImageError as e:
        raise invalid_request(str(e), param="messages") from e


# -- tools in the prompt -----------------------------------------------------------------------
def template_knows_tools(template: str | None) -> bool:
    """The chat template renders `tools` itself (Qwen, Llama 3.1, Mistral, Hermes...)."""
    return bool(template) and "tools" in (template or "")


def chat_for_template(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    native: bool,
    harmony: bool = False,
) -> list[dict[str, Any]]:
    """The messages as the template takes them: assistant calls' arguments as objects (the
    templates write them with `tojson`); for a template that knows no tools (`native`
    False), tools, calls and results written into the text in hermes' format; for gpt-oss's
    (`harmony`), one call per assistant message (`one_call_each`)."""
    if harmony:
        messages = one_call_each(messages)
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if native:
            if calls:
                message = {**message, "tool_calls": [_call_for_template(c) for c in calls]}
            out.append(message)
            continue
        if message["role"] == "tool":
            text = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            out.append({"role": "user", "content": text})
        elif calls:
            blocks = [_hermes_block(_call_for_template(c)) for c in calls]
            text = "\n".join([message.get("content") or "", *blocks]).strip()
            out.append({"role": "assistant", "content": text})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    if tools and not native:
        system = _tools_system_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def one_call_each(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpt-oss's chat: an assistant message of several calls as one message per call, each
    followed by its result (the tool message whose `tool_call_id` is the call's id, else the
    next result whose id names no call). An assistant's reasoning sent back
    (`reasoning_content`) is the template's `thinking`, as transformers passes it; a call
    message's chain of thought goes with its first call only, in place of its content (the
    template renders one of them, as the analysis message harmony feeds back before a call)."""
    out: list[dict[str, Any]] = []
    at = 0
    while at < len(messages):
        message = _with_thinking(messages[at])
        at += 1
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or not calls:
            out.append(message)
            continue
        results: list[dict[str, Any]] = []
        while at < len(messages) and messages[at]["role"] == "tool":
            results.append(messages[at])
            at += 1
        ids = {call.get("id") for call in calls}
        for k, call in enumerate(calls):
            single = {**message, "tool_calls": [call]}
            if k:
                single = {key: v for key, v in single.items() if key != "thinking"}
                single["content"] = ""
            elif "thinking" in single:
                single["content"] = ""
            out.append(single)
            mine = [r for r in results if r.get("tool_call_id") == call.get("id")]
            found = mine or [r for r in results if r.get("tool_call_id") not in ids]
            if found:
                out.append(found[0])
                results.remove(found[0])
        out.extend(results)
    return out


def described(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as gpt-oss's template takes them: it writes each function's description (as a
    `//` comment) and fails on one without, which OpenAI's tools may leave out ('' then)."""
    return [
        {
            **tool,
            "function": {
                **tool["function"],
                "description": tool["function"].get("description") or "",
            },
        }
        for tool in tools
    ]


def _with_thinking(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = message.get("reasoning_content")
    if message["role"] != "assistant" or reasoning is None:
        return message
    rest = {key: v for key, v in message.items() if key != "reasoning_content"}
    return {"thinking": reasoning, **rest}


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else the template gets the text as sent
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def _hermes_block(call: dict[str, Any]) -> str:
    value = {"name": call["function"].get("name"), "arguments": call["function"].get("arguments")}
    return f"<tool_call>\n{json.dumps(value, ensure_ascii=False)}\n</tool_call>"


def _tools_system_text(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to answer. Their signatures, one JSON object a line, are "
        f"between <tools> and </tools>:\n<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, answer with a JSON object of its name and arguments between "
        "<tool_call> and </tool_call>, one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
        "</tool_call>"
    )
