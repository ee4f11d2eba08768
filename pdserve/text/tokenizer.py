"""A model's tokenizer for prompts, used by the router (so prefixes are matched on token ids) and the offline `LLM`:
tokenizer.json through `tokenizers`, chat messages rendered with the model's Jinja chat template the way Hugging Face
renders it.

One BOS rule everywhere: a text prompt gets what tokenizer.json's post-processor adds (Hugging Face's
`add_special_tokens=True`); a rendered chat gets none, since the template writes any BOS itself."""

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pdserve.text.detokenizer import IncrementalDetokenizer

SHORT_TEXT_CHARS = 1024  # up to this, text is encoded on the calling thread, holding the GIL


class PromptError(ValueError):
    """The messages cannot be rendered for this model; `param` names the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class _TemplateRaised(Exception):
    """Raised by a template's raise_exception(): the messages are not acceptable to this model."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # HF's tojson keeps non-ASCII text as is (jinja's default filter escapes it and HTML characters).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _special_token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict with `content`."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def has_tokenizer(model_dir: str | Path) -> bool:
    return (Path(model_dir) / "tokenizer.json").is_file()


class PromptTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        directory = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        # Token ids a prompt may hold: the model's embedding rows when config.json is there (often more than the
        # tokenizer's entries), else the tokenizer's.
        model_config_path = directory / "config.json"
        model_config = json.loads(model_config_path.read_text()) if model_config_path.exists() else {}
        self.vocab_size = int(model_config.get("vocab_size") or self.tokenizer.get_vocab_size(with_added_tokens=True))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _special_token_text(config.get("bos_token"))
        self.eos_token = _special_token_text(config.get("eos_token"))
        template = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template
        self._compiled = None
        if template is not None:
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.filters["tojson"] = _tojson
            environment.globals["raise_exception"] = _raise_exception
            environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = environment.from_string(template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call drops the GIL while it works (a single encode holds it), so other threads run meanwhile; a
        # short text is encoded holding it: handing it to the batch call's own threads costs more than the work.
        if len(text) <= SHORT_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def detokenizer(self, prompt_token_ids: list[int], stop: list[str]) -> IncrementalDetokenizer:
        """The workers' incremental detokenizer (same algorithm, same tokenizer.json): text of a migrated stream."""
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        if self._compiled is None:
            raise PromptError("this model has no chat template; use /v1/completions")
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **template_kwargs,
            )
        except _TemplateRaised as error:
            raise PromptError(f"chat template rejected the messages: {error}") from None
        except (TemplateError, TypeError, ValueError, KeyError) as error:
            raise PromptError(f"chat template failed on the messages: {error}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        # The template writes any BOS itself, so the tokenizer adds none (as HF's apply_chat_template does).
        return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs), add_special_tokens=False)
