"""Throughput and latency against concurrency, per speculation mode (issue 23).

For each mode (k = 0, a fixed k: the draft started with `--speculation fixed`, and `auto`: with `--speculation
auto`, the verifier's goodput control of the draft length) a verifier and a draft service start with the CLI, and
for each concurrency C, C client streams send greedy requests back to back (code prompts, a fixed number of output
tokens, EOS ignored) until --requests-per-stream x C requests (at least --min-requests) are done. By default
(--order level) each level runs all modes back to back, in an order that alternates from level to level, so the
modes of one level are measured minutes apart rather than half an hour (the auto stack runs throughout; a fixed
mode's stack stops as soon as another mode runs, and starts again where its mode is next measured). Every stack
first serves each prompt once, so that all start a level with the prompts in their prefix cache. Mode `0@auto`
sends k = 0 requests to the auto stack: plain decoding through auto's own verifier process, where `0` runs on a
stack of its own (two processes of the same code can differ by a tenth in speed: see SAME_STACK_K0); `4@auto`
sends requests of a fixed k = 4 there (the request's speculation FIXED; the auto draft then starts with
--allow-request-fixed), so a fixed k is compared with auto on the same two processes. Per
concurrency and mode it reports:
- aggregate output tokens/s (all tokens over the window's wall time);
- the same over the level's full-load span (full_load_tok_s): until the first stream finds no request left. The
  rest is the level's tail, with fewer streams running: a mode whose requests finish apart (drafting: acceptance
  differs by request) runs a longer, thinner tail than one whose batch stays in step (k = 0, equal requests). The
  span's figure leaves the tail out and is the shorter, noisier measure; it is a diagnostic beside the level's
  figure, by which the issue's goals are judged;
- time to first token, p50 and p99 over requests;
- inter-token latency, p50 and p99 over requests, each request's (last chunk - first chunk) / (tokens - 1), the
  definition guidellm and aiperf use.

    python bench/capacity.py [--pair default|synthetic] [--concurrency 1,2,4,8,16,32,64] [--tokens 48]
                             [--modes 0,4,auto|0@auto,4,auto] [--rtt-ms 0] [--pin] [--requests-per-stream 2]
                             [--min-requests 8]
                             [--order level|mode|abba]
                             [--out bench/out/capacity]

--pair default: the pair from `make models` (.models/target and .models/draft), colocated on this host as
`specwire verifier` and `specwire draft` start them. --pair synthetic: bench/rtt.py's pair (a 1024-hidden,
8-layer random Qwen2 target and a draft made of its first layer: it agrees often), with --pin putting the verifier
on core 0 and the draft on core 1 as if on two hosts, and --rtt-ms through bench/delay_proxy.py.
Writes JSON and a markdown table (after every run of a mode, so a run that fails late keeps them) and, at the end, a PNG
(throughput against concurrency, one line per mode; TTFT and ITL p50/p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(ROOT / "bench"))

from delay_proxy import LinkShape, ProxyThread  # noqa: E402
from pooling import everywhere_line, load_runs, positive, summary_cells, summary_line  # noqa: E402
from service_usage import cpu_seconds, draft_rows, rows_between, rows_cell, summed  # noqa: E402

from specwire import AsyncClient  # noqa: E402
from specwire.launch import Stack, free_port, scrape_metric  # noqa: E402


def code_prompts() -> list[str]:
    return json.loads((ROOT / "specwire" / "bench_prompts.json").read_text())["code"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# k = 0 requests on the auto stack: plain decoding through the same verifier process as auto's. Two verifier
# processes of the same code ran the same forward up to about 13 % apart on one host (2026-12-05, 2-core AMD EPYC:
# auto's one-sequence forwards 1.07-1.13x k = 0's in one run and 0.96-0.97x in the next, the stacks started in
# the other order), and a ratio between two stacks carries that; this one does not.
SAME_STACK_K0 = "0@auto"
ON_AUTO = "@auto"  # `K@auto`: requests of a fixed k on the auto stack (K = 0: SAME_STACK_K0)


def stack_of(mode: str) -> str:
    """The stack a mode runs on: its own, but the auto stack for `K@auto`."""
    return "auto" if mode.endswith(ON_AUTO) else mode


def k_of(mode: str) -> int | None:
    """The k a mode's requests ask for (None: the draft service's own, auto's cap)."""
    return None if mode == "auto" else int(mode.removesuffix(ON_AUTO))


