"""DeepSeek's thinking format: reasoning split from the answer whole and in any pieces, the prompt's open block found
by token id, and a constrained answer's grammar placed after the reasoning."""

import pytest
from grammar_matching import grammar_takes

from pdserve.text.grammars import FREE_TEXT_LARK, check_grammar, json_schema_source
from pdserve.text.reasoning import ReasoningFormat, ReasoningParser, split_reasoning
from pdserve.text.tool_calls import DeepSeekToolCalls, ToolSpec
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.wire.sampling import Grammar

OUTPUT = "<think>\nLet me see: 2 < 3.</think>\n\nYes."


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(OUTPUT)])
def test_pieces_of_any_size_split_as_the_whole(size):
    parser, reasoning, content = ReasoningParser(opened=False), "", ""
    for start in range(0, len(OUTPUT), size):
        more_reasoning, more_content = parser.feed(OUTPUT[start:start + size])
        reasoning, content = reasoning + more_reasoning, content + more_content
    more_reasoning, more_content = parser.finish()
    assert (reasoning + more_reasoning, content + more_content) == ("\nLet me see: 2 < 3.", "\n\nYes.")
    assert split_reasoning(OUTPUT, opened=False) == ("\nLet me see: 2 < 3.", "\n\nYes.")


def test_where_the_reasoning_starts_and_what_is_left_open():
    assert split_reasoning("2 < 3.</think>Yes.", opened=True) == ("2 < 3.", "Yes.")  # the prompt opened it
    assert split_reasoning("Yes. <think>no</think>", opened=False) == ("", "Yes. <think>no</think>")  # not at the start
    assert split_reasoning("<think>cut off at max_tokens</thi", opened=False) == ("cut off at max_tokens</thi", "")
    assert split_reasoning("<thi", opened=False) == ("", "<thi")
    assert split_reasoning("", opened=True) == ("", "")


@pytest.fixture(scope="module")
def deepseek(tiny_v3_deepseek) -> PromptTokenizer:
    return PromptTokenizer(tiny_v3_deepseek)


def test_the_format_is_found_only_for_a_model_whose_template_thinks(deepseek, tiny_model_dir):
    found = ReasoningFormat.for_model(deepseek.tokenizer, deepseek.chat_template)
    assert found is not None and deepseek.tokenizer.id_to_token(found.end_id) == "</think>"
    assert ReasoningFormat.for_model(deepseek.tokenizer, "{{ messages }}") is None  # the tags, but no thinking
    tiny = PromptTokenizer(tiny_model_dir)
    assert ReasoningFormat.for_model(tiny.tokenizer, tiny.chat_template) is None  # no tags


def test_a_prompt_opens_the_reasoning_when_it_ends_inside_a_think_block(deepseek):
    found = ReasoningFormat.for_model(deepseek.tokenizer, deepseek.chat_template)
    messages = [{"role": "user", "content": "Is 2 < 3?"}]
    assert found.opened_by(deepseek.encode_chat(messages, thinking=True))
    assert not found.opened_by(deepseek.encode_chat(messages))
    closed = deepseek.encode("<think>x</think>", add_special_tokens=False)
    assert not found.opened_by(closed) and found.opened_by(closed + [found.start_id, 5])


def test_a_constrained_answer_comes_after_free_reasoning(deepseek, tiny_v3_deepseek):
    found = ReasoningFormat.for_model(deepseek.tokenizer, deepseek.chat_template)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    json_answer = Grammar("lark", found.after_reasoning("json_schema", json_schema_source(schema)))
    tools = DeepSeekToolCalls.for_tokenizer(deepseek.tokenizer)
    calls = Grammar("lark", found.after_reasoning("lark", tools.grammar([ToolSpec("f", {"type": "object"})], False)))
    free = Grammar("lark", found.after_reasoning("lark", FREE_TEXT_LARK))
    for grammar in (json_answer, calls, free):
        check_grammar(grammar.kind, grammar.source)
    assert grammar_takes(tiny_v3_deepseek, deepseek, json_answer, ['Think: {"a": no', found.end_id, '{"a":1}'])
    assert not grammar_takes(tiny_v3_deepseek, deepseek, json_answer, ["Think", found.end_id, "plain text"])
    eos = deepseek.tokenizer.token_to_id(deepseek.eos_token)
    assert grammar_takes(tiny_v3_deepseek, deepseek, json_answer, ["Think", found.end_id, '{"a":1}', eos])
    assert not grammar_takes(tiny_v3_deepseek, deepseek, json_answer, ['{"a":1}', eos])  # JSON as reasoning is no answer
    assert grammar_takes(tiny_v3_deepseek, deepseek, calls, ["Hmm", found.end_id, *tools_call_ids(deepseek)])
    assert not grammar_takes(tiny_v3_deepseek, deepseek, free, ["Think", found.end_id, "fine", found.end_id])


def tools_call_ids(tokenizer: PromptTokenizer) -> list:
    """One call of `f` with `{}` as the model writes it: marker tokens by id, the rest as text."""
    marker = tokenizer.tokenizer.token_to_id
    return [marker("<｜tool▁calls▁begin｜>"), marker("<｜tool▁call▁begin｜>"), "function", marker("<｜tool▁sep｜>"),
            "f\n```json\n{}\n```", marker("<｜tool▁call▁end｜>"), marker("<｜tool▁calls▁end｜>")]
