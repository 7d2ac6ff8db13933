"""Chat templates rendered as transformers renders them, with jinja2 alone.

A chat template is a Jinja program shipped with the model; the prompt a model was trained on is
what transformers' ``apply_chat_template(..., tokenize=False)`` makes of it, so this module
keeps its rules (written here from its documented behaviour, checked against it by
``tests/tokenization/test_tokenizer.py``):

- the environment: Jinja's immutable sandbox, ``trim_blocks`` and ``lstrip_blocks`` on, loop
  controls (``break``/``continue``), the ``{% generation %}`` block (assistant-mask marker:
  renders its body), a ``tojson`` filter that does not escape HTML and takes ``indent``,
  ``separators``, ``sort_keys`` and ``ensure_ascii``, the globals ``raise_exception`` (a
  ``TemplateError``), ``strftime_now``, a ``dict`` constructor and a ``namespace`` that refuses
  underscore names;
- the variables: the named special tokens (``bos_token``...), then the caller's keyword
  arguments over them, then ``messages``, ``tools``, ``documents``, ``add_generation_prompt``;
- the messages: keys whose value is None dropped, values rebuilt as plain JSON-like data, a
  reasoning text under any of its names also offered as ``reasoning_content`` and ``thinking``;
- ``continue_final_message``: the last message (its ``content``, or the named field) left open,
  the text after it cut.

Compiled templates are cached by their source.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning comes under; templates read the first (and gpt-oss "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_OPEN_END = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where a continued message's text ends


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: where a template marks the assistant's own
    tokens (for training masks). A render for a prompt only needs its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own filter escapes <, >, & and ' for HTML: a prompt wants the JSON as written.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _DictMaker:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, without the type itself (whose
    attributes a template could otherwise walk)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that stores no underscore-prefixed attribute (no reach into the
    interpreter's internals through a name a template sets)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._refuse(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._refuse(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _refuse(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set {name!r} on a namespace (underscore names)"
            )


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the chat environment (cached: a server renders one template
    for every request)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def plain_data(value: Any) -> Any:
    """``value`` rebuilt from JSON-like types only (subclasses cut back to their base type,
    dataclasses and pydantic models as dicts, anything else a ``<TypeName>`` placeholder): a
    template sees no object whose methods the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":  # a numpy scalar
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _message_dicts(conversation: Any) -> list[dict[str, Any]]:
    """Messages as plain dicts without their None values, reasoning offered under the names
    templates read."""
    out = []
    for message in plain_data(list(getattr(conversation, "messages", conversation))):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tool_schemas(tools: list[Any] | None) -> list[Any] | None:
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, dict):
            # transformers would read a Python function's signature and docstring; the engine
            # only ever hands over JSON schemas.
            raise ValueError("tools: each tool must be a JSON schema (a dict)")
    return list(tools)


def _open_final_message(messages: list[dict[str, Any]], field: str, source: str) -> str:
    """Mark the end of the last message's ``field``; returns its text (before the mark)."""
    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty")
    last = messages[-1]
    text = last.get(field)
    if text is None:
        raise ValueError(f'continue_final_message: the final message has no "{field}"')
    fields = [field]
    if field in REASONING_FIELDS:  # copied under several names: mark every copy
        fields = [f for f in REASONING_FIELDS if last.get(f) == text]
    if not any(f in source for f in fields):
        raise ValueError(f'continue_final_message: the chat template never reads "{field}"')
    if isinstance(text, (list, tuple)):
        for block in reversed(text):
            if "text" in block:
                opened = str(block["text"])
                block["text"] = opened + _OPEN_END
                return opened
        raise ValueError("continue_final_message: the final message has no text to continue")
    for f in fields:
        last[f] = last[f] + _OPEN_END
    return str(text)


def _cut_after_final_message(rendered: str, opened: str) -> str:
    mark = _OPEN_END.strip()
    if opened.strip() not in rendered or mark not in rendered:
        raise ValueError(
            "continue_final_message: the chat template dropped part of the final message"
        )
    at = rendered.rindex(mark)
    if rendered[at : at + len(_OPEN_END)] == _OPEN_END:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def select_template(
    own: str | dict[str, str] | None, chosen: str | None, tools: list[Any] | None
) -> str:
    """The template source to render: ``chosen`` (a source, or a name among the tokenizer's
    templates), else the tokenizer's (its ``tool_use`` one when tools are given, else
    ``default``)."""
    if isinstance(own, dict):
        if chosen is not None and chosen in own:
            return own[chosen]
        if chosen is None:
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(
                f"the tokenizer has several chat templates and none is the default: pass one "
                f"of {sorted(own)} as chat_template"
            )
    if chosen is not None:
        return chosen
    if own is None:
        raise ValueError("the tokenizer has no chat template and none was passed")
    return own


@dataclasses.dataclass(frozen=True)
class ChatRenderer:
    """A tokenizer's chat templates and named special tokens: all ``apply_chat_template(...,
    tokenize=False)`` reads. What a template worker is sent instead of the whole tokenizer
    (its start then loads no vocabulary)."""

    chat_template: str | dict[str, str] | None
    special_tokens_map: dict[str, str]

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        return select_template(self.chat_template, chat_template, tools)

    def apply_chat_template(
        self,
        conversation: Any,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str:
        if tokenize:
            raise ValueError("tokenize: this renderer has no vocabulary (text only)")
        return render_chat(
            self.get_chat_template(chat_template, tools),
            conversation,
            special_tokens=self.special_tokens_map,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )


def render_chat(
    source: str,
    conversation: Any,
    *,
    special_tokens: Mapping[str, str],
    tools: list[Any] | None = None,
    documents: list[Any] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """One conversation through the template ``source`` (see the module for the rules)."""
    messages = _message_dicts(conversation)
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot be used together")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents: each document must be a dict (title, text)")
    variables = plain_data({**special_tokens, **kwargs})
    opened = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        opened = _open_final_message(messages, field, source)
    rendered = compile_template(source).render(
        **variables,
        messages=messages,
        tools=plain_data(_tool_schemas(tools)),
        documents=plain_data(documents),
        add_generation_prompt=add_generation_prompt,
    )
    return rendered if opened is None else _cut_after_final_message(rendered, opened)
