import math

import pytest
import torch

from pdserve.engine.sampler import filtered_probs, sample, skip_draws
from pdserve.wire.sampling import SamplingParams

VOCAB = 50


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample_rows(logits, params, seeds=None, banned=None):
    batch_size = logits.shape[0]
    generators = [seeded(s) for s in (seeds or range(batch_size))]
    return sample(logits, params, generators, banned or [[] for _ in range(batch_size)])


def test_greedy_picks_argmax_and_lowest_id_on_ties():
    logits = torch.randn(4, VOCAB, generator=seeded(0))
    logits[3, 7] = logits[3, 30] = logits[3].max() + 1.0
    result = sample_rows(logits, [SamplingParams(temperature=0.0)] * 4)
    expected = logits.argmax(dim=-1).tolist()
    assert result.token_ids == expected
    assert result.token_ids[3] == 7
    assert result.logprobs is None


def test_low_precision_logits_are_accepted_and_left_untouched():
    logits = torch.randn(2, VOCAB, generator=seeded(1)).to(torch.bfloat16)
    before = logits.clone()
    result = sample_rows(logits, [SamplingParams(temperature=0.0), SamplingParams()], banned=[[0, 1], []])
    assert torch.equal(logits, before)
    assert result.token_ids[0] == logits[0].float()[2:].argmax().item() + 2


def test_seeded_row_is_reproducible_whatever_the_batch_and_row_order():
    torch.manual_seed(0)
    target = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=123)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, min_p=0.05), SamplingParams()]
    steps = [torch.randn(1, VOCAB, generator=seeded(100 + i)) for i in range(20)]

    def run(position: int, neighbours: list[SamplingParams]) -> list[int]:
        target_generator = seeded(123)
        other_generators = [seeded(1000 + i) for i in range(len(neighbours))]
        tokens = []
        for step_logits in steps:
            rows = [torch.randn(1, VOCAB) for _ in neighbours]
            rows.insert(position, step_logits)
            params = list(neighbours)
            params.insert(position, target)
            generators = list(other_generators)
            generators.insert(position, target_generator)
            result = sample(torch.cat(rows), params, generators, [[] for _ in params])
            tokens.append(result.token_ids[position])
        return tokens

    alone = run(0, [])
    assert run(0, others) == alone
    assert run(2, others) == alone
    assert run(1, others[::-1]) == alone
    assert len(set(alone)) > 1  # really sampled, not stuck on the argmax


def test_top_k_one_equals_greedy():
    logits = torch.randn(8, VOCAB, generator=seeded(2))
    result = sample_rows(logits, [SamplingParams(temperature=1.3, top_k=1)] * 8)
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_argmax():
    logits = torch.randn(8, VOCAB, generator=seeded(3))
    result = sample_rows(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 8)
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filtered_probs(probs.log(), [SamplingParams(top_p=0.8)])
    assert kept[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    kept = filtered_probs(probs.log(), [SamplingParams(top_p=0.81)])
    assert (kept[0] > 0).tolist() == [True, True, True, False]


def test_top_k_keeps_only_the_k_largest():
    logits = torch.randn(1, VOCAB, generator=seeded(4))
    top3 = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=3)] * 400
    result = sample_rows(logits.expand(400, -1), params)
    assert set(result.token_ids) == top3


def test_min_p_drops_tokens_below_fraction_of_top_probability():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    kept = filtered_probs(probs.log()[None], [SamplingParams(min_p=0.3)])
    assert (kept[0] > 0).tolist() == [True, True, True, False, False]
    result = sample_rows(probs.log().expand(500, -1), [SamplingParams(min_p=0.3)] * 500)
    assert set(result.token_ids) == {0, 1, 2}


def test_banned_ids_are_never_chosen():
    logits = torch.zeros(300, 6)
    logits[:, 2] = 10.0  # the favourite, banned
    banned = [[2, 5]] * 300
    result = sample_rows(logits, [SamplingParams(temperature=1.0)] * 150 + [SamplingParams(temperature=0.0)] * 150,
                         banned=banned)
    assert set(result.token_ids) == {0, 1, 3, 4}


