"""OpenAI Responses request -> the internal chat request (pure functions).

Input items become the OpenAI-shaped chat messages the chat stage renders,
so this route, chat completions and Anthropic Messages share one encoder
and build the same prompt for the same conversation:

* `message` items keep their role (`system`, `developer`, `user`,
  `assistant`); text parts become chat text parts, `input_image` parts
  `ImageInput`s in place (`api/images.py` checks them and places or refuses them).
* The assistant-side items of one turn (`reasoning`, an assistant
  `message`, `function_call`s) fold into one assistant message with
  `reasoning_content`, `content` and `tool_calls`.
* `function_call_output` items are tool messages, in place.
* A `reasoning` item's text is its `reasoning_text` content, or else what
  its `encrypted_content` holds (see `sealed`), so a stateless client that
  keeps only the token still re-renders the exact reasoning.

Tools of type `namespace` flatten into their functions, named
`namespace.name` in the prompt; `ResponsesTurn.namespaces` maps such a name
back so a call comes out as a `function_call` with `namespace` and `name`.
Hosted tools (`web_search`, ...) cannot run here and are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from mlxserve.api.body import FunctionSpec
from mlxserve.api.errors import bad_request
from mlxserve.api.generation import ChatGeneration, Sampling
from mlxserve.api.notices import warn_once
from mlxserve.api.responses.protocol import ResponsesRequest
from mlxserve.api.sealed import unseal_reasoning
from mlxserve.api.structured import ToolChoice, answer_constraint, with_response_format
from mlxserve.chat import PromptRequest
from mlxserve.chat.images import ImageInput

Item = Mapping[str, Any]

ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
MEDIA_PARTS = frozenset({"input_file", "input_audio"})
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "mcp",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
        "tool_search",
    }
)
# OpenAI's reasoning efforts in the encoder's vocabulary; None is the model's default.
EFFORTS: dict[str, str | None] = {
    "none": "none",
    "minimal": "low",
    "low": "low",
    "medium": None,  # OpenAI's default: the model's default (DeepSeek: high)
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}
NAMESPACE_SEPARATOR = "."


@dataclass(frozen=True)
class ResponsesTurn:
    """One Responses request in the server's terms."""

    generation: ChatGeneration
    # The conversation as Responses items (the previous response's, then this input).
    items: tuple[Item, ...]
    # Prompt tool name -> (namespace, function name), for namespaced functions.
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)


def input_items(req: ResponsesRequest) -> list[Item]:
    """The request's `input` as a list of items (a string is one user message)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


def _str_field(item: Item, key: str, where: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        raise bad_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _input_image(part: Item, where: str) -> ImageInput:
    """An `input_image` part: `image_url` as a data: URL (`detail` is ignored)."""
    if part.get("file_id") is not None:
        raise bad_request(
            f"{where}: file_id is not supported (this server keeps no files); send the image "
            "inline as image_url, a data: URL (data:image/png;base64,...)",
            where,
        )
    if part.get("image_url") is None:
        raise bad_request(f"{where}: an input_image needs image_url (a data: URL)", where)
    return ImageInput(where, url=part.get("image_url"))


def _text_parts(content: Any, where: str, images: bool = False) -> str | list[Any]:
    """A message's content as chat content: a string, or chat text parts (and, where
    `images`, the `ImageInput`s of its `input_image` parts, in place)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    parts: list[Any] = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise bad_request(f"{here} must be a content part object", here)
        kind = part.get("type")
        if kind == "input_image":
            if not images:
                raise bad_request(f"{here}: an assistant message cannot hold an image", here)
            parts.append(_input_image(part, here))
            continue
        if kind in MEDIA_PARTS:
            raise bad_request(
                f"{here}: '{kind}' parts are not supported: this model takes text only", here
            )
        if kind == "refusal":
            text = part.get("refusal")
        elif kind in TEXT_PARTS:
            text = part.get("text")
        else:
            raise bad_request(f"{here}: unknown content part type {kind!r}", here)
        if not isinstance(text, str):
            raise bad_request(f"{here}.text must be a string", here)
        parts.append({"type": "text", "text": text})
    return parts


def _reasoning_text(item: Item, where: str) -> str:
    content = item.get("content")
    if content is not None and not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a list of reasoning_text parts", f"{where}.content"
        )
    texts: list[str] = []
    for j, part in enumerate(content or ()):
        text = part.get("text") if isinstance(part, Mapping) else None
        if not isinstance(text, str):
            raise bad_request(
                f"{where}.content[{j}].text must be a string", f"{where}.content[{j}]"
            )
        texts.append(text)
    if texts:
        return "".join(texts)
    sealed = item.get("encrypted_content")
    if sealed is None:
        return ""
    if not isinstance(sealed, str):
        raise bad_request(
            f"{where}.encrypted_content must be a string", f"{where}.encrypted_content"
        )
    text = unseal_reasoning(sealed)
    if text is None:
        warn_once("sealed", "a reasoning item's encrypted_content is not ours; left out")
        return ""
    return text


