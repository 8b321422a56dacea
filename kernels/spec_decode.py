"""The inputs of a batch's rejection sampling (kernels.rejection_sampler): where each sequence's draft tokens and
target rows sit in the flattened batch and the q they were drawn from (SpecDecodeMetadata), each sequence's seed,
position and mode (SamplingMetadata), and the checks the launcher runs on them before any kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """Where each sequence's draft tokens sit in the flattened batch, and the q they were drawn from.

    Target rows follow the same layout with one extra row per sequence: sequence i owns target rows
    cu_num_draft_tokens[i] + i ... cu_num_draft_tokens[i + 1] + i, its k_i draft rows then its bonus row.
    """

    draft_token_ids: torch.Tensor  # [num_draft_tokens] int64, every sequence's drafts, flattened
    cu_num_draft_tokens: torch.Tensor  # [batch + 1] int64, offsets of each sequence's drafts
    draft_probs: torch.Tensor | None  # [num_draft_tokens, vocab_size], q densified; None when no row uses it
    is_one_hot: torch.Tensor  # [batch] bool: q = delta(draft token), its draft_probs rows are never read
    # token trees: [num_draft_tokens] int64, each draft token's parent among its sequence's draft tokens (its index
    # there, below its own), or -1 for a child of the last verified token; None: every sequence's drafts are a
    # chain (parents -1, 0, 1, ...). A node's children, in index order, are the draws in the order they were
    # drawn, each from its own row of draft_probs.
    draft_parents: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.cu_num_draft_tokens.numel() - 1

    @property
    def num_draft_tokens(self) -> int:
        return self.draft_token_ids.numel()

    def to(self, device: torch.device | str) -> SpecDecodeMetadata:
        return SpecDecodeMetadata(self.draft_token_ids.to(device), self.cu_num_draft_tokens.to(device),
                                  None if self.draft_probs is None else self.draft_probs.to(device),
                                  self.is_one_hot.to(device),
                                  None if self.draft_parents is None else self.draft_parents.to(device))

    def tree_layout(self) -> TreeLayout:
        """Where each target row's children sit, and how deep each row is (for a chain one device sync, the
        longest path and the most drafts; a tree's depths take one more per level)."""
        return TreeLayout.build(self.cu_num_draft_tokens, self.draft_parents, self.num_draft_tokens)


@dataclass(frozen=True)
class TreeLayout:
    """A batch's draft tokens as trees over the target rows (a chain is a tree whose nodes have one child each).

    Sequence i owns target rows r0 = cu[i] + i ... cu[i + 1] + i: row r0 is its root (the last verified token's
    distribution, which decides the first draft tokens), row r0 + 1 + j the distribution after its draft token j.
    A row's children are the draft tokens whose parent it is, in index order."""

    child_offsets: torch.Tensor  # [num_target_rows + 1] int64: row r's children are child_ids[offsets[r]:offsets[r + 1]]
    child_ids: torch.Tensor  # [num_draft_tokens] int64 flat draft indices, grouped by parent row
    row_depth: torch.Tensor  # [num_target_rows] int64: the position a row decides, less its sequence's first
    parent_rows: torch.Tensor  # [num_draft_tokens] int64: the target row each draft token is verified against
    sibling_index: torch.Tensor  # [num_draft_tokens] int64: its rank among its parent's children
    node_seq: torch.Tensor  # [num_draft_tokens] int64: the sequence it belongs to
    max_path: int  # the most draft tokens one round can accept (the deepest node's depth + 1; 0 without drafts)
    max_nodes: int  # the most draft tokens of one sequence

    @classmethod
    def build(cls, cu: torch.Tensor, parents: torch.Tensor | None, num_draft: int) -> TreeLayout:
        device = cu.device
        batch = cu.numel() - 1
        counts = cu[1:] - cu[:-1]
        node_seq = torch.repeat_interleave(torch.arange(batch, device=device), counts, output_size=num_draft)
        local = torch.arange(num_draft, device=device) - cu[node_seq]
        first_row = cu[:-1] + torch.arange(batch, device=device)  # [batch] each sequence's root row
        if parents is None:
            parent_local = local - 1
            depth = local
        else:
            parent_local = parents
            depth = torch.zeros_like(local)
            ancestor = parent_local.clone()
            while bool((ancestor >= 0).any()):  # at most the deepest node's depth rounds
                up = ancestor >= 0
                depth += up.to(torch.int64)
                ancestor = torch.where(up, parent_local[(cu[node_seq] + ancestor).clamp_min(0)], ancestor)
        parent_rows = first_row[node_seq] + parent_local + 1
        num_rows = num_draft + batch
        order = torch.sort(parent_rows, stable=True).indices  # by parent row, then by index
        per_row = torch.bincount(parent_rows, minlength=num_rows)
        child_offsets = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        child_offsets[1:] = per_row.cumsum(0)
        sibling_index = torch.empty_like(local)
        sibling_index[order] = torch.arange(num_draft, device=device) - child_offsets[parent_rows[order]]
        row_depth = torch.zeros(num_rows, dtype=torch.int64, device=device)
        row_depth[first_row[node_seq] + local + 1] = depth + 1
        max_path, max_nodes = torch.stack([depth.max() + 1, counts.max()]).tolist() if num_draft else (0, 0)
        return cls(child_offsets, order, row_depth, parent_rows, sibling_index, node_seq, max_path, max_nodes)


