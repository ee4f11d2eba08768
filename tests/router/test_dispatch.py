"""Route choice for disaggregated and `both` workers, on a real worker pool admitted without the network
(tests/router/worker_pools.py)."""

from pdserve.wire.block_hash import prefix_page_hashes
from pdserve.wire.kv_events import KVEvent
from pdserve.wire.protocol import KVEventBatch, Plan, PrefillSource, RankLoad
from pdserve_router.dispatch import Dispatcher
from pdserve_router.metrics import RouterMetrics
from pdserve_router.policies import LocalPrefillRule, make_policy
from pdserve_router.prefix_index import PrefixIndex
from tests.router.worker_pools import admit, pool_of


def pool_with(tmp_path, roles: dict[str, tuple[str, int]], loads: dict[str, list[RankLoad]] | None = None):
    """url -> (role, number of ranks), each admitted (idle unless `loads` names its ranks' loads)."""
    pool = pool_of(tmp_path / "workers", list(roles))
    for url, (role, ranks) in roles.items():
        admit(pool, url, role, ranks, (loads or {}).get(url))
    return pool


def dispatcher(pool, index=None, policy="prefix", local_prefill=LocalPrefillRule(),
               prefill_fallback=True) -> Dispatcher:
    return Dispatcher(pool, index or PrefixIndex(), make_policy(policy, 1.0, 0.5), RouterMetrics("tiny", policy),
                      max_attempts=3, first_token_timeout_s=5, retry_after_s=1, make_detokenizer=None,
                      local_prefill=local_prefill, prefill_fallback=prefill_fallback)


def test_disaggregated_route_sends_to_decode_rank_with_the_prefill_rank_as_source(tmp_path):
    pool = pool_with(tmp_path, {"http://p": ("prefill", 2), "http://d": ("decode", 1)})
    index = PrefixIndex()
    for rank in (0, 1):
        index.add_rank(("http://p", rank), 4)
    prompt = list(range(32))
    index.apply(("http://p", 1), KVEventBatch(1, 0, [KVEvent("cleared"), KVEvent("stored", prefix_page_hashes(prompt, 4))]))
    route = dispatcher(pool, index).choose(prompt, excluded=set())
    assert route.prefill == ("http://p", 1) and route.target == ("http://d", 0)
    assert route.plan == Plan(kind="decode", prefill=PrefillSource(url="http://p", rank=1))
    assert route.matched_tokens == 32


def test_both_worker_gets_a_both_plan_on_its_own_rank(tmp_path):
    route = dispatcher(pool_with(tmp_path, {"http://b": ("both", 1)})).choose([1, 2, 3], excluded=set())
    assert route.target == route.prefill == ("http://b", 0) and route.plan == Plan(kind="both")


def test_prefill_workers_without_any_decode_worker_cannot_serve(tmp_path):
    chooser = dispatcher(pool_with(tmp_path, {"http://p": ("prefill", 1)}))
    assert chooser.choose([1, 2, 3], excluded=set()) is None and not chooser.can_serve()


def test_decode_ranks_prefill_themselves_when_no_prefill_rank_can_take_the_request(tmp_path):
    pool = pool_with(tmp_path, {"http://p": ("prefill", 1), "http://d": ("decode", 2)})
    chooser = dispatcher(pool, policy="round_robin")
    # The only prefill rank failed this request's hand-off: a decode rank prefills the retry itself.
    fallback = chooser.choose([1, 2, 3], excluded={("http://p", 0)})
    assert fallback.prefill == fallback.target and fallback.target[0] == "http://d" and fallback.plan == Plan(kind="both")
    # ...but not on a decode rank this request already failed on.
    assert chooser.choose([1, 2, 3], excluded={("http://p", 0), fallback.target}).target != fallback.target
    assert chooser.choose([1, 2, 3], excluded={("http://p", 0), ("http://d", 0), ("http://d", 1)}) is None
    assert chooser.choose([1, 2, 3], excluded=set()).plan.kind == "decode"  # prefill ranks first while there are any
    off = dispatcher(pool, prefill_fallback=False)
    assert off.choose([1, 2, 3], excluded={("http://p", 0)}) is None


def test_a_decode_pool_alone_serves_with_the_fallback_and_not_without(tmp_path):
    pool = pool_with(tmp_path, {"http://d": ("decode", 1)})
    assert dispatcher(pool).can_serve()
    assert not dispatcher(pool, prefill_fallback=False).can_serve()


def test_retry_excludes_ranks_already_tried(tmp_path):
    pool = pool_with(tmp_path, {"http://b1": ("both", 1), "http://b2": ("both", 1)})
    chooser = dispatcher(pool, policy="round_robin")
    first = chooser.choose([1], excluded=set())
    second = chooser.choose([1], excluded={first.prefill})
    assert second.prefill != first.prefill
    assert chooser.choose([1], excluded={first.prefill, second.prefill}) is None


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_rank_only_while_prefill_is_busy(tmp_path):
    roles = {"http://p": ("prefill", 1), "http://d": ("decode", 1)}
    busy = {"http://p": [RankLoad(0, running=1, waiting=2, free_pages=10, total_pages=10, prefix_cache_pages=0)]}
    rule = LocalPrefillRule(max_tokens=16, min_prefill_queue=3)
    chooser = dispatcher(pool_with(tmp_path, roles, busy), local_prefill=rule)
    local = chooser.choose(list(range(16)), excluded=set())
    assert local.prefill == local.target == ("http://d", 0) and local.plan == Plan(kind="both")
    long_prompt = chooser.choose(list(range(17)), excluded=set())
    assert long_prompt.target == ("http://d", 0) and long_prompt.plan.kind == "decode"
    idle = dispatcher(pool_with(tmp_path, roles), local_prefill=rule)
    assert idle.choose(list(range(16)), excluded=set()).plan.kind == "decode"
    assert dispatcher(pool_with(tmp_path, roles, busy)).choose(
        list(range(16)), excluded=set()).plan.kind == "decode"  # off by default


def test_prefill_goes_to_the_cached_rank_and_decode_to_the_least_loaded(tmp_path):
    decode_loads = [RankLoad(0, running=9, waiting=0, free_pages=10, total_pages=64, prefix_cache_pages=0),
                    RankLoad(1, running=2, waiting=0, free_pages=60, total_pages=64, prefix_cache_pages=0)]
    pool = pool_with(tmp_path, {"http://p1": ("prefill", 2), "http://p2": ("prefill", 2), "http://d": ("decode", 2)},
                     {"http://d": decode_loads})
    index = PrefixIndex()
    for key in pool.ranks_with_role(("prefill",)):
        index.add_rank(key, 4)
        index.apply(key, KVEventBatch(key[1], 0, [KVEvent("cleared")]))
    prompt = list(range(40))
    index.apply(("http://p2", 0), KVEventBatch(0, 1, [KVEvent("stored", prefix_page_hashes(prompt, 4)[:6])]))
    route = dispatcher(pool, index).choose(prompt, excluded=set())
    assert route.prefill == ("http://p2", 0) and route.matched_tokens == 24 and route.target == ("http://d", 1)
    retried = dispatcher(pool, index).choose(prompt, excluded={("http://p2", 0), ("http://d", 1)})
    assert retried.prefill != ("http://p2", 0) and retried.matched_tokens == 0 and retried.target == ("http://d", 0)