def fixed_on_auto(mode: str) -> bool:
    """Whether a mode's requests ask the auto stack for a fixed k above 0 (speculation FIXED)."""
    return mode.endswith(ON_AUTO) and bool(k_of(mode))


def label_of(mode: str) -> str:
    if mode.endswith(ON_AUTO):
        return f"k = {k_of(mode)} on auto's stack"
    return {"0": "k = 0", "auto": "auto"}.get(mode, f"k = {mode}")


def _request(prompt: str | list[int], k: int | None, fixed: bool = False) -> dict:
    """A request's prompt (text or token ids), draft length (None: the draft service's own) and, with `fixed`,
    its k every round whatever the verifier chooses (the auto draft's --allow-request-fixed), as client kwargs."""
    return {"prompt_token_ids" if isinstance(prompt, list) else "prompt": prompt,
            **({} if k is None else {"num_speculative_tokens": k}), **({"speculation": "fixed"} if fixed else {})}


def full_load_span(arrivals: list[tuple[float, int]], start: float, first_idle: float) -> tuple[int, float]:
    """(tokens, seconds) from `start` until `first_idle`, the moment the first stream found no request left to
    send: the level's span while all its streams had a request in flight. The rest of the level is its tail, in
    which the streams still running finish apart (a batch whose requests drafted is out of step) and the load
    falls; the level's tok/s holds the tail, this does not. `arrivals`: (time, tokens) of every chunk received."""
    return sum(n for t, n in arrivals if t <= first_idle), first_idle - start


def full_load_tok_s(arrivals: list[tuple[float, int]], start: float, first_idle: float) -> float:
    """Tokens a second over full_load_span (0 for an empty span)."""
    tokens, span = full_load_span(arrivals, start, first_idle)
    return tokens / span if span > 0 else 0.0


def figures(raw: dict) -> dict:
    """A level's figures from its raw counts (run_level's and ModeStack.measure's `raw`; the sum of two parts'
    under --order abba): tokens/s over the wall time, the same over the full-load spans, TTFT and ITL
    percentiles over all requests, drafted tokens per verification and acceptance."""
    ttfts, itls = raw["ttfts_s"], raw["itls_s"]
    row = {"requests": raw["requests"], "tok_s": raw["generated"] / raw["wall_s"], "wall_s": raw["wall_s"],
           "full_load_tok_s": raw["full_tokens"] / raw["full_span_s"] if raw["full_span_s"] > 0 else 0.0,
           "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5), "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
           "itl_p50_ms": 1e3 * percentile(itls, 0.5), "itl_p99_ms": 1e3 * percentile(itls, 0.99)}
    if "drafts" in raw:
        row["draft_tokens_per_verification"] = raw["draft_tokens"] / raw["drafts"] if raw["drafts"] else 0.0
        row["acceptance"] = raw["accepted"] / max(1.0, raw["draft_tokens"])
    return row


def merge_parts(first: dict, second: dict) -> dict:
    """One mode's level measured in two parts (--order abba) as one row: the raw counts summed (request lists
    joined, the parts' wall times and full-load spans added) and the figures taken again from them; the
    services' CPU seconds and the draft's rows summed."""
    raw = {key: first["raw"][key] + second["raw"][key] for key in first["raw"]}
    rows = summed(first["draft_rows"], second["draft_rows"])
    halves = [{key: half[key] for key in ("tok_s", "wall_s", "full_load_tok_s", "draft_tokens_per_verification")
               if key in half} for half in (first, second)]
    merged = {**first, **figures(raw), "raw": raw, "draft_rows": rows, "parts": 2, "halves": halves,
              "verifier_cpu_s": first["verifier_cpu_s"] + second["verifier_cpu_s"],
              "draft_cpu_s": first["draft_cpu_s"] + second["draft_cpu_s"]}
    warnings = [part["warning"] for part in (first, second) if "warning" in part]
    if warnings:
        merged["warning"] = "; ".join(warnings)
    return merged


