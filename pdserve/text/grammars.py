"""Grammars for constrained decoding as the router builds and checks them and the engine compiles them (llguidance).
A grammar is a kind ("json_schema" or "lark", as in `pdserve.wire.sampling.Grammar`) and its source text: JSON
Schemas (OpenAI's `response_format`), free text without special tokens (`tool_choice: none`), tool calls."""

import json
from typing import Any

import llguidance

# Compact JSON (no free whitespace): a model cannot stall inside a JSON value on endless blank space.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# Any text, but no special token: llguidance's lexemes never match one, so e.g. tool-call markers cannot appear.
FREE_TEXT_LARK = "start: /(?s:.*)/"


class GrammarError(ValueError):
    """A grammar that cannot be compiled."""


def json_schema_source(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def lark_json(schema: dict[str, Any]) -> str:
    """A JSON Schema embedded in a Lark grammar, compact like `json_schema_grammar`'s."""
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON}, separators=(",", ":"), ensure_ascii=False)


def llguidance_grammar(kind: str, source: str) -> str:
    """llguidance's serialized grammar; raises GrammarError on a malformed one."""
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(source, overrides=COMPACT_JSON)
        return llguidance.LLMatcher.grammar_from_lark(source)
    except ValueError as error:
        raise GrammarError(f"invalid {kind} grammar: {error}") from None


def check_grammar(kind: str, source: str) -> None:
    """Raises GrammarError when the grammar does not compile (unsupported schema keywords, bad Lark...)."""
    message = llguidance.LLMatcher.validate_grammar(llguidance_grammar(kind, source))
    if message:
        raise GrammarError(message.strip())
