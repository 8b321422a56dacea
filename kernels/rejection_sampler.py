"""Rejection sampling of a batch of draft blocks against the target (Leviathan et al. 2023; Chen et al. 2023),
where a block is a chain of draft tokens or a token tree (SpecInfer, Miao et al. 2024; Recursive Speculative
Decoding, Jeon et al. 2024).

Vocabulary, as in vLLM's sampler:
- accepted tokens: draft tokens kept, each with probability min(1, p(x) / q(x)), up to the first rejection;
- recovered token: at the first rejection, a sample of norm(max(0, p - q)) replaces the draft token;
- bonus token: when all k drafts are accepted, a sample of p at position k + 1.
Every sequence gets exactly one recovered-or-bonus token, so a round adds between 1 and k + 1 tokens.

Wire modes: greedy rows accept while the draft equals argmax p and then emit argmax p; one-hot rows use
q = delta(x) (accept with probability p(x), recover from p without x); sparse/dense rows use the q the draft
sampled from.

Trees. Target row r of a sequence is the distribution that decides its children (the root row: the tokens after
the last verified one; the row after draft token j: its children). Verification descends from the root: at each
row, its children x_1 .. x_m are tried in index order against a residual target r_i, starting from r_1 = p:
x_i is accepted with probability min(1, r_i(x_i) / q_i(x_i)), and on rejection r_{i+1} = norm(max(0, r_i - q_i)).
The first accepted child is the next row; when every child is rejected (or there is none) the round ends with a
sample of r_{m+1}. This is lossless whenever x_i is distributed as q_i given everything before it: children drawn
i.i.d. from q (q_i = q; SpecInfer's multi-step speculative sampling), or without replacement (q_i = q without the
earlier children, renormalised; RSD), which is what the draft sends, q_i per node. With q_i = delta(x_i) (one-hot)
it holds for any children, however chosen: r_{i+1} is then r_i without x_i. A chain is a tree of one child per row,
and this rule is then the chain's. Greedy rows descend to the child equal to argmax p; coupled rows to the child
equal to y = argmax p / E, and emit y where none is: the output is the target-alone output whatever the tree.

Coupled rows (Gumbel-max coupling; Daliri, Musco and Suresh 2024, arXiv 2408.07978) need no q: at every position
t of the block the verifier computes y_t = argmax_v p_t(v) / E_t(v), with E_t(v) = exponential64(seed, t,
TARGET_SAMPLE, v) the very noise a target-alone step at t races p against. It accepts while the draft equals y
and then emits y. Every emitted token is y_t, an exact sample of p_t, so the output is the target-alone seeded
output whatever the draft proposed; a draft that picks x_t = argmax q_t / E_t with the same noise matches with
probability at least (1 - TV(p, q)) / (1 + TV(p, q)).

Random numbers are drawn where they are used, from kernels/philox.py, keyed by each sequence's seed and by the
position each number decides: the acceptance uniform of a row's i-th child at position t is uniform64(seed, t,
ACCEPT, i), and the recovered-or-bonus sample at position t races its residual against exponential64(seed, t,
TARGET_SAMPLE, v) over the vocabulary v. Rows of one depth share their numbers: a round descends through one row
per depth, so each number decides at most one token. No [batch, vocab] noise tensor exists, and the reference
draws the very same numbers.

Two kernels: one program per target row decides what the row does if the descent reaches it (the child it
accepts, or its final token: the recovered or bonus sample, argmax, or y), computing a vocabulary-wide residual
only for a row that rejects; then one program per sequence walks from its root.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import PLACEHOLDER_TOKEN_ID
from kernels.philox import Purpose, exponential64, exponential_race_reference, uniform64, uniform64_reference
from kernels.platform import VOCAB_BLOCK, reference_guard, use_triton, vocab_warps
from kernels.spec_decode import SamplingMetadata, SpecDecodeMetadata, TreeLayout, check_inputs

ACCEPT = tl.constexpr(int(Purpose.ACCEPT))
TARGET_SAMPLE = tl.constexpr(int(Purpose.TARGET_SAMPLE))


@triton.jit
def decide_rows_kernel(
    choice_ptr,  # [num_target_rows] int64 out: the child the row accepts (index among its sequence's drafts), or -1
    final_ptr,  # [num_target_rows] int64 out: the token the round ends with at this row when choice is -1
    target_probs_ptr,  # [num_target_rows, vocab_size]
    target_argmax_ptr,  # [num_target_rows] int64
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] (unused without HAS_DRAFT_PROBS)
    cu_num_draft_ptr,  # [batch + 1] int64
    child_offsets_ptr,  # [num_target_rows + 1] int64 (TreeLayout)
    child_ids_ptr,  # [num_draft_tokens] int64
    row_depth_ptr,  # [num_target_rows] int64
    z_ptr,  # [num_draft_tokens] float64 out: the residual's mass each q-drawn child was tested against
    is_greedy_ptr,  # [batch] bool
    is_one_hot_ptr,  # [batch] bool
    is_coupled_ptr,  # [batch] bool
    seeds_ptr,  # [batch] int64
    positions_ptr,  # [batch] int64, the position the first draft tokens decide
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    j = tl.program_id(1)
    start = tl.load(cu_num_draft_ptr + seq)
    n = tl.load(cu_num_draft_ptr + seq + 1) - start
    if j > n:
        return
    row = (start + seq + j).to(tl.int64)  # int64: row * vocab overflows int32 for large batches
    greedy = tl.load(is_greedy_ptr + seq)
    coupled = tl.load(is_coupled_ptr + seq) & ~greedy
    uses_q = HAS_DRAFT_PROBS & ~tl.load(is_one_hot_ptr + seq)
    c0 = tl.load(child_offsets_ptr + row)
    c1 = tl.load(child_offsets_ptr + row + 1)
    seed = tl.load(seeds_ptr + seq)
    position = tl.load(positions_ptr + seq) + tl.load(row_depth_ptr + row)  # the position this row decides
    offs = tl.arange(0, BLOCK_V)
    p_row = target_probs_ptr + row * vocab_size
    choice = tl.full([], -1, tl.int64)
    final = tl.full([], -1, tl.int64)
    if greedy:
        final = tl.load(target_argmax_ptr + row)
    elif coupled:  # y = argmax p / E, the target-alone sample at this position
        best = tl.full([], -1.0, tl.float64)
        for v0 in range(0, vocab_size, BLOCK_V):
            cols = v0 + offs
            mask = cols < vocab_size
            p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float64)
            score = tl.where(mask, p / exponential64(seed, position, TARGET_SAMPLE, cols), -1.0)
            tile = tl.max(score, axis=0)
            if tile > best:  # strict: the first maximum wins, as torch.argmax
                best = tile
                final = v0 + tl.argmax(score, axis=0).to(tl.int64)
    if greedy | coupled:  # descend to the child that equals the row's token
        for c in range(c0, c1):
            node = tl.load(child_ids_ptr + c)
            if choice < 0:
                if tl.load(draft_token_ids_ptr + node) == final:
                    choice = node - start
    else:
        # NOTE: r_i is never stored: r_{j+1} = max(0, r_j - z_j q_j) is recomputed from p wherever it is read, with
        # the masses z_j kept per child (its float64 values are those a stored residual would hold), so a row's
        # memory does not grow with its children, whatever a draft sends
        z = tl.full([], 1.0, tl.float64)  # the mass of the unnormalised residual r_i (r_1 = p, taken as 1)
        for c in range(c0, c1):
            if choice < 0:
                i = c - c0
                node = tl.load(child_ids_ptr + c)
                x = tl.load(draft_token_ids_ptr + node)
                r_x = tl.load(p_row + x).to(tl.float64)
                if i > 0:
                    if uses_q:
                        for c2 in range(c0, c):
                            n2 = tl.load(child_ids_ptr + c2)
                            q2 = tl.load(draft_probs_ptr + n2 * vocab_size + x).to(tl.float64)
                            r_x = tl.maximum(r_x - tl.load(z_ptr + n2) * q2, 0.0)
                    else:  # r_i is p without the earlier children
                        for c2 in range(c0, c):
                            if tl.load(draft_token_ids_ptr + tl.load(child_ids_ptr + c2)) == x:
                                r_x = r_x * 0.0
                q_row = draft_probs_ptr + node * vocab_size
                q_x = tl.full([], 1.0, tl.float64)
                if uses_q:
                    q_x = tl.load(q_row + x).to(tl.float64)
                u = uniform64(seed, position, ACCEPT, i)
                tl.store(z_ptr + node, z)
                tl.debug_barrier()  # read back below and by the later children
                if u * q_x * z < r_x:  # with probability min(1, r_i(x) / q_i(x))
                    choice = node - start
                elif uses_q:
                    if c + 1 < c1:  # the next child is tested against r_{i+1} = max(0, r_i - z q_i): its mass
                        z_next = tl.full([], 0.0, tl.float64)
                        for v0 in range(0, vocab_size, BLOCK_V):
                            cols = v0 + offs
                            mask = cols < vocab_size
                            r = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float64)
                            for c2 in range(c0, c + 1):
                                n2 = tl.load(child_ids_ptr + c2)
                                q = tl.load(draft_probs_ptr + n2 * vocab_size + cols, mask=mask, other=0.0)
                                r = tl.maximum(r - tl.load(z_ptr + n2) * q.to(tl.float64), 0.0)
                            z_next += tl.sum(r, axis=0)
                        z = z_next
                else:
                    z = z - r_x
        if choice < 0:  # every child rejected, or none: a sample of the residual (of p for a leaf)
            m = c1 - c0
            best_r = tl.full([], -1.0, tl.float64)
            best_p = tl.full([], -1.0, tl.float64)
            idx_r = tl.full([], 0, tl.int64)
            idx_p = tl.full([], 0, tl.int64)
            mass_r = tl.full([], 0.0, tl.float64)
            for v0 in range(0, vocab_size, BLOCK_V):
                cols = v0 + offs
                mask = cols < vocab_size
                p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float64)
                residual = p
                if m > 0:
                    if uses_q:
                        for c in range(c0, c1):
                            n2 = tl.load(child_ids_ptr + c)
                            q = tl.load(draft_probs_ptr + n2 * vocab_size + cols, mask=mask, other=0.0)
                            residual = tl.maximum(residual - tl.load(z_ptr + n2) * q.to(tl.float64), 0.0)
                    else:
                        for c in range(c0, c1):
                            x = tl.load(draft_token_ids_ptr + tl.load(child_ids_ptr + c))
                            residual = tl.where(cols == x, 0.0, residual)
                e = exponential64(seed, position, TARGET_SAMPLE, cols)
                score_r = tl.where(mask, residual / e, -1.0)
                score_p = tl.where(mask, p / e, -1.0)
                tile_r = tl.max(score_r, axis=0)
                tile_p = tl.max(score_p, axis=0)
                if tile_r > best_r:
                    best_r = tile_r
                    idx_r = v0 + tl.argmax(score_r, axis=0).to(tl.int64)
                if tile_p > best_p:
                    best_p = tile_p
                    idx_p = v0 + tl.argmax(score_p, axis=0).to(tl.int64)
                mass_r += tl.sum(residual, axis=0)
            # NOTE: the residual can vanish in floating point when rejection was (numerically) impossible; p and q
            # then agree, so sampling p is right
            final = tl.where(mass_r > 0.0, idx_r, idx_p)
    tl.store(choice_ptr + row, choice)
    tl.store(final_ptr + row, final)


@triton.jit
def descend_kernel(
    out_ptr,  # [batch, max_path + 1] int64, prefilled with the placeholder
    path_ptr,  # [batch, max(max_path, 1)] int64, prefilled with -1: the accepted draft tokens' indices
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    cu_num_draft_ptr,  # [batch + 1] int64
    choice_ptr,  # [num_target_rows] int64 from decide_rows_kernel
    final_ptr,  # [num_target_rows] int64
    out_stride,
    path_stride,
):
    seq = tl.program_id(0)
    start = tl.load(cu_num_draft_ptr + seq)
    n = tl.load(cu_num_draft_ptr + seq + 1) - start
    row = (start + seq).to(tl.int64)
    out_row = out_ptr + seq.to(tl.int64) * out_stride
    path_row = path_ptr + seq.to(tl.int64) * path_stride
    done = False
    for d in range(0, n + 1):  # a path holds at most n drafts, then its final token
        if not done:
            c = tl.load(choice_ptr + row)
            if c >= 0:
                tl.store(out_row + d, tl.load(draft_token_ids_ptr + start + c))
                tl.store(path_row + d, c)
                row = (start + seq + c + 1).to(tl.int64)
            else:
                tl.store(out_row + d, tl.load(final_ptr + row))
                done = True


def rejection_sample(
    target_probs: torch.Tensor,  # [num_draft_tokens + batch, vocab_size], rows laid out as SpecDecodeMetadata says
    target_argmax: torch.Tensor,  # [num_draft_tokens + batch] int64, argmax of the target logits (greedy rows)
    spec: SpecDecodeMetadata,
    sampling: SamplingMetadata,
    *,
    return_path: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[batch, max_path + 1] int64: each sequence's accepted draft tokens then its recovered or bonus token,
    padded with PLACEHOLDER_TOKEN_ID (max_path: the longest root-to-leaf path; a chain's k). With return_path,
    also [batch, max(max_path, 1)] int64: the indices of the accepted draft tokens among the sequence's, padded
    with -1 (a chain's are 0, 1, ...)."""
    check_inputs(target_probs, target_argmax, spec, sampling)
    layout = spec.tree_layout()
    if use_triton(target_probs):
        out, path = rejection_sample_triton(target_probs, target_argmax, spec, sampling, layout)
    else:
        out, path = rejection_sample_reference(target_probs, target_argmax, spec, sampling, layout)
    return (out, path) if return_path else out