@dataclass(frozen=True)
class SamplingMetadata:
    """The sampling side of the batch: which sequences are greedy, and the key of each one's random numbers."""

    is_greedy: torch.Tensor  # [batch] bool: accept while draft == target argmax, then emit the argmax
    seeds: torch.Tensor  # [batch] int64 in [0, 2^63), the Philox key
    positions: torch.Tensor  # [batch] int64, the position each sequence's first draft token (or bonus) decides
    # [batch] bool: accept while draft == argmax p / E, then emit it (Gumbel-max coupling; greedy rows ignore it);
    # None: no row is coupled
    is_coupled: torch.Tensor | None = None

    def coupled_mask(self) -> torch.Tensor:
        """[batch] bool: the sampled rows verified by coupling."""
        if self.is_coupled is None:
            return torch.zeros_like(self.is_greedy)
        return self.is_coupled & ~self.is_greedy

    def to(self, device: torch.device | str) -> SamplingMetadata:
        return SamplingMetadata(self.is_greedy.to(device), self.seeds.to(device), self.positions.to(device),
                                None if self.is_coupled is None else self.is_coupled.to(device))


def check_inputs(target_probs: torch.Tensor, target_argmax: torch.Tensor, spec: SpecDecodeMetadata,
                 sampling: SamplingMetadata) -> None:
    """Shapes and dtypes that the kernels and the reference rely on; a ValueError names the first mismatch."""
    batch, num_draft = spec.batch_size, spec.num_draft_tokens
    cu = spec.cu_num_draft_tokens
    if cu.dim() != 1 or cu.numel() < 1 or cu[[0, -1]].tolist() != [0, num_draft]:  # one device sync
        raise ValueError(f"cu_num_draft_tokens must run from 0 to num_draft_tokens = {num_draft}, got "
                         f"{cu.tolist()}")
    num_rows = num_draft + batch
    if target_probs.dim() != 2 or target_probs.shape[0] != num_rows:
        raise ValueError(f"target_probs must be [num_draft_tokens + batch = {num_rows}, vocab], got "
                         f"{tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    checks = [
        ("target_argmax", target_argmax, (num_rows,), torch.int64),
        ("draft_token_ids", spec.draft_token_ids, (num_draft,), torch.int64),
        ("cu_num_draft_tokens", spec.cu_num_draft_tokens, (batch + 1,), torch.int64),
        ("is_one_hot", spec.is_one_hot, (batch,), torch.bool),
        ("is_greedy", sampling.is_greedy, (batch,), torch.bool),
        ("seeds", sampling.seeds, (batch,), torch.int64),
        ("positions", sampling.positions, (batch,), torch.int64),
    ]
    if sampling.is_coupled is not None:
        checks.append(("is_coupled", sampling.is_coupled, (batch,), torch.bool))
    if spec.draft_probs is not None:
        checks.append(("draft_probs", spec.draft_probs, (num_draft, vocab), None))
    if spec.draft_parents is not None:
        checks.append(("draft_parents", spec.draft_parents, (num_draft,), torch.int64))
    for name, tensor, shape, dtype in checks:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(tensor.shape)}")
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if spec.draft_parents is not None and num_draft:
        counts = cu[1:] - cu[:-1]
        local = torch.arange(num_draft, device=cu.device) - torch.repeat_interleave(cu[:-1], counts)
        if not bool(((spec.draft_parents >= -1) & (spec.draft_parents < local)).all()):
            raise ValueError("draft_parents: each draft token's parent must be -1 or an earlier draft token of its "
                             "sequence")