async def run_level(address: str, concurrency: int, prompts: list, tokens: int, k: int | None, *,
                    per_stream: int = 2, min_requests: int = 8, fixed: bool = False,
                    part: tuple[int, int] | None = None) -> dict:
    """`concurrency` streams, back to back, until max(min_requests, per_stream * concurrency) requests are done;
    with `part` (first, count), only those requests of the level (their prompts: the level's from `first` on)."""
    total = max(min_requests, per_stream * concurrency)
    first_request, count = part or (0, total)
    next_request = iter(range(first_request, first_request + count))
    ttfts: list[float] = []
    itls: list[float] = []
    arrivals: list[tuple[float, int]] = []
    first_idle: float | None = None
    generated = 0

    async def worker(client: AsyncClient) -> None:
        nonlocal generated, first_idle
        for i in next_request:
            prompt = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            first = last = None
            n = 0
            stream = client.stream(**_request(prompt, k, fixed), max_tokens=tokens, temperature=0.0, ignore_eos=True)
            async for chunk in stream:
                if not chunk.token_ids:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                last = now
                n += len(chunk.token_ids)
                arrivals.append((now, len(chunk.token_ids)))
            generated += n
            ttfts.append(first - t0)
            if n > 1:
                itls.append((last - first) / (n - 1))
        if first_idle is None:
            first_idle = time.perf_counter()

    async with AsyncClient(address, timeout=3600) as client:
        # warm the link; k = 0, so that on the auto stack these junk tokens' certain rejections do not enter the
        # verifier's acceptance counts (at one stream a fresh verifier's first evidence, it chose k = 2 for the
        # first three requests on the strength of it, a4cf289)
        await client.generate(prompt_token_ids=[5, 6, 7], max_tokens=2, temperature=0.0, num_speculative_tokens=0)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    full_tokens, full_span = full_load_span(arrivals, t0, first_idle if first_idle is not None else t0 + wall)
    raw = {"requests": count, "generated": generated, "wall_s": wall, "full_tokens": full_tokens,
           "full_span_s": full_span, "ttfts_s": ttfts, "itls_s": itls}
    return {"concurrency": concurrency, **figures(raw), "raw": raw}


