"""What a chat request's messages become before the chat template sees them.

Kept apart from the request flow in ``serving_chat`` because it is read on its own: the CLI and
``pagedllm chat`` check ``--chat-template`` with :func:`load_chat_template` before any server
exists, and the message checks (text parts only, the prompt-size count) are per message, not
per request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.entrypoints.openai.serving_tools import history_message


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's path, or the Jinja template itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long template string is not a valid path
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: text parts joined, other parts refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        f"messages.{i}.content: only text parts are supported, got {part.type!r}",
                        param="messages",
                        code="unsupported_content",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        item: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            item["name"] = m.name
        out.append(history_message(item, m.tool_calls, m.tool_call_id))
    return out


def message_chars(content: Any) -> int:
    """A message's text length (string content or text parts), for the prompt-size limit."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(getattr(p, "text", None) or "") for p in content)
    return 0
