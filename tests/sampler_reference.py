"""The plain algorithm, one sequence and one position at a time, to check kernels.rejection_sampler against; and
the exact match probability of Gumbel-max coupling."""

from __future__ import annotations

import torch

from kernels.philox import Purpose, exponential64_reference, uniform64_reference


def rejection_sample_loop(target_probs, target_argmax, spec, sampling) -> list[list[int]]:
    draft_token_ids, draft_probs, is_one_hot, is_greedy = (spec.draft_token_ids, spec.draft_probs, spec.is_one_hot,
                                                            sampling.is_greedy)
    vocab = torch.arange(target_probs.shape[1])
    is_coupled = sampling.coupled_mask()
    out = []
    cu = spec.cu_num_draft_tokens.tolist()
    for i in range(len(cu) - 1):
        start, k = cu[i], cu[i + 1] - cu[i]
        row0 = start + i
        seed, pos = int(sampling.seeds[i]), int(sampling.positions[i])
        tokens: list[int] = []
        final = None
        for j in range(k):
            x = int(draft_token_ids[start + j])
            if bool(is_greedy[i]):
                ok = x == int(target_argmax[row0 + j])
            elif bool(is_coupled[i]):  # Gumbel-max coupling: the draft must equal the target's own sample
                y = int(torch.argmax(target_probs[row0 + j].to(torch.float64)
                                     / exponential64_reference(seed, pos + j, Purpose.TARGET_SAMPLE, vocab)))
                ok = x == y
            else:
                p_x = float(target_probs[row0 + j, x])
                q_x = 1.0 if bool(is_one_hot[i]) else float(draft_probs[start + j, x])
                u = float(uniform64_reference(seed, pos + j, Purpose.ACCEPT, torch.tensor(0)))
                ok = u < p_x / q_x
            if not ok:
                if bool(is_greedy[i]):
                    final = int(target_argmax[row0 + j])
                elif bool(is_coupled[i]):
                    final = y
                else:
                    p = target_probs[row0 + j].to(torch.float64).clone()
                    if bool(is_one_hot[i]):
                        p[x] = 0.0
                    else:
                        p = (p - draft_probs[start + j].to(torch.float64)).clamp_min(0.0)
                    if float(p.sum()) == 0.0:
                        p = target_probs[row0 + j].to(torch.float64)
                    final = int(torch.argmax(p / exponential64_reference(seed, pos + j, Purpose.TARGET_SAMPLE, vocab)))
                break
            tokens.append(x)
        if final is None:
            n = len(tokens)
            if bool(is_greedy[i]):
                final = int(target_argmax[row0 + n])
            else:
                noise = exponential64_reference(seed, pos + n, Purpose.TARGET_SAMPLE, vocab)
                final = int(torch.argmax(target_probs[row0 + n].to(torch.float64) / noise))
        out.append(tokens + [final])
    return out


def coupled_match_probability(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax p / E = argmax q / E) for one E ~ Exp(1)^V: token v wins both races iff E_w >= E_v m_w for every
    w, with m_w = max(p_w / p_v, q_w / q_v); integrating over E_v gives 1 / sum_w m_w."""
    both = (p > 0) & (q > 0)
    total = 0.0
    for v in both.nonzero().squeeze(1).tolist():
        total += 1.0 / float(torch.maximum(p / p[v], q / q[v]).sum())
    return total


def tree_sample_loop(target_probs, target_argmax, spec, sampling) -> list[list[int]]:
    """Token trees, the rule as written: from the root, try each row's children in index order against the residual
    r_i (r_1 = p; r_{i+1} = norm(max(0, r_i - q_i)), or r_i without x_i for one-hot), accept the first with
    probability min(1, r_i(x) / q_i(x)), descend into it; else end with a sample of the last residual."""
    vocab = torch.arange(target_probs.shape[1])
    coupled = sampling.coupled_mask()
    cu = spec.cu_num_draft_tokens.tolist()
    out = []
    for s in range(len(cu) - 1):
        start, n = cu[s], cu[s + 1] - cu[s]
        parents = spec.draft_parents[start:start + n].tolist() if spec.draft_parents is not None else list(range(-1, n - 1))
        seed, pos0 = int(sampling.seeds[s]), int(sampling.positions[s])
        tokens, node, depth = [], -1, 0  # node -1: the root
        while True:
            row = start + s + node + 1
            p = target_probs[row].to(torch.float64)
            children = [c for c in range(n) if parents[c] == node]
            pos = pos0 + depth
            if bool(sampling.is_greedy[s]) or bool(coupled[s]):
                y = int(target_argmax[row]) if bool(sampling.is_greedy[s]) else int(torch.argmax(
                    p / exponential64_reference(seed, pos, Purpose.TARGET_SAMPLE, vocab)))
                match = [c for c in children if int(spec.draft_token_ids[start + c]) == y]
                if not match:
                    tokens.append(y)
                    break
                chosen = match[0]
            else:
                r, chosen = p.clone(), None
                for i, c in enumerate(children):
                    x = int(spec.draft_token_ids[start + c])
                    one_hot = bool(spec.is_one_hot[s]) or spec.draft_probs is None
                    q = torch.zeros_like(p) if one_hot else spec.draft_probs[start + c].to(torch.float64)
                    if one_hot:
                        q[x] = 1.0
                    mass = 1.0 if i == 0 else float(r.sum())
                    u = float(uniform64_reference(seed, pos, Purpose.ACCEPT, torch.tensor(i)))
                    if u * float(q[x]) * mass < float(r[x]):
                        chosen = c
                        break
                    r = (r - mass * q).clamp_min(0.0) if not one_hot else r.index_fill(0, torch.tensor([x]), 0.0)
                if chosen is None:
                    if float(r.sum()) == 0.0:
                        r = p
                    tokens.append(int(torch.argmax(r / exponential64_reference(seed, pos, Purpose.TARGET_SAMPLE, vocab))))
                    break
            tokens.append(int(spec.draft_token_ids[start + chosen]))
            node, depth = chosen, depth + 1
        out.append(tokens)
    return out
