"""Route choice for disaggregated and `both` workers, on a plain stub of the worker pool's snapshots."""

from pdserve.wire.block_hash import prefix_page_hashes
from pdserve.wire.kv_events import KVEvent
from pdserve.wire.protocol import KVEventBatch, Plan, PrefillSource, RankLoad
from pdserve_router.dispatch import Dispatcher
from pdserve_router.metrics import RouterMetrics
from pdserve_router.policies import LocalPrefillRule, make_policy
from pdserve_router.prefix_index import PrefixIndex


class StubPool:
    def __init__(self, roles: dict[str, tuple[str, int]], loads: dict | None = None) -> None:
        self.roles = roles  # url -> (role, number of ranks)
        self._loads = loads or {}

    def ranks_with_role(self, roles):
        return [(url, r) for url, (role, count) in sorted(self.roles.items()) if role in roles for r in range(count)]

    def role_of(self, url):
        return self.roles[url][0]

    def loads(self):
        return self._loads


def dispatcher(pool, index=None, policy="prefix", local_prefill=LocalPrefillRule()) -> Dispatcher:
    return Dispatcher(pool, index or PrefixIndex(), make_policy(policy, 1.0, 0.5), RouterMetrics("tiny", policy),
                      max_attempts=3, first_token_timeout_s=5, retry_after_s=1, make_detokenizer=None,
                      local_prefill=local_prefill)


def test_disaggregated_route_sends_to_decode_rank_with_the_prefill_rank_as_source():
    pool = StubPool({"http://p": ("prefill", 2), "http://d": ("decode", 1)})
    index = PrefixIndex()
    for rank in (0, 1):
        index.add_rank(("http://p", rank), 4)
    prompt = list(range(32))
    index.apply(("http://p", 1), KVEventBatch(1, 0, [KVEvent("cleared"), KVEvent("stored", prefix_page_hashes(prompt, 4))]))
    route = dispatcher(pool, index).choose(prompt, excluded=set())
    assert route.prefill == ("http://p", 1) and route.target == ("http://d", 0)
    assert route.plan == Plan(kind="decode", prefill=PrefillSource(url="http://p", rank=1))
    assert route.matched_tokens == 32


def test_both_worker_gets_a_both_plan_on_its_own_rank():
    route = dispatcher(StubPool({"http://b": ("both", 1)})).choose([1, 2, 3], excluded=set())
    assert route.target == route.prefill == ("http://b", 0) and route.plan == Plan(kind="both")


def test_prefill_workers_without_any_decode_worker_cannot_serve():
    chooser = dispatcher(StubPool({"http://p": ("prefill", 1)}))
    assert chooser.choose([1, 2, 3], excluded=set()) is None and not chooser.can_serve()


def test_retry_excludes_ranks_already_tried():
    pool = StubPool({"http://b1": ("both", 1), "http://b2": ("both", 1)})
    chooser = dispatcher(pool, policy="round_robin")
    first = chooser.choose([1], excluded=set())
    second = chooser.choose([1], excluded={first.prefill})
    assert second.prefill != first.prefill
    assert chooser.choose([1], excluded={first.prefill, second.prefill}) is None


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_rank_only_while_prefill_is_busy():
    busy = {("http://p", 0): RankLoad(0, running=1, waiting=2, free_pages=10, total_pages=10, prefix_cache_pages=0)}
    rule = LocalPrefillRule(max_tokens=16, min_prefill_queue=3)
    chooser = dispatcher(StubPool({"http://p": ("prefill", 1), "http://d": ("decode", 1)}, busy), local_prefill=rule)
    local = chooser.choose(list(range(16)), excluded=set())
    assert local.prefill == local.target == ("http://d", 0) and local.plan == Plan(kind="both")
    long_prompt = chooser.choose(list(range(17)), excluded=set())
    assert long_prompt.target == ("http://d", 0) and long_prompt.plan.kind == "decode"
    idle = dispatcher(StubPool({"http://p": ("prefill", 1), "http://d": ("decode", 1)}), local_prefill=rule)
    assert idle.choose(list(range(16)), excluded=set()).plan.kind == "decode"
    assert dispatcher(StubPool({"http://p": ("prefill", 1), "http://d": ("decode", 1)}, busy)).choose(
        list(range(16)), excluded=set()).plan.kind == "decode"  # off by default
