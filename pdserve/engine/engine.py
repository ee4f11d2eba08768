"""One DP rank's engine: admits requests, steps the model under continuous batching, and reports what each step made.

Overlapped scheduling (`EngineConfig.overlap_scheduling`): a step's sampled tokens stay on the device as the next
step's input ids and reach the host asynchronously, so the host schedules and prepares step N+1 while the device
computes step N, and `step()` returns what the step before it sampled. A request that ends on a token (EOS, a stop
token or string) is therefore seen to end one step late: the token it computed meanwhile is discarded, never emitted.
Ends that the host knows without the token's value (max_tokens, the context length) are not scheduled past.
"""

import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdserve.cache.host_tier import HostTier
from pdserve.cache.page_allocator import PageAllocator, pages_for
from pdserve.cache.radix_cache import NullPrefixCache, RadixCache
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import decode_graph_config
from pdserve.engine.device_values import on_device
from pdserve.engine.expert_rebalance import ExpertRebalancer
from pdserve.engine.host_kv_pool import HostKVPool
from pdserve.engine.in_flight import InFlightStep
from pdserve.engine.logits_processing import LogitsProcessing
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.piecewise_graphs import piecewise_graph_config
from pdserve.engine.request import PromptTokenLogprobs, Request, RequestStatus
from pdserve.engine.sampler import SampleResult, sample, sample_on_device, skip_draws
from pdserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from pdserve.engine.simulated import SimulatedRunner
from pdserve.engine.stats import EngineStats
from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
from pdserve.engine.step_shape import StepShape, step_shape
from pdserve.model.compiled_layers import compile_layers, wants_compiled_layers
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.model.loader import build_model, load_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.expert_load import ExpertCountsReader, ExpertLoad
from pdserve.ops.moe import ExpertRange, MoEBackend
from pdserve.ops.moe_ep import ExpertParallelMoE
from pdserve.ops.select import select_backends
from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.tokenizer import PromptTokenizer, has_tokenizer
from pdserve.wire.kv_events import KVEvent
from pdserve.wire.sampling import SamplingParams

log = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request the engine cannot run as given (empty prompt, too long, unknown token id...)."""


class NoCapacityError(RuntimeError):
    """The rank cannot take the request now (its KV pool is full, or every sequence slot is taken); another rank or a
    retry may."""


@dataclass(frozen=True)
class ReservedPages:
    """Pages reserved for a prompt that another rank will write. `settled` (CUDA) completes once every step launched
    before the reservation has run: only then may the page ids leave this rank."""

    page_ids: list[int]
    settled: torch.cuda.Event | None


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    new_top_token_ids: list[list[int]] | None = None
    new_top_logprobs: list[list[float]] | None = None
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # sampling.prompt_logprobs, on a request's first output: per prompt token (the first None)
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_keep_fp8(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FP8 weights stay FP8: `auto` keeps them where the FP8 kernels run (bf16 on CUDA, Triton present)."""
    if name == "auto":
        return device.type == "cuda" and dtype == torch.bfloat16 and importlib.util.find_spec("triton") is not None
    return name == "keep"


