"""Fitting a step profile to a step trace: medians of the steps nearest each grid point, a profile StepProfile loads,
and no point made up where no step was; then the GPU script's own CPU smoke run, from worker start to fitted file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.profile_fit import FitGrid, fit_profile
from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
from pdserve.engine.step_shape import StepShape
from pdserve.engine.step_trace import StepRecord, StepTrace, read_trace

ROOT = Path(__file__).resolve().parents[2]
KERNEL = StepProfile.load(DEFAULT_PROFILE)
GRID = FitGrid(decode_batches=(1, 16), decode_contexts=(1000, 4000), prefill_tokens=(1, 1024, 4096))


def decode(batch: int, context: float, *turns_ms: float) -> list[StepRecord]:
    return [StepRecord(0.0, StepShape(batch, context), turn / 2, turn) for turn in turns_ms]


def prefill(tokens: int, *turns_ms: float, seqs: int = 1) -> list[StepRecord]:
    return [StepRecord(0.0, StepShape(prefill_tokens=tokens, prefill_seqs=seqs), turn / 2, turn) for turn in turns_ms]


def full_trace() -> list[StepRecord]:
    return (decode(1, 1000, 10, 12, 11) + decode(1, 1100, 40)  # 1100 is near 1000: its step counts there
            + decode(1, 4000, 14, 15, 13) + decode(16, 1000, 20, 21, 22, 23) + decode(15, 4100, 30, 31, 32)
            + decode(40, 1000, 999)  # nearest 16, but too far from it: unused
            + prefill(1024, 50, 54, 52) + prefill(4096, 90, 91) + prefill(1024, 999, seqs=3)  # several prompts: unused
            + [StepRecord(0.0, StepShape(16, 1000, 1024, 1), 10, 999)])  # a mixed step: unused


def test_each_point_is_the_median_turn_of_its_nearest_steps_and_the_profile_loads(tmp_path):
    fit = fit_profile(full_trace(), KERNEL, GRID, "in service", "a synthetic trace")
    assert fit.missing == []
    assert fit.profile["decode_ms"] == {"batches": [1, 16], "contexts": [1000, 4000],
                                        "ms": [[11.5, 14], [21.5, 31]]}
    assert fit.profile["samples"] == {"decode": [[4, 3], [4, 3]], "prefill": [0, 3, 2]}
    # No prefill step of 1 token: that point is the batch-1 decode step, said so.
    assert fit.profile["prefill_ms"] == {"tokens": [1, 1024, 4096], "ms": [11.5, 52, 90.5]}
    assert fit.notes and "batch-1 decode" in fit.notes[0] and "batch-1 decode" in fit.profile["source"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(fit.profile))
    profile = StepProfile.load(path)
    assert profile.decode_step_ms(16, 4000) == pytest.approx(31)
    assert profile.prefill_step_ms(1024) == pytest.approx(52)
    assert (profile.kv_bytes_per_token, profile.kv_pool_tokens) == (KERNEL.kv_bytes_per_token, KERNEL.kv_pool_tokens)


def test_a_decode_point_without_steps_is_left_out_and_named_not_filled_in():
    trace = [r for r in full_trace() if not (r.shape.decode_batch == 15 and r.shape.decode_context == 4100)]
    fit = fit_profile(trace, KERNEL, GRID, "in service", "a trace without batch 16 at 4k")
    assert fit.profile["decode_ms"]["batches"] == [1]  # row and column alike (one measured point each): the row
    assert fit.profile["decode_ms"]["contexts"] == [1000, 4000]
    assert "decode batch 16 x context 4000: no decode-only step" in fit.missing
    assert "decode batch 16 left out" in fit.missing
    assert fit.profile["missing"] == fit.missing


def test_a_prefill_point_without_steps_is_left_out_and_named():
    grid = FitGrid(decode_batches=(16,), decode_contexts=(1000,), prefill_tokens=(1, 1024, 16384))
    fit = fit_profile(full_trace(), KERNEL, grid, "in service", "no batch 1, no 16k prompt")
    assert fit.profile["prefill_ms"] == {"tokens": [1024], "ms": [52]}
    assert fit.missing == ["prefill 1 tokens: no step of one prompt's chunk alone",
                           "prefill 16384 tokens: no step of one prompt's chunk alone"]


def test_a_trace_with_no_decode_only_step_fits_nothing():
    with pytest.raises(ValueError, match="no decode-only step"):
        fit_profile(prefill(1024, 50), KERNEL, GRID, "in service", "prefill only")


def test_every_prefill_step_also_prices_steps_of_several_prompts_by_their_tokens():
    trace = full_trace() + prefill(1024, 80, 82, seqs=2)
    one_prompt = fit_profile(trace, KERNEL, GRID, "in service", "one prompt's chunks")
    every_step = fit_profile(trace, KERNEL, GRID, "in service", "every prefill step", every_prefill_step=True)
    assert one_prompt.profile["prefill_ms"]["ms"][1] == 52  # 50, 54, 52: the several-prompt steps left out
    assert every_step.profile["prefill_ms"]["ms"][1] == 67  # 50, 52, 54, 80, 82, 999: the median of all six
    assert every_step.profile["samples"]["prefill"][1] == 6


def test_a_trace_file_reads_back_what_was_recorded(tmp_path):
    trace = StepTrace(tmp_path / "t.rank0", flush_interval_s=3600)
    trace.record(StepShape(4, 100.5), started_s=10.0, engine_ms=1.25, ended_s=10.002)
    assert read_trace(tmp_path / "t.rank0") == []  # held until a flush
    trace.close()
    (record,) = read_trace(tmp_path / "t.rank0")
    assert record.shape == StepShape(4, 100.5) and record.engine_ms == 1.25 and record.turn_ms == pytest.approx(2)


@pytest.mark.slow  # ~32 s of CI's 15 minutes; the trace and the fit are tested above and in test_step_trace.py
def test_the_service_profile_script_measures_and_fits_a_profile_on_the_cpu(tmp_path):
    """benchmarks/gpu_service_profile.py --smoke: a real local cluster (Ray, a worker process, the router), ~30 s."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_service_profile.py"), "--smoke",
                          "--out", str(tmp_path), "--deadline-s", "240"],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    profile = StepProfile.load(tmp_path / "service-profile.json")
    assert profile.decode_batches == [1, 4] and len(profile.decode_contexts) == 2
    assert profile.prefill_tokens[0] == 1 and len(profile.prefill_tokens) == 4
    assert read_trace(tmp_path / "step-trace.jsonl.both.rank0")
    assert list((tmp_path / "logs").rglob("both-0.log"))
    assert "| decode batch 4 ctx 76 |" in run.stdout and "skip" not in run.stdout
