"""Past one verifier (issue 27), on loopback on this host:

1. throughput: one draft service in front of 1, 2 and 3 verifiers (`--verifier A,B,C`), S concurrent greedy
   streams of T tokens each: aggregate tokens/s, its ratio to one verifier, and where the draft placed them;
2. failover: 2 verifiers, S streams; once each has streamed some tokens, SIGKILL the verifier holding the most
   sequences and take, per stream, the longest wait between two of its tokens after the kill, against the
   median wait before it (the streams on the other verifier go on; those on the killed one stall until their
   sequence resumes elsewhere: the stall is the failover time, from the kill to their next token);
3. tensor parallelism: a verifier with --tensor-parallel-size 2 against 1, each with --num-threads 2, one
   stream: the mean verification step time (on CPU this is a correctness path, not a speed goal).

    python bench/scale_out.py [--pair tiny|default] [--streams 12] [--tokens 64] [--verifiers 1,2,3]
                              [--sections throughput,failover,tp] [--out DIR]

`--pair tiny` (the default): the test suite's tiny text pair, built in a temporary folder (compute is small, so
this measures the services, the streams and the placement); `default`: .models/target and .models/draft from
`make models`. Section 3 always runs the default target (.models/target) when it is there. Prints markdown tables
and writes scale_out.json into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

from specwire import AsyncClient, Client  # noqa: E402
from specwire.launch import Stack, free_port, scrape_metric  # noqa: E402


def pair(name: str, tmp: Path) -> tuple[Path, Path, str]:
    """(target, draft, dtype)."""
    if name == "tiny":
        from tiny_models import make_text_pair

        target, draft = make_text_pair(tmp, "qwen2")
        return target, draft, "float32"
    return ROOT / ".models" / "target", ROOT / ".models" / "draft", "float32"


class Services:
    def __init__(self, target: Path, draft: Path, dtype: str, n: int, logs: Path,
                 verifier_args: tuple[str, ...] = ()) -> None:
        self.stack = Stack()
        self.ports = [free_port() for _ in range(n)]
        self.verifiers = [self.stack.start(f"verifier{i}", ["verifier", "--model", str(target), "--dtype", dtype,
                                                            "--num-threads", "1", *verifier_args],
                                           port=p, log_dir=logs / f"v{n}-{i}", timeout_s=600)
                          for i, p in enumerate(self.ports)]
        self.metrics = free_port()
        self.draft = self.stack.start("draft", ["draft", "--model", str(draft), "--dtype", dtype, "--num-threads", "1",
                                                "--verifier", ",".join(f"127.0.0.1:{p}" for p in self.ports),
                                                "--num-speculative-tokens", "4", "--verifier-retry-deadline", "60",
                                                "--metrics-port", str(self.metrics)],
                                      log_dir=logs / f"d{n}", timeout_s=600)

    def placements(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics}/metrics"
        return {f"127.0.0.1:{p}": scrape_metric(url, "specwire_draft_verifier_sequences",
                                                {"verifier": f"127.0.0.1:{p}"}) or 0.0 for p in self.ports}

    def draft_metric(self, name: str, **labels) -> float:
        return scrape_metric(f"http://127.0.0.1:{self.metrics}/metrics", name, labels or None) or 0.0


def prompts(n: int) -> list[list[int]]:
    return [[(5 + 7 * i + 3 * j) % 40 + 3 for j in range(12)] for i in range(n)]


async def burst(address: str, streams: int, tokens: int) -> tuple[float, int]:
    async with AsyncClient(address, timeout=900) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(client.generate(prompt_token_ids=p, max_tokens=tokens, temperature=0.0,
                                                      ignore_eos=True) for p in prompts(streams)))
        return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def throughput(target: Path, draft: Path, dtype: str, counts: list[int], streams: int, tokens: int,
               logs: Path) -> list[dict]:
    rows = []
    for n in counts:
        services = Services(target, draft, dtype, n, logs)
        try:
            asyncio.run(burst(services.draft.address, streams, 8))  # warm-up: every verifier gets some
            runs = [asyncio.run(burst(services.draft.address, streams, tokens)) for _ in range(3)]
            wall, count = sorted(runs)[1]
            load = services.draft_metric("specwire_draft_placements_total", reason="load")
            rows.append({"verifiers": n, "tokens_per_s": count / wall, "wall_s": wall, "load_placements": load})
        finally:
            services.stack.stop()
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / base
    return rows


def failover(target: Path, draft: Path, dtype: str, streams: int, logs: Path) -> dict:
    services = Services(target, draft, dtype, 2, logs)
    try:
        asyncio.run(burst(services.draft.address, 4, 8))
        killed: dict = {}
        progressed = [asyncio.Event() for _ in range(streams)]
        arrivals: list[list[float]] = [[] for _ in range(streams)]

        async def one(i: int, prompt: list[int], client: AsyncClient) -> int:
            n = 0
            async for chunk in client.stream(prompt_token_ids=prompt, max_tokens=400, temperature=0.0,
                                             ignore_eos=True):
                arrivals[i].append(time.perf_counter())
                n += len(chunk.token_ids)
                if n >= 16:
                    progressed[i].set()
            return n

        async def run() -> None:
            async with AsyncClient(services.draft.address, timeout=900) as client:
                tasks = [asyncio.create_task(one(i, p, client)) for i, p in enumerate(prompts(streams))]
                await asyncio.gather(*(e.wait() for e in progressed))
                on = services.placements()
                victim = max(range(2), key=lambda i: on[f"127.0.0.1:{services.ports[i]}"])
                killed["on_victim"] = on[f"127.0.0.1:{services.ports[victim]}"]
                killed["t"] = time.perf_counter()
                services.verifiers[victim].proc.send_signal(signal.SIGKILL)
                await asyncio.gather(*tasks)

        asyncio.run(run())
        t = killed["t"]
        before = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False) if b < t]
        # per stream, its longest wait that spans the kill or follows it: a stalled stream's is its failover
        stalls = sorted(max(b - max(a, t) for a, b in zip(times, times[1:], strict=False) if b > t)
                        for times in arrivals)
        return {"streams": streams, "on_killed_verifier": killed["on_victim"],
                "failovers": services.draft_metric("specwire_draft_failovers_total"),
                "gap_before_median_s": statistics.median(before), "stall_max_s": stalls[-1],
                "stalls_s": [round(g, 3) for g in stalls]}
    finally:
        services.stack.stop()


def tensor_parallel(logs: Path, tokens: int) -> list[dict]:
    target = ROOT / ".models" / "target"
    if not target.exists():
        return []
    prompt = "def quicksort(xs):"
    rows = []
    for tp in (1, 2):
        stack = Stack()
        try:
            v = stack.start("verifier", ["verifier", "--model", str(target), "--dtype", "float32", "--num-threads", "2",
                                         "--tensor-parallel-size", str(tp)], log_dir=logs / f"tp{tp}", timeout_s=900)
            d = stack.start("draft", ["draft", "--model", str(ROOT / ".models" / "draft"), "--dtype", "float32",
                                      "--num-threads", "2", "--verifier", v.address, "--num-speculative-tokens", "4",
                                      "--speculation", "fixed"], log_dir=logs / f"tp{tp}d", timeout_s=900)
            with Client(d.address, timeout=900) as client:
                client.generate(prompt, max_tokens=4, temperature=0.0)
                stats = [client.generate(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
                         for _ in range(3)]
            steps = [s.stats.verify_time_s / s.stats.num_rounds for s in stats]
            rows.append({"tensor_parallel_size": tp, "step_s": statistics.median(steps),
                         "token_ids": stats[0].token_ids})
        finally:
            stack.stop()
    rows[1]["ratio"] = rows[1]["step_s"] / rows[0]["step_s"]
    rows[1]["identical_output"] = rows[0]["token_ids"] == rows[1]["token_ids"]
    for row in rows:
        del row["token_ids"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--verifiers", default="1,2,3")
    parser.add_argument("--sections", default="throughput,failover,tp")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    out: dict = {"pair": args.pair, "streams": args.streams, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, dtype = pair(args.pair, Path(tmp))
        logs = Path(tmp) / "logs"
        if "throughput" in sections:
            out["throughput"] = throughput(target, draft, dtype, [int(n) for n in args.verifiers.split(",")],
                                           args.streams, args.tokens, logs)
            print(f"\n{args.streams} greedy streams of {args.tokens} tokens, one draft, k = 4 ({args.pair} pair)\n")
            print("| verifiers | tokens/s | ratio to 1 |\n|---|---|---|")
            for row in out["throughput"]:
                print(f"| {row['verifiers']} | {row['tokens_per_s']:.1f} | {row['ratio']:.2f}x |")
        if "failover" in sections:
            out["failover"] = f = failover(target, draft, dtype, max(4, args.streams // 2), logs)
            print(f"\nfailover: {f['streams']} streams on 2 verifiers, {f['on_killed_verifier']:.0f} on the killed one "
                  f"({f['failovers']:.0f} failovers): longest wait for a token after the kill, per stream "
                  f"{f['stalls_s']} s (max {f['stall_max_s'] * 1e3:.0f} ms); median wait between tokens before "
                  f"the kill {f['gap_before_median_s'] * 1e3:.1f} ms")
        if "tp" in sections:
            out["tensor_parallel"] = rows = tensor_parallel(logs, 32)
            if rows:
                print("\n| tensor-parallel size | mean verification step | ratio |\n|---|---|---|")
                for row in rows:
                    print(f"| {row['tensor_parallel_size']} | {row['step_s'] * 1e3:.0f} ms | "
                          f"{row.get('ratio', 1.0):.2f}x |")
                print(f"identical greedy output: {rows[1]['identical_output']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale_out.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
