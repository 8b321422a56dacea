"""Protocol overhead per round (issue 5, goal 4): the services on loopback with mock models whose forward costs
(almost) nothing (1 layer, hidden 16, vocab 64), so what a round costs is gRPC, asyncio, thread hops and Python.

Per generation: overhead per round = (wall - draft compute - verifier step) / rounds, and the raw round time
wall / rounds. Prints medians over the generations. Usage: python bench/protocol_overhead.py [--n 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from specwire import Client  # noqa: E402
from specwire.launch import Stack  # noqa: E402

from tiny_models import build_model, model_config, perturbed, save, word_tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=40, help="generations per setting")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="specwire-proto-"))
    tok = word_tokenizer(64)
    config = model_config("llama", 64, eos_token_id=None, hidden=16, layers=1, heads=2, kv_heads=1, init=0.5)
    target = build_model(config, 0, torch.float32)
    tdir, ddir = save(target, tok, root / "t"), save(perturbed(target, 1, 0.05), tok, root / "d")
    results = {}
    with Stack() as stack:
        v = stack.start("verifier", ["verifier", "--model", str(tdir)], log_dir=root / "logs")
        d = stack.start("draft", ["draft", "--model", str(ddir), "--verifier", v.address], log_dir=root / "logs")
        with Client(d.address) as client:
            for k in (0, 4):
                client.generate(prompt_token_ids=[1, 2, 3], max_tokens=8, temperature=0.0, num_speculative_tokens=k)
                overhead, round_ms, verify_ms, draft_ms = [], [], [], []
                for i in range(args.n):
                    s = client.generate(prompt_token_ids=[1 + i % 50, 2, 3], max_tokens=args.tokens, temperature=0.0,
                                        num_speculative_tokens=k, ignore_eos=True).stats
                    overhead.append(1e3 * (s.wall_time_s - s.draft_time_s - s.verify_time_s) / s.num_rounds)
                    round_ms.append(1e3 * s.wall_time_s / s.num_rounds)
                    verify_ms.append(1e3 * s.verify_time_s / s.num_rounds)
                    draft_ms.append(1e3 * s.draft_time_s / s.num_rounds)
                results[f"k={k}"] = {"overhead_ms_per_round": statistics.median(overhead),
                                     "round_ms": statistics.median(round_ms),
                                     "verifier_step_ms": statistics.median(verify_ms),
                                     "draft_ms": statistics.median(draft_ms)}
                r = results[f"k={k}"]
                print(f"k={k}: round {r['round_ms']:.2f} ms median = draft {r['draft_ms']:.2f} + verifier step "
                      f"{r['verifier_step_ms']:.2f} + overhead {r['overhead_ms_per_round']:.2f} ms (goal <= 1 ms)")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
