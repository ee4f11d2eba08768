"""DeepSeek's tool-call formats: the grammar that makes a model call tools (`tool_choice` required or a named
function), and the parser that turns its output text, whole or streamed, into content and OpenAI tool calls.

DeepSeek-V3 writes
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>
    (more calls, one per line)<｜tool▁calls▁end｜>
after any plain content; V3.1 and later write each call as
    <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>
back to back. Which one a model uses is read from its chat template (`CallStyle.of_template`). The markers are added
tokens that detokenization keeps (they are not special)."""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from pdserve.text.grammars import lark_json
from pdserve.text.markers import marker_prefix_len

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
# after CALL_BEGIN: the call's type, the separator, the function name, the opening of the JSON block (V3); or the
# function name and the separator (V3.1)
_HEADER = re.compile(r"\s*(?:function)?\s*" + re.escape(SEPARATOR) + r"\s*([^\n]*?)\s*\n\s*```(?:json)?[ \t]*\n")
_NAME_FIRST_HEADER = re.compile(r"\s*([^\n]*?)\s*" + re.escape(SEPARATOR))
_CLOSING = re.compile(r"\s*(?:```)?\s*$")  # between the arguments and CALL_END
_LONGEST_CLOSING_TAIL = 16


@dataclass(frozen=True)
class CallStyle:
    """How a model writes one call between CALL_BEGIN and CALL_END, and what comes between two calls."""

    name_first: bool  # V3.1: NAME<sep>ARGUMENTS; V3: function<sep>NAME, then the arguments in a ```json block
    separator: str  # between calls: a newline (V3), nothing (V3.1)

    @classmethod
    def of_template(cls, render: Callable[[list[dict[str, Any]]], str]) -> "CallStyle":
        """The style the chat template writes an assistant turn's two calls in (`render`: messages -> text); V3's
        when the template renders no calls."""
        calls = [{"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": "{}"}}
                 for name in ("probe_a", "probe_b")]
        try:
            text = render([{"role": "user", "content": "?"},
                           {"role": "assistant", "content": None, "tool_calls": calls}])
        except ValueError:
            return V3_STYLE
        first = text.find(CALL_BEGIN)
        first_end = text.find(CALL_END, first)
        second = text.find(CALL_BEGIN, first_end)
        if min(first, first_end, second) < 0:
            return V3_STYLE
        header = text[first + len(CALL_BEGIN):first_end]
        return cls(header.split(SEPARATOR)[0].strip() == "probe_a", text[first_end + len(CALL_END):second])


V3_STYLE = CallStyle(name_first=False, separator="\n")
V3_1_STYLE = CallStyle(name_first=True, separator="")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]


@dataclass
class ToolCallDelta:
    """A piece of the index-th call: its name when it starts, then pieces of its JSON arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


class DeepSeekToolCalls:
    """The format for one model (it holds the marker tokens' ids for grammars, and the style its template writes)."""

    def __init__(self, marker_ids: dict[str, int], style: CallStyle = V3_STYLE) -> None:
        self._ids = marker_ids
        self.style = style

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, style: CallStyle = V3_STYLE) -> "DeepSeekToolCalls | None":
        """The format when the tokenizer has its marker tokens, else None (the model cannot call tools)."""
        ids = {marker: tokenizer.token_to_id(marker) for marker in (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEPARATOR)}
        return None if None in ids.values() else cls(ids, style)  # type: ignore[arg-type]

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        """A Lark grammar: one tool call (or, if `parallel`, one or more) of these tools, arguments per their schema."""
        token = {marker: f"<[{token_id}]>" for marker, token_id in self._ids.items()}
        rules = []
        for i, tool in enumerate(tools):
            if self.style.name_first:
                rules.append(f"fn_{i}: {json.dumps(tool.name)} {token[SEPARATOR]} args_{i}")
            else:
                rules.append(f'fn_{i}: {json.dumps(tool.name + chr(10) + "```json" + chr(10))} args_{i} "\\n```"')
            rules.append(f"args_{i}: {lark_json(tool.parameters)}")
        functions = " | ".join(f"fn_{i}" for i in range(len(tools)))
        more = ""
        if parallel:
            more = f" ({json.dumps(self.style.separator)} call)*" if self.style.separator else " call*"
        header = "" if self.style.name_first else f'"function" {token[SEPARATOR]} '
        lines = [f"start: {token[CALLS_BEGIN]} call{more} {token[CALLS_END]}",
                 f"call: {token[CALL_BEGIN]} {header}({functions}) {token[CALL_END]}", *rules]
        return "\n".join(lines)


class ToolCallParser:
    """Splits output text into content and tool-call deltas as it arrives. Text that may be the start of a marker
    (or of the closing of a call's arguments) is held back until the next piece or `finish` decides it."""

    def __init__(self, style: CallStyle = V3_STYLE) -> None:
        self._buffer = ""
        self._state = "content"  # content -> between -> header -> arguments -> between ... -> after
        self._header = _NAME_FIRST_HEADER if style.name_first else _HEADER
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        while True:
            buffer = self._buffer
            if self._state == "content":
                at = buffer.find(CALLS_BEGIN)
                if at >= 0:
                    content += buffer[:at]
                    self._buffer, self._state = buffer[at + len(CALLS_BEGIN):], "between"
                    continue
                keep = 0 if final else marker_prefix_len(buffer, CALLS_BEGIN)
                content += buffer[: len(buffer) - keep]
                self._buffer = buffer[len(buffer) - keep:]
                break
            if self._state == "between":
                rest = buffer.lstrip()
                if rest.startswith(CALL_BEGIN):
                    self._buffer, self._state = rest[len(CALL_BEGIN):], "header"
                    continue
                if rest.startswith(CALLS_END) or final or not (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
                    self._buffer, self._state = "", "after"  # the calls are over (or the text is not a call)
                    continue
                break
            if self._state == "header":
                found = self._header.match(buffer)
                if found is None:
                    if final:
                        self._buffer = ""
                    break
                deltas.append(ToolCallDelta(self.calls, name=found.group(1)))
                self.calls += 1
                self._buffer, self._state = buffer[found.end():], "arguments"
                continue
            if self._state == "arguments":
                at = buffer.find(CALL_END)
                if at >= 0:
                    arguments, self._buffer, self._state = _CLOSING.sub("", buffer[:at]), buffer[at + len(CALL_END):], "between"
                else:
                    keep = 0 if final else _closing_tail_len(buffer)
                    arguments, self._buffer = buffer[: len(buffer) - keep], buffer[len(buffer) - keep:]
                if arguments:
                    deltas.append(ToolCallDelta(self.calls - 1, arguments=arguments))
                if at >= 0:
                    continue
                break
            self._buffer = ""  # after the calls: the model should have ended; nothing more is content
            break
        return content, _merged(deltas)


def _closing_tail_len(text: str) -> int:
    """Length of the longest end of `text` that may still become the closing of the arguments (blank space, the
    code fence, the start of CALL_END)."""
    for length in range(min(len(text), _LONGEST_CLOSING_TAIL + len(CALL_END)), 0, -1):
        tail = text[-length:]
        for split in range(len(tail) + 1):
            if CALL_END.startswith(tail[split:]) and re.fullmatch(r"\s*`{0,3}\s*", tail[:split]):
                return length
    return 0


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument pieces of one call as one delta."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and delta.name is None:
            merged[-1].arguments += delta.arguments
        else:
            merged.append(delta)
    return merged
