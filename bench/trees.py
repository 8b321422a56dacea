"""Token trees against chains (issue 26), on the default pair from `make models` (target float32, draft bfloat16,
as `make demo` runs them), one verifier and a draft service per configuration, on loopback:

1. At the same number of verified tokens N per round (4, 8, 16): a chain of k = N against a tree of N nodes, one
   stream, per prompt category (specwire/bench_prompts.json), greedy and at temperature 0.8 (sparse wire mode,
   seeded): tokens per round and tokens/s, and the tree's ratio to the chain.
2. The N = 16 pair at 0, 20 and 50 ms of RTT (bench/delay_proxy.py between draft and verifier), greedy, code.
3. The verifier's cost of one 16-node tree against one 16-token chain (17 rows each), in-process after the
   services stop: the median step time of the same sequence verified each way.

    python bench/trees.py [--sizes 4,8,16] [--tokens 48] [--per-category 2] [--rtts 0,20,50] [--raw-trees]
                          [--branches B] [--out DIR]

--branches sets the trees' B (--tree-branches; 2 by default).

Trees rank their nodes by calibrated probabilities (the draft's default, draft_service.tree_calibration);
--raw-trees adds trees ranked by the raw ones (--tree-calibration false) beside them. Every configuration runs in a
draft service of its own, whose calibration starts empty and learns from the prompts in the order they run.

Prints markdown tables and writes trees.json into --out. Each figure is a median over the prompts and seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # last: bench/kernels.py must not shadow kernels/

from delay_proxy import LinkShape, ProxyThread  # noqa: E402

from specwire import Client  # noqa: E402
from specwire.launch import Stack  # noqa: E402

# per N: the tree's depth (--num-speculative-tokens) and branches. Greedy trees go as deep as their confidence
# (EAGLE-2's rerank); sampled (sparse) ones draw max(B, ceil(N / depth)) nodes per depth
TREES = {4: (4, 2), 8: (8, 2), 16: (16, 2)}


def configs(sizes: list[int], raw: bool = False, branches: int | None = None) -> list[tuple[str, int, list[str]]]:
    """(name, N, draft arguments) per configuration; the name's first word is its kind (chain, tree, tree-raw).
    `branches`: the trees' B (None: TREES')."""
    out = []
    for n in sizes:
        depth, b = TREES[n]
        b = b if branches is None else branches
        out.append((f"chain k={n}", n, ["--num-speculative-tokens", str(n)]))
        tree = ["--num-speculative-tokens", str(depth), "--tree-branches", str(b), "--tree-nodes", str(n)]
        out.append((f"tree N={n} (depth {depth}, B={b})", n, tree))
        if raw:
            out.append((f"tree-raw N={n} (depth {depth}, B={b}, raw probabilities)", n,
                        [*tree, "--tree-calibration", "false"]))
    return out


def run_prompts(address: str, prompts: list[str], tokens: int, temperature: float,
                warmup: tuple[str, ...] = ()) -> dict:
    """The medians over `prompts`, after generating `warmup` (other prompts, not measured: a draft service's tree
    calibration learns from its verdicts, and a fresh one ranks by the draft's raw probabilities)."""
    rows = []
    with Client(address, timeout=900) as client:
        client.generate(prompts[0], max_tokens=4, temperature=0.0)  # warm-up
        for i, prompt in enumerate((*warmup, *prompts)):
            kwargs = dict(temperature=temperature, ignore_eos=True, max_tokens=tokens)
            if temperature > 0:  # a measured prompt's seed does not depend on the warm-up
                kwargs.update(seed=1000 + i - len(warmup) if i >= len(warmup) else 2000 + i, wire_mode="sparse")
            stats = client.generate(prompt, **kwargs).stats
            if i >= len(warmup):
                rows.append(stats)
    return {"tokens_per_round": statistics.median(s.mean_acceptance_length for s in rows),
            "tok_s": statistics.median(s.tokens_per_second for s in rows),
            "drafted_per_round": statistics.median(s.num_draft_tokens / s.num_rounds for s in rows)}


def section_sizes(stack: Stack, verifier: str, sizes: list[int], prompts: dict[str, list[str]], tokens: int,
                  log_dir: Path, temperatures: tuple[float, ...] = (0.0, 0.8), raw: bool = False,
                  warmup: dict[str, tuple[str, ...]] | None = None, branches: int | None = None) -> list[dict]:
    rows = []
    for name, n, args in configs(sizes, raw, branches):
        d = stack.start("draft", ["draft", "--model", str(ROOT / ".models" / "draft"), "--dtype", "bfloat16",
                                  "--verifier", verifier, "--speculation", "fixed", *args], log_dir=log_dir)
        for temperature in temperatures:
            for category, texts in prompts.items():
                row = {"config": name, "N": n, "temperature": temperature, "category": category,
                       **run_prompts(d.address, texts, tokens, temperature, (warmup or {}).get(category, ()))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        d.stop()
        stack.services.remove(d)
    return rows


def section_rtt(stack: Stack, verifier: str, rtts: list[float], prompts: list[str], tokens: int,
                log_dir: Path, warmup: tuple[str, ...] = (), pipeline: bool = False,
                branches: int | None = None) -> list[dict]:
    rows = []
    for name, n, args in configs([16], branches=branches):
        for rtt in rtts:
            with ProxyThread(verifier, LinkShape(delay_s=rtt / 2000)) as proxy:
                d = stack.start("draft", ["draft", "--model", str(ROOT / ".models" / "draft"), "--dtype", "bfloat16",
                                          "--verifier", proxy.address, "--speculation", "fixed", *args,
                                          *(["--pipeline"] if pipeline else [])], log_dir=log_dir)
                row = {"config": name, "N": n, "rtt_ms": rtt, "pipeline": pipeline,
                       **run_prompts(d.address, prompts, tokens, 0.0, warmup)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                d.stop()
                stack.services.remove(d)
    return rows


def section_step_cost(repeats: int = 9) -> dict:
    """A sequence of a 256-token prompt verifies 16 draft tokens, as a chain or as a tree (depth 6, 3 branches), in
    turn, `repeats` times each (a fresh sequence each time, its prompt from the prefix cache): the median of the
    step's forward + verification time."""
    import random

    from common.sampling import SamplingParams
    from verifier_service.config import VerifierConfig
    from verifier_service.server import build_engine
    from verifier_service.types import CloseCmd, OpenCmd, ProposeCmd, SeqKey

    engine = build_engine(VerifierConfig(model=str(ROOT / ".models" / "target"), dtype="float32"))
    rng = random.Random(0)
    prompt = tuple(rng.randrange(1000, 20000) for _ in range(256))
    parents = (-1, -1, -1, 0, 0, 1, 3, 3, 4, 6, 6, 7, 9, 9, 12, 12)
    times: dict[str, list[float]] = {"chain": [], "tree": []}
    for r in range(repeats + 1):
        drafts = tuple(rng.randrange(1000, 20000) for _ in range(16))
        for i, kind in enumerate(("chain", "tree")):
            key = SeqKey(1, 2 * r + i)
            engine.submit(OpenCmd(key, prompt, SamplingParams(temperature=0.0, max_tokens=64).with_seed()))
            engine.step()
            while engine.scheduler.sequences[key].needs_prefill:
                engine.step()
            engine.submit(ProposeCmd(key, len(prompt), drafts, None, draft_parents=parents if kind == "tree" else None))
            result = engine.step()
            if r:  # the first round warms up
                times[kind].append(result.stats.step_time_s)
            engine.submit(CloseCmd(key))
    chain, tree = statistics.median(times["chain"]), statistics.median(times["tree"])
    return {"chain_step_ms": 1e3 * chain, "tree_step_ms": 1e3 * tree, "tree_over_chain": tree / chain,
            "repeats": repeats}


def table_sizes(rows: list[dict]) -> str:
    by = {(r["N"], r["temperature"], r["category"], r["config"].split()[0]): r for r in rows}
    raw = any(kind == "tree-raw" for *_, kind in by)
    lines = ["| N | temperature | category | chain tokens/round | tree tokens/round | ratio | chain tok/s | tree tok/s "
             "| speedup |" + (" raw tree tokens/round | raw ratio | raw speedup |" if raw else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if raw else "")]
    for (n, t, c, kind), chain in by.items():
        if kind != "chain":
            continue
        tree = by[(n, t, c, "tree")]
        line = (f"| {n} | {t:g} | {c} | {chain['tokens_per_round']:.2f} | {tree['tokens_per_round']:.2f} | "
                f"{tree['tokens_per_round'] / chain['tokens_per_round']:.2f}x | {chain['tok_s']:.2f} | "
                f"{tree['tok_s']:.2f} | {tree['tok_s'] / chain['tok_s']:.2f}x |")
        if raw:
            other = by[(n, t, c, "tree-raw")]
            line += (f" {other['tokens_per_round']:.2f} | {other['tokens_per_round'] / chain['tokens_per_round']:.2f}x"
                     f" | {other['tok_s'] / chain['tok_s']:.2f}x |")
        lines.append(line)
    return "\n".join(lines)


def table_rtt(rows: list[dict]) -> str:
    lines = ["| RTT ms | chain tok/s | tree tok/s | tree / chain | chain tokens/round | tree tokens/round |",
             "|---|---|---|---|---|---|"]
    by = {(r["rtt_ms"], r["config"].split()[0]): r for r in rows}
    for rtt in dict.fromkeys(r["rtt_ms"] for r in rows):
        chain, tree = by[(rtt, "chain")], by[(rtt, "tree")]
        lines.append(f"| {rtt:g} | {chain['tok_s']:.2f} | {tree['tok_s']:.2f} | {tree['tok_s'] / chain['tok_s']:.2f}x | "
                     f"{chain['tokens_per_round']:.2f} | {tree['tokens_per_round']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,8,16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--rtts", default="0,20,50")
    parser.add_argument("--sections", default="sizes,rtt,step")
    parser.add_argument("--temperatures", default="0,0.8")
    parser.add_argument("--categories", default="code,prose,chat")
    parser.add_argument("--raw-trees", action="store_true", help="also trees ranked by raw probabilities")
    parser.add_argument("--warmup", type=int, default=0,
                        help="per category, generate this many other prompts (its last ones) before measuring")
    parser.add_argument("--pipeline", action="store_true", help="the rtt section's drafts with --pipeline")
    parser.add_argument("--branches", type=int, default=None, help="the trees' --tree-branches (default: 2)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.branches is not None and args.branches < 2:
        parser.error("--branches: a tree has at least 2 (1 is the chain, measured beside it already)")
    out = args.out or Path(tempfile.mkdtemp(prefix="specwire-trees-"))
    out.mkdir(parents=True, exist_ok=True)
    data = json.loads(resources.files("specwire").joinpath("bench_prompts.json").read_text())
    prompts = {c: data[c][:args.per_category] for c in args.categories.split(",")}
    warmup = {c: tuple(data[c][len(data[c]) - args.warmup:]) if args.warmup else () for c in {*prompts, "code"}}
    if any(args.per_category + args.warmup > len(data[c]) for c in warmup):
        parser.error("--per-category and --warmup overlap: the warm-up prompts would be measured")
    sections = args.sections.split(",")
    results: dict = {}
    if "sizes" in sections or "rtt" in sections:
        with Stack() as stack:
            v = stack.start("verifier", ["verifier", "--model", str(ROOT / ".models" / "target"), "--dtype", "float32",
                                         "--max-draft-tokens", "16"], log_dir=out / "logs")
            if "sizes" in sections:
                results["sizes"] = section_sizes(stack, v.address, [int(x) for x in args.sizes.split(",")], prompts,
                                                 args.tokens, out / "logs",
                                                 tuple(float(t) for t in args.temperatures.split(",")),
                                                 raw=args.raw_trees, warmup=warmup, branches=args.branches)
                print(table_sizes(results["sizes"]), flush=True)
            if "rtt" in sections:
                results["rtt"] = section_rtt(stack, v.address, [float(x) for x in args.rtts.split(",")],
                                             data["code"][:args.per_category], args.tokens, out / "logs",
                                             warmup["code"], args.pipeline, args.branches)
                print(table_rtt(results["rtt"]), flush=True)
    if "step" in sections:
        results["step"] = section_step_cost()
        print(json.dumps(results["step"]), flush=True)
    (out / "trees.json").write_text(json.dumps(results, indent=2))
    print(f"results: {out / 'trees.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
