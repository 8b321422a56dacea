"""The verifier's CPU engine against the memory-bandwidth floor (issue 5, goal 1).

Floor of one forward = bytes of weights it reads (every matrix but the embedding table) / measured read
bandwidth (a streaming sum over 2 GiB). Prints target-only step time as a fraction of that floor, and the cost of
verifying k + 1 = 5 tokens against 1. Medians of --repeats. Usage: python bench/cpu_floor.py [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.sampling import SamplingParams  # noqa: E402
from verifier_service.config import VerifierConfig  # noqa: E402
from verifier_service.server import build_engine  # noqa: E402
from verifier_service.types import OpenCmd, ProposeCmd, SeqKey, VerdictOut  # noqa: E402


def read_bandwidth(repeats: int) -> float:
    x = torch.ones(512 << 20, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / ".models" / "target"))
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    bandwidth = read_bandwidth(args.repeats)
    engine = build_engine(VerifierConfig(model=args.model))
    runner = engine.runner.model
    weight_bytes = sum(p.packed.numel() * p.packed.element_size()
                       for p in [*runner.qkv, *runner.o_proj, *runner.gate_up, *runner.down, runner.head]) \
        if runner.packed else sum(p.numel() * p.element_size() for n, p in engine.loaded.model.named_parameters()
                                  if "embed_tokens" not in n)
    weight_bytes += sum(p.numel() * p.element_size() for n, p in engine.loaded.model.named_parameters()
                        if "norm" in n)
    floor = weight_bytes / bandwidth
    key = SeqKey(1, 1)
    prompt = list(range(1000, 1100))
    engine.submit(OpenCmd(key, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=10_000).with_seed()))
    engine.step()  # prefill
    verified = len(prompt)
    times: dict[int, list[float]] = {1: [], 5: []}
    for _ in range(args.repeats):
        for n in (1, 5):
            engine.submit(ProposeCmd(key, verified, tuple([7] * (n - 1)), None))
            t0 = time.perf_counter()
            result = engine.step()
            times[n].append(time.perf_counter() - t0)
            verified += sum(len(o.token_ids) for o in result.outcomes if isinstance(o, VerdictOut))
    one, five = statistics.median(times[1]), statistics.median(times[5])
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights read per forward {weight_bytes / 1e9:.2f} GB; "
          f"floor {1e3 * floor:.0f} ms")
    print(f"target-only step {1e3 * one:.0f} ms = {100 * floor / one:.0f} % of the floor (goal >= 70 %)")
    print(f"verify 5 tokens {1e3 * five:.0f} ms = {five / one:.2f} x one token (goal <= 1.4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
