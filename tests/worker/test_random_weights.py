"""Workers started with `--load-format random` on a config-only model directory (how GPU benchmarks of real shapes
run without a checkpoint): a prefill and a decode worker build the same weights from the seed, so P/D tokens
equal the offline engine's with the same random weights."""

import json
from pathlib import Path

import pytest
import torch
from worker_calls import disaggregated, token_ids

from pdserve import LLM, SamplingParams
from pdserve.cluster.local import ClusterConfig, LocalCluster
from pdserve.model.tiny import make_config_only_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEED = 3


@pytest.fixture(scope="module")
def config_only_model(tiny_v2, tmp_path_factory) -> str:
    config = json.loads((Path(tiny_v2) / "config.json").read_text())
    model = make_config_only_model(tmp_path_factory.mktemp("config-only"), config)
    assert not list(model.glob("*.safetensors"))
    return str(model)


def test_random_weight_workers_agree_with_the_offline_engine(config_only_model, ray_address, tmp_path):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 400, (n,), generator=gen).tolist() for n in (5, 40)]
    llm = LLM(config_only_model, progress=False, dtype="float32", load_format="random", seed=SEED)
    expected = [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling=GREEDY)]
    # A different seed gives different weights, so agreement below is not an accident of the prompt.
    other = LLM(config_only_model, progress=False, dtype="float32", load_format="random", seed=SEED + 1)
    assert [r.token_ids for r in other.generate(prompt_token_ids=prompts, sampling=GREEDY)] != expected

    cfg = ClusterConfig(model=config_only_model, port=0, num_prefill=1, num_decode=1, ray_address=ray_address,
                        worker_args=("--dtype", "float32", "--num-pages", "64", "--load-format", "random",
                                     "--seed", str(SEED), "--gpus-per-rank", "0.5"),
                        log_dir=str(tmp_path))
    with LocalCluster(cfg) as cluster:
        prefill, decode = (w.url for w in cluster.workers)
        for prompt, tokens in zip(prompts, expected):
            events = disaggregated(decode, prefill, prompt, GREEDY)
            assert events[-1].finish_reason == "length", events[-1].error
            assert token_ids(events) == tokens
