"""Decode steps under CUDA graphs: captured once per batch size at start-up, replayed with the batch padded up.

Eager decode is bound by the host launching ~2,300 kernels a step; a replay launches them as one. What changes
between steps lives in fixed device buffers filled before each replay: token ids, positions and KV slots (one
host-to-device copy) and flashinfer's attention plan (made on the host, copied into its metadata buffers). Nothing
inside a step waits on the host. Padding rows decode token 0 at position 0 into a scratch page that no request
owns, and their logits are dropped.
"""

import logging
from dataclasses import dataclass

import torch

from pdserve.model.deepseek import Backends, DeepseekForCausalLM
from pdserve.ops.attention import AttentionBatch
from pdserve.ops.attention_flashinfer import WORKSPACE_BYTES, FlashInferMLA, FlashInferMLAGraphSlot

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class DecodeGraphConfig:
    batch_sizes: tuple[int, ...]  # captured sizes, ascending; larger decode batches run eagerly
    max_pages_per_seq: int


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The default sizes below min(max_num_seqs, 256), then that cap itself, so every decode batch up to it fits."""
    cap = min(max_num_seqs, CAPTURE_SIZES[-1])
    return tuple(s for s in CAPTURE_SIZES if s < cap) + (cap,)


def decode_graph_config(enabled: bool, model: DeepseekForCausalLM, max_num_seqs: int, max_model_len: int,
                        page_size: int) -> DecodeGraphConfig | None:
    """None where graphs cannot run: turned off, on the CPU, or attention not on flashinfer (the torch reference
    loops over sequences on the host)."""
    if not enabled:
        return None
    if not isinstance(model.backends.attention, FlashInferMLA):
        if next(model.parameters()).device.type == "cuda":
            log.info("decode runs eagerly: CUDA graphs need the flashinfer attention backend (bfloat16)")
        return None
    return DecodeGraphConfig(capture_sizes(max_num_seqs), -(-max_model_len // page_size))


@dataclass
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    attention: FlashInferMLAGraphSlot
    logits: torch.Tensor  # [batch size, vocab] float32, rewritten by every replay


class DecodeGraphs:
    def __init__(self, model: DeepseekForCausalLM, kv_cache: torch.Tensor, page_size: int, cfg: DecodeGraphConfig,
                 scratch_page: int):
        self.model, self.kv_cache, self.page_size = model, kv_cache, page_size
        self.sizes = cfg.batch_sizes
        self.scratch_page = scratch_page
        device = kv_cache.device
        # Rows: token ids, positions, KV slots. One copy fills them; every graph reads a prefix of each row.
        self._inputs = torch.zeros(3, self.sizes[-1], dtype=torch.int64, device=device)
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # replays never overlap
        pool = torch.cuda.graph_pool_handle()
        self._steps: dict[int, _CapturedStep] = {}
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            self._steps[size] = self._capture(size, cfg.max_pages_per_seq, pool)
        log.info("captured decode CUDA graphs for batch sizes %s", list(self.sizes))

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def _capture(self, size: int, max_pages_per_seq: int, pool) -> _CapturedStep:
        cfg = self.model.cfg
        attention = FlashInferMLAGraphSlot(
            self._workspace, size, size * max_pages_per_seq, self.page_size, cfg.num_attention_heads,
            cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.softmax_scale, self.kv_cache.dtype,
        )
        self._fill(attention, [], [], [], [], [], size)  # all padding: a valid plan for the warm-up and capture
        ids, positions, slots = self._inputs[:, :size]
        batch = AttentionBatch(query_lens=[1] * size, kv_lens=[1] * size, slot_mapping=slots, page_size=self.page_size,
                               page_table=torch.zeros(size, 1, dtype=torch.int64, device=ids.device))  # unused
        backends = Backends(attention=attention, moe=self.model.backends.moe)

        def step() -> torch.Tensor:
            return self.model.compute_logits(self.model(ids, positions, self.kv_cache, batch, backends))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up outside the capture: lazy initialisation and kernel selection happen here
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = step()
        return _CapturedStep(graph, attention, logits)

    def _fill(self, attention: FlashInferMLAGraphSlot, input_ids: list[int], positions: list[int], slots: list[int],
              kv_lens: list[int], page_ids: list[list[int]], size: int) -> None:
        pad = size - len(input_ids)
        attention.plan(kv_lens + [1] * pad, page_ids + [[self.scratch_page]] * pad)
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad,
                             slots + [self.scratch_page * self.page_size] * pad], dtype=torch.int64)
        self._inputs[:, :size].copy_(host)

    @torch.inference_mode()  # the plan buffers were made under inference mode, at capture
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], kv_lens: list[int],
            page_ids: list[list[int]]) -> torch.Tensor:
        """One new token per sequence (at most max_batch_size); float32 logits [num seqs, vocab], valid until the
        next run."""
        num_seqs = len(input_ids)
        size = next(s for s in self.sizes if s >= num_seqs)
        step = self._steps[size]
        self._fill(step.attention, input_ids, positions, slots, kv_lens, page_ids, size)
        step.graph.replay()
        return step.logits[:num_seqs]
