"""Trains and writes the byte-level BPE tokenizer of a tiny DeepSeek checkpoint.

Special tokens and chat templates follow DeepSeek's naming so code that looks for them by name works unchanged.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.model.tiny_corpus import TINY_CORPUS

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
V3_USER_TOKEN = "<｜User｜>"
V3_ASSISTANT_TOKEN = "<｜Assistant｜>"

# DeepSeek-V2-Chat style: plain-text role prefixes, the system prompt first, eos closing each assistant turn.
V2_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if message['role'] == 'user' %}User: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unsupported role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# DeepSeek-V3 style: role tokens instead of text prefixes.
V3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if message['role'] == 'user' %}" + V3_USER_TOKEN + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + V3_ASSISTANT_TOKEN + "{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unsupported role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + V3_ASSISTANT_TOKEN + "{% endif %}"
)


@dataclass(frozen=True)
class TinyTokenizerIds:
    """What config.json and generation_config.json need to know about the written tokenizer."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int


def special_tokens_for(arch: str) -> list[str]:
    if arch == "v2":
        return [BOS_TOKEN, EOS_TOKEN]
    if arch == "v3":
        return [BOS_TOKEN, EOS_TOKEN, V3_USER_TOKEN, V3_ASSISTANT_TOKEN]
    raise ValueError(f"arch must be 'v2' or 'v3', got {arch!r}")


def train_tiny_tokenizer(arch: str, vocab_size: int = 512) -> Tokenizer:
    """Byte-level BPE over TINY_CORPUS; specials take ids 0.. so bos=0 and eos=1 as in DeepSeek-V3."""
    specials = special_tokens_for(arch)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TINY_CORPUS, trainer)
    # Encoding a plain prompt starts with bos, as DeepSeek's tokenizers do.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
    )
    return tokenizer


def write_tiny_tokenizer(out_dir: Path, arch: str, model_max_length: int) -> TinyTokenizerIds:
    """Writes tokenizer.json and tokenizer_config.json; returns the ids the model config must agree with."""
    tokenizer = train_tiny_tokenizer(arch)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": V2_CHAT_TEMPLATE if arch == "v2" else V3_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    return TinyTokenizerIds(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
    )
