"""One Triton kernel for an all-to-all's writes into peer memory (pdserve/ops/peer_exchange.py): every peer's share of
one or two row tensors, stored straight into that peer's buffer by the GPU's threads.

Copies (cudaMemcpyAsync into each peer's mapped buffer) do the same as one copy-engine operation per peer and tensor:
3 R a layer in the expert exchange, each a node of the decode graph ordered against the kernels around it. One kernel
per all-to-all took 6.6% off EP2's batch-256 decode step on two H200s (docs/benchmarks.md).
"""

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 8
BLOCK_WORDS = 1024


@triton.jit
def _write_share(base, byte_offset, src_ptr, peer, rank, rows, rows_per_peer, row_words, BLOCK_WORDS: tl.constexpr):
    """Rows `rows` of `peer`'s share of src ([R x rows_per_peer, row_words]) -> the peer's buffer at `byte_offset`,
    rows [rank x rows_per_peer, ...): where what this rank sends lands in every peer."""
    dst = (base + byte_offset).to(tl.pointer_type(src_ptr.dtype.element_ty))
    row_ok = rows < rows_per_peer
    src_rows = (peer * rows_per_peer + rows).to(tl.int64) * row_words
    dst_rows = (rank * rows_per_peer + rows).to(tl.int64) * row_words
    for start in range(0, row_words, BLOCK_WORDS):
        words = start + tl.arange(0, BLOCK_WORDS)
        mask = row_ok[:, None] & (words < row_words)[None, :]
        values = tl.load(src_ptr + src_rows[:, None] + words[None, :], mask=mask)
        tl.store(dst + dst_rows[:, None] + words[None, :], values, mask=mask)


# Shares change size with every captured batch: not specialized on their row counts or places.
@triton.jit(do_not_specialize=["rows_per_peer", "byte_offset", "second_byte_offset"])
def _write_shares_kernel(bases_ptr, rank, rows_per_peer, src_ptr, byte_offset, row_words, second_ptr,
                         second_byte_offset, second_row_words, TWO: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         BLOCK_WORDS: tl.constexpr, SECOND_BLOCK_WORDS: tl.constexpr):
    peer = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    base = tl.load(bases_ptr + peer)
    _write_share(base, byte_offset, src_ptr, peer, rank, rows, rows_per_peer, row_words, BLOCK_WORDS)
    if TWO:
        _write_share(base, second_byte_offset, second_ptr, peer, rank, rows, rows_per_peer, second_row_words,
                     SECOND_BLOCK_WORDS)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s rows as 32-bit words (the exchange's rows: bf16 hidden states of an even width, int64 expert ids)."""
    rows = tensor.reshape(tensor.shape[0], -1).view(torch.uint8)
    if rows.shape[1] % 4:
        raise ValueError(f"rows of {rows.shape[1]} bytes are not whole 32-bit words")
    return rows.view(torch.int32)


def write_shares(peer_bases: torch.Tensor, rank: int, tensors: list[torch.Tensor], byte_offsets: list[int]) -> None:
    """For each of one or two contiguous tensors of R x C rows (R = len(peer_bases), the peers' buffer addresses as an
    int64 tensor on the device): rows [p C, p C + C) -> peer p's buffer at that tensor's byte offset, at rows [rank C,
    rank C + C)."""
    if len(tensors) not in (1, 2) or len(byte_offsets) != len(tensors):
        raise ValueError(f"one or two tensors, each with its byte offset: {len(tensors)}, {len(byte_offsets)}")
    if tensors[0].shape[0] != tensors[-1].shape[0]:
        raise ValueError(f"tensors of {tensors[0].shape[0]} and {tensors[-1].shape[0]} rows")
    world_size = peer_bases.shape[0]
    rows_per_peer = tensors[0].shape[0] // world_size
    first = _words(tensors[0])
    second = _words(tensors[-1])
    grid = (triton.cdiv(rows_per_peer, BLOCK_ROWS), world_size)
    _write_shares_kernel[grid](
        peer_bases, rank, rows_per_peer, first, byte_offsets[0], first.shape[1], second, byte_offsets[-1],
        second.shape[1], TWO=len(tensors) == 2, BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_WORDS=min(BLOCK_WORDS, triton.next_power_of_2(first.shape[1])),
        SECOND_BLOCK_WORDS=min(BLOCK_WORDS, triton.next_power_of_2(second.shape[1])))
