"""One Triton kernel for the routed experts' combine (pdserve.ops.moe_grouped.sum_slot_rows): each token's sum of the
expert output rows of its slots, read where the grouped GEMMs left them (sorted by expert).

Eager torch does it as a gather of every slot's row, a select that zeroes the slots of other ranks' experts, and a sum
over the slots: two [slots, hidden] temporaries written and read back. This kernel reads only the rows of the slots
that count and writes each token's sum once. (torch.compile's kernel for the same three ops, with dynamic sizes, made
EP2's prefill step 14% slower on two H200s, and EP1's 4%: docs/benchmarks.md.)
"""

import torch
import triton
import triton.language as tl

BLOCK_COLS = 1024


@triton.jit
def _sum_slot_rows_kernel(rows_ptr, slot_row_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_COLS: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    in_row = cols < hidden
    total = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # in slot order, float32: the same sum as torch's, and deterministic
        row = tl.load(slot_row_ptr + token.to(tl.int64) * TOP_K + slot)
        if row >= 0:
            total += tl.load(rows_ptr + row.to(tl.int64) * hidden + cols, mask=in_row).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=in_row)


def sum_slot_rows_triton(rows: torch.Tensor, slot_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[t] = sum over t's k slots s with slot_row[s] >= 0 of rows[slot_row[s]]; rows [R, hidden] contiguous,
    slot_row [T k] (-1: the slot adds nothing)."""
    rows, slot_row = rows.contiguous(), slot_row.contiguous()
    tokens = slot_row.shape[0] // top_k
    out = rows.new_empty(tokens, rows.shape[1])
    if tokens:
        grid = (tokens, triton.cdiv(rows.shape[1], BLOCK_COLS))
        _sum_slot_rows_kernel[grid](rows, slot_row, out, rows.shape[1], TOP_K=top_k, BLOCK_COLS=BLOCK_COLS)
    return out
