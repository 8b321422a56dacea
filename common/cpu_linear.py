"""Linear layers for the CPU path: oneDNN-packed float weights, or weight-only int8 or int4.

NOTE: aten's CPU linear is slow for the skinny matrices of decoding. Measured on the 2-core AVX2 dev machine,
a 1536x8960 fp32 linear took 3.4 ms at 1 row and 7.3 ms at 5 rows through aten, and 2.2 ms and 1.7 ms with
weights reordered once for oneDNN. The 1536x151936 lm_head took 152 ms at 5 rows through aten and 21 ms packed.
This is what makes verifying k + 1 tokens cost about the same as one. Projections that read the same input
(q/k/v, gate/up) are fused into one packed matrix, so there are fewer calls and each reads its input once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of this dtype on this CPU: float32 wherever it runs, bfloat16 only where the
    CPU has the instructions its bf16 path needs (AVX512-BW/VL/DQ or AVX-NE-CONVERT); an AVX2-only CPU keeps
    bfloat16 weights as they are (torch's own matmul)."""
    if not onednn_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# the fewest rows a packed linear is called with (fewer are padded with zero rows, sliced off again): measured on
# the 2-core AVX2 EPYC with 1 thread, oneDNN's path for 1 or 2 rows read a 1536x151936 fp32 lm_head at 83 ms, 4 rows
# at 47 ms (1536x17920: 11.0 and 5.8 ms); with 2 threads 48 and 38 ms. A step of 1 token took 580 ms, one of 4 tokens
# 389 (the default target, 128 tokens of context). Rows are computed independently, and 2 to 40 rows round alike
# there (and float32 on an AMX Xeon up to 200; bfloat16 there only up to 32: MAX_BF16_ROWS).
MIN_ROWS = 4
# the most rows one bfloat16 call takes (more run in chunks of this many): on a CPU with AMX, oneDNN's bf16 linear
# takes another kernel from 33 rows on (presumably its AMX one), which sums in another order, so a row's result
# depended on how many rows came with it (measured on a 2-core Intel Xeon with amx_bf16, 1536 -> 8960: 2 to 32 rows
# agree bit for bit with each row alone, every count from 33 to 200 differs; 8960 -> 1536 and 1536 -> 2048 switch
# at 33 too). A verification step of 8 streams' 5-token blocks (40 rows) would then not compute what the same tokens
# decoded one by one compute. The chunks cost bf16 there: a 40-row call of 1536 -> 8960 took 2.4 ms in chunks
# against 1.4 ms whole, 128 rows 5.2 against 2.5 (1 thread). float32 has no such kernel (2 to 200 agree) and runs
# whole.
MAX_BF16_ROWS = 32


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """y = x W^T + b for one or more concatenated nn.Linear layers, with W reordered for oneDNN."""

    def __init__(self, *linears: torch.nn.Linear) -> None:
        super().__init__()
        weight = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
        biases = [lin.bias for lin in linears]
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else torch.zeros(lin.out_features)
                                   for b, lin in zip(biases, linears, strict=True)])
        else:
            self.bias = None
        self.out_features = weight.shape[0]
        self.splits = [lin.out_features for lin in linears]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features]
        # NOTE: oneDNN takes another path for a single row, whose sums round differently from the same row in a
        # batch (checked: 1 row differs, 2 to 40 rows agree bit for bit, but see MAX_BF16_ROWS), and its 2-row path
        # is slow (MIN_ROWS).
        # Fewer rows than MIN_ROWS run padded to MIN_ROWS, so a token's logits do not depend on whether it was
        # decoded alone (k = 0) or verified in a block, and a step of one or two tokens is not the slowest one.
        # More than MAX_BF16_ROWS bfloat16 rows run in chunks of at most that many, for the same reason.
        rows = x.shape[0]
        if rows > MAX_BF16_ROWS and x.dtype == torch.bfloat16:
            return torch.cat([self._rows(chunk) for chunk in x.split(MAX_BF16_ROWS)])
        return self._rows(x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if 0 < rows < MIN_ROWS:
            padded = torch.nn.functional.pad(x, (0, 0, 0, MIN_ROWS - rows))
            return _onednn_linear(padded, self.packed, self.bias)[:rows]
        return _onednn_linear(x, self.packed, self.bias)


class Int8Linear(torch.nn.Module):
    """y = x dequant(Wq)^T + b for one or more concatenated nn.Linear layers, weights quantized to int8 per output
    channel (symmetric: scale = max|w| / 127, q = round(w / scale)), activations in the model's dtype, through
    aten's weight-only int8 matmul.

    NOTE: measured on the 2-core AVX2 dev machine, a 1536x8960 bf16 linear took 0.26 ms at 1 row against 0.37 ms
    through oneDNN-packed bf16 weights, and 0.69 ms against 0.47 ms at 5 rows: int8 reads a quarter of fp32's bytes,
    which is what a memory-bound 1-row draft step pays for. Every shape uses the same kernel, so the quantized model
    is one function whatever the batch: the target a speculative output is lossless against.
    """

    def __init__(self, *linears: torch.nn.Linear) -> None:
        super().__init__()
        weight = torch.cat([lin.weight.detach() for lin in linears], dim=0).to(torch.float32)
        dtype = linears[0].weight.dtype
        biases = [lin.bias for lin in linears]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else torch.zeros(lin.out_features, dtype=dtype)
                                   for b, lin in zip(biases, linears, strict=True)]).to(dtype)
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.qweight = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(dtype)
        self.out_features = weight.shape[0]

    def dequantized(self) -> torch.Tensor:  # [out, in] float32: what the int8 weights stand for
        return self.qweight.to(torch.float32) * self.scales.to(torch.float32)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features]
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        return y if self.bias is None else y + self.bias