@dataclass
class _Reply:
    """The assistant-side items of one turn, folded into one chat message."""

    reasoning: list[str] = field(default_factory=list)
    content: list[Any] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    stage: int = -1  # 0 reasoning, 1 message, 2 function calls

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            out["tool_calls"] = self.calls
        return out


class _Conversation:
    """Builds chat messages from items in order, checking each one."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.calls: set[str] = set()
        self._reply: _Reply | None = None

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, Mapping):
            raise bad_request(f"{where} must be an item object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "reasoning":
            self._assistant(0).reasoning.append(_reasoning_text(item, where))
        elif kind == "function_call":
            self._function_call(item, where)
        elif kind == "function_call_output":
            self._call_output(item, where)
        elif kind == "item_reference":
            raise bad_request(
                f"{where}: item_reference is not supported; send the item itself", where
            )
        else:
            raise bad_request(f"{where}: unknown input item type {kind!r}", f"{where}.type")

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        return self.messages

    def _assistant(self, stage: int) -> _Reply:
        """The open reply, or a new one when this item cannot continue it."""
        reply = self._reply
        if reply is None or stage < reply.stage or (stage == reply.stage and stage < 2):
            self._close()
            reply = self._reply = _Reply()
        reply.stage = stage
        return reply

    def _close(self) -> None:
        if self._reply is not None:
            self.messages.append(self._reply.message())
            self._reply = None

    def _message(self, item: Item, where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}",
                f"{where}.role",
            )
        content = _text_parts(item.get("content"), f"{where}.content", role != "assistant")
        if role == "assistant":
            reply = self._assistant(1)
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            reply.content.extend(parts)
            return
        self._close()
        self.messages.append({"role": role, "content": content})

    def _function_call(self, item: Item, where: str) -> None:
        call_id = _str_field(item, "call_id", where)
        name = _str_field(item, "name", where)
        namespace = _str_field(item, "namespace", where, required=False)
        arguments = item.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise bad_request(f"{where}.arguments must be a JSON string", f"{where}.arguments")
        assert call_id is not None and name is not None
        if namespace:
            name = namespace + NAMESPACE_SEPARATOR + name
        self.calls.add(call_id)
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self._assistant(2).calls.append(call)

    def _call_output(self, item: Item, where: str) -> None:
        call_id = _str_field(item, "call_id", where)
        if call_id not in self.calls:
            raise bad_request(
                f"{where}: function_call_output for {call_id!r} has no function_call with that "
                "call_id before it",
                f"{where}.call_id",
            )
        output = item.get("output", "")
        content = _text_parts(output, f"{where}.output", images=True)
        self._close()
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})


def chat_messages(
    history: Sequence[Any], items: Sequence[Any], instructions: str | None = None
) -> list[dict[str, Any]]:
    """`instructions` (a system message), then the items, as OpenAI chat messages.

    `history` holds the items `previous_response_id` resolved to, `items` the input.
    """
    convo = _Conversation()
    for i, item in enumerate(history):
        convo.add(item, f"previous_response_id item {i}")
    for i, item in enumerate(items):
        convo.add(item, f"input[{i}]")
    messages = convo.finish()
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("input: at least one input item is required", "input")
    return messages


def _function(tool: Mapping[str, Any], name: str, where: str) -> dict[str, Any]:
    # The same function object a chat-completions client sends, so both render alike.
    keys = ("description", "parameters", "strict")
    spec = {k: tool.get(k) for k in keys if tool.get(k) is not None}
    try:
        checked = FunctionSpec.model_validate({"name": name, **spec})
    except ValidationError as e:
        msg = str(e.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")
        raise bad_request(f"{where}: {msg}", where) from e
    return {"type": "function", "function": checked.model_dump(exclude_none=True)}


def chat_tools(
    tools: Sequence[Any] | None,
) -> tuple[list[dict[str, Any]] | None, dict[str, tuple[str, str]]]:
    """The function tools in chat shape, and the namespaced names to split back."""
    out: list[dict[str, Any]] = []
    namespaces: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or not isinstance(kind, str):
            raise bad_request(f"{where} must be a tool object with a type", where)
        if kind == "function":
            out.append(_function(tool, str(tool.get("name") or ""), where))
        elif kind == "namespace":
            space = tool.get("name")
            inner = tool.get("tools")
            if not isinstance(space, str) or not space or not isinstance(inner, list):
                raise bad_request(f"{where}: a namespace needs a name and a list of tools", where)
            for j, fn in enumerate(inner):
                here = f"{where}.tools[{j}]"
                if not isinstance(fn, Mapping) or fn.get("type", "function") != "function":
                    warn_once(f"ns:{space}", "namespace %r: only its functions are served", space)
                    continue
                name = str(fn.get("name") or "")
                full = space + NAMESPACE_SEPARATOR + name
                out.append(_function(fn, full, here))
                namespaces[full] = (space, name)
        else:
            warn_once(
                f"tool:{kind}",
                "leaving tool type %r out of the prompt: this server cannot serve it",
                kind,
            )
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    return out or None, namespaces


def tool_choice(req: ResponsesRequest, names: set[str]) -> ToolChoice:
    """`tool_choice` in the server's terms; 400 for a tool this server cannot run."""
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if not isinstance(choice, Mapping):
        mode = choice or "auto"
        return ToolChoice(mode, parallel=parallel, label=mode)
    kind = choice.get("type")
    if kind in HOSTED_TOOLS or kind not in ("function", "allowed_tools"):
        raise bad_request(
            f"tool_choice names the tool type {kind!r}, which this server cannot run",
            "tool_choice",
        )
    if kind == "function":
        return ToolChoice("named", str(choice.get("name")), parallel)
    if not names:
        raise bad_request("tool_choice needs function tools", "tool_choice")
    # The allowed subset is shown in full and served as `auto`.
    return ToolChoice("auto", parallel=parallel)