class Engine:
    def __init__(self, cfg: EngineConfig, experts: ExpertRange | None = None,
                 on_kv_events: Callable[[list[KVEvent]], None] | None = None,
                 wrap_moe: Callable[[MoEBackend], MoEBackend] | None = None):
        """`experts`: the routed experts this rank loads (default all); `wrap_moe`: wraps the configured MoE backend
        (expert parallelism puts its exchange around it, and runs its received rows through it)."""
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.overlap_scheduling = cfg.overlap_scheduling == "on" or (cfg.overlap_scheduling == "auto"
                                                                    and self.device.type == "cuda")
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model_config = ModelConfig.from_dir(cfg.model)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        if cfg.execution == "simulated":
            if wrap_moe is not None:
                raise ValueError("a simulated engine has no experts to place: expert parallelism needs the model")
            profile = StepProfile.load(cfg.profile or DEFAULT_PROFILE)
            num_pages = cfg.num_pages or max(2, profile.kv_pool_tokens // cfg.page_size)
            self.runner: ModelRunner | SimulatedRunner = SimulatedRunner(
                profile, self.model_config.vocab_size, num_pages, cfg.page_size, cfg.time_scale, cfg.seed)
            self.expert_weight_bytes, described = 0, f"simulated ({profile.name})"
            self.fixed_exchange: ExpertParallelMoE | None = None
            self._expert_counts: ExpertCountsReader | None = None
            self._rebalancer: ExpertRebalancer | None = None
        else:
            model = self._build_model(cfg, experts, wrap_moe)
            exchange = model.backends.moe if isinstance(model.backends.moe, ExpertParallelMoE) else None
            if cfg.redundant_experts and exchange is None:
                raise ValueError("redundant_experts needs expert parallelism (a worker's --expert-parallel)")
            self._rebalancer = ExpertRebalancer(model, exchange, cfg.redundant_experts, cfg.expert_rebalance_steps) \
                if cfg.redundant_experts else None
            # Under expert parallelism a graph holds the fixed-capacity exchange; with split sizes nothing can.
            use_graphs = cfg.cuda_graphs and (exchange is None or cfg.expert_exchange != "splits")
            graphs = decode_graph_config(use_graphs, model, cfg.max_num_seqs, self.max_model_len, cfg.page_size)
            # The exchange the ranks agree on before each step: none where every step exchanges split sizes.
            fixed = cfg.expert_exchange == "fixed" or graphs is not None
            self.fixed_exchange = exchange if fixed else None
            if self.fixed_exchange is not None and self._wants_peer_writes(self.fixed_exchange):
                # before the KV pool takes what is free: the exchange's buffers are device memory too
                mapped = self.fixed_exchange.use_peer_writes(
                    graphs.batch_sizes[-1] if graphs else cfg.max_num_seqs, self.model_config.num_experts_per_tok,
                    self.model_config.hidden_size, self.dtype, self.device)
                if not mapped and cfg.expert_peer_writes == "on":
                    raise RuntimeError("expert_peer_writes is on, but some rank could not map its peers' memory")
            num_pages = cfg.num_pages or self._pages_that_fit()
            compiled = compile_layers(model) if wants_compiled_layers(cfg.compile_layers, model) else None
            piecewise = piecewise_graph_config(cfg.piecewise_graphs, graphs is not None, model,
                                               cfg.max_num_batched_tokens)
            self.runner = ModelRunner(model, num_pages, cfg.page_size, self.device, self.dtype, graphs,
                                      self.fixed_exchange, compiled, cfg.compile_eager_steps, piecewise)
            self.expert_weight_bytes = model.routed_expert_bytes()
            load = model.backends.expert_load
            self._expert_counts = ExpertCountsReader(load) if load is not None else None
            described = (f"routed experts [{model.expert_range.first}, +{model.expert_range.count}): "
                         f"{self.expert_weight_bytes} bytes")
        self.allocator = PageAllocator(num_pages)
        host_tier = None
        if cfg.host_kv_cache_gib:
            host_pool = HostKVPool(self.runner.kv_cache, cfg.host_kv_cache_gib)
            host_tier = HostTier(host_pool.num_slots, host_pool.to_host, host_pool.to_device)
        self.prefix_cache = (RadixCache(self.allocator, cfg.page_size, on_kv_events, host_tier)
                             if cfg.enable_prefix_cache else NullPrefixCache(self.allocator))
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.page_size, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.mixed_prefill_tokens),
            self.allocator, self.prefix_cache,
        )
        self.tokenizer = PromptTokenizer(cfg.model) if has_tokenizer(cfg.model) else None
        self.logits_processing = LogitsProcessing(
            Path(cfg.model) / "tokenizer.json" if self.tokenizer is not None else None,
            self.model_config.vocab_size, list(self.model_config.eos_token_ids),
        )
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._seed_source = torch.Generator().manual_seed(cfg.seed)
        self._prefix_queries_tokens = self._prefix_hits_tokens = 0
        self._prompt_tokens = self._generation_tokens = 0
        self.last_step = StepShape()  # what the last step computed (the step trace times it)
        self.last_step_wait_s = 0.0  # of the last step() call, the host's wait for the device (a step in flight)
        self._in_flight: InFlightStep | None = None  # the overlapped step whose tokens the host has not read yet
        log.info("engine ready: %s pages of %s tokens on %s (%s); %s", num_pages, cfg.page_size, self.device,
                 self.dtype, described)

    def _build_model(self, cfg: EngineConfig, experts: ExpertRange | None,
                     wrap_moe: Callable[[MoEBackend], MoEBackend] | None) -> DeepseekForCausalLM:
        mc = self.model_config
        backends = select_backends(cfg.attention_backend, cfg.moe_backend, self.device, self.dtype,
                                   mla_widths=(mc.kv_lora_rank, mc.qk_rope_head_dim))
        if wrap_moe is not None:
            backends = replace(backends, moe=wrap_moe(backends.moe))
        if mc.n_routed_experts:
            backends = replace(backends, expert_load=ExpertLoad.zeros(mc.num_hidden_layers, mc.n_routed_experts,
                                                                      self.device))
        keep_fp8 = resolve_keep_fp8(cfg.fp8_weights, self.device, self.dtype)
        if keep_fp8 and mc.fp8_block_size is not None and mc.n_routed_experts and self.device.type == "cuda":
            from pdserve.ops import cutlass_fp8

            cutlass_fp8.available(self.device)  # builds the prefill experts' kernel now (once a host), not mid-step
        if cfg.load_format == "random":
            model = build_model(self.model_config, backends, self.device, self.dtype, experts, keep_fp8)
            return init_random_weights(model, cfg.seed)
        return load_model(cfg.model, self.model_config, backends, self.device, self.dtype, experts, cfg.progress,
                          keep_fp8)

    def _wants_peer_writes(self, exchange: ExpertParallelMoE) -> bool:
        setting = self.cfg.expert_peer_writes
        if setting == "off" or self.device.type != "cuda" or exchange.world_size < 2:
            return False
        return setting == "on" or exchange.peer_writes_possible()  # a collective: every rank decides alike

    def _pages_that_fit(self) -> int:
        mc = self.model_config
        page_bytes = mc.num_hidden_layers * self.cfg.page_size * mc.kv_dim * torch.finfo(self.dtype).bits // 8
        if self.device.type == "cuda":
            # Blocks the caching allocator kept from loading (finish_weights replaces each layer's experts with a
            # larger stacked copy; V2-Lite left ~28 GB behind) are free for the pool: mem_get_info counts them as used.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.cfg.gpu_memory_fraction) * total
        else:
            budget = self.cfg.kv_cache_memory_gib * 2**30
        return max(2, int(budget // page_bytes))

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> Request:
        request = self._new_request(request_id, prompt_token_ids, sampling)
        self.scheduler.add(request)
        return request

    def _new_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> Request:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        if bad := [t for t in prompt_token_ids if not 0 <= t < vocab]:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if sampling.continued_tokens >= len(prompt_token_ids):
            raise InvalidRequestError(f"continued_tokens ({sampling.continued_tokens}) must be fewer than the prompt's "
                                      f"{len(prompt_token_ids)} tokens")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens; the context is {self.max_model_len}, leaving no room to generate"
            )
        longest = min(len(prompt_token_ids) + sampling.max_tokens, self.max_model_len)
        if pages_for(longest, self.cfg.page_size) > self.allocator.num_pages:
            raise InvalidRequestError(
                f"request may reach {longest} tokens, more than the KV pool holds "
                f"({self.allocator.num_pages} pages of {self.cfg.page_size}); lower max_tokens"
            )
        if sampling.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer.json in the model directory")
        try:
            self.logits_processing.check(sampling)
            grammar = self.logits_processing.grammar_for(sampling, prompt_token_ids)
        except ValueError as error:
            raise InvalidRequestError(str(error)) from None
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        if sampling.seed is not None and not sampling.greedy:  # drawn on the worker that made them
            skip_draws(generator, vocab, sampling.continued_tokens)
        request = Request(request_id, list(prompt_token_ids), sampling, generator, grammar=grammar)
        self.requests[request_id] = request
        if self.tokenizer is not None:
            self.detokenizers[request_id] = self.tokenizer.detokenizer(request.prompt_token_ids, sampling.stop)
        return request

    # --- disaggregation: a prefill rank keeps a finished prompt's pages for the transfer; a decode rank
    # reserves pages, lets the prefill rank fill them, then decodes from the first token it sampled.
    def add_prefill_only(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> Request:
        request = self._new_request(request_id, prompt_token_ids, replace(sampling, max_tokens=1, stop=[]))
        request.keep_pages_on_finish = True
        self.scheduler.add(request)
        return request

    def release(self, request_id: str) -> None:
        """Free the pages a finished prefill-only request kept for its transfer."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.release_kept_pages(request)

    def reserve(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> ReservedPages:
        """Pages for the whole prompt, to be written by a prefill rank; raises NoCapacityError if the pool is full or
        the rank already holds max_num_seqs sequences (running or reserved: a decode batch never outgrows the largest
        captured graph, whose steps would otherwise run eagerly at several times the time)."""
        if len(self.requests) >= self.cfg.max_num_seqs:
            raise NoCapacityError(f"all {self.cfg.max_num_seqs} sequence slots are taken")
        num_pages = pages_for(len(prompt_token_ids), self.cfg.page_size)
        growth = self.growth_pages()
        if self.available_pages - num_pages < growth:
            raise NoCapacityError(f"no room for {num_pages} pages beside the {growth} the held sequences' next "
                                  f"tokens take ({self.allocator.num_free} free)")
        request = self._new_request(request_id, prompt_token_ids, sampling)
        pages = self.prefix_cache.alloc_or_evict(num_pages)
        if pages is None:
            self._forget(request)
            raise NoCapacityError(f"no room for {num_pages} pages ({self.allocator.num_free} free)")
        request.page_ids = pages
        settled = None
        if self.device.type == "cuda":
            # A remote rank writes these pages without regard to our stream: pages freed while a launched step may
            # still write them (an overlapped step of a request that ended, was aborted or preempted) must wait for
            # it before their ids leave this rank. The caller waits, off the step thread, which steps on meanwhile.
            settled = torch.cuda.Event()
            settled.record(torch.cuda.current_stream(self.device))
        return ReservedPages(pages, settled)

    @property
    def available_pages(self) -> int:
        """Pages a new sequence can take: free ones and those only the prefix cache holds (evicted on demand)."""
        return self.allocator.num_free + self.prefix_cache.num_cached_pages

    def growth_pages(self) -> int:
        """Pages the held sequences (running, reserved, preempted) still need for up to `decode_reserve_tokens` more
        tokens each, fewer where max_tokens or the context ends sooner."""
        reserve, page_size = self.cfg.decode_reserve_tokens, self.cfg.page_size
        if not reserve:
            return 0
        pages = 0
        for request in self.requests.values():
            length = len(request.prompt_token_ids) + len(request.output_token_ids)
            more = min(reserve, request.sampling.max_tokens - len(request.output_token_ids))
            pages += max(0, pages_for(min(length + more, self.max_model_len), page_size) - len(request.page_ids))
        return pages

    def start_decoding(self, request_id: str, first: RequestOutput) -> RequestOutput:
        """The reserved pages now hold the prompt's KV: decode on from the prefill rank's first token (`first`:
        what the prefill rank produced; its grammar state is re-created here by accepting that token)."""
        request = self.requests[request_id]
        request.num_computed_tokens = len(request.prompt_token_ids)
        if request.sampling.seed is not None and not request.sampling.greedy:  # the prefill rank drew it from the seed
            skip_draws(request.generator, self.model_config.vocab_size, 1)
        self.scheduler.add_running(request)
        # The prefill rank prefilled the prompt and sampled this token, and counted both: not counted again here.
        return self._append_token(request, first, counted_elsewhere=True)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.keep_pages_on_finish = False
        self.scheduler.finish(request, "abort")
        self._forget(request)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def stats(self) -> EngineStats:
        host = self.prefix_cache.host_tier
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            held=len(self.requests),
            free_pages=self.allocator.num_free,
            total_pages=self.allocator.num_pages,
            prefix_cache_pages=self.prefix_cache.num_cached_pages,
            host_cache_pages=host.num_pages if host else 0,
            host_cache_offloaded_pages=host.offloaded_pages if host else 0,
            host_cache_loaded_pages=host.loaded_pages if host else 0,
            prefix_queries_tokens=self._prefix_queries_tokens,
            prefix_hits_tokens=self._prefix_hits_tokens,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            growth_pages=self.growth_pages(),
            queued_prompt_tokens=(sum(r.num_pending_tokens for r in self.scheduler.waiting)
                                  + sum(r.num_pending_tokens for r in self.scheduler.running if r.is_prefilling)),
            expert_weight_bytes=self.expert_weight_bytes,
            expert_exchange_overflows=self.fixed_exchange.exchange.overflow_steps if self.fixed_exchange else 0,
            expert_peer_writes=self.fixed_exchange is not None and self.fixed_exchange.peer is not None,
            expert_tokens=self._expert_counts.per_expert() if self._expert_counts is not None else [],
            expert_replica_slots_filled=self._rebalancer.slots_filled if self._rebalancer is not None else 0,
        )

    # --- the step -------------------------------------------------------------------------------------------
    def step(self, force_forward: bool = False) -> list[RequestOutput]:
        """One scheduled forward pass. `force_forward` runs it even with nothing scheduled (an empty batch), so
        that expert-parallel ranks stepping in lockstep all join the same collectives. Overlapped, the outputs are
        those of the step before (read while this one runs), plus this step's when it had to run synchronously."""
        previous, self._in_flight = self._in_flight, None
        self.last_step_wait_s = 0.0
        scheduled = self.scheduler.schedule()
        self.last_step = step_shape(scheduled)
        if not scheduled and not force_forward:
            return self._resolve(previous)
        logits = self._execute(scheduled, previous)
        if not scheduled:
            return self._resolve(previous)
        self.scheduler.advance(scheduled)
        sampling_requests = [seq.request for seq in scheduled if seq.request.num_pending_tokens == 0]
        if not sampling_requests:
            return self._resolve(previous)
        if self.overlap_scheduling and not self.logits_processing.needs_sync(sampling_requests):
            self._in_flight = self._launch_sample(logits, sampling_requests)
            outputs = self._resolve(previous)
            if not self.scheduler.has_work_to_schedule:
                # Nothing to prepare while this step runs (its requests all end on their length): read it now, not
                # one call later (a prefill-only request on an idle prefill rank hands off a step sooner).
                outputs += self._resolve(self._in_flight)
                self._in_flight = None
            return outputs
        # Synchronously: this step's processing may read the previous step's tokens (a grammar's mask, penalties),
        # and requests that ended on one of them drop out (their rows' logits were computed past their end).
        outputs = self._resolve(previous)
        rows = [row for row, request in enumerate(sampling_requests) if request.status is not RequestStatus.FINISHED]
        if len(rows) < len(sampling_requests):
            logits = logits[on_device(rows, logits.device)]
            sampling_requests = [sampling_requests[row] for row in rows]
        if not sampling_requests:
            return outputs
        processing = self.logits_processing.for_batch(sampling_requests)
        result = sample(logits, [r.sampling for r in sampling_requests], [r.generator for r in sampling_requests],
                        processing.banned_token_ids, processing.apply)
        return outputs + [self._append_token(request, _sampled(result, i, request.sampling))
                          for i, request in enumerate(sampling_requests)]

    def _execute(self, scheduled: list[ScheduledSeq], previous: InFlightStep | None) -> torch.Tensor:
        """The forward pass; under expert parallelism with the fixed-capacity exchange, the ranks first agree on the
        step's size (every rank calls this, an idle one with nothing scheduled), and a step in which some rank's
        pairs overflowed runs again with split sizes on every rank (rewriting the same KV slots)."""
        exchange = self.fixed_exchange
        if exchange is None:
            logits = self.runner.execute(scheduled, previous)
        else:
            fixed_tokens = exchange.agree_fixed_tokens(self.runner.fixed_step_tokens(scheduled))
            logits = self.runner.execute(scheduled, previous, fixed_tokens)
            if (fixed_tokens is not None and exchange.may_overflow(fixed_tokens, self.model_config.num_experts_per_tok)
                    and exchange.overflowed_anywhere()):
                logits = self.runner.execute(scheduled, previous)
        if self._rebalancer is not None:
            self._rebalancer.after_step()
        self.last_step_wait_s += self.runner.take_device_wait_s()
        return logits

    def _launch_sample(self, logits: torch.Tensor, requests: list[Request]) -> InFlightStep:
        """Sample on the device and start the copy to the host; each request counts one more unresolved token."""
        processing = self.logits_processing.for_batch(requests)
        drawn = sample_on_device(logits, [r.sampling for r in requests], [r.generator for r in requests],
                                 processing.banned_token_ids, processing.apply)
        for request in requests:
            request.num_unresolved_tokens += 1
            request.ends_when_resolved = (request.num_output_tokens >= request.sampling.max_tokens
                                          or request.num_tokens >= self.max_model_len)
        return InFlightStep.launch(requests, drawn)

    def _resolve(self, in_flight: InFlightStep | None) -> list[RequestOutput]:
        """Append what an overlapped step sampled once it is on the host (waiting for it if it still runs). Rows of
        requests that ended meanwhile (on the step before's token, or aborted) are discarded."""
        if in_flight is None:
            return []
        waited_from_s = time.perf_counter()
        result = in_flight.result()
        self.last_step_wait_s += time.perf_counter() - waited_from_s
        outputs = []
        for row, request in enumerate(in_flight.requests):
            if request.status is RequestStatus.FINISHED:
                continue
            request.num_unresolved_tokens -= 1
            outputs.append(self._append_token(request, _sampled(result, row, request.sampling)))
        return outputs

    def _append_token(self, request: Request, sampled: RequestOutput, counted_elsewhere: bool = False) -> RequestOutput:
        """Append the one token of `sampled` (its token and log-probabilities) and say what it means for the request.
        `counted_elsewhere`: another rank prefilled the prompt and sampled this token, and counted both."""
        token_id = sampled.new_token_ids[0]
        logprob = sampled.new_logprobs[0] if sampled.new_logprobs else None
        if not counted_elsewhere:
            if not request.output_token_ids:
                self._prefix_queries_tokens += len(request.prompt_token_ids)
                self._prefix_hits_tokens += request.num_cached_tokens
                self._prompt_tokens += len(request.prompt_token_ids)
            self._generation_tokens += 1
        request.output_token_ids.append(token_id)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        sampling = request.sampling
        text, stop_hit = "", False
        detokenizer = self.detokenizers.get(request.request_id)
        if detokenizer is not None:
            text, stop_hit = detokenizer.push([token_id])
        grammar_complete = self.logits_processing.accept(request, token_id)
        finish_reason = "stop" if stop_hit or grammar_complete else self.token_ends(
            sampling, token_id, len(request.prompt_token_ids), len(request.output_token_ids))
        if finish_reason is not None:
            # Overlapped: a token sampled past the end is discarded (its step's row is skipped when it resolves).
            request.num_unresolved_tokens, request.ends_when_resolved = 0, False
            # A prefill-only request goes on on a decode rank, whose detokenizer releases held-back bytes later.
            if detokenizer is not None and not stop_hit and not request.keep_pages_on_finish:
                text += detokenizer.flush()
            self.scheduler.finish(request, finish_reason)
            self._forget(request)
        first_of_prompt = len(request.output_token_ids) == 1
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            new_logprobs=[logprob] if logprob is not None else None,
            new_top_token_ids=sampled.new_top_token_ids,
            new_top_logprobs=sampled.new_top_logprobs,
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=request.num_cached_tokens,
            # a decode rank that received the KV computed none: the prefill rank's first event carries them
            prompt_logprobs=(request.prompt_logprobs if first_of_prompt and request.prompt_logprobs
                             and not request.needs_prompt_logprobs else None),
        )

    def token_ends(self, sampling: SamplingParams, token_id: int, prompt_tokens: int,
                   output_tokens: int) -> str | None:
        """How an output token ends its request by its id and the lengths alone (an EOS or stop token id, max_tokens,
        the context), `output_tokens` counting it; None: it does not. Reads only settings fixed at start, so any
        thread may ask; stop strings and grammars are the engine's own to judge."""
        if token_id in sampling.stop_token_ids or (not sampling.ignore_eos
                                                   and token_id in self.model_config.eos_token_ids):
            return "stop"
        if output_tokens >= sampling.max_tokens or prompt_tokens + output_tokens >= self.max_model_len:
            return "length"
        return None

    def _forget(self, request: Request) -> None:
        if not request.keep_pages_on_finish:
            self.requests.pop(request.request_id, None)
        self.detokenizers.pop(request.request_id, None)


def _sampled(result: SampleResult, row: int, sampling: SamplingParams) -> RequestOutput:
    """Row `row` of a sample as a one-token output (log-probabilities only where the request asked)."""
    wants = sampling.logprobs or sampling.top_logprobs > 0
    output = RequestOutput("", [result.token_ids[row]],
                           [result.logprobs[row]] if wants and result.logprobs is not None else None)
    if sampling.top_logprobs and result.top_token_ids is not None and result.top_logprobs is not None:
        output.new_top_token_ids = [result.top_token_ids[row]]
        output.new_top_logprobs = [result.top_logprobs[row]]
    return output
