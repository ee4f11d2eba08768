"""Steps outside the decode graphs (prefill chunks, mixed steps, decode batches above the largest decode graph) of up
to 2,048 tokens as CUDA graphs between their attention calls, captured at start-up for a ladder of token counts.

Even with the layers' regions compiled such a step was host-bound: ~107 compiled calls a step at 150-480 us of host
time each (dynamo's guards, the dynamic-shape wrappers, Python launches) against ~20 ms of device work for 1,024
tokens. Everything but attention depends on the token count alone, so it is captured: piece 0 embeds the tokens and
projects layer 0's attention inputs; piece l finishes layer l - 1 (o_proj, residual, MLP or experts) and projects
layer l's attention inputs; the last piece finishes the last layer and normalises. Attention runs eagerly between
the pieces, on the real tokens only, with its plan made on the host as before (its work depends on the sequences).

A step of n tokens replays the pieces of the smallest captured size T >= n. The pieces pass their results through
fixed buffers of T rows: rows past n are padding that starts each step as token 0 at position 0 (so their values
stay bounded), is never attended, and is weighted 0 in the experts' load counts. Each form of attention (absorbed,
expanded) has its own pieces, as their attention inputs differ in shape. Every piece's temporaries come from one
graph memory pool that all of them share: a piece copies its results into the buffers before it ends, and replays
never overlap, so the pool holds about one piece's temporaries at the largest size.

Without CUDA (the tests on the CPU) the same pieces run directly instead of replaying a capture.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pdserve.engine.cuda_graphs import capture
from pdserve.model.deepseek import EAGER_REGIONS, DeepseekForCausalLM, LayerRegions
from pdserve.ops.attention import AttentionBatch
from pdserve.ops.expert_load import mark_real_rows
from pdserve.ops.moe_ep import ExpertParallelMoE
from pdserve.ops.select import Backends

log = logging.getLogger(__name__)

# Only where a step is host-bound: a compiled step takes ~35 ms of host time whatever its size, the device ~19 ms at
# 512 tokens and ~33 ms at 2,048 (one H100), so above ~2k tokens the host has nothing left to save, and a padded
# row costs the device what a real one does (a ladder up to 8k in 1.33-1.5x steps made a P/D prefill worker slower
# at 24 req/s). Close steps, so padding stays under ~13% of a step.
TOKEN_SIZES = (64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


@dataclass(frozen=True)
class PiecewiseGraphConfig:
    token_sizes: tuple[int, ...]  # captured sizes, ascending; steps of more tokens run without graphs


def token_sizes(max_step_tokens: int) -> tuple[int, ...]:
    """The ladder below the step's token budget, then the budget itself where it is lower than the ladder's top."""
    cap = min(max_step_tokens, TOKEN_SIZES[-1])
    return tuple(s for s in TOKEN_SIZES if s < cap) + (cap,)


def piecewise_graph_config(enabled: bool, decode_graphs: bool, model: DeepseekForCausalLM,
                           max_step_tokens: int) -> PiecewiseGraphConfig | None:
    """None where they cannot run: turned off, where decode graphs cannot (the CPU, attention not on flashinfer),
    or under expert parallelism (an exchange of split sizes cannot be captured)."""
    if not enabled or not decode_graphs or isinstance(model.backends.moe, ExpertParallelMoE):
        return None
    return PiecewiseGraphConfig(token_sizes(max_step_tokens))


class PiecewiseGraphs:
    @torch.inference_mode()  # buffers made as inference tensors, as every step's are: dynamo guards on the kind
    def __init__(self, model: DeepseekForCausalLM, cfg: PiecewiseGraphConfig, backends: Backends,
                 regions: LayerRegions | None, device: torch.device, dtype: torch.dtype):
        """`backends`, `regions`: what the pieces run (the layers' compiled regions and experts where the engine
        compiles them for steps outside the decode graphs). Captured here on CUDA; the warm-up before the first
        capture compiles the regions if nothing has yet."""
        mc = model.cfg
        self.model = model
        self.sizes = cfg.token_sizes
        self.max_tokens = self.sizes[-1]
        self._capture = device.type == "cuda"
        rows, heads = self.max_tokens, mc.num_attention_heads
        self._inputs = torch.zeros(2, rows, dtype=torch.int64, device=device)  # token ids, positions
        self._x = torch.zeros(rows, mc.hidden_size, dtype=dtype, device=device)  # the residual stream
        self._rotations = torch.zeros(rows, 2, mc.qk_rope_head_dim // 2, dtype=torch.float32, device=device)
        self._hidden = torch.zeros(rows, mc.hidden_size, dtype=dtype, device=device)
        load = backends.expert_load
        self._pair_valid = torch.zeros(rows * mc.num_experts_per_tok, dtype=torch.int64, device=device)
        self._backends = replace(backends, expert_load=load.masked(self._pair_valid)) if load is not None else backends
        self._regions = regions or EAGER_REGIONS
        expands = backends.attention.expands(mc.qk_head_dim, mc.v_head_dim)
        # Per form (expanded or not): the attention inputs (queries' nope part, rope part, latents, rope keys) and
        # the attention's output, as the model's regions produce and take them.
        self._attention_io: dict[bool, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
        for expanded in (False, True) if expands else (False,):
            q_width, out_width = (mc.qk_nope_head_dim, mc.v_head_dim) if expanded else (mc.kv_lora_rank,
                                                                                       mc.kv_lora_rank)
            inputs = (torch.zeros(rows, heads, q_width, dtype=dtype, device=device),
                      torch.zeros(rows, heads, mc.qk_rope_head_dim, dtype=dtype, device=device),
                      torch.zeros(rows, mc.kv_lora_rank, dtype=dtype, device=device),
                      torch.zeros(rows, mc.qk_rope_head_dim, dtype=dtype, device=device))
            self._attention_io[expanded] = inputs, torch.zeros(rows, heads, out_width, dtype=dtype, device=device)
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self._capture else None
        self._pieces: dict[tuple[int, bool], list[Callable[[], None]]] = {}
        for expanded in self._attention_io:
            for size in reversed(self.sizes):  # largest first: the smaller pieces reuse its pool memory
                self._pieces[size, expanded] = [self._captured(self._piece(index, size, expanded), pool)
                                                for index in range(mc.num_hidden_layers + 1)]
        if self._capture:
            log.info("captured piecewise CUDA graphs (%s) for token counts %s in %.1f s",
                     "both attention forms" if expands else "absorbed attention", list(self.sizes),
                     time.perf_counter() - started)

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """The model's final hidden states [n, D] for n = len(input_ids) tokens (device tensors), as the model's own
        forward computes them; a view of a buffer the next call rewrites."""
        num_tokens = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_tokens)
        expanded = self.model.attends_expanded(batch, self._backends)
        self._inputs[0, :num_tokens].copy_(input_ids)
        self._inputs[1, :num_tokens].copy_(positions)
        self._inputs[:, num_tokens:size].zero_()
        mark_real_rows(self._pair_valid, num_tokens, size, self.model.cfg.num_experts_per_tok)
        (q, q_pe, latent, k_pe), heads_out = self._attention_io[expanded]
        pieces = self._pieces[size, expanded]
        pieces[0]()
        for layer_idx, layer in enumerate(self.model.model.layers):
            out = layer.attend(q[:num_tokens], q_pe[:num_tokens], latent[:num_tokens], k_pe[:num_tokens],
                               kv_cache[layer_idx], batch, self._backends, expanded)
            heads_out[:num_tokens].copy_(out)
            pieces[layer_idx + 1]()
        return self._hidden[:num_tokens]

    def _piece(self, index: int, size: int, expanded: bool) -> Callable[[], None]:
        """Piece `index` at `size` rows: finish layer index - 1 (embed the tokens for 0), then project layer
        index's attention inputs (normalise the result after the last layer), every result into the buffers."""
        model, layers = self.model, self.model.model.layers
        backends, regions = self._backends, self._regions
        ids, positions = self._inputs[0, :size], self._inputs[1, :size]
        x_buffer, rotations, hidden = self._x[:size], self._rotations[:size], self._hidden[:size]
        inputs, heads_out = self._attention_io[expanded]
        inputs = tuple(buffer[:size] for buffer in inputs)
        heads_out = heads_out[:size]

        def run() -> None:
            if index == 0:
                x = model.model.embed_tokens(ids)
                rotations.copy_(model.rope.rotations(positions))
            else:
                x = layers[index - 1].finish(x_buffer, heads_out, backends, expanded, regions)
            if index == len(layers):
                hidden.copy_(model.model.norm(x))
                return
            outputs = regions.attention_inputs(layers[index], x, rotations, model.rope, not expanded)
            for buffer, output in zip(inputs, outputs):
                buffer.copy_(output)
            x_buffer.copy_(x)

        return run

    @torch.inference_mode()
    def _captured(self, run: Callable[[], None], pool) -> Callable[[], None]:
        return capture(run, pool)[0].replay if self._capture else run
