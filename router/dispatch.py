"""Sending one generation to the workers: pick the prefill rank (policy) and, for a prefill worker, a decode rank;
send ONE GenerateRequest (to the decode worker, which drives the prefill itself, or to a `both` worker); retry on
another rank while no token has come back, migrate the stream to another decode path after (router/migration.py);
abort on the worker when the caller stops listening."""

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.wire.client import WorkerUnavailable
from pdserve.wire.protocol import GenerateRequest, Plan, PrefillSource, TokenEvent
from pdserve.wire.sampling import SamplingParams
from pdserve_router.errors import APIError
from pdserve_router.metrics import RouterMetrics
from pdserve_router.migration import Continuation, DetokenizerFactory
from pdserve_router.policies import LocalPrefillRule, LongStepAllowance, Policy, RoutingRequest, choose_decode
from pdserve_router.prefix_index import PrefixIndex, RankKey
from pdserve_router.workers import WorkerPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    prefill: RankKey  # where the prompt is computed (and its prefix looked up)
    target: RankKey  # where the GenerateRequest goes: the decode rank, or the prefill rank of a `both` worker
    plan: Plan
    matched_tokens: int


def no_workers_error(retry_after_s: int) -> APIError:
    return APIError(
        503, "no worker is available to serve this request; retry shortly", code="no_workers", type="server_error",
        headers={"Retry-After": str(retry_after_s)},
    )


