"""Named workloads from the disaggregation issue: GPU sizes, and `-cpu` variants scaled down for the tiny model."""

from pdserve.bench.workload import LengthRange, WorkloadConfig

PRESETS: dict[str, dict] = {
    # Chat turns (prompt 1k-2k, output 128-512) with long-document requests (8k-16k prompts) among them.
    "mixed": dict(prompt_len=LengthRange(1024, 2048), output_len=LengthRange(128, 512), long_fraction=0.1,
                  long_prompt_len=LengthRange(8192, 16384)),
    "shared-prefix": dict(prompt_len=LengthRange(128, 512), output_len=LengthRange(128, 512), num_prefix_groups=16,
                          system_prompt_len=2048, turns_per_conversation=3),
    # Chat or agent sessions re-sending a growing history (6 turns, 512-1k new tokens each): what a prefix cache is
    # for, once the sessions' histories outgrow a rank's pool (the host tier's case).
    "multi-turn": dict(prompt_len=LengthRange(512, 1024), output_len=LengthRange(64, 128), turns_per_conversation=6),
    "mixed-cpu": dict(prompt_len=LengthRange(64, 128), output_len=LengthRange(16, 48), long_fraction=0.1,
                      long_prompt_len=LengthRange(1024, 2048)),
    "multi-turn-cpu": dict(prompt_len=LengthRange(32, 64), output_len=LengthRange(8, 16), turns_per_conversation=6),
    "shared-prefix-cpu": dict(prompt_len=LengthRange(32, 64), output_len=LengthRange(8, 16), num_prefix_groups=8,
                              system_prompt_len=512, turns_per_conversation=2),
}


def workload_from_preset(name: str, **overrides: object) -> WorkloadConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown workload preset {name!r}; known: {', '.join(PRESETS)}")
    return WorkloadConfig(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})