def rejection_sample_triton(target_probs: torch.Tensor, target_argmax: torch.Tensor, spec: SpecDecodeMetadata,
                            sampling: SamplingMetadata, layout: TreeLayout | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, path) as rejection_sample gives them, from the two kernels."""
    layout = layout or spec.tree_layout()
    batch, width = spec.batch_size, layout.max_path
    device = target_probs.device
    out = torch.full((batch, width + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    path = torch.full((batch, max(width, 1)), -1, dtype=torch.int64, device=device)
    if batch == 0:
        return out, path
    vocab = target_probs.shape[1]
    num_rows = target_probs.shape[0]
    target_probs = target_probs.contiguous()
    has_q = spec.draft_probs is not None
    q = spec.draft_probs.contiguous() if has_q else target_probs  # a valid pointer the kernel never reads
    # an empty tensor gets a one-element stand-in: the kernels never read it, but the pointer must be valid
    drafts = spec.draft_token_ids if spec.num_draft_tokens else torch.zeros(1, dtype=torch.int64, device=device)
    child_ids = layout.child_ids if spec.num_draft_tokens else drafts
    z = torch.empty(max(spec.num_draft_tokens, 1), dtype=torch.float64, device=device)
    choice = torch.empty(num_rows, dtype=torch.int64, device=device)
    final = torch.empty(num_rows, dtype=torch.int64, device=device)
    # step 1: what each row does if the descent reaches it
    decide_rows_kernel[(batch, layout.max_nodes + 1)](
        choice, final, target_probs, target_argmax, drafts, q, spec.cu_num_draft_tokens, layout.child_offsets,
        child_ids, layout.row_depth, z, sampling.is_greedy, spec.is_one_hot,
        sampling.coupled_mask(), sampling.seeds, sampling.positions, vocab, HAS_DRAFT_PROBS=has_q,
        BLOCK_V=VOCAB_BLOCK, num_warps=vocab_warps())
    # step 2: from each root, through the accepted children, to the final token
    descend_kernel[(batch,)](out, path, drafts, spec.cu_num_draft_tokens, choice, final, out.stride(0),
                             path.stride(0), num_warps=1)
    return out, path


def rejection_sample_reference(target_probs: torch.Tensor, target_argmax: torch.Tensor, spec: SpecDecodeMetadata,
                               sampling: SamplingMetadata, layout: TreeLayout | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: the scalars of every draft token (p and q of it at its parent row, its uniform) in a few
    vectorised ops; then a descent of all sequences together, one depth per pass, whose coupled rows race in one
    batch per pass; then the final samples of every sequence in one race. A residual over the vocabulary is
    built in the descent only at a row that rejects one of several children drawn from a q that was sent."""
    reference_guard("rejection_sample_reference")
    layout = layout or spec.tree_layout()
    batch, width = spec.batch_size, layout.max_path
    out = torch.full((batch, width + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    path = torch.full((batch, max(width, 1)), -1, dtype=torch.int64)
    if batch == 0:
        return out, path
    drafts_t, q = spec.draft_token_ids, spec.draft_probs
    node_seq = layout.node_seq
    p_x = target_probs[layout.parent_rows, drafts_t].to(torch.float64).tolist()
    q_x = q[torch.arange(spec.num_draft_tokens), drafts_t].to(torch.float64).tolist() if q is not None else []
    u = uniform64_reference(sampling.seeds[node_seq], sampling.positions[node_seq] + layout.row_depth[layout.parent_rows],
                            Purpose.ACCEPT, layout.sibling_index).tolist()
    cu, drafts = spec.cu_num_draft_tokens.tolist(), drafts_t.tolist()
    offsets, kids = layout.child_offsets.tolist(), layout.child_ids.tolist()
    greedy, coupled = sampling.is_greedy.tolist(), sampling.coupled_mask().tolist()
    uses_q = [q is not None and not one_hot for one_hot in spec.is_one_hot.tolist()]
    argmax = target_argmax.tolist()
    # the sampled finals, raced together at the end: (sequence, depth, row), and what their residual is:
    # p less the tried children's tokens (one-hot), max(0, p - q of the one child), or a residual built here
    races: list[tuple[int, int, int]] = []
    zeroed: list[tuple[int, int]] = []  # (race, token)
    minus_q: list[tuple[int, int]] = []  # (race, flat draft index)
    built: list[tuple[int, torch.Tensor]] = []  # (race, residual)
    at = [(cu[s] + s, 0) for s in range(batch)]  # each sequence's row and depth
    live = list(range(batch))
    while live:
        racing = [s for s in live if coupled[s]]  # y = argmax p / E at each coupled row reached
        ys: dict[int, int] = {}
        if racing:
            rows = torch.tensor([at[s][0] for s in racing])
            won = exponential_race_reference(target_probs[rows], sampling.seeds[racing],
                                             sampling.positions[racing] + layout.row_depth[rows], Purpose.TARGET_SAMPLE)
            ys = dict(zip(racing, won.tolist(), strict=True))
        still = []
        for s in live:
            row, depth = at[s]
            children = kids[offsets[row]:offsets[row + 1]]
            choice, final = -1, None
            if greedy[s] or coupled[s]:
                final = argmax[row] if greedy[s] else ys[s]
                choice = next((c - cu[s] for c in children if drafts[c] == final), -1)
            else:
                z, residual, tried = 1.0, None, []
                for i, c in enumerate(children):
                    x = drafts[c]
                    r_x = p_x[c] if i == 0 else (float(residual[x]) if uses_q[s] else 0.0 if x in tried else p_x[c])
                    if u[c] * (q_x[c] if uses_q[s] else 1.0) * z < r_x:  # with probability min(1, r_i(x) / q_i(x))
                        choice = c - cu[s]
                        break
                    tried.append(x)
                    if not uses_q[s]:
                        z -= r_x
                    elif len(children) >= 2:  # r_{i+1} = max(0, r_i - z q_i)
                        base = target_probs[row].to(torch.float64) if residual is None else residual
                        residual = (base - z * q[c].to(torch.float64)).clamp_min(0.0)
                        z = float(residual.sum())
                if choice < 0:
                    race = len(races)
                    races.append((s, depth, row))
                    if children and not uses_q[s]:
                        zeroed.extend((race, x) for x in tried)
                    elif len(children) == 1:
                        minus_q.append((race, children[0]))
                    elif children:
                        built.append((race, residual))
            if choice < 0:
                if final is not None:
                    out[s, depth] = final
                continue
            out[s, depth] = drafts[cu[s] + choice]
            path[s, depth] = choice
            at[s] = (cu[s] + s + choice + 1, depth + 1)
            still.append(s)
        live = still
    if races:  # exponential race: argmax r / E with E ~ Exp(1) samples from r / sum(r) without normalising
        seqs = torch.tensor([r[0] for r in races])
        rows = torch.tensor([r[2] for r in races])
        p = target_probs[rows].to(torch.float64)  # [num_races, vocab]
        residual = p.clone()
        if zeroed:
            residual[torch.tensor([r for r, _ in zeroed]), torch.tensor([x for _, x in zeroed])] = 0.0
        if minus_q:
            idx = torch.tensor([r for r, _ in minus_q])
            residual[idx] = (p[idx] - q[torch.tensor([c for _, c in minus_q])].to(torch.float64)).clamp_min(0.0)
        for r, tensor in built:
            residual[r] = tensor
        # NOTE: the residual can vanish in floating point when rejection was (numerically) impossible; p and q
        # then agree, so sampling p is right
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
        won = exponential_race_reference(residual, sampling.seeds[seqs],
                                         sampling.positions[seqs] + layout.row_depth[rows], Purpose.TARGET_SAMPLE)
        for (s, depth, _), final in zip(races, won.tolist(), strict=True):
            out[s, depth] = final
    return out, path
