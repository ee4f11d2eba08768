import pytest
from transformers import AutoTokenizer

from pdserve.text.tokenizer import PromptError, PromptTokenizer

MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant."},
    {"role": "user", "content": "hello world, how are you today?"},
]


def test_chat_rendering_matches_hugging_face_apply_chat_template(tiny_model_dir):
    ours = PromptTokenizer(str(tiny_model_dir))
    theirs = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for add_generation_prompt in (True, False):
        expected_text = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.render_chat(MESSAGES, add_generation_prompt) == expected_text
        expected_ids = theirs.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=add_generation_prompt)
        if hasattr(expected_ids, "keys"):  # transformers 5 returns a BatchEncoding
            expected_ids = expected_ids["input_ids"]
        assert ours.encode_chat(MESSAGES, add_generation_prompt) == list(expected_ids)


def test_bos_token_given_as_added_token_dict_reaches_the_template(tiny_model_dir):
    rendered = PromptTokenizer(str(tiny_model_dir)).render_chat(MESSAGES)
    assert rendered.startswith("<s><|system|>") and rendered.endswith("<|assistant|>")


def test_completion_prompt_encoding_matches_hugging_face_with_bos(tiny_model_dir):
    ours = PromptTokenizer(str(tiny_model_dir))
    theirs = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "the quick brown fox"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode(text)[0] == ours.tokenizer.token_to_id("<s>")


def test_template_raise_exception_is_a_prompt_error_naming_messages(tiny_model_dir):
    with pytest.raises(PromptError) as caught:
        PromptTokenizer(str(tiny_model_dir)).render_chat([{"role": "wizard", "content": "hi"}])
    assert caught.value.param == "messages"
    assert "unknown role wizard" in str(caught.value)


def test_decode_round_trips_text(tiny_model_dir):
    tokenizer = PromptTokenizer(str(tiny_model_dir))
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
