"""Linear layers with oneDNN-packed weights for the CPU float32 path.

NOTE: aten's CPU linear is slow for the skinny matrices of decoding. Measured on the 2-core AVX2 dev machine,
a 1536x8960 fp32 linear took 3.4 ms at 1 row and 7.3 ms at 5 rows through aten, and 2.2 ms and 1.7 ms with
weights reordered once for oneDNN. The 1536x151936 lm_head took 152 ms at 5 rows through aten and 21 ms packed.
This is what makes verifying k + 1 tokens cost about the same as one. Projections that read the same input
(q/k/v, gate/up) are fused into one packed matrix, so there are fewer calls and each reads its input once.
"""

from __future__ import annotations

import torch


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
