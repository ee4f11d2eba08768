"""Chooses each step's work: decodes first, then prefill chunks, under a token budget and the page supply.

Queues: a request waits in `waiting` until its first chunk fits, then sits in `running` until it finishes. When pages
run out, unlocked prefix-cache pages are evicted first; then the newest running request is preempted (its pages
freed, its computed pages left in the prefix cache) and goes back to the front of `waiting` to be recomputed.
The scheduler never touches tensors.
"""

from collections import deque
from dataclasses import dataclass

from pdserve.cache.page_allocator import PageAllocator, pages_for
from pdserve.cache.radix_cache import NullPrefixCache, RadixCache
from pdserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # Prefill tokens a step may carry beside decodes (None: the whole budget). A mixed step lasts the decodes' time
    # plus the chunk's, and every running request waits it out as one inter-token gap.
    mixed_prefill_tokens: int | None = None

    @property
    def prefill_tokens_beside_decodes(self) -> int:
        """The most prompt tokens a step computes beside running decodes."""
        cap = self.mixed_prefill_tokens
        return self.max_num_batched_tokens if cap is None else min(cap, self.max_num_batched_tokens)


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a next token is sampled."""
        return self.num_new_tokens == self.request.num_pending_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: PageAllocator, prefix_cache: RadixCache | NullPrefixCache):
        self.cfg = cfg
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose KV is already in its pages (decode after a KV transfer)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_work_to_schedule(self) -> bool:
        """Whether a next step would compute anything: a request whose last token is in flight needs nothing."""
        return bool(self.waiting) or any(not request.ends_when_resolved for request in self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.cfg.max_num_batched_tokens
        prefill_room: int | None = None  # tokens left for prefill chunks, set at the first chunk
        scheduled: list[ScheduledSeq] = []
        preempted = False
        # Decodes before prefill chunks, older before newer.
        for request in sorted(self.running, key=lambda r: (r.is_prefilling, r.arrival_s)):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.ends_when_resolved:
                continue  # its last token is in flight: computing past it would be discarded
            pending = request.num_pending_tokens
            prefilling = pending > 1
            num_new = min(pending, budget)
            if prefilling:
                if prefill_room is None:  # decodes come first, so whatever is scheduled by now decodes
                    prefill_room = self._prefill_room(budget, beside_decodes=bool(scheduled))
                num_new = min(num_new, prefill_room)
                if num_new == 0:
                    break  # the rest are prefill chunks too
            while not self._grow(request, num_new):
                # never a request already given work this step, nor one about to end (a prefill-only request keeps
                # its pages for the KV transfer)
                unscheduled = [r for r in self.running if all(r is not seq.request for seq in scheduled)
                               and not r.ends_when_resolved]
                victim = max(unscheduled, key=lambda r: r.arrival_s)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                scheduled.append(ScheduledSeq(request, num_new))
                budget -= num_new
                if prefilling:
                    prefill_room -= num_new
        if prefill_room is None:
            prefill_room = self._prefill_room(budget, beside_decodes=bool(scheduled))
        while (self.waiting and budget > 0 and prefill_room > 0 and not preempted
               and len(self.running) < self.cfg.max_num_seqs):
            request = self.waiting[0]
            self._match_prefix(request)
            num_new = min(request.num_pending_tokens, budget, prefill_room)
            if not self._grow(request, num_new):
                self._release_pages(request)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledSeq(request, num_new))
            budget -= num_new
            prefill_room -= num_new
        return scheduled

    def _prefill_room(self, budget: int, beside_decodes: bool) -> int:
        return min(budget, self.cfg.prefill_tokens_beside_decodes) if beside_decodes else budget

    def advance(self, scheduled: list[ScheduledSeq]) -> None:
        """Record the KV computed by a step; cache a prompt's pages as soon as its prefill completes."""
        for seq in scheduled:
            request = seq.request
            request.num_computed_tokens += seq.num_new_tokens
            if seq.samples and seq.num_new_tokens > 1:
                self._cache_pages(request)

    def finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._cache_pages(request)
        if not request.keep_pages_on_finish:
            self._release_pages(request)

    def release_kept_pages(self, request: Request) -> None:
        self._release_pages(request)

    def _match_prefix(self, request: Request) -> None:
        if request.page_ids or request.needs_prompt_logprobs:  # a cached prefix has no logits to give
            return
        match = self.prefix_cache.match_prefix(request.all_token_ids[:-1])  # at least one token is computed
        request.page_ids = list(match.page_ids)
        request.num_computed_tokens = match.num_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = match.num_tokens

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        """Give the request enough pages for num_new_tokens more tokens; False if the pool cannot."""
        page_size = self.cfg.page_size
        needed = pages_for(request.num_computed_tokens + num_new_tokens, page_size) - len(request.page_ids)
        if needed <= 0:
            return True
        pages = self.prefix_cache.alloc_or_evict(needed)
        if pages is None:
            return False
        request.page_ids.extend(pages)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._cache_pages(request)
        self._release_pages(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _cache_pages(self, request: Request) -> None:
        if request.num_computed_tokens >= self.cfg.page_size:
            self.prefix_cache.insert(request.all_token_ids[: request.num_computed_tokens], request.page_ids)

    def _release_pages(self, request: Request) -> None:
        self.allocator.decref(request.page_ids)
        request.page_ids = []
        request.num_computed_tokens = 0