def _effort(req: ResponsesRequest) -> tuple[str | None, dict[str, Any]]:
    """(reasoning_effort, chat_template_kwargs) for `reasoning.effort`."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None:
        return None, {}
    if effort not in EFFORTS:
        raise bad_request(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}",
            "reasoning.effort",
        )
    if effort == "none":
        return "none", {"thinking": False, "enable_thinking": False}
    return EFFORTS[effort], {}


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format` (None for plain text)."""
    fmt = req.text.format if req.text is not None else None
    kind = (fmt or {}).get("type", "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"text.format type {kind!r} is not supported", "text.format")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not name or not isinstance(schema, Mapping):
        raise bad_request("text.format json_schema needs a name and a schema object", "text.format")
    spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _shown_format(fmt: Mapping[str, Any]) -> Mapping[str, Any]:
    """What the prompt shows of a response format: the schema itself when there is one."""
    spec = fmt.get("json_schema")
    return spec["schema"] if isinstance(spec, Mapping) else fmt


def _format_schema(fmt: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if fmt is None:
        return None
    spec = fmt.get("json_schema")
    return spec["schema"] if isinstance(spec, Mapping) else {"type": "object"}


def to_turn(req: ResponsesRequest, history: Sequence[Item] = ()) -> ResponsesTurn:
    """A Responses request (after the items `previous_response_id` resolved to)."""
    current = input_items(req)
    messages = chat_messages(history, current, req.instructions)
    fmt = response_format(req)
    if fmt is not None:
        messages = with_response_format(messages, _shown_format(fmt))
    tools, namespaces = chat_tools(req.tools)
    choice = tool_choice(req, {t["function"]["name"] for t in tools or ()})
    effort, kwargs = _effort(req)
    prompt = PromptRequest(
        messages=messages, tools=tools, reasoning_effort=effort, chat_template_kwargs=kwargs
    )
    sampling = Sampling(
        max_tokens=req.max_output_tokens,
        prompt_param="input",
        max_tokens_param="max_output_tokens",
        temperature=req.temperature,
        top_p=req.top_p,
        logprobs=req.include_logprobs,
        top_logprobs=(req.top_logprobs or 0) if req.include_logprobs else 0,
    )
    generation = ChatGeneration(
        prompt=prompt,
        sampling=sampling,
        tools_enabled=bool(tools) and choice.mode != "none",
        parallel_tool_calls=choice.parallel_calls,
        stream=bool(req.stream),
        constraint=answer_constraint(tools, choice, _format_schema(fmt)),
    )
    return ResponsesTurn(generation, (*history, *current), namespaces)


def echo_settings(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a response object repeats them (the API's defaults filled in)."""
    reasoning = req.reasoning
    text: dict[str, Any] = {"format": (req.text.format if req.text else None) or {"type": "text"}}
    if req.text is not None and req.text.verbosity is not None:
        text["verbosity"] = req.text.verbosity
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "store": req.stores,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_logprobs": req.top_logprobs or 0,
        "text": text,
        "tool_choice": req.tool_choice or "auto",
        "tools": list(req.tools or ()),
        "truncation": req.truncation or "disabled",
        "metadata": dict(req.metadata or {}),
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
        "background": False,
        "service_tier": "default",
    }
