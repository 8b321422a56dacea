"""Token-tree verification (kernels.rejection_sampler): agreement with the rule written as a plain loop, and the
statistics of the output per wire mode, with negative controls the same test must reject: the draft's own
marginals, and children picked by a deterministic top-B but verified as if they had been drawn."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import PLACEHOLDER_TOKEN_ID
from kernels.philox import Purpose, exponential64_reference
from kernels.rejection_sampler import rejection_sample
from kernels.spec_decode import SamplingMetadata, SpecDecodeMetadata

from sampler_reference import tree_sample_loop

# trees of 6 and 7 nodes: two children of the root, with two and one children; and a wider one, three by two
SHAPES = {
    "b2": [-1, -1, 0, 0, 1, 2],
    "b3": [-1, -1, -1, 0, 0, 1, 3],
}


def random_trees(gen: torch.Generator, sizes: list[int], max_children: int) -> list[int]:
    """Per sequence, `size` nodes whose parents are -1 or earlier nodes, each with at most `max_children`."""
    parents: list[int] = []
    for n in sizes:
        counts: dict[int, int] = {}
        for i in range(n):
            options = [p for p in range(-1, i) if counts.get(p, 0) < max_children]
            p = options[int(torch.randint(0, len(options), (), generator=gen))]
            counts[p] = counts.get(p, 0) + 1
            parents.append(p)
    return parents


def tree_inputs(gen: torch.Generator, sizes: list[int], vocab: int, *, greedy, one_hot, coupled, max_children=3):
    batch = len(sizes)
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    total = int(cu[-1])
    parents = torch.tensor(random_trees(gen, sizes, max_children), dtype=torch.int64)
    target = torch.rand(total + batch, vocab, generator=gen, dtype=torch.float64).pow(4)
    target /= target.sum(1, keepdim=True)
    q = torch.rand(total, vocab, generator=gen, dtype=torch.float64).pow(4)
    q[:, : vocab // 3] = 0.0
    q /= q.sum(1, keepdim=True)
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1)
    # some drafts that the target agrees with, so that descents go deep: the argmax of the parent row
    layout = SpecDecodeMetadata(drafts, cu, None, torch.zeros(batch, dtype=torch.bool), parents).tree_layout()
    agree = torch.rand(total, generator=gen) < 0.5
    drafts = torch.where(agree, target[layout.parent_rows].argmax(1), drafts)
    q[agree] = 0.0
    q[agree, drafts[agree]] = 1.0
    return dict(target_probs=target, target_argmax=target.argmax(1),
                spec=SpecDecodeMetadata(drafts, cu, q, torch.tensor(one_hot), parents),
                sampling=SamplingMetadata(torch.tensor(greedy), torch.randint(0, 2**62, (batch,), generator=gen),
                                          torch.randint(0, 1000, (batch,), generator=gen), torch.tensor(coupled)))


def _mixed(gen, vocab):
    sizes = [0, 1, 5, 7, 3, 8, 6, 4, 9, 2]
    return tree_inputs(gen, sizes, vocab,
                       greedy=[False, True, True, False, False, False, False, False, True, False],
                       one_hot=[False, False, False, True, False, True, False, False, False, True],
                       coupled=[False] * 6 + [True, True, False, False])


@pytest.mark.parametrize("vocab", [50, 3000])
def test_trees_match_the_rule_as_a_loop(vocab):
    for seed in range(4):
        inputs = _mixed(torch.Generator().manual_seed(seed * 7 + vocab), vocab)
        out, path = rejection_sample(**inputs, return_path=True)
        got = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()]
        assert got == tree_sample_loop(**inputs)
        # the path names the accepted draft tokens, a chain of parent links from the root
        spec = inputs["spec"]
        for s, row in enumerate(path.tolist()):
            nodes = [n for n in row if n >= 0]
            start = int(spec.cu_num_draft_tokens[s])
            assert [int(spec.draft_token_ids[start + n]) for n in nodes] == got[s][:len(nodes)]
            assert [int(spec.draft_parents[start + n]) for n in nodes] == [-1, *nodes][:len(nodes)]


def test_a_chain_given_as_a_tree_is_verified_as_the_chain():
    gen = torch.Generator().manual_seed(11)
    sizes = [3, 5, 0, 4]
    inputs = tree_inputs(gen, sizes, 200, greedy=[False, True, False, False], one_hot=[False, False, True, False],
                         coupled=[False, False, False, True], max_children=1)
    chain = torch.cat([torch.arange(-1, n - 1) for n in sizes])
    spec = inputs["spec"]
    as_tree = SpecDecodeMetadata(spec.draft_token_ids, spec.cu_num_draft_tokens, spec.draft_probs, spec.is_one_hot,
                                 chain)
    as_chain = SpecDecodeMetadata(spec.draft_token_ids, spec.cu_num_draft_tokens, spec.draft_probs, spec.is_one_hot)
    a = rejection_sample(inputs["target_probs"], inputs["target_argmax"], as_tree, inputs["sampling"])
    b = rejection_sample(inputs["target_probs"], inputs["target_argmax"], as_chain, inputs["sampling"])
    assert torch.equal(a, b)


def test_bad_parents_are_refused():
    gen = torch.Generator().manual_seed(2)
    inputs = tree_inputs(gen, [3], 20, greedy=[False], one_hot=[False], coupled=[False])
    spec = inputs["spec"]
    for parents in ([-1, 1, 0], [-1, -2, 0], [0, -1, 1]):
        inputs["spec"] = SpecDecodeMetadata(spec.draft_token_ids, spec.cu_num_draft_tokens, spec.draft_probs,
                                            spec.is_one_hot, torch.tensor(parents))
        with pytest.raises(ValueError, match="parent"):
            rejection_sample(**inputs)


# --- statistics -----------------------------------------------------------------------------------------------

VOCAB, N, POSITIONS = 10, 40_000, 3
# E[TV] <= 0.5 sqrt(V / N) = 0.0079 and P(TV > E[TV] + t) <= exp(-2 N t^2): 0.024 fails a correct sampler < 1e-8
TV_BOUND = 0.024


def _dists(seed: int, rows: int) -> torch.Tensor:  # [rows, VOCAB]
    g = torch.Generator().manual_seed(seed)  # always 32 rows drawn: the first ones never depend on `rows`
    return (torch.randn(32, VOCAB, generator=g, dtype=torch.float64) * 1.5).softmax(1)[:rows]


def simulate_trees(children: str, parents: list[int], *, seed: int = 0) -> torch.Tensor:
    """N generations of POSITIONS tokens where the target at position t is p[t] and the draft's q[t] (context
    free, so the exact answer is known), a tree of shape `parents` per round. `children`: how a node's children
    are made and what is sent:
    - "without-replacement": drawn from q without replacement, each with q less the earlier ones (sparse);
    - "iid": drawn i.i.d. from q, each with q (sparse, SpecInfer);
    - "top-one-hot": the B most likely under q, ids only (one-hot: lossless for any children);
    - "coupled": the B best of q / E with the verifier's noise, ids only;
    - "top-as-drawn": the B most likely, sent as if drawn without replacement (the bias the rule forbids)."""
    depth = []
    for par in parents:
        depth.append(0 if par < 0 else depth[par] + 1)
    n = len(parents)
    p, q = _dists(1, POSITIONS + n + 2), _dists(2, POSITIONS + n + 2)
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((N, POSITIONS), -1, dtype=torch.int64)
    pos = torch.zeros(N, dtype=torch.int64)
    ids_only = children in ("top-one-hot", "coupled")
    while bool((pos < POSITIONS).any()):
        live = (pos < POSITIONS).nonzero().squeeze(1)
        b = live.numel()
        seeds = live + seed * N
        drafts = torch.zeros(b, n, dtype=torch.int64)
        sent = torch.zeros(b, n, VOCAB, dtype=torch.float64)
        for i, par in enumerate(parents):
            siblings = [c for c in range(i) if parents[c] == par]
            qt = q[pos[live] + depth[i]].clone()  # [b, VOCAB], the draft at the node's position
            if children in ("without-replacement", "top-as-drawn", "top-one-hot"):
                for c in siblings:
                    qt[torch.arange(b), drafts[:, c]] = 0.0
                qt /= qt.sum(1, keepdim=True)
            if children == "coupled":
                noise = exponential64_reference(seeds.unsqueeze(1), (pos[live] + depth[i]).unsqueeze(1),
                                                Purpose.TARGET_SAMPLE, torch.arange(VOCAB).unsqueeze(0))
                scores = q[pos[live] + depth[i]] / noise
                drafts[:, i] = scores.topk(len(siblings) + 1, dim=1).indices[:, -1]
            elif children.startswith("top"):
                drafts[:, i] = qt.argmax(1)
            else:
                drafts[:, i] = torch.multinomial(qt, 1, generator=gen).squeeze(1)
            sent[:, i] = qt
        rows = torch.cat([pos[live].unsqueeze(1), pos[live].unsqueeze(1) + 1 + torch.tensor(depth)], 1)
        target = p[rows].reshape(b * (n + 1), VOCAB)
        spec = SpecDecodeMetadata(drafts.flatten(), torch.arange(b + 1) * n, None if ids_only else sent.reshape(-1, VOCAB),
                                  torch.full((b,), ids_only), torch.tensor(parents).repeat(b))
        sampling = SamplingMetadata(torch.zeros(b, dtype=torch.bool), seeds, pos[live],
                                    torch.full((b,), children == "coupled"))
        res = rejection_sample(target, target.argmax(1), spec, sampling)
        for j in range(res.shape[1]):
            cur = pos[live]
            ok = (res[:, j] >= 0) & (cur < POSITIONS)
            out[live[ok], cur[ok]] = res[ok, j]
            pos[live[ok]] += 1
    return out


def tv_per_position(tokens: torch.Tensor, against: torch.Tensor) -> list[float]:
    return [0.5 * float((torch.bincount(tokens[:, t], minlength=VOCAB) / N - against[t]).abs().sum())
            for t in range(POSITIONS)]


def test_bound_derivation():
    expected = 0.5 * math.sqrt(VOCAB / N)
    assert math.exp(-2 * N * (TV_BOUND - expected) ** 2) < 1e-8


@pytest.mark.parametrize("children,shape", [("without-replacement", "b2"), ("iid", "b3"), ("top-one-hot", "b3"),
                                            ("coupled", "b2")])
def test_tree_output_follows_the_target(children, shape):
    p, q = _dists(1, POSITIONS), _dists(2, POSITIONS)
    tokens = simulate_trees(children, SHAPES[shape])
    assert max(tv_per_position(tokens, p)) <= TV_BOUND
    # negative control: the same test tells the draft's own marginals apart from the target's
    assert max(tv_per_position(tokens, q)) > TV_BOUND


def test_negative_control_children_picked_by_top_b_fail_the_sampled_rule():
    tvs = tv_per_position(simulate_trees("top-as-drawn", SHAPES["b3"]), _dists(1, POSITIONS))
    assert max(tvs) > TV_BOUND, f"the test cannot tell deterministic children apart: {tvs}"
