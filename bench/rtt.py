"""Tokens/s against the round-trip time between draft and verifier (issue 10): the draft reaches the verifier
through bench/delay_proxy.py, which adds 0, 5, 20 and 50 ms of RTT; 1 stream and 8 concurrent streams.

Models: on this CPU today's real target takes ~300 ms a step, which would hide any RTT. The synthetic pair here
is sized so a verify step takes 10-30 ms, about a GPU's step for a 7B target: a random Qwen2 target (hidden
1024, 8 layers) whose layers after the first add little to the residual stream, and a draft made of the
target's first layer (same embeddings and head), so the draft agrees often and costs about an eighth of a
target step. `--real` also runs the default pair from `make models` (1 stream).

    python bench/rtt.py [--rtts 0,5,20,50] [--tokens 64] [--reps 3] [--real]

Prints a markdown table and writes JSON next to it (--out). Greedy; each figure is the median of --reps runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(ROOT / "bench"))  # last: bench/kernels.py must not shadow kernels/

import torch  # noqa: E402
from delay_proxy import LinkShape, ProxyThread  # noqa: E402

from specwire import AsyncClient, Client  # noqa: E402
from specwire.launch import Stack, free_port, scrape_metric  # noqa: E402

from tiny_models import build_model, byte_bpe_tokenizer, model_config, save  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42, 43], [100, 7, 3, 9, 11], [60, 61, 2], [8, 8, 9], [300, 12, 4],
           [17, 18, 19, 20, 21], [250, 251, 3]]


def synthetic_pair(root: Path, hidden: int = 1024, layers: int = 8, damp: float = 0.05) -> tuple[Path, Path]:
    tok = byte_bpe_tokenizer(320)
    config = model_config("qwen2", len(tok), eos_token_id=tok.eos_token_id, hidden=hidden, layers=layers,
                          heads=16, kv_heads=2, init=0.05)
    target = build_model(config, seed=0, dtype=torch.float32)
    with torch.no_grad():
        for layer in target.model.layers[1:]:  # later layers write little into the residual stream
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    draft_config = model_config("qwen2", len(tok), eos_token_id=tok.eos_token_id, hidden=hidden, layers=1,
                                heads=16, kv_heads=2, init=0.05)
    draft = build_model(draft_config, seed=1, dtype=torch.float32)
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")
             or k.startswith("model.layers.0.")}
    draft.load_state_dict(state)
    return save(target, tok, root / "target"), save(draft, tok, root / "draft")


def one_stream(address: str, tokens: int, reps: int) -> dict:
    runs = []
    with Client(address, timeout=600) as client:
        client.generate(prompt_token_ids=PROMPTS[0], max_tokens=4, temperature=0.0)  # warm-up
        for i in range(reps):
            s = client.generate(prompt_token_ids=PROMPTS[i % len(PROMPTS)], max_tokens=tokens, temperature=0.0,
                                ignore_eos=True).stats
            runs.append(s)
    return {"tok_s": statistics.median(s.tokens_per_second for s in runs),
            "tokens_per_round": statistics.median(s.mean_acceptance_length for s in runs),
            "verify_ms_per_round": statistics.median(1e3 * s.verify_time_s / s.num_rounds for s in runs),
            "draft_ms_per_round": statistics.median(1e3 * s.draft_time_s / s.num_rounds for s in runs),
            "round_ms": statistics.median(1e3 * s.wall_time_s / s.num_rounds for s in runs)}


def many_streams(address: str, tokens: int, reps: int, n: int = 8) -> dict:
    async def run_once() -> float:
        async with AsyncClient(address, timeout=600) as client:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(client.generate(prompt_token_ids=PROMPTS[i % len(PROMPTS)],
                                                             max_tokens=tokens, temperature=0.0, ignore_eos=True)
                                             for i in range(n)))
            wall = time.perf_counter() - t0
        return sum(r.stats.num_generated_tokens for r in results) / wall

    return {"aggregate_tok_s": statistics.median(asyncio.run(run_once()) for _ in range(reps))}


def measure(target: Path, draft: Path, rtts: list[float], tokens: int, reps: int, streams: bool, log_dir: Path,
            draft_args: list[str], pin: bool) -> list[dict]:
    """One row per (RTT, pipelining off/on): a fresh draft service behind a proxy of that RTT, one verifier.
    pin: the verifier on core 0 and the draft on core 1, as on two hosts (else they share every core)."""
    rows = []
    verifier_cpus, draft_cpus = ({0}, {1}) if pin else (None, None)
    with Stack() as stack:
        verifier = stack.start("verifier", ["verifier", "--model", str(target), "--dtype", "float32"],
                               log_dir=log_dir, cpus=verifier_cpus)
        for rtt in rtts:
            for pipeline in (False, True):
                with ProxyThread(verifier.address, LinkShape(delay_s=rtt / 2000)) as proxy:
                    metrics_port = free_port()
                    d = stack.start(f"draft-{rtt:g}-{pipeline}", ["draft", "--model", str(draft), "--verifier",
                                                                  proxy.address, "--pipeline", str(pipeline),
                                                                  "--metrics-port", str(metrics_port),
                                                                  *draft_args], log_dir=log_dir, cpus=draft_cpus)
                    row = {"rtt_ms": rtt, "pipeline": pipeline, **one_stream(d.address, tokens, reps)}
                    counts = _counters(f"http://127.0.0.1:{metrics_port}/metrics")
                    # rounds whose block was already at the verifier (a pipelined branch guessed the verdict)
                    row["pipelined_share_1_stream"] = counts["used"] / counts["rounds"] if counts["rounds"] else 0.0
                    if streams:
                        row.update(many_streams(d.address, tokens, reps))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    d.stop()
                    stack.services.remove(d)
    return rows


def _counters(url: str) -> dict[str, float]:
    return {"used": scrape_metric(url, "specwire_draft_pipelined_proposals_total", {"outcome": "used"}) or 0.0,
            "rounds": scrape_metric(url, "specwire_draft_rounds_total") or 0.0}


def table(rows: list[dict], title: str) -> str:
    """Per RTT: tokens/s without and with pipelining, and the share of the single stream's loss to the RTT
    (against 0 ms without pipelining) that pipelining recovers."""
    by = {(r["rtt_ms"], r["pipeline"]): r for r in rows}
    base = by[(rows[0]["rtt_ms"], False)]
    lines = [title, "", "| RTT ms | 1 stream tok/s, off | on (rounds pipelined) | loss recovered | tokens/round | "
             "verify ms/round | "
             "8 streams tok/s, off | on | off vs 0 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for rtt in dict.fromkeys(r["rtt_ms"] for r in rows):
        off, on = by[(rtt, False)], by[(rtt, True)]
        lost = base["tok_s"] - off["tok_s"]
        recovered = f"{(on['tok_s'] - off['tok_s']) / lost:.0%}" if lost > 0.02 * base["tok_s"] else "-"
        agg = (f"{off['aggregate_tok_s']:.1f} | {on['aggregate_tok_s']:.1f} | "
               f"{off['aggregate_tok_s'] / base['aggregate_tok_s']:.0%} |" if "aggregate_tok_s" in off
               else "- | - | - |")
        lines.append(f"| {rtt:g} | {off['tok_s']:.1f} | {on['tok_s']:.1f} ({on['pipelined_share_1_stream']:.0%}) | "
                     f"{recovered} | "
                     f"{off['tokens_per_round']:.2f} | {off['verify_ms_per_round']:.1f} | {agg}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", default="0,5,20,50")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--real", action="store_true", help="also the default pair from .models (1 stream)")
    parser.add_argument("--real-only", action="store_true", help="only the default pair")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default: a temp dir)")
    parser.add_argument("--no-pin", action="store_true", help="let verifier and draft share every core (by "
                        "default each gets one core of its own, as on two hosts)")
    args = parser.parse_args()
    rtts = [float(x) for x in args.rtts.split(",")]
    root = Path(tempfile.mkdtemp(prefix="specwire-rtt-"))
    results = {}
    if not args.real_only:
        target, draft = synthetic_pair(root)
        results["synthetic"] = measure(target, draft, rtts, args.tokens, args.reps, True, root / "logs",
                                       ["--num-speculative-tokens", str(args.k)], not args.no_pin)
        print(table(results["synthetic"], f"synthetic pair (hidden 1024, 8 layers / 1 layer), k={args.k}, "
                    f"greedy, {args.tokens} tokens"))
    if args.real or args.real_only:
        results["real"] = measure(ROOT / ".models" / "target", ROOT / ".models" / "draft", rtts, args.tokens,
                                  1, False, root / "logs-real",
                                  ["--num-speculative-tokens", str(args.k), "--dtype", "bfloat16"], not args.no_pin)
        print(table(results["real"], f"default pair, k={args.k}, greedy, {args.tokens} tokens"))
    out = args.out or root / "rtt.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
