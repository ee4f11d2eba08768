"""A model's sampling defaults from its generation_config.json (Hugging Face's file), used where a request leaves a
setting out: temperature, top_p, top_k, repetition_penalty, max_new_tokens. `do_sample: false` means greedy."""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    repetition_penalty: float = 1.0
    max_tokens: int | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "GenerationDefaults":
        path = Path(model_dir) / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        greedy = config.get("do_sample") is False
        top_k = config.get("top_k")
        return cls(
            temperature=0.0 if greedy else float(config.get("temperature", 1.0)),
            top_p=float(config.get("top_p", 1.0)),
            top_k=int(top_k) if top_k else -1,
            repetition_penalty=float(config.get("repetition_penalty", 1.0)),
            max_tokens=config.get("max_new_tokens"),
        )