INT4_GROUP = 32


@dataclass(frozen=True)
class Int4Weights:
    """One matrix in torch's int4 convention: w = (q - 8) * scale + zero per group of INT4_GROUP input weights."""

    q: torch.Tensor  # [out, in] int32 in [0, 15]
    scale: torch.Tensor  # [out, in / INT4_GROUP] float32
    zero: torch.Tensor  # [out, in / INT4_GROUP] float32

    def dequantized(self) -> torch.Tensor:  # [out, in] float32, with scale and zero as given (not rounded)
        out, cols = self.q.shape
        groups = (self.q.to(torch.float32).reshape(out, -1, INT4_GROUP) - 8.0) * self.scale[..., None]
        return (groups + self.zero[..., None]).reshape(out, cols)


def quantize_int4(weight: torch.Tensor) -> Int4Weights:
    """Affine min/max quantization per group of INT4_GROUP input weights (what a float checkpoint gets)."""
    weight = weight.detach().to(torch.float32)
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP:
        raise ValueError(f"int4 quantization needs in_features divisible by {INT4_GROUP}, got {in_features}")
    groups = weight.reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    return Int4Weights(q.reshape(out_features, in_features), scale, low + 8.0 * scale)


class Int4Linear(torch.nn.Module):
    """Weight-only int4 for one or more concatenated nn.Linear layers: affine per group of 32 input weights, in
    torch's int4 convention w = (q - 8) * scale + zero with q in [0, 15] (scale and zero in bfloat16, as Q4_K's
    affine sub-blocks of 32), through aten's CPU int4 matmul. Activations run in bfloat16; the output is cast back to
    the model's dtype. Every shape uses the same kernel.

    `codes`, one entry per linear, gives weights already in this form (a GGUF's Q4 blocks, common.gguf_weights);
    a None entry, or no `codes`, quantizes that linear's float weight with quantize_int4.

    NOTE: measured on the 2-core AVX2 dev machine, a 1536x8960 linear took 0.25 ms at 1 row, 0.69 ms at 5 rows and
    3.5 ms at 40, the same as int8: at these sizes the kernel is compute-bound, so int4 buys memory, not speed.
    The kernel also takes float32 activations with float32 scales (which would keep a Q4_K scale exact), but that
    path is a scalar reference: 10 ms at 1 row, 81 ms at 5.
    """

    def __init__(self, *linears: torch.nn.Linear, codes: Sequence[Int4Weights | None] | None = None) -> None:
        super().__init__()
        codes = list(codes) if codes is not None else [None] * len(linears)
        if len(codes) != len(linears):
            raise ValueError(f"{len(linears)} linears but {len(codes)} code entries")
        parts = [c if c is not None else quantize_int4(lin.weight) for c, lin in zip(codes, linears, strict=True)]
        for part, lin in zip(parts, linears, strict=True):
            if tuple(part.q.shape) != (lin.out_features, lin.in_features):
                raise ValueError(f"int4 codes of shape {tuple(part.q.shape)} for a linear of "
                                 f"{(lin.out_features, lin.in_features)}")
        self.dtype = linears[0].weight.dtype
        biases = [lin.bias for lin in linears]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else torch.zeros(lin.out_features, dtype=self.dtype)
                                   for b, lin in zip(biases, linears, strict=True)]).to(self.dtype)
        q = torch.cat([p.q for p in parts])
        scale = torch.cat([p.scale for p in parts])
        zero = torch.cat([p.zero for p in parts])
        out_features, in_features = q.shape
        padded = -(-out_features // 16) * 16  # the packing wants N divisible by 16: zero rows, sliced off
        pad = padded - out_features
        q_padded = torch.cat([q, q.new_full((pad, in_features), 8)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_padded.to(torch.int32).contiguous(), 1)
        self._q = q  # for dequantized() (tests); the services free it
        self.out_features = out_features

    def dequantized(self) -> torch.Tensor:  # [out, in] float32: what the kernel multiplies by (bf16 scale and zero)
        sz = self.scales_and_zeros.to(torch.float32).transpose(0, 1)[:self.out_features]  # [out, groups, 2]
        return Int4Weights(self._q, sz[..., 0].contiguous(), sz[..., 1].contiguous()).dequantized()

    def release_reference(self) -> None:
        self._q = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.qweight, INT4_GROUP,
                                                       self.scales_and_zeros)[:, :self.out_features].to(self.dtype)
        return y if self.bias is None else y + self.bias
