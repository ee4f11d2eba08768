"""The offline API: `LLM(model=DIR).generate(prompts, sampling)` runs requests to completion in this process;
`chat(conversations, sampling)` renders each conversation with the model's chat template first."""

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine, InvalidRequestError
from pdserve.engine.request import PromptTokenLogprobs
from pdserve.wire.sampling import SamplingParams


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None  # per token: the most likely token ids -> log-probability
    # sampling.prompt_logprobs: per prompt token (the first None), its log-probability and the most likely token ids
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    cached_tokens: int = 0


class LLM:
    def __init__(self, model: str, **engine_options: Any):
        self.engine = Engine(EngineConfig(model=str(model), **engine_options))
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | None = None,
        sampling: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        progress: bool = False,
    ) -> list[GenerationResult]:
        """One result per prompt, in order. Give text `prompts` or `prompt_token_ids`, not both."""
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if self.engine.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer.json in the model directory")
            prompt_token_ids = [self.engine.tokenizer.encode(p) for p in prompts]
        assert prompt_token_ids is not None
        sampling = sampling or SamplingParams()
        sampling_list = sampling if isinstance(sampling, list) else [replace(sampling) for _ in prompt_token_ids]
        if len(sampling_list) != len(prompt_token_ids):
            raise InvalidRequestError(f"{len(sampling_list)} sampling params for {len(prompt_token_ids)} prompts")
        results: dict[str, GenerationResult] = {}
        for ids, params in zip(prompt_token_ids, sampling_list):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, ids, params)
            results[request_id] = GenerationResult(request_id, list(ids), logprobs=[] if params.logprobs else None,
                                                   top_logprobs=[] if params.top_logprobs else None)
        with tqdm(total=len(results), desc="generating", unit="req", disable=not progress) as bar:
            while self.engine.has_work():
                for out in self.engine.step():
                    result = results[out.request_id]
                    result.token_ids.extend(out.new_token_ids)
                    result.text += out.text
                    result.cached_tokens = out.cached_tokens
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    if result.logprobs is not None and out.new_logprobs:
                        result.logprobs.extend(out.new_logprobs)
                    if result.top_logprobs is not None and out.new_top_token_ids and out.new_top_logprobs:
                        result.top_logprobs.extend(dict(zip(ids, values)) for ids, values
                                                   in zip(out.new_top_token_ids, out.new_top_logprobs))
                    if out.finish_reason is not None:
                        result.finish_reason = out.finish_reason
                        bar.update(1)
        return list(results.values())

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        progress: bool = False,
        **template_kwargs: Any,
    ) -> list[GenerationResult]:
        """One result per conversation (a list of messages; one conversation alone is taken too), each rendered with
        the chat template and the generation prompt (`template_kwargs`: e.g. `tools`, or `thinking` for V3.1)."""
        if self.engine.tokenizer is None or self.engine.tokenizer.chat_template is None:
            raise InvalidRequestError("chat needs a tokenizer.json and a chat template in the model directory")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.engine.tokenizer.encode_chat(messages, **template_kwargs)  # type: ignore[arg-type]
                   for messages in conversations]
        return self.generate(sampling=sampling, prompt_token_ids=prompts, progress=progress)
