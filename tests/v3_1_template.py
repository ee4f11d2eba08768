"""A tiny checkpoint whose chat template writes tool calls as DeepSeek-V3.1 does: NAME<sep>ARGUMENTS, back to
back (the template is our own, for tests)."""

import json
import shutil
from pathlib import Path

V3_1_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<｜User｜>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<｜Assistant｜>{{ message['content'] }}"
    "{%- if message['tool_calls'] -%}<｜tool▁calls▁begin｜>{%- for call in message['tool_calls'] -%}"
    "<｜tool▁call▁begin｜>{{ call['function']['name'] }}<｜tool▁sep｜>{{ call['function']['arguments'] }}"
    "<｜tool▁call▁end｜>{%- endfor -%}<｜tool▁calls▁end｜>{%- endif -%}<｜end▁of▁sentence｜>"
    "{%- elif message['role'] == 'tool' -%}<｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜>"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"
)


def with_v3_1_template(model_dir: str, directory: Path, template: str = V3_1_TEMPLATE) -> str:
    """A copy of `model_dir` (a tiny checkpoint with DeepSeek's tokenizer) in `directory`, with the V3.1-style
    template (or `template`)."""
    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": template}, ensure_ascii=False))
    return str(directory)