def test_draws_at_temperature_one_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    expected = torch.softmax(logits, dim=-1)
    generator = seeded(7)  # one generator shared by every row: draws follow each other in the same stream
    draws, counts = 20_000, torch.zeros(5)
    for _ in range(draws // 2_000):
        result = sample(logits.expand(2_000, -1), [SamplingParams()] * 2_000, [generator] * 2_000, [[]] * 2_000)
        counts += torch.bincount(torch.tensor(result.token_ids), minlength=5)
    expected_counts = expected * draws
    chi_square = ((counts - expected_counts) ** 2 / expected_counts).sum().item()
    assert chi_square < 18.47  # 4 degrees of freedom, p = 0.001


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([[1.0, 0.0]])
    cold = filtered_probs(logits, [SamplingParams(temperature=0.5)])
    hot = filtered_probs(logits, [SamplingParams(temperature=2.0)])
    assert cold[0, 0].item() == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert hot[0, 0].item() == pytest.approx(1 / (1 + math.exp(-0.5)))


def test_logprobs_are_the_models_before_bans_and_adjustments():
    logits = torch.randn(3, VOCAB, generator=seeded(8))
    banned = [[0], [], [1, 2]]
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(top_k=5), SamplingParams(temperature=0.3)]

    def push_token_7(rows: torch.Tensor) -> None:
        rows[:, 7] += 100.0

    result = sample(logits, params, [seeded(s) for s in range(3)], banned, push_token_7)
    assert result.token_ids == [7, 7, 7]
    reference = torch.log_softmax(logits, dim=-1)
    assert result.logprobs == pytest.approx([reference[row, 7].item() for row in range(3)])


def test_top_logprobs_are_the_models_most_likely_tokens_per_row():
    logits = torch.randn(4, VOCAB, generator=seeded(9))
    params = [SamplingParams(top_logprobs=3), SamplingParams(temperature=0.0), SamplingParams(top_logprobs=20),
              SamplingParams(logprobs=True, top_logprobs=1)]
    result = sample_rows(logits, params, banned=[[int(logits[0].argmax())], [], [], []])
    reference = torch.log_softmax(logits, dim=-1)
    assert [len(row) for row in result.top_token_ids] == [3, 0, 20, 1]
    for row, (ids, values) in enumerate(zip(result.top_token_ids, result.top_logprobs)):
        best = reference[row].topk(len(ids))
        assert values == pytest.approx(best.values.tolist())
        assert [reference[row, i].item() for i in ids] == pytest.approx(values)
    assert result.top_token_ids[0][0] == int(logits[0].argmax())  # the model's favourite, though banned


def test_mismatched_batch_sizes_are_rejected():
    with pytest.raises(ValueError, match="2 params"):
        sample(torch.zeros(3, VOCAB), [SamplingParams()] * 2, [seeded(0)] * 3, [[]] * 3)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs CUDA")])])
@pytest.mark.parametrize("count", [1, 7])
def test_skipped_draws_leave_the_generator_where_the_samplers_draws_do(device, count):
    """The decode rank skips the draw of the token its prefill rank made, a migrated stream those of the tokens it
    streamed: the generator must end exactly where that many draws of a batch row leave it (on CUDA by one jump of
    Philox's offset), or the tokens after them are another sample."""
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, seed=2)]
    drawn = [torch.Generator(device).manual_seed(s) for s in (3, 4)]
    skipped = [torch.Generator(device).manual_seed(s) for s in (3, 4)]
    for _ in range(count):
        sample(torch.randn(2, VOCAB, device=device), params, drawn, [[], []])
    for generator in skipped:
        skip_draws(generator, VOCAB, count)
    for after_draws, after_skips in zip(drawn, skipped):
        assert torch.equal(torch.rand(8, device=device, generator=after_draws),
                           torch.rand(8, device=device, generator=after_skips))
    skipped_once, fresh = torch.Generator(device).manual_seed(3), torch.Generator(device).manual_seed(3)
    skip_draws(skipped_once, VOCAB, 1)
    assert not torch.equal(torch.rand(8, device=device, generator=skipped_once),
                           torch.rand(8, device=device, generator=fresh))  # it does move the generator
