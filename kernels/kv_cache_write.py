"""Write new K/V rows into their slots of the paged pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.platform import elementwise_warps, reference_guard, use_triton


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads * head_dim (of K, of V)], contiguous rows
    key_cache_ptr, value_cache_ptr,  # [num_slots, num_kv_heads * head_dim (of K, of V)]
    slot_ptr,  # [num_tokens] int32 or int64; a negative slot: a padding token, nothing written
    ROW: tl.constexpr,  # num_kv_heads * head_dim of K
    BLOCK: tl.constexpr,
    ROW_V: tl.constexpr = 0,  # of V, when its head dim differs (MLA); 0: ROW
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    if ROW_V == 0 or ROW_V == ROW:
        for start in range(0, ROW, BLOCK):
            mask = start + offs < ROW
            src = token.to(tl.int64) * ROW + start + offs
            dst = slot * ROW + start + offs
            tl.store(key_cache_ptr + dst, tl.load(key_ptr + src, mask=mask), mask=mask)
            tl.store(value_cache_ptr + dst, tl.load(value_ptr + src, mask=mask), mask=mask)
    else:
        for start in range(0, ROW, BLOCK):
            mask = start + offs < ROW
            tl.store(key_cache_ptr + slot * ROW + start + offs,
                     tl.load(key_ptr + token.to(tl.int64) * ROW + start + offs, mask=mask), mask=mask)
        for start in range(0, ROW_V, BLOCK):
            mask = start + offs < ROW_V
            tl.store(value_cache_ptr + slot * ROW_V + start + offs,
                     tl.load(value_ptr + token.to(tl.int64) * ROW_V + start + offs, mask=mask), mask=mask)


def write_kv_reference(key, value, key_cache, value_cache, slot_mapping) -> None:
    reference_guard("write_kv_reference")
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim_v]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, slot = block_id * block_size + offset
) -> None:
    """Slot -1 marks a padding token of a static (graph-replayed) batch: the Triton kernel skips it. Only the
    Triton path sees padding (common.static_forward runs where the kernels do), so the reference refuses it."""
    if key.shape[0] == 0:
        return
    if not use_triton(key, key_cache):
        return write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
    write_kv_triton(key, value, key_cache, value_cache, slot_mapping)


def write_kv_triton(key, value, key_cache, value_cache, slot_mapping) -> None:
    row = key_cache.shape[2] * key_cache.shape[3]
    row_v = value_cache.shape[2] * value_cache.shape[3]
    key = key.to(key_cache.dtype).contiguous()
    value = value.to(value_cache.dtype).contiguous()
    write_kv_kernel[(key.shape[0],)](key, value, key_cache, value_cache, slot_mapping, ROW=row,
                                     BLOCK=min(1024, triton.next_power_of_2(max(row, row_v))),
                                     ROW_V=0 if row_v == row else row_v, num_warps=elementwise_warps())
