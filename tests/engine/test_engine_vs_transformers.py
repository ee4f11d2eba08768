"""Greedy float32 generation and prefill logits agree with transformers' own DeepseekV2/V3 on random tiny checkpoints."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.ops.attention import AttentionBatch

PROMPT_LENGTHS = (1, 7, 16, 33, 120, 300)
NEW_TOKENS = 32

VARIANTS = {
    "v2-yarn-no-qlora": ("v2", {}),
    "v2-group-limited-2-dense": ("v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                                        "num_hidden_layers": 4, "first_k_dense_replace": 2}),
    "v2-plain-rope-qlora": ("v2", {"rope_scaling": None, "q_lora_rank": 24}),
    "v3-yarn-qlora": ("v3", {}),
    "v3-no-qlora-2-dense": ("v3", {"q_lora_rank": None, "num_hidden_layers": 4, "first_k_dense_replace": 2}),
}


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def transformers_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    outputs = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_equal_transformers(tiny_model_factory, variant):
    arch, overrides = VARIANTS[variant]
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(model_dir, progress=False)
    prompts = random_prompts(llm.engine.model_config.vocab_size)
    results = llm.generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [r.token_ids for r in results] == transformers_greedy(model_dir, prompts)


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_prefill_logits_match_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    engine = Engine(EngineConfig(model=model_dir, progress=False))
    prompt = random_prompts(engine.model_config.vocab_size)[4]
    request = engine.add_request("r", prompt, GREEDY)
    seq = engine.scheduler.schedule()
    # logits of every position: run the model directly over the pages the scheduler gave the prompt
    size = engine.cfg.page_size
    slots = [request.page_ids[i // size] * size + i % size for i in range(len(prompt))]
    batch = AttentionBatch([len(prompt)], [len(prompt)], torch.tensor([request.page_ids]), torch.tensor(slots), size)
    model = engine.runner.model
    ours = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), engine.runner.kv_cache, batch))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert len(seq) == 1
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


@pytest.mark.parametrize("tokenizer", ["tiny", "deepseek"])
def test_logprobs_equal_log_softmax_of_transformers_logits(tiny_model_factory, tokenizer):
    """Chosen-token and top-5 log-probabilities (float32) are log-softmax of the reference model's logits."""
    model_dir = tiny_model_factory("v3", tokenizer=tokenizer)
    llm = LLM(model_dir, progress=False)
    prompt = random_prompts(llm.engine.model_config.vocab_size, seed=1)[2]
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
    result = llm.generate(prompt_token_ids=[prompt], sampling=sampling)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt + result.token_ids])).logits[0].float(), dim=-1)
    for step, token_id in enumerate(result.token_ids):
        expected = reference[len(prompt) - 1 + step]
        assert abs(result.logprobs[step] - expected[token_id].item()) < 1e-4
        top = result.top_logprobs[step]
        assert set(top) == set(expected.topk(5).indices.tolist())
        assert max(abs(value - expected[token].item()) for token, value in top.items()) < 1e-4
