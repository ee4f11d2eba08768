"""DeepSeek-V2/V3 decoder: MLA attention over a paged latent cache, dense MLP or MoE, on a flat batch of tokens.

Parameter names follow the Hugging Face checkpoints, except routed experts, which are stacked per layer
(`mlp.experts.w13` = gate and up, `mlp.experts.w2` = down) and hold only this rank's experts. With `fp8_block` set,
the linears an FP8 checkpoint ships in FP8 stay FP8 (pdserve.model.fp8_modules), each with its `*_scale_inv` grid.
Linears that read the same input can be fused into one GEMM (`fuse_projections`) and keep their names.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.config import ModelConfig
from pdserve.model.fp8_modules import FP8Linear, FP8RoutedExperts
from pdserve.model.rope import RotaryEmbedding
from pdserve.ops.attention import AttentionBackend, AttentionBatch, gather_kv, write_kv
from pdserve.ops.expert_load import ExpertLoad
from pdserve.ops.expert_placement import LayerPlacement, reserve_replica_slots
from pdserve.ops.moe import ExpertRange, MoEBackend
from pdserve.ops.moe_ep import ExpertParallelMoE, overlaps_shared
from pdserve.ops.select import Backends


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's RMSNorm: one fused kernel on CUDA (float32 statistics, one rounding at the end) where the written-out
        # form takes six; on the CPU in float32 it is bit-identical to Hugging Face's upcast-normalise-scale.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def fuse_rows(owner: nn.Module, name: str, linears: list[nn.Module]) -> None:
    """Stack the linears' weights in one matrix, registered on `owner` as buffer `name` (None where any linear is not
    a plain nn.Linear, e.g. FP8), and make each weight a view of its rows: one GEMM then computes all of them, memory
    is unchanged, and writes into the weights (loading) land in the stacked matrix."""
    fused = None
    if all(type(linear) is nn.Linear for linear in linears):
        fused = torch.cat([linear.weight.detach() for linear in linears])
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
            start += rows
    owner.register_buffer(name, fused, persistent=False)


def _linear(in_features: int, out_features: int, fp8_block: tuple[int, int] | None = None) -> nn.Module:
    if fp8_block is not None:
        return FP8Linear(in_features, out_features, fp8_block)
    return nn.Linear(in_features, out_features, bias=False)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.cfg = cfg
        heads, qk_dim = cfg.num_attention_heads, cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = _linear(cfg.hidden_size, heads * qk_dim, fp8_block)
        else:
            self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank, fp8_block)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = _linear(cfg.q_lora_rank, heads * qk_dim, fp8_block)
        # Dequantized at load too: its 576 output columns fit no cuBLAS blockwise layout, and the Triton FP8 GEMM ran
        # this shape at 0.24-0.41x of bf16's speed on an H100 (benchmarks/gpu_fp8_gemm.py); bf16 costs V3 ~0.5 GB.
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, cfg.kv_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        # Never FP8 (dequantized at load): the absorbed form reads this weight as per-head W_UK and W_UV matrices in
        # einsums with the queries and the attention output, not as a linear. In bf16 it costs V3 ~1 GB more than FP8.
        self.kv_b_proj = _linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(heads * cfg.v_head_dim, cfg.hidden_size, fp8_block)
        self.register_buffer("input_proj", None, persistent=False)  # see fuse_projections()

    def fuse_projections(self) -> None:
        """The two projections of the layer's input (the query's, or its low-rank first half, and the latent's) as
        one GEMM: at decode sizes each is a GEMV-shaped read of its weight, and one larger read runs closer to the
        memory's bandwidth than two."""
        fuse_rows(self, "input_proj", [self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj,
                                       self.kv_a_proj_with_mqa])

    def project(self, x, rotations, rope: RotaryEmbedding, absorb: bool):
        """Queries (nope part, absorbed into the latent space when `absorb`; rope part) and the new tokens' latents
        and rope keys, all rotated: what either attention form starts from."""
        cfg = self.cfg
        heads, nope, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if self.input_proj is not None:
            q, latent_and_rope = F.linear(x, self.input_proj).split([self.input_proj.shape[0] - cfg.kv_dim,
                                                                       cfg.kv_dim], dim=-1)
        else:
            q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_a_proj(x)
            latent_and_rope = self.kv_a_proj_with_mqa(x)
        if cfg.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(-1, heads, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        latent, k_pe = latent_and_rope.split([rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = rope.apply(q_pe, rotations)
        k_pe = rope.apply(k_pe, rotations)
        if absorb:  # W_UK folded into the query, so attention works on latents only
            q_nope = torch.einsum("thd,hdr->thr", q_nope, self._kv_b_heads()[:, :nope])
        return q_nope, q_pe, latent, k_pe

    def output(self, heads_out: torch.Tensor, latent_out: bool) -> torch.Tensor:
        """o_proj of the attention output [T, H, v_dim], or of its latent form [T, H, kv_lora_rank] with W_UV
        applied first (the absorbed form)."""
        cfg = self.cfg
        if latent_out:
            heads_out = torch.einsum("thr,hvr->thv", heads_out, self._kv_b_heads()[:, cfg.qk_nope_head_dim:])
        return self.o_proj(heads_out.reshape(heads_out.shape[0], cfg.num_attention_heads * cfg.v_head_dim))

    def _kv_b_heads(self) -> torch.Tensor:
        cfg = self.cfg
        return self.kv_b_proj.weight.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                          cfg.kv_lora_rank)

    def attend_expanded(self, q_nope, q_pe, latent, k_pe, kv_cache, batch: AttentionBatch,
                        backend: AttentionBackend) -> torch.Tensor:
        """Attention with per-head keys and values expanded from the latents (see pdserve.ops.attention); writes the
        new latents to the cache, as the absorbed backends do. Returns [T, H, v_dim]."""
        cfg = self.cfg
        heads, nope, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        write_kv(kv_cache, latent, k_pe, batch)
        if batch.kv_lens != batch.query_lens:  # some sequence has a cached prefix: its keys come from the pages
            latent, k_pe = gather_kv(kv_cache, batch).split([rank, cfg.qk_rope_head_dim], dim=-1)
        k_nope, v = self.kv_b_proj(latent).view(-1, heads, nope + cfg.v_head_dim).split([nope, cfg.v_head_dim], -1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return backend.forward_expanded(q, k, v.contiguous(), batch, cfg.softmax_scale)


def uses_expanded_attention(cfg: ModelConfig, batch: AttentionBatch) -> bool:
    """Whether this step attends in the expanded form: when it costs fewer multiply-adds than the absorbed one.
    Expanding costs a kv_b projection of every key, absorbing one of every query (in and out); per (query, key)
    pair the expanded form then does (qk_dim + v_dim) per head against (2 * kv_lora_rank + rope_dim). A decode-only
    step always stays absorbed: it is what the captured CUDA graphs run."""
    if not batch.query_lens or max(batch.query_lens) == 1:
        return False
    projection = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
    pairs = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in zip(batch.query_lens, batch.kv_lens))
    expanded = sum(batch.kv_lens) * projection + pairs * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    absorbed = sum(batch.query_lens) * projection + pairs * cfg.num_attention_heads * (2 * cfg.kv_lora_rank
                                                                                       + cfg.qk_rope_head_dim)
    return expanded < absorbed


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.gate_proj = _linear(hidden, inter, fp8_block)
        self.up_proj = _linear(hidden, inter, fp8_block)
        self.down_proj = _linear(inter, hidden, fp8_block)
        self.register_buffer("gate_up", None, persistent=False)  # see fuse_projections()

    def fuse_projections(self) -> None:
        fuse_rows(self, "gate_up", [self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


FUSED_ROUTING_MAX_TOKENS = 16  # at 64 tokens the two paths take the same time; the sort's does not grow as fast
# Up to this many tokens the stacked shared experts run in the expert kernels' slots (MoE.stack_shared_experts): decode
# steps of 1, 4, 8 and 16 sequences took 5.8, 1.1, 2.0 and 0.7% less time than with the dense MLP on an H100; with
# slots at every size, batch 64, 256 and a 16k prefill measured 1-3% slower (docs/benchmarks.md).
SHARED_SLOTS_MAX_TOKENS = FUSED_ROUTING_MAX_TOKENS


def ranked_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ids torch.topk(scores, k) picks along the last dimension (largest first, a tie to the lower id), from each
    entry's rank: how many entries rank above it. Comparisons and sums only, so a compiled region fuses it with the
    softmax before it; [rows, n] costs rows x n x n comparisons, which is why only a few rows take it."""
    n = scores.shape[-1]
    ids = torch.arange(n, device=scores.device)
    mine, other = scores.unsqueeze(-1), scores.unsqueeze(-2)
    rank = ((other > mine) | ((other == mine) & (ids < ids.unsqueeze(-1)))).sum(-1)  # [rows, n]
    at_place = rank.unsqueeze(-2) == torch.arange(k, device=scores.device).unsqueeze(-1)  # [rows, k, n]
    return torch.where(at_place, ids, 0).sum(-1)


class TopkRouter(nn.Module):
    """Chooses each token's experts: V2 softmax (greedy or group-limited), V3 sigmoid with bias-corrected groups."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x, weight = x.to(torch.float32), self.weight.to(torch.float32)  # see finish_weights()
        # A few tokens' routing, compiled, as reductions inductor fuses: the GEMV as a product and a sum, the top-k by
        # counting ranks, instead of cuBLAS's two-kernel GEMV and a sort kernel (6 against 13 us a layer at batch 1 on
        # an H100, benchmarks/gpu_routing.py). Eagerly it would materialise [tokens, experts, hidden].
        few = torch.compiler.is_compiling() and x.shape[0] <= FUSED_ROUTING_MAX_TOKENS
        logits = (x.unsqueeze(1) * weight).sum(-1) if few else F.linear(x, weight)
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
            choice_scores = scores
            if cfg.topk_method == "group_limited_greedy":
                group_scores = scores.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group).amax(dim=-1)
                choice_scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
        else:
            scores = logits.sigmoid()
            biased = scores + self.e_score_correction_bias
            group_scores = biased.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group).topk(2, dim=-1)[0].sum(-1)
            choice_scores = biased.masked_fill(~self._group_mask(group_scores), float("-inf"))
        if few:
            topk_ids = ranked_top_k(choice_scores, cfg.num_experts_per_tok)
        else:
            topk_ids = torch.topk(choice_scores, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
        if cfg.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids, topk_weights * cfg.routed_scaling_factor

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        top_groups = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        return group_mask.repeat_interleave(cfg.n_routed_experts // cfg.n_group, dim=1)


class RoutedExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, experts: ExpertRange):
        super().__init__()
        self.experts = experts
        inter = cfg.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(experts.count, 2 * inter, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(experts.count, cfg.hidden_size, inter))
        self.stacked_shared = 0  # shared experts stacked after the routed ones (MoE.stack_shared_experts)
        self.placement: LayerPlacement | None = None  # replicas of other ranks' experts (reserve_replica_slots)

    def reserve_replica_slots(self, spare: int, rank: int, world_size: int) -> LayerPlacement:
        """Room for `spare` replicas after this rank's own experts (expert_placement.reserve_replica_slots)."""
        self.placement = reserve_replica_slots(self, ("w13", "w2"), spare, rank, world_size)
        self.placement.weights = self.placement.slots
        return self.placement

    def stack(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Appends experts of the same shapes after this rank's own."""
        self.w13 = nn.Parameter(torch.cat([self.w13.detach(), w13]), requires_grad=False)
        self.w2 = nn.Parameter(torch.cat([self.w2.detach(), w2]), requires_grad=False)
        self.stacked_shared += w13.shape[0]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13, self.w2


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, experts: ExpertRange,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = TopkRouter(cfg)
        # Stacked gate and up rows keep whole FP8 blocks only when moe_intermediate_size is a multiple of the block's
        # rows (V3's 2048 is); otherwise the routed experts are dequantized at load.
        if fp8_block is not None and cfg.moe_intermediate_size % fp8_block[0] == 0:
            self.experts: RoutedExperts | FP8RoutedExperts = FP8RoutedExperts(
                cfg.hidden_size, cfg.moe_intermediate_size, experts, fp8_block)
        else:
            self.experts = RoutedExperts(cfg, experts)
        self.shared_experts = (
            DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, fp8_block)
            if cfg.n_shared_experts else None
        )

    def stack_shared_experts(self) -> None:
        """A copy of the shared experts as experts of their own (n_shared_experts of moe_intermediate_size each, which
        is what they are) stacked after the routed ones. Steps of a few tokens give every token their slots, and the
        expert kernels compute them in the same launches, where the dense MLP took three more kernels and read its
        weights at a lower fraction of the memory's bandwidth (batch-1 decode 3.74 -> 3.58 ms on an H100); larger
        steps keep the dense MLP, faster there (docs/benchmarks.md). The copy costs V2-Lite 0.9 GB. For plain
        weights (not FP8) of a rank that holds every routed expert, whose backend addresses them by id locally (an
        expert-parallel exchange sends ids to their owners)."""
        shared = self.shared_experts
        if shared is None or not isinstance(self.experts, RoutedExperts) or type(shared.gate_proj) is not nn.Linear:
            return
        count = self.gate.cfg.n_shared_experts
        inter, hidden = self.gate.cfg.moe_intermediate_size, self.gate.cfg.hidden_size
        gate, up = (linear.weight.detach().view(count, inter, hidden) for linear in (shared.gate_proj, shared.up_proj))
        self.experts.stack(torch.cat([gate, up], dim=1),
                           shared.down_proj.weight.detach().view(hidden, count, inter).transpose(0, 1))

    def in_slots(self, tokens: int) -> bool:
        """Whether a step of this many tokens runs the shared experts in the expert kernels' slots. (Asked twice a MoE
        layer each step: an isinstance, not a getattr default, which on FP8 experts raises inside nn.Module.)"""
        return (isinstance(self.experts, RoutedExperts) and self.experts.stacked_shared > 0
                and tokens <= SHARED_SLOTS_MAX_TOKENS)

    def choose(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gate's choice for each token (routed expert ids, for the load counts) and the slots the expert
        kernels compute (ids and weights): the routed experts, then, in_slots(), the stacked shared ones at weight 1."""
        topk_ids, topk_weights = self.gate(h)
        if not self.in_slots(h.shape[0]):
            return topk_ids, topk_ids, topk_weights
        stacked, first = self.experts.stacked_shared, self.experts.experts.first + self.experts.experts.count
        shared_ids = torch.arange(first, first + stacked, device=h.device, dtype=topk_ids.dtype).expand(h.shape[0], -1)
        return (topk_ids, torch.cat([topk_ids, shared_ids], dim=1),
                torch.cat([topk_weights, topk_weights.new_ones(h.shape[0], stacked)], dim=1))

    def routed(self, x: torch.Tensor, routed_ids: torch.Tensor, slot_ids: torch.Tensor, slot_weights: torch.Tensor,
               backend: MoEBackend, load: ExpertLoad | None, shared_beside: bool = False) -> torch.Tensor:
        """Each token's experts' weighted sum, by the backend's kernels (choose() has picked the slots); with
        `shared_beside` (see shared_beside()), the shared experts' output added, computed while the tokens travel."""
        if load is not None:
            load.record(self.layer_idx, routed_ids)
        w13, w2 = self.experts.weights()
        placed = {} if self.experts.placement is None else {"placement": self.experts.placement}
        if shared_beside:
            return backend.forward(x, slot_ids, slot_weights, w13, w2, self.experts.experts.first,
                                   beside=functools.partial(self.shared_experts, x), **placed)
        return backend.forward(x, slot_ids, slot_weights, w13, w2, self.experts.experts.first, **placed)

    def shared_beside(self, backend: MoEBackend) -> bool:
        """Whether the backend runs the shared experts while it exchanges the routed tokens between ranks (then
        routed() includes them and combine() adds nothing)."""
        return self.shared_experts is not None and overlaps_shared(backend)

    def combine(self, x: torch.Tensor, routed: torch.Tensor, shared_added: bool = False) -> torch.Tensor:
        """The routed sum plus the shared experts' output, where neither choose() put them in the slots nor the
        backend added them (`shared_added`)."""
        if self.shared_experts is None or shared_added or self.in_slots(x.shape[0]):
            return routed
        return routed + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, experts: ExpertRange,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, fp8_block)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = (MoE(cfg, layer_idx, experts, fp8_block) if self.is_moe
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, fp8_block))

    def forward(self, x, rotations, rope, kv_cache, batch: AttentionBatch, backends: Backends, expanded: bool,
                regions: "LayerRegions | None" = None):
        """The layer as three regions of plain tensor work around the two calls into backends (attention, routed
        experts); `regions` runs them compiled (see LayerRegions), eagerly by default."""
        regions = regions or EAGER_REGIONS
        q, q_pe, latent, k_pe = regions.attention_inputs(self, x, rotations, rope, not expanded)
        heads_out = self.attend(q, q_pe, latent, k_pe, kv_cache, batch, backends, expanded)
        return self.finish(x, heads_out, backends, expanded, regions)

    def attend(self, q, q_pe, latent, k_pe, kv_cache, batch: AttentionBatch, backends: Backends,
               expanded: bool) -> torch.Tensor:
        """The attention backend's part: writes the new latents to the cache, returns the heads' output."""
        if expanded:
            return self.self_attn.attend_expanded(q, q_pe, latent, k_pe, kv_cache, batch, backends.attention)
        return backends.attention.forward(q, q_pe, latent, k_pe, kv_cache, batch, self.cfg.softmax_scale)

    def finish(self, x, heads_out, backends: Backends, expanded: bool, regions: "LayerRegions") -> torch.Tensor:
        """Everything after attention: o_proj and the residual, the MLP or the experts (routed by the backend)."""
        x, h, routed_ids, slot_ids, slot_weights = regions.attention_output(self, x, heads_out, not expanded)
        shared_beside = self.is_moe and self.mlp.shared_beside(backends.moe)
        routed = (self.mlp.routed(h, routed_ids, slot_ids, slot_weights, backends.moe, backends.expert_load,
                                  shared_beside) if self.is_moe else None)
        return regions.mlp_output(self, x, h, routed, shared_beside)


def attention_inputs(layer: DecoderLayer, x, rotations, rope: RotaryEmbedding, absorb: bool):
    return layer.self_attn.project(layer.input_layernorm(x), rotations, rope, absorb)


def attention_output(layer: DecoderLayer, x, heads_out, latent_out: bool):
    """Residual after attention, the MLP's normalised input, and (MoE layers) MoE.choose()'s routed ids and slots."""
    x = x + layer.self_attn.output(heads_out, latent_out)
    h = layer.post_attention_layernorm(x)
    return (x, h, *layer.mlp.choose(h)) if layer.is_moe else (x, h, None, None, None)


def mlp_output(layer: DecoderLayer, x, h, routed: torch.Tensor | None, shared_added: bool = False):
    return x + (layer.mlp.combine(h, routed, shared_added) if layer.is_moe else layer.mlp(h))


@dataclass(frozen=True)
class LayerRegions:
    """How a decoder layer runs its tensor work between the backends' kernels: eagerly, op by op, or each region
    compiled by inductor into a few fused kernels (norms, RoPE, residuals, routing softmax and top-k around the
    GEMMs). One compiled region serves every layer and every batch size (a graph for each kind of layer and attention
    form, and for a few tokens, whose routing takes another path): the layer's weights are its inputs."""

    attention_inputs: Callable
    attention_output: Callable
    mlp_output: Callable


EAGER_REGIONS = LayerRegions(attention_inputs, attention_output, mlp_output)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, experts: ExpertRange, fp8_block: tuple[int, int] | None = None):
        super().__init__()
        # Built on the meta device (build_model): a weight given skips the random init, whose meta kernel imports
        # torch._dynamo (~1.5 s of every rank's start on the 2-core machine, where nothing compiles).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, experts, fp8_block) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backends: Backends, experts: ExpertRange | None = None,
                 fp8_block: tuple[int, int] | None = None):
        """`fp8_block`: keep the decoder layers' linears block-FP8 with blocks of this shape (None: all dense)."""
        super().__init__()
        self.cfg = cfg
        self.backends = backends
        self.expert_range = experts or ExpertRange(0, cfg.n_routed_experts)
        self.model = DeepseekModel(cfg, self.expert_range, fp8_block)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.rope: RotaryEmbedding | None = None  # built on the final device by init_rope()

    def init_rope(self, device: torch.device) -> None:
        self.rope = RotaryEmbedding(self.cfg.rope, device)

    def fuse_projections(self) -> None:
        """Linears that read the same input become one GEMM each (see fuse_rows): on the final device, before any
        weight is written."""
        for module in self.modules():
            if isinstance(module, (MLAttention, DenseMLP)):
                module.fuse_projections()

    def finish_weights(self) -> None:
        """Once the weights are in: the routers' weights in float32, the precision routing runs in, so that no step
        converts them again (a kernel a layer; their values do not change), and the shared experts stacked with the
        routed ones where the rank holds them all (MoE.stack_shared_experts)."""
        holds_all = (self.expert_range.count == self.cfg.n_routed_experts
                     and not isinstance(self.backends.moe, ExpertParallelMoE))
        for module in self.modules():
            if isinstance(module, TopkRouter):
                module.weight = nn.Parameter(module.weight.to(torch.float32), requires_grad=False)
            elif isinstance(module, MoE) and holds_all:
                module.stack_shared_experts()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, batch: AttentionBatch,
                backends: Backends | None = None, regions: LayerRegions | None = None):
        """input_ids/positions [T]; kv_cache [layers, pages, page_size, kv_dim]. Returns final hidden states [T, D].
        `backends` replaces the model's own for this call (CUDA graphs capture with a fixed-buffer attention);
        `regions`: how the layers run their own tensor work (eagerly by default)."""
        assert self.rope is not None, "call init_rope() after moving the model to its device"
        backends = backends or self.backends
        rotations = self.rope.rotations(positions)
        expanded = self.attends_expanded(batch, backends)
        x = self.model.embed_tokens(input_ids)
        for layer_idx, layer in enumerate(self.model.layers):
            x = layer(x, rotations, self.rope, kv_cache[layer_idx], batch, backends, expanded, regions)
        return self.model.norm(x)

    def attends_expanded(self, batch: AttentionBatch, backends: Backends) -> bool:
        """Whether this step's attention runs in the expanded form (see uses_expanded_attention), where the backend
        has kernels for the model's head widths."""
        return uses_expanded_attention(self.cfg, batch) and backends.attention.expands(self.cfg.qk_head_dim,
                                                                                       self.cfg.v_head_dim)

    def routed_expert_bytes(self) -> int:
        """Memory held by this rank's routed expert weights, FP8 scales included (what expert parallelism divides);
        shared experts stacked with them not counted."""
        total = 0
        for module in self.modules():
            if isinstance(module, (RoutedExperts, FP8RoutedExperts)):
                routed = module.experts.count  # experts of one shape: the routed ones' share is exact
                held = sum(p.numel() * p.element_size() for p in module.parameters())
                stacked = module.stacked_shared if isinstance(module, RoutedExperts) else 0
                total += held * routed // (routed + stacked)
        return total

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).to(torch.float32)
