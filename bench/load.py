"""Load: many concurrent streams against a running draft service for a bounded time, mixed greedy and seeded
sampled requests. Checks what must hold under load and prints the latencies.

    python bench/load.py --draft 127.0.0.1:50052 --verifier-metrics http://127.0.0.1:9400/metrics \
        [--streams 64] [--duration 60] [--pids VERIFIER_PID,DRAFT_PID]

Checks: zero errors; every request (greedy or seeded) gives the tokens it gave in a quiet run (alone, before
the load), so no client receives a token the verifier would not have given it;
the services' resident memory grows by less than --rss-growth over the run; the verifier holds zero KV blocks
once the load ends. Prints p50/p99 time to first token and per-token latency (the time between a request's
first and last token over its other tokens). tests/test_load.py runs it (60 s by default, 5 min in the slow
profile). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specwire import AsyncClient, SpecwireError  # noqa: E402
from specwire.launch import scrape_metric  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42, 43], [100, 7, 3, 9, 11], [60, 61, 2], [8, 8, 9], [300, 12, 4],
           [17, 18, 19, 20, 21], [250, 251, 3]]


def request_mix(n_seeded: int = 8) -> tuple[list[dict], list[dict]]:
    """(seeded sampled requests whose outputs are checked against a quiet run, greedy requests)."""
    seeded = [dict(prompt_token_ids=PROMPTS[i % len(PROMPTS)], max_tokens=16 + 4 * (i % 5), temperature=0.9,
                   top_p=0.95, seed=7000 + i, ignore_eos=True) for i in range(n_seeded)]
    greedy = [dict(prompt_token_ids=p, max_tokens=24 + 4 * (i % 7), temperature=0.0, ignore_eos=True)
              for i, p in enumerate(PROMPTS)]
    return seeded, greedy


@dataclass
class LoadReport:
    requests: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: int = 0
    ttft_s: list[float] = field(default_factory=list)
    per_token_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    rss_mib: dict[str, tuple[float, float]] = field(default_factory=dict)  # pid label -> (start, end)
    kv_blocks_at_end: float | None = None

    @staticmethod
    def _pct(values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict:
        return {"requests": self.requests, "tokens": self.tokens, "errors": len(self.errors),
                "mismatches": self.mismatches, "wall_s": round(self.wall_s, 1),
                "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
                "ttft_ms_p50": round(1e3 * self._pct(self.ttft_s, 0.5), 1),
                "ttft_ms_p99": round(1e3 * self._pct(self.ttft_s, 0.99), 1),
                "per_token_ms_p50": round(1e3 * self._pct(self.per_token_s, 0.5), 2),
                "per_token_ms_p99": round(1e3 * self._pct(self.per_token_s, 0.99), 2),
                "rss_mib": {k: [round(a), round(b)] for k, (a, b) in self.rss_mib.items()},
                "kv_blocks_at_end": self.kv_blocks_at_end}


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) / 1024


async def _one(client: AsyncClient, req: dict, report: LoadReport) -> list[int] | None:
    t0 = time.perf_counter()
    tokens: list[int] = []
    t_first = t_last = None
    try:
        async for chunk in client.stream(**req):
            if not chunk.token_ids:
                continue
            t_last = time.perf_counter()
            if t_first is None:
                t_first = t_last
            tokens.extend(chunk.token_ids)
    except SpecwireError as err:
        report.errors.append(str(err))
        return None
    report.requests += 1
    report.tokens += len(tokens)
    if t_first is not None:
        report.ttft_s.append(t_first - t0)
        if len(tokens) > 1:
            report.per_token_s.append((t_last - t_first) / (len(tokens) - 1))
    return tokens


async def run_load(draft: str, *, streams: int, duration_s: float, pids: dict[str, int] | None = None,
                   verifier_metrics: str | None = None, seed: int = 0) -> LoadReport:
    report = LoadReport()
    seeded, greedy = request_mix()
    rng = random.Random(seed)
    async with AsyncClient(draft, timeout=max(120.0, duration_s)) as client:
        requests = seeded + greedy
        # the reference: one at a time, nothing beside
        expected = [(await client.generate(**req)).token_ids for req in requests]
        for label, pid in (pids or {}).items():
            report.rss_mib[label] = (rss_mib(pid), 0.0)
        deadline = time.monotonic() + duration_s
        t0 = time.perf_counter()

        async def worker() -> None:
            while time.monotonic() < deadline:
                i = rng.randrange(len(requests))
                out = await _one(client, requests[i], report)
                if out is not None and out != expected[i]:
                    report.mismatches += 1

        await asyncio.gather(*(worker() for _ in range(streams)))
        report.wall_s = time.perf_counter() - t0
    for label, pid in (pids or {}).items():
        report.rss_mib[label] = (report.rss_mib[label][0], rss_mib(pid))
    if verifier_metrics:
        end = time.monotonic() + 10
        while (blocks := scrape_metric(verifier_metrics, "specwire_kv_blocks_used")) != 0 and time.monotonic() < end:
            await asyncio.sleep(0.1)
        report.kv_blocks_at_end = blocks
    return report


def failures(report: LoadReport, rss_growth: float = 0.5, rss_slack_mib: float = 256) -> list[str]:
    """The checks that failed (empty: all hold). RSS may grow by rss_growth of its start plus rss_slack_mib
    (allocator warm-up under the first real load)."""
    bad = []
    if report.errors:
        bad.append(f"{len(report.errors)} errors, e.g. {report.errors[0]}")
    if report.mismatches:
        bad.append(f"{report.mismatches} requests differed from their quiet run")
    for label, (start, end) in report.rss_mib.items():
        if end > start * (1 + rss_growth) + rss_slack_mib:
            bad.append(f"{label} RSS grew from {start:.0f} to {end:.0f} MiB")
    if report.kv_blocks_at_end not in (None, 0):
        bad.append(f"{report.kv_blocks_at_end:.0f} KV blocks still held after the load")
    if report.requests == 0:
        bad.append("no request finished")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="draft service HOST:PORT")
    parser.add_argument("--verifier-metrics", default=None, help="the verifier's /metrics URL (blocks check)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--pids", default="", help="VERIFIER_PID,DRAFT_PID for the memory check")
    args = parser.parse_args()
    pids = dict(zip(("verifier", "draft"), map(int, filter(None, args.pids.split(","))), strict=False))
    report = asyncio.run(run_load(args.draft, streams=args.streams, duration_s=args.duration, pids=pids,
                                  verifier_metrics=args.verifier_metrics))
    print(json.dumps(report.summary(), indent=2))
    bad = failures(report)
    for line in bad:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
