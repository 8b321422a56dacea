"""How many tokens a round a token tree of N nodes could take, against a chain of N, on the default pair.

Greedy verification accepts a drafted path exactly while it is the target's greedy continuation, so what a round
takes depends only on where the draft's guesses leave that continuation. This script generates the target's
greedy continuation of each code prompt (transformers, float32, on the local model directory), feeds it to the
draft in one forward (teacher forcing: the draft's distribution at each position given the true prefix, as the
draft has it on the accepted path), and replays rounds of N verified draft tokens over it:

- **chain**: the draft's argmax at each position; a round takes the drafts up to the first one that is not the
  target's token, plus the target's own token (the correction or the bonus);

Both verify N draft tokens a round (N + 1 target rows); a tree's drafting differs (its N nodes in about as many
draft rows over fewer, wider steps), which this leaves out. The target runs in transformers (float32) and the
draft teacher-forced in one bfloat16 forward, so near-ties may fall otherwise than in the services.
- **oracle tree, B branches**: the most a tree of N nodes can take whose nodes' children are the draft's
  likeliest tokens, in order, at most B (as specwire's greedy trees are, best-first by path probability, or a
  static top-k tree): it must hold the true path and, at each depth, the siblings the draft ranks above the true
  token (they share its parent and score higher), so a round takes the true path while the target's token is
  among the draft's B likeliest and those nodes fit in N. The oracle knows the continuation; a tree of any other
  shape (a child that is not among its parent's likeliest) is not bounded by it.

- **chain and a lookup branch** (`--lookup L`): the chain, and beside it the tokens that followed the latest
  earlier occurrence of the context's longest suffix (prompt lookup, draft_service.ngram, at most L of them), a
  branch from the root that shares the chain's nodes while both are the target's tokens; the chain gives up as
  many nodes as the branch adds, so both verify N. A round takes the longer of the two accepted paths. Greedy and
  coupled trees may hold any tokens, so this shape is lossless there; it is not one of the draft's likeliest.

A tree the draft builds without knowing the continuation takes at most the oracle's; the gap between the chain and
the oracle is what trees can win at all on this pair. The draft's confidence where its argmax is right and where
it is wrong says how well a tree built from its probabilities can place its branches.

    python bench/tree_ceiling.py [--prompts 4] [--tokens 96] [--nodes 4,8,16] [--branches 2,3] [--out DIR]

Prints markdown tables and writes tree_ceiling.json into --out. One process, no services: about 30 s a prompt
of 96 tokens on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from importlib import resources
from pathlib import Path

TOP = 4  # the draft's likeliest tokens whose rank is kept (beyond them: rank TOP, never in a tree of B <= TOP)


def ranks_and_confidence(target_dir: Path, draft_dir: Path, prompts: list[str], tokens: int,
                         threads: int) -> list[dict]:
    """Per prompt: the target's greedy continuation, the rank of each of its tokens in the draft's distribution
    given the true prefix (0: the draft's argmax; TOP: not among its TOP likeliest) and the draft's top-1
    probability there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.bfloat16).eval()
    out = []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        full = greedy_continuation(target, ids, tokens)
        with torch.no_grad():
            logits = draft(full).logits[0].float()
        n_prompt = ids.shape[1]
        cont = full[0, n_prompt:].tolist()
        probs = torch.softmax(logits[n_prompt - 1:n_prompt - 1 + len(cont)], -1)
        top = torch.topk(probs, TOP, -1)
        ranks = []
        for j, token in enumerate(cont):
            hit = (top.indices[j] == token).nonzero().flatten().tolist()
            ranks.append(hit[0] if hit else TOP)
        out.append({"prompt_tokens": n_prompt, "prompt": ids[0].tolist(), "continuation": cont, "ranks": ranks,
                    "p1": top.values[:, 0].tolist()})
    return out


def greedy_continuation(target, ids, tokens: int):
    """The prompt `ids` (1 x n) and exactly `tokens` of the target's greedy continuation, EOS or not."""
    import torch

    with torch.no_grad():
        return target.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, top_k=None,
                               top_p=None, temperature=None)


def chain_rounds(ranks: list[int], n: int) -> int:
    """Rounds a chain of n drafts takes over the continuation."""
    start = rounds = 0
    while start < len(ranks):
        accepted = 0
        while accepted < n and start + accepted < len(ranks) and ranks[start + accepted] == 0:
            accepted += 1
        start += accepted + 1
        rounds += 1
    return rounds


def oracle_tree_rounds(ranks: list[int], n: int, branches: int) -> int:
    """Rounds the best tree of n nodes, at most `branches` children a node (the draft's likeliest), takes: the true
    path while its token is among them and the path with the siblings ranked above it fits in n nodes."""
    start = rounds = 0
    while start < len(ranks):
        accepted = nodes = 0
        while start + accepted < len(ranks):
            rank = ranks[start + accepted]
            if rank >= branches or nodes + 1 + rank > n:
                break
            nodes += 1 + rank
            accepted += 1
        start += accepted + 1
        rounds += 1
    return rounds


