"""DeepSeek's thinking format (R1, and V3.1's thinking mode): the model reasons between `<think>` and `</think>`
before it answers. The router returns that reasoning apart from the answer (`reasoning_content`, as DeepSeek's API
does), and a constrained answer (JSON, tool calls) starts after it.

The reasoning is open from the first output token when the rendered prompt ends inside a `<think>` block (R1's newer
template writes `<think>\\n` after the assistant tag; V3.1's writes `<think>` when asked to think); otherwise it opens
only if the output starts with `<think>` (R1's first template left that to the model)."""

import json
from dataclasses import dataclass

from tokenizers import Tokenizer

from pdserve.text.grammars import lark_json
from pdserve.text.markers import marker_prefix_len

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """The thinking tags of one tokenizer, by token id."""

    start_id: int
    end_id: int

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, chat_template: str | None) -> "ReasoningFormat | None":
        """The format when the tokenizer has both tags as tokens and the chat template writes `<think>` (a model
        trained to think), else None: a model without it answers as before, its text untouched."""
        start_id, end_id = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
        if start_id is None or end_id is None or not chat_template or THINK_START not in chat_template:
            return None
        return cls(start_id, end_id)

    def opened_by(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt ends inside a `<think>` block: its last tag is an opening one. (List searches, not a
        Python loop: a long prompt without tags is scanned on the router's event loop.)"""
        if self.start_id not in prompt_token_ids:
            return False
        last_start = len(prompt_token_ids) - 1 - prompt_token_ids[::-1].index(self.start_id)
        return self.end_id not in prompt_token_ids[last_start + 1:]

    def reasoning_tokens(self, token_ids: list[int], opened: bool) -> int:
        """How many of an output's tokens are reasoning, its tags included (what usage reports as reasoning_tokens)."""
        if not (opened or token_ids[:1] == [self.start_id]):
            return 0
        return token_ids.index(self.end_id) + 1 if self.end_id in token_ids else len(token_ids)

    def after_reasoning(self, kind: str, source: str) -> str:
        """A Lark grammar for what follows the reasoning of a prompt that opened it: any text without special tokens,
        `</think>`, then the constrained answer (`kind` json_schema: a JSON Schema; lark: a grammar whose start rule
        is renamed)."""
        if kind == "json_schema":
            answer = f"answer: {lark_json(json.loads(source))}"
        else:
            answer = "\n".join("answer:" + line[len("start:"):] if line.startswith("start:") else line
                               for line in source.splitlines())
        return f"start: reasoning <[{self.end_id}]> answer\nreasoning: /(?s:.*)/\n{answer}"


class ReasoningParser:
    """Splits output text into reasoning and content as it arrives. Text that may be the start of a tag is held back
    until the next piece or `finish` decides it."""

    def __init__(self, opened: bool) -> None:
        self._state = "reasoning" if opened else "start"  # start -> reasoning -> content, or start -> content
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            if THINK_START.startswith(self._buffer):
                return "", ""  # may still become <think>
            if self._buffer.startswith(THINK_START):
                self._buffer, self._state = self._buffer[len(THINK_START):], "reasoning"
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(THINK_END)
            if end < 0:
                held = marker_prefix_len(self._buffer, THINK_END)
                reasoning, self._buffer = self._buffer[:len(self._buffer) - held], self._buffer[len(self._buffer) - held:]
                return reasoning, ""
            reasoning, self._buffer, self._state = self._buffer[:end], self._buffer[end + len(THINK_END):], "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning cut off before `</think>` stays reasoning."""
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


def split_reasoning(text: str, opened: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    parser = ReasoningParser(opened)
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    return reasoning + more_reasoning, content + more_content