class ModeStack:
    """A verifier and a draft service for one mode ("0", a fixed k, or "auto"); `measure` runs one concurrency
    level on them. An idle stack costs no CPU (the services' OpenMP teams wait passively)."""

    def __init__(self, mode: str, target: Path, draft: Path, rtt_ms: float, pin: bool, log_dir: Path,
                 extra_verifier: list[str], extra_draft: list[str], name: str = "") -> None:
        self.mode = mode
        self.k = k_of(mode)
        verifier_cpus, draft_cpus = ({0}, {1}) if pin else (None, None)
        self._exit = ExitStack()
        stack = self._exit.enter_context(Stack())
        try:
            vmetrics = free_port()
            self.verifier = stack.start(f"verifier-{name or mode}",
                                        ["verifier", "--model", str(target), "--metrics-port", str(vmetrics),
                                         *extra_verifier], log_dir=log_dir, cpus=verifier_cpus)
            upstream = self.verifier.address
            if rtt_ms:
                upstream = self._exit.enter_context(
                    ProxyThread(self.verifier.address, LinkShape(delay_s=rtt_ms / 2000))).address
            dmetrics = free_port()
            self.draft = stack.start(f"draft-{name or mode}",
                                     ["draft", "--model", str(draft), "--verifier", upstream, "--speculation",
                                      "auto" if mode == "auto" else "fixed", "--metrics-port", str(dmetrics),
                                      *extra_draft],
                                     log_dir=log_dir, cpus=draft_cpus)
        except BaseException:
            self._exit.close()
            raise
        self.metrics_url = f"http://127.0.0.1:{vmetrics}/metrics"
        self.draft_metrics_url = f"http://127.0.0.1:{dmetrics}/metrics"

    def warm(self, prompts: list) -> None:
        """Serve each prompt once (one token), so that the verifier's prefix cache holds them all, as a stack's does
        after any level. A stack that runs from the previous level has them cached, and one that starts fresh would
        otherwise prefill whole prompts there: 617 prompt tokens in one 17.9 s step where a warm stack prefilled
        233 (32 streams, d5205a2)."""
        async def serve_all() -> None:
            async with AsyncClient(self.draft.address, timeout=3600) as client:
                await asyncio.gather(*(client.generate(**_request(p, self.k), max_tokens=1, temperature=0.0)
                                       for p in prompts))
        asyncio.run(serve_all())

    def measure(self, concurrency: int, prompts: list, tokens: int, per_stream: int, min_requests: int,
                mode: str | None = None, part: tuple[int, int] | None = None) -> dict:
        """`mode`: `K@auto` on the auto stack (its requests ask for a fixed k = K); else this stack's own. `part`:
        run_level's (a part of the level's requests)."""
        mode = mode or self.mode
        k = k_of(mode)
        before = _spec_counters(self.metrics_url)
        rows_before = draft_rows(self.draft_metrics_url)
        cpu_before = cpu_seconds(self.verifier.proc.pid), cpu_seconds(self.draft.proc.pid)
        row = {"mode": mode, **asyncio.run(run_level(self.draft.address, concurrency, prompts, tokens, k,
                                                     per_stream=per_stream, min_requests=min_requests,
                                                     fixed=fixed_on_auto(mode), part=part))}
        after = _spec_counters(self.metrics_url)
        # CPU seconds each service used in the level (both share the cores unless pinned)
        row["verifier_cpu_s"] = cpu_seconds(self.verifier.proc.pid) - cpu_before[0]
        row["draft_cpu_s"] = cpu_seconds(self.draft.proc.pid) - cpu_before[1]
        # what the draft's model computed in the level: token positions by kind (prompt, catch_up, round, draft)
        # and when (drafting, warming); see specwire_draft_model_rows
        row["draft_rows"] = rows_between(rows_before, draft_rows(self.draft_metrics_url))
        row["raw"].update({key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")})
        row.update(figures(row["raw"]))
        if fixed_on_auto(mode) and row["draft_tokens_per_verification"] < k / 2:
            # a draft that ignored the request's speculation FIXED (one older than the field) runs it as auto
            row["warning"] = f"k = {k} requested fixed, {row['draft_tokens_per_verification']:.2f} drafted a verification"
            print(f"WARNING: {mode} at {concurrency} streams: {row['warning']}", file=sys.stderr, flush=True)
        return row

    def close(self) -> None:
        self._exit.close()


def schedule(modes: list[str], levels: list[int], order: str) -> list[tuple[str, int]]:
    """(mode, concurrency) in the order they run. "mode": each mode's levels in turn. "level": each level's modes
    back to back, the direction reversed from one level to the next, so that a drift of the host's speed over the
    run (other tenants, thermal state) falls on every mode alike instead of on the mode measured last. "abba":
    each level's modes as "level" orders them, then again in reverse, each run half the level's requests (a pair
    appears twice): within a level every mode's two halves sit at about the same mean time (exactly where every
    mode's halves take equal times), so a drift that is linear over the level falls on all modes alike, and each
    mode follows another mode as often as it is followed. It does not spare auto's controllers the state they
    carry from the lighter level before (its first half starts with it, its second with the first's). A level
    then starts twice and has two tails, each half a wave or two of its own; a mode whose requests finish apart
    (drafting) spends a larger share of its level in a thinner tail than in "level" order, and a mode on a stack
    of its own (not `K@auto`) runs its halves on two fresh processes, where auto's run on one that lives through
    the run: the figures are not comparable with a "level" run's."""
    if order == "mode":
        return [(m, c) for m in modes for c in levels]
    runs = [(m, c) for i, c in enumerate(levels) for m in (modes if i % 2 == 0 else modes[::-1])]
    if order == "abba":
        n = len(modes)
        return [run for at in range(0, len(runs), n) for run in runs[at:at + n] + runs[at:at + n][::-1]]
    return runs


def stacks_to_close(running: list[str], own: str, modes: list[str], order: str) -> list[str]:
    """The stacks to stop before `own`'s mode runs: at most two at a time (each holds its own copy of the weights:
    about 10 GB for the default pair). The auto stack lives through the run in level and abba order, as a service
    would (its step-time model and trial state carry from one level to the next), and in mode order too where it
    serves `K@auto` modes; a fixed mode learns nothing, so its stack starts again where it is next measured."""
    keep_auto = order in ("level", "abba") or any(m.endswith(ON_AUTO) for m in modes)
    return [m for m in running if m != own and not (keep_auto and m == "auto")]


class Rows:
    """The run's rows, one per (mode, level), in the order first measured. Under --order abba a level's first half
    is a row marked "part": 0 until its second half comes, and then the two are one row (merge_parts)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._at: dict[tuple[str, int], int] = {}  # (mode, level) -> its index in rows
        self._halves: dict[tuple[str, int], int] = {}  # halves measured

    def half_next(self, mode: str, level: int) -> int:
        """Which half of (mode, level) runs next under abba: 0, then 1 (a level listed twice: ValueError;
        plan_refusal refuses such a run before it starts)."""
        half = self._halves.get((mode, level), 0)
        if half > 1:
            raise ValueError(f"{mode} at {level} streams: both halves are measured already")
        return half

    def plan(self, mode: str, level: int, order: str, total: int) -> tuple[int | None, tuple[int, int] | None]:
        """(half, run_level's part) of the next run of (mode, level), `total` its level's requests: (None, None)
        for a whole level; under abba the next half and its requests."""
        if order != "abba":
            return None, None
        half = self.half_next(mode, level)
        return half, part_of(total, half)

    def add(self, row: dict, half: int | None = None) -> dict:
        """A run's row (`half`: which half, under abba; None: a whole level, a new row even where the level
        repeats); returns the row as kept (both halves merged, for the second)."""
        key = (row["mode"], row["concurrency"])
        if half is None:
            self.rows.append(row)
            return row
        self._halves[key] = half + 1
        if half == 0:
            self._at[key] = len(self.rows)
            self.rows.append({**row, "part": 0})
            return self.rows[-1]
        first = {k: v for k, v in self.rows[self._at[key]].items() if k != "part"}
        self.rows[self._at[key]] = merge_parts(first, row)
        return self.rows[self._at[key]]


def level_requests(concurrency: int, per_stream: int, min_requests: int) -> int:
    """A level's requests: per_stream a stream, at least min_requests."""
    return max(min_requests, per_stream * concurrency)


def plan_refusal(modes: list[str], levels: list[int], order: str, per_stream: int, min_requests: int) -> str | None:
    """Why a run's plan is refused before anything starts (None: it is not): a mode or a level listed twice (the
    table keeps one row a pair; under abba its halves would not pair up), or under abba a level whose half leaves
    a stream with nothing to send at first."""
    for name, values in (("mode", modes), ("level", levels)):
        if len(set(values)) < len(values):
            return f"a {name} is listed twice in {values}"
    short = [c for c in levels if level_requests(c, per_stream, min_requests) // 2 < c]
    if order == "abba" and short:
        return (f"--order abba: half of a level's requests must keep every stream busy at first; at "
                f"{', '.join(map(str, short))} streams it does not (raise --requests-per-stream or --min-requests)")
    return None


def part_of(total: int, half: int) -> tuple[int, int]:
    """(first request, count) of a level's half (0 or 1) under --order abba: the first takes total // 2."""
    first = total // 2
    return (0, first) if half == 0 else (first, total - first)


def _spec_counters(url: str) -> dict[str, float]:
    def get(name: str) -> float:
        return scrape_metric(url, name) or 0.0
    return {"drafts": get("specwire_spec_decode_num_drafts_total"),
            "draft_tokens": get("specwire_spec_decode_num_draft_tokens_total"),
            "accepted": get("specwire_spec_decode_num_accepted_tokens_total")}


def _rows_cell(row: dict) -> str:
    """The draft's CPU seconds, then its model's rows in the level (service_usage.rows_cell)."""
    return f"{row.get('draft_cpu_s', 0.0):.1f} s; " + rows_cell(row.get("draft_rows"))


def _versus_best(by: dict, level: int, key: str, others: list[str]) -> str:
    """Auto's figure `key` at `level` over the best of `others`' there, as a table cell ("" where a figure is
    missing or 0: a row of an older run's JSON, an empty span)."""
    auto = by[("auto", level)].get(key) if ("auto", level) in by else None
    theirs = [by[(m, level)].get(key) for m in others if (m, level) in by]
    return f"{auto / max(theirs):.2f}x" if auto and theirs and all(theirs) else ""


def _halves_cell(by: dict, level: int, others: list[str]) -> str:
    """Under --order abba: auto over the best of `others` in each half of the level, then how far apart k = 0's
    two halves came out: plain decoding measured against itself, on the same processes where it runs on auto's
    stack, what the run can resolve at that level (a fixed k > 0's halves also differ by where its requests'
    acceptance makes them finish). Where k = 0 runs first in the level its halves are the level's first and
    last runs; where it runs in the middle, they are back to back, and the spread is likely smaller. "" where a
    row has no halves (a level in one part, an older run's JSON); no spread without a k = 0 mode."""
    auto = by.get(("auto", level), {}).get("halves")
    present = [m for m in others if (m, level) in by]
    theirs = [by[(m, level)].get("halves") for m in present]
    if not auto or len(auto) != 2 or not theirs or any(not h or len(h) != 2 for h in theirs):
        return ""
    if not all(h["tok_s"] for half in (auto, *theirs) for h in half):
        return ""
    ratios = [auto[i]["tok_s"] / max(h[i]["tok_s"] for h in theirs) for i in range(2)]
    plain = [h for m, h in zip(present, theirs, strict=True) if k_of(m) == 0]
    apart = "".join(f"; {100 * (max(h[0]['tok_s'], h[1]['tok_s']) / min(h[0]['tok_s'], h[1]['tok_s']) - 1):.1f} %"
                    for h in plain[:1])
    return f"{ratios[0]:.2f}x / {ratios[1]:.2f}x{apart}"


def table(rows: list[dict], modes: list[str], levels: list[int]) -> str:
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    head = "| streams | " + " | ".join(f"{label_of(m)} tok/s" for m in modes)
    same_stack = [m for m in modes if m.endswith(ON_AUTO)]
    head += " | auto / best fixed" + (" | auto / best on auto's stack" if same_stack else "")
    head += " | the same at full load"
    halves = any(r.get("halves") for r in rows)
    head += " | auto / best in each half; k = 0's halves apart" if halves else ""
    head += " | " + " | ".join(f"{label_of(m)} TTFT p50/p99 ms" for m in modes)
    head += " | " + " | ".join(f"{label_of(m)} ITL p50/p99 ms" for m in modes) + " | auto drafts/verification"
    head += " | auto draft CPU; rows prompt / catch-up / round / draft (+warming) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in levels:
        # a level's first half alone (abba, a run cut between halves) says so
        cells = [f"{by[(m, c)]['tok_s']:.1f}" + (" (half)" if "part" in by[(m, c)] else "") if (m, c) in by else ""
                 for m in modes]
        fixed = [m for m in modes if m != "auto"]
        ratio = _versus_best(by, c, "tok_s", fixed)
        if same_stack:  # the ratio between modes of one pair of processes, without the spread between processes
            ratio += " | " + _versus_best(by, c, "tok_s", same_stack)
        # the last ratio again, over the streams' full-load spans (full_load_tok_s: without the level's tail)
        ratio += " | " + _versus_best(by, c, "full_load_tok_s", same_stack or fixed)
        if halves:  # the same ratio in each half, beside what separates a fixed mode's two halves
            ratio += " | " + _halves_cell(by, c, same_stack or fixed)
        ttft = [f"{by[(m, c)]['ttft_p50_ms']:.0f} / {by[(m, c)]['ttft_p99_ms']:.0f}" if (m, c) in by else ""
                for m in modes]
        itl = [f"{by[(m, c)]['itl_p50_ms']:.0f} / {by[(m, c)]['itl_p99_ms']:.0f}" if (m, c) in by else ""
               for m in modes]
        k_auto = f"{by[('auto', c)]['draft_tokens_per_verification']:.2f}" if ("auto", c) in by else ""
        rows_auto = _rows_cell(by[("auto", c)]) if ("auto", c) in by else ""
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {ratio} | " + " | ".join(ttft) + " | "
                     + " | ".join(itl) + f" | {k_auto} | {rows_auto} |")
    return "\n".join(lines)


def table_of_run(run: dict) -> str:
    """A run's JSON ({"title", "rows"}) as its title and table: the modes in the order first measured, the levels
    in rising order."""
    rows = run["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    return f"{run.get('title', '')}\n\n{table(rows, modes, levels)}"


def auto_ratios(run: dict) -> dict[int, tuple[float, float | None]]:
    """A run's JSON as (auto / the best of the other modes, auto / k = 0 or None where k = 0 was not run), by
    level: the table's "auto / best" as a number. A level counts only where auto and every other mode of the run
    have whole rows there (not a first half alone, "part": a run cut within a level would compare auto with some
    of the modes) with figures above 0 (pooling.positive). k = 0 is `0@auto` where the run has it, else `0`."""
    by = {(r["mode"], r["concurrency"]): r for r in run["rows"]}
    modes = {m for m, _ in by} - {"auto"}
    out: dict[int, tuple[float, float | None]] = {}
    for level in sorted({c for _, c in by}):
        rows = [by.get((m, level)) for m in ("auto", *sorted(modes))]
        if not modes or any(r is None or "part" in r or not positive(r.get("tok_s")) for r in rows):
            continue
        auto = rows[0]["tok_s"]
        plain = next((by[(m, level)]["tok_s"] for m in (f"0{ON_AUTO}", "0") if (m, level) in by), None)
        out[level] = (auto / max(r["tok_s"] for r in rows[1:]), auto / plain if plain else None)
    return out


def pool_table(runs: list[tuple[str, dict]], goal: float = 0.95, one_stream_goal: float = 1.8) -> str:
    """Several runs' JSON ((label, run), in the order given) as one table (bench/pooling.py): by level, auto / best
    over the runs that measured it; then auto / k = 0 at one stream against `one_stream_goal`, and the runs that
    reached `goal` at every level (of those that measured every level any of them did)."""
    ratios = [(label, auto_ratios(run)) for label, run in runs]
    levels = sorted({c for _, r in ratios for c in r})
    lines = [f"| streams | runs | auto / best: mean | median | lowest | runs at {goal:g}x or more |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {c} | " + summary_cells([(r[c][0], label) for label, r in ratios if c in r], goal) + " |"
              for c in levels]
    text = "\n".join(lines)
    one = [(r[1][1], label) for label, r in ratios if 1 in r and r[1][1] is not None]
    if one:
        text += "\n\nauto / k = 0 at one stream: " + summary_line(one, one_stream_goal)
    every = everywhere_line([(label, {c: v[0] for c, v in r.items()}) for label, r in ratios], goal,
                            f"every level ({', '.join(map(str, levels))} streams)")
    return text + (f"\n\n{every}" if every else "")


def plot(rows: list[dict], modes: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for m in modes:
        rs = sorted((r for r in rows if r["mode"] == m), key=lambda r: r["concurrency"])
        if not rs:
            continue
        label = label_of(m)
        xs = [r["concurrency"] for r in rs]
        axes[0].plot(xs, [r["tok_s"] for r in rs], marker="o", label=label)
        axes[1].plot(xs, [r["ttft_p50_ms"] for r in rs], marker="o", label=f"{label} p50")
        axes[1].plot(xs, [r["ttft_p99_ms"] for r in rs], marker="x", linestyle="--", label=f"{label} p99")
        axes[2].plot(xs, [r["itl_p50_ms"] for r in rs], marker="o", label=f"{label} p50")
        axes[2].plot(xs, [r["itl_p99_ms"] for r in rs], marker="x", linestyle="--", label=f"{label} p99")
    for ax, name in zip(axes, ("output tokens/s", "time to first token, ms", "inter-token latency, ms"),
                        strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=["default", "synthetic", "agreeing"], default="default",
                   help="agreeing: the synthetic pair with the target's later layers writing nothing into the "
                        "residual stream, so the draft (its first layer) has the target's next-token function: "
                        "greedy acceptance 1 at the target's cost")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--modes", default="0,4", help="k = 0, fixed ks, `auto` (a draft with --speculation auto), and "
                                                  f"`K{ON_AUTO}`: requests of a fixed k = K on the auto stack "
                                                  "(its draft then takes --allow-request-fixed)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per level: this many per stream")
    p.add_argument("--min-requests", type=int, default=8, help="and at least this many")
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--pin", action="store_true", help="verifier on core 0, draft on core 1")
    p.add_argument("--order", choices=["level", "mode", "abba"], default="level",
                   help="level (default): each level runs all modes back to back, alternating their order; mode: one "
                        "mode's levels after another (a drift of the host's speed then falls on whole modes); abba: "
                        "each level's modes, then again in reverse, half its requests each (see schedule)")
    p.add_argument("--auto-k", type=int, default=None,
                   help="the auto draft's cap on k (its --num-speculative-tokens; default: the service's, 4)")
    p.add_argument("--draft-args", default="",
                   help="more draft-service flags for every mode's draft, as one string (--draft-args=--pipeline)")
    p.add_argument("--verifier-args", default="",
                   help="more verifier flags for every mode's verifier, as one string (--verifier-args='--phases split')")
    p.add_argument("--models", type=Path, default=ROOT / ".models")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "capacity")
    p.add_argument("--table-from", type=Path, default=None, metavar="JSON",
                   help="print the table of a run's JSON (this version's columns) and run nothing")
    p.add_argument("--pool", type=Path, nargs="+", default=None, metavar="JSON",
                   help="print auto / best by level over several runs' JSON (pool_table) and run nothing")
    args = p.parse_args()
    if args.pool:
        try:
            runs = load_runs(args.pool, ("mode", "concurrency", "tok_s"))
        except ValueError as err:
            p.error(str(err))
        print(pool_table(runs))
        return 0
    if args.table_from is not None:
        print(table_of_run(json.loads(args.table_from.read_text())))
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    if (refusal := plan_refusal(modes, levels, args.order, args.requests_per_stream, args.min_requests)):
        p.error(refusal)
    log_dir = Path(tempfile.mkdtemp(prefix="specwire-capacity-"))
    if args.pair == "default":
        target, draft = args.models / "target", args.models / "draft"
        prompts: list = code_prompts()
        extra_verifier: list[str] = []
        extra_draft: list[str] = []
    else:
        from rtt import PROMPTS, synthetic_pair

        target, draft = synthetic_pair(log_dir / "models", damp=0.0 if args.pair == "agreeing" else 0.05)
        prompts = PROMPTS
        extra_verifier = ["--dtype", "float32"]
        extra_draft = ["--dtype", "float32"]
    rows = Rows()
    stacks: dict[str, ModeStack] = {}
    starts: dict[str, int] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.pair}-rtt{args.rtt_ms:g}{'-pinned' if args.pin else ''}"
    stem += f"-autok{args.auto_k}" if args.auto_k is not None else ""
    stem += "-abba" if args.order == "abba" else ""
    for side, extra in (("v", args.verifier_args), ("d", args.draft_args)):  # which side's flags: in the name too
        stem += f"-{side}-{re.sub(r'[^a-z0-9]+', '-', extra.lower()).strip('-')}" if extra else ""
    title = (f"{args.pair} pair, {args.tokens} tokens, greedy, RTT {args.rtt_ms:g} ms"
             f"{', pinned 1+1 cores' if args.pin else ', colocated'}"
             f"{f', auto capped at k = {args.auto_k}' if args.auto_k is not None else ''}"
             f"{', each level in two halves (modes ABC CBA)' if args.order == 'abba' else ''}"
             f"{f', verifier {args.verifier_args}' if args.verifier_args else ''}"
             f"{f', draft {args.draft_args}' if args.draft_args else ''}")

    def write() -> str:
        """The JSON and the table of the rows so far (after every measurement: a run that fails late keeps them;
        each file replaced whole, never left half written)."""
        md = table(rows.rows, modes, levels)
        for path, text in ((args.out / f"{stem}.json", json.dumps({"title": title, "rows": rows.rows}, indent=1)),
                           (args.out / f"{stem}.md", f"{title}\n\n{md}\n")):
            part = path.with_name(path.name + ".part")
            part.write_text(text)
            part.replace(path)
        return md

    try:
        for mode, c in schedule(modes, levels, args.order):
            own = stack_of(mode)
            for other in stacks_to_close(list(stacks), own, modes, args.order):
                stacks.pop(other).close()
            if own not in stacks:
                cap = ["--num-speculative-tokens", str(args.auto_k)] if own == "auto" and args.auto_k is not None else []
                if own == "auto" and any(fixed_on_auto(m) for m in modes):
                    cap.append("--allow-request-fixed")
                starts[own] = starts.get(own, 0) + 1  # logs: one per start (abba starts a fixed mode twice a level)
                stacks[own] = ModeStack(own, target, draft, args.rtt_ms, args.pin, log_dir,
                                        [*extra_verifier, *shlex.split(args.verifier_args)],
                                        [*extra_draft, *cap, *shlex.split(args.draft_args)],
                                        name=f"{own}-from-c{c}-{starts[own]}")
                stacks[own].warm(prompts)
            half, part = rows.plan(mode, c, args.order, level_requests(c, args.requests_per_stream, args.min_requests))
            row = stacks[own].measure(c, prompts, args.tokens, args.requests_per_stream, args.min_requests, mode, part)
            row = rows.add(row, half)
            print(json.dumps({key: value for key, value in row.items() if key != "raw"}), flush=True)
            write()
    finally:
        for stack in stacks.values():
            stack.close()
    md = write()
    plot(rows.rows, modes, args.out / f"{stem}.png", title)
    print(f"\n{title}\n\n{md}\n\nlogs: {log_dir}")
    medians = [r["tok_s"] for r in rows.rows]
    return 0 if medians and statistics.fmean(medians) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