def lookup_tree_rounds(prompt: list[int], continuation: list[int], ranks: list[int], n: int, lookup: int) -> int:
    """Rounds a tree of n nodes takes that is the chain plus a prompt-lookup branch of at most `lookup` tokens
    from the root (module docstring): the branch's nodes past the ones it shares with the chain come off the
    chain's depth."""
    from draft_service.ngram import propose_ngram

    start = rounds = 0
    while start < len(ranks):
        chain_ok = 0  # the chain's drafts that are the target's tokens, from here
        while start + chain_ok < len(ranks) and ranks[start + chain_ok] == 0:
            chain_ok += 1
        branch = propose_ngram(prompt + continuation[:start], lookup) if lookup else []
        branch_ok = 0
        while branch_ok < len(branch) and start + branch_ok < len(continuation) and \
                branch[branch_ok] == continuation[start + branch_ok]:
            branch_ok += 1
        shared = min(chain_ok, branch_ok)  # both the target's tokens there: the same nodes
        depth = n - (len(branch) - shared)
        accepted = max(min(chain_ok, depth), branch_ok)
        start += accepted + 1
        rounds += 1
    return rounds


def summarize(per_prompt: list[dict], sizes: list[int], branches: list[int], lookups: tuple[int, ...] = ()) -> dict:
    rows = []
    for n in sizes:
        chain = [len(p["ranks"]) / chain_rounds(p["ranks"], n) for p in per_prompt]
        row = {"N": n, "chain": chain, "chain_median": statistics.median(chain)}
        for b in branches:
            tree = [len(p["ranks"]) / oracle_tree_rounds(p["ranks"], n, b) for p in per_prompt]
            row[f"oracle_b{b}"] = tree
            row[f"oracle_b{b}_median"] = statistics.median(tree)
            row[f"oracle_b{b}_ratio_median"] = statistics.median(t / c for t, c in zip(tree, chain, strict=True))
        for lookup in lookups:
            tree = [len(p["ranks"]) / lookup_tree_rounds(p["prompt"], p["continuation"], p["ranks"], n, lookup)
                    for p in per_prompt]
            row[f"lookup{lookup}_median"] = statistics.median(tree)
            row[f"lookup{lookup}_ratio_median"] = statistics.median(t / c for t, c in zip(tree, chain, strict=True))
        rows.append(row)
    right = [p1 for p in per_prompt for r, p1 in zip(p["ranks"], p["p1"], strict=True) if r == 0]
    wrong = [p1 for p in per_prompt for r, p1 in zip(p["ranks"], p["p1"], strict=True) if r > 0]
    wrong_ranks = [r for p in per_prompt for r in p["ranks"] if r > 0]
    return {"sizes": rows, "right": len(right), "wrong": len(wrong),
            "p1_right": _quantiles(right), "p1_wrong": _quantiles(wrong),
            "wrong_by_rank": {str(r): wrong_ranks.count(r) for r in range(1, TOP + 1)}}


def _quantiles(values: list[float]) -> list[float]:
    if not values:
        return []
    values = sorted(values)
    return [round(values[int(q * (len(values) - 1))], 3) for q in (0.1, 0.25, 0.5, 0.75, 0.9)]


def tables(summary: dict, branches: list[int], lookups: tuple[int, ...] = ()) -> str:
    head = "| N | chain tokens/round | " + " | ".join(f"oracle tree B = {b} | ratio | per prompt" for b in branches)
    head += "".join(f" | chain + lookup of {lookup} | per prompt" for lookup in lookups) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(branches) + 2 * len(lookups))]
    for row in summary["sizes"]:
        cells = [str(row["N"]), f"{row['chain_median']:.2f}"]
        for b in branches:
            value = row[f"oracle_b{b}_median"]
            cells += [f"{value:.2f}", f"{value / row['chain_median']:.2f}x", f"{row[f'oracle_b{b}_ratio_median']:.2f}x"]
        for lookup in lookups:
            cells += [f"{row[f'lookup{lookup}_median']:.2f}", f"{row[f'lookup{lookup}_ratio_median']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    by_rank = summary["wrong_by_rank"]
    lines += ["", f"The draft's argmax was the target's token at {summary['right']} positions and not at "
              f"{summary['wrong']} (the target's token its 2nd / 3rd / 4th likeliest / beyond: "
              f"{' / '.join(str(by_rank[str(r)]) for r in range(1, TOP + 1))}).",
              f"Its top-1 probability (10th, 25th, 50th, 75th, 90th percentiles) where right: "
              f"{summary['p1_right']}; where wrong: {summary['p1_wrong']}."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=".models", help="directory with target/ and draft/")
    parser.add_argument("--prompts", type=int, default=4, help="the first N code prompts (as bench/trees.py)")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--nodes", default="4,8,16")
    parser.add_argument("--branches", default="2,3")
    parser.add_argument("--lookup", default="", help="also a chain with a prompt-lookup branch of at most these many "
                        "tokens (comma-separated, e.g. 4,8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    branches = [int(x) for x in args.branches.split(",")]
    if any(b < 1 or b > TOP for b in branches):
        parser.error(f"--branches must be in [1, {TOP}]")
    data = json.loads(resources.files("specwire").joinpath("bench_prompts.json").read_text())
    models = Path(args.models)
    per_prompt = ranks_and_confidence(models / "target", models / "draft", data["code"][:args.prompts],
                                      args.tokens, args.threads)
    lookups = tuple(int(x) for x in args.lookup.split(",") if x)
    summary = summarize(per_prompt, sizes, branches, lookups)
    text = tables(summary, branches, lookups)
    sys.stdout.write(f"code prompts 1 to {args.prompts}, {args.tokens} tokens, greedy; medians over prompts (ratio: of "
                     f"the medians; per prompt: the median of each prompt's ratio)\n\n"
                     f"{text}\n")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tree_ceiling.json").write_text(json.dumps({"args": vars(args), "summary": summary,
                                                           "per_prompt": per_prompt}, indent=1))
        (out / "tree_ceiling.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