class Dispatcher:
    def __init__(
        self, pool: WorkerPool, index: PrefixIndex, policy: Policy, metrics: RouterMetrics,
        max_attempts: int, first_token_timeout_s: float, retry_after_s: int,
        make_detokenizer: DetokenizerFactory, max_migrations: int = 2,
        local_prefill: LocalPrefillRule = LocalPrefillRule(), prefill_fallback: bool = True,
    ) -> None:
        self._pool = pool
        self._index = index
        self._policy = policy
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._max_migrations = max_migrations
        self._local_prefill = local_prefill
        self._prefill_fallback = prefill_fallback
        self._long_steps: dict[RankKey, LongStepAllowance] = collections.defaultdict(LongStepAllowance)
        self._make_detokenizer = make_detokenizer
        self._first_token_timeout_s = first_token_timeout_s
        self._retry_after_s = retry_after_s
        self._sequence = itertools.count()
        self._abort_tasks: set[asyncio.Task] = set()

    def can_serve(self) -> bool:
        """A `both` rank, or a decode rank with a prefill rank to pair with or the fallback (choose's candidates, none
        excluded)."""
        if self._pool.ranks_with_role(("both",)):
            return True
        return bool(self._pool.ranks_with_role(("decode",))) and (
            self._prefill_fallback or bool(self._pool.ranks_with_role(("prefill",))))

    def choose(self, prompt_token_ids: list[int], excluded: set[RankKey]) -> Route | None:
        decode_ranks = self._pool.candidates(("decode",), excluded)
        # A prefill rank needs a decode rank to pair with; a `both` rank does not.
        candidates = self._pool.candidates(("prefill", "both") if decode_ranks.keys else ("both",), excluded)
        if not candidates.keys:
            if not (self._prefill_fallback and decode_ranks.keys):
                return None
            # No prefill rank left (the pool is down, or each one failed this request): serve slower, not fail.
            decode = decode_ranks.keys[choose_decode(self._pool.loads_of(decode_ranks), next(self._sequence))]
            self._metrics.count_prefill_fallback()
            return Route(decode, decode, Plan(kind="both"), 0)
        matches = self._index.matched_tokens(prompt_token_ids)
        position = candidates.position
        by_position = {position[key]: tokens for key, tokens in matches.items() if key in position}
        sequence_number = next(self._sequence)
        request = RoutingRequest(prompt_len=len(prompt_token_ids), sequence_number=sequence_number)
        loads = self._pool.loads_of(candidates)
        chosen = self._policy(loads, by_position, request)
        prefill = candidates.keys[chosen]
        if self._pool.role_of(prefill[0]) == "both":
            return Route(prefill, prefill, Plan(kind="both"), matches.get(prefill, 0))
        decode = decode_ranks.keys[choose_decode(self._pool.loads_of(decode_ranks), sequence_number)]
        if self._local_prefill.enabled and self._local_prefill.prefill_on_decode(
                len(prompt_token_ids), int(loads.queue[chosen]), *self._pool.prefill_backlog(prefill),
                *self._pool.decode_backlog(decode), self._long_steps[decode], time.monotonic()):
            self._metrics.count_local_prefill()
            return Route(decode, decode, Plan(kind="both"), 0)
        plan = Plan(kind="decode", prefill=PrefillSource(url=prefill[0], rank=prefill[1]))
        return Route(prefill, decode, plan, matches.get(prefill, 0))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, arrival_s: float, choice: int = 0
    ) -> AsyncIterator[list[tuple[int, TokenEvent]]]:
        """The request's TokenEvents, each as (`choice`, event) so that a response merges several choices' batches
        without re-wrapping them, in the batches the worker's stream brought them. A worker failure before the first
        token retries on another rank (at most `max_attempts` ranks, then APIError(503), or the last worker's error
        event if it sent one); after it, the stream migrates to another decode path (at most `max_migrations` times,
        then an error event)."""
        continuation = Continuation(prompt_token_ids, sampling, self._make_detokenizer)
        excluded: set[RankKey] = set()
        failed_starts = 0
        last_error_event: TokenEvent | None = None
        for attempt in itertools.count():
            prompt = continuation.next_prompt()  # the prompt and what was streamed: one list, made once an attempt
            deciding_s = time.perf_counter()
            route = self.choose(prompt, excluded)
            self._metrics.observe_routing_decision(time.perf_counter() - deciding_s)
            if route is None:
                break
            self._note_route(route, attempt, continuation, prompt, arrival_s)
            attempt_id = f"{request_id}-{attempt}"  # unique per attempt: a half-started earlier one may linger
            worker_request = GenerateRequest(
                request_id=attempt_id, rank=route.target[1], prompt_token_ids=prompt,
                sampling=continuation.next_sampling(), plan=route.plan,
            )
            client = self._pool.client(route.target[0])
            worker_finished = finished = False  # the worker's stream ended / the request did (a router-side stop)
            failure: str | None = None
            target_refused = False  # the target never took the request: no prefill was asked for
            prefill_failed = False  # the target is fine: its hand-off's prefill side failed
            try:
                batches = client.generate_batches(worker_request, self._first_token_timeout_s)
                async with contextlib.aclosing(batches):
                    async for batch in batches:
                        absorbed = []
                        for event in batch:
                            if event.finish_reason == "error":
                                worker_finished, failure, last_error_event = True, event.error or "worker error", event
                                prefill_failed = event.prefill_failed
                                break
                            worker_finished = event.finish_reason is not None
                            absorbed.append((choice, continuation.absorb(event)))
                            if finished := absorbed[-1][1].finish_reason is not None:
                                break
                        if absorbed:
                            yield absorbed
                        if finished or failure is not None:
                            break
                if finished:
                    return
            except WorkerUnavailable as error:
                failure, target_refused = str(error), error.refused
                self._pool.report_failure(route.target[0])  # a dead prefill worker is ejected by its health checks
            finally:
                if not worker_finished:  # the caller left, the router stopped it, or it failed: free what it holds
                    self._abort_later(client, attempt_id)
            if not prefill_failed:  # else the same decode rank takes the retry, with another prefill rank
                excluded.add(route.target)
            if not continuation.started:
                logger.warning("request %s failed on %s before its first token: %s", request_id, route.target, failure)
                if not target_refused:
                    # The prefill may be at fault. A target that refused (a dead decode worker not yet ejected) never
                    # asked it for anything, and it may be the only prefill rank there is.
                    excluded.add(route.prefill)
                failed_starts += 1
                if failed_starts >= self._max_attempts:
                    break
                continue
            if continuation.migrations >= self._max_migrations:
                message = (f"the worker failed after {len(continuation.streamed_token_ids)} tokens and the request "
                           f"was already migrated {continuation.migrations} time(s): {failure}")
                yield [(choice, self._failed(attempt_id, message))]
                return
            logger.warning("request %s: %s failed after %d tokens (%s); migrating", request_id, route.target,
                           len(continuation.streamed_token_ids), failure)
            continuation.migrate()
            self._metrics.count_migration()
        if continuation.started:
            message = "the worker failed mid-stream and no other worker can continue it"
            yield [(choice, self._failed(request_id, message))]
        elif last_error_event is not None:
            yield [(choice, last_error_event)]
        else:
            raise no_workers_error(self._retry_after_s)

    def _note_route(self, route: Route, attempt: int, continuation: Continuation, prompt: list[int],
                    arrival_s: float) -> None:
        if attempt == 0:
            self._metrics.observe_queue(time.monotonic() - arrival_s)
            self._metrics.observe_prefix_match_ratio(route.matched_tokens / max(1, len(continuation.prompt_token_ids)))
        elif not continuation.started:
            self._metrics.count_retry()
        self._index.record_assignment(route.prefill, prompt)
        self._pool.note_assignment(route.prefill, len(prompt) - route.matched_tokens)
        if route.target != route.prefill:
            self._pool.note_assignment(route.target, 0)

    @staticmethod
    def _failed(request_id: str, message: str) -> TokenEvent:
        return TokenEvent(request_id, [], finish_reason="error", error=message)

    def _abort_later(self, client, request_id: str) -> None:
        # Runs while the caller's task is being cancelled, so the abort gets a task of its own.
        task = asyncio.create_task(client.abort(request_id))
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)
