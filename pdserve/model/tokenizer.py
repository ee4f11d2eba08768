"""The model's tokenizer (tokenizer.json) and how a text prompt becomes token ids (BOS as tokenizer_config.json says)."""

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


@dataclass(frozen=True)
class PromptEncoder:
    tokenizer: Tokenizer
    bos_token_id: int | None
    add_bos: bool

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids


def load_prompt_encoder(model_dir: str | Path, bos_token_id: int | None) -> PromptEncoder | None:
    """None when the model directory has no tokenizer.json (token-id prompts only)."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        return None
    tokenizer_config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text()) if tokenizer_config_path.is_file() else {}
    return PromptEncoder(
        tokenizer=Tokenizer.from_file(str(model_dir / "tokenizer.json")),
        bos_token_id=bos_token_id,
        add_bos=bool(tokenizer_config.get("add_bos_token", True)),
    )
