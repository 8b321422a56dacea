"""The gateway measured by two serving benchmarks from PyPI that nobody here wrote: guidellm and aiperf (issue 23).

For each mode a fresh verifier, draft service and `specwire gateway` start with the CLI on this host (the default
pair from `make models`), and for each concurrency each client runs against the gateway's /v1/completions,
streamed, with its own synthetic prompts (--prompt-tokens long, --output-tokens generated, EOS ignored) and a
bounded number of requests: max(--min-requests, --requests-per-stream x C) per level (8, 2). The figures printed are the clients' own, read from the files
they write: time to first token, inter-token latency (p50 and p99, ms) and output tokens/s.

    bench/external_clients.sh [--modes k0,auto] [--concurrency 1,4,16] [--clients guidellm,aiperf]
                              [--prompt-tokens 64] [--output-tokens 48] [--order alternate|abba]
                              [--out bench/out/external]

Modes: k0 starts the draft with --num-speculative-tokens 0 (the target alone, through the same path); auto with
--speculation auto (the verifier chooses each round's draft length); fixed-K with --speculation fixed
--num-speculative-tokens K; k0@auto runs on auto's stack and every request asks for num_speculative_tokens 0 (the
clients put it in each request's body), so plain decoding is measured through the same verifier process as auto:
two processes of the same code have run the same forward up to about 13 % apart on this host, which a ratio
between two stacks carries. Modes that share a stack run each level back to back (client by client), in the
order given at the first level and reversed at every second, so that neither is always measured first; the others
each start a stack of their own. The clients run from their own virtual environments (bench/.venv-guidellm,
bench/.venv-aiperf, which bench/external_clients.sh installs), offline: the tokenizer is the target's directory
and nothing is fetched from a model hub. The clients run niced (--client-nice, 19), so that on a host they share
with the services they take only the CPU the services leave. Each row also holds the CPU seconds the verifier, the
draft, the gateway and the client used in that run, and what the draft's model computed (its rows by kind). With
--order abba each level runs the modes of a stack twice, client by client (ABBA, the level's requests each time),
and a mode's two runs are one row (merge_halves: output tokens/s over both, the latency percentiles the mean of the
two runs'), with each run's output tokens/s beside it. Every run's requests carry a prefix-cache salt of their own
(request_body), so none finds an earlier run's prompts cached. Writes summary.json and each client's own output under
--out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

from pooling import everywhere_line, load_runs, positive, summary_cells  # noqa: E402
from service_usage import children_cpu_seconds, cpu_seconds, draft_rows, rows_between, rows_cell, summed  # noqa: E402

from specwire.launch import Stack, free_port  # noqa: E402

VENVS = {"guidellm": ROOT / "bench" / ".venv-guidellm", "aiperf": ROOT / "bench" / ".venv-aiperf"}
# Never a model hub: the tokenizer is a local directory and the prompts are synthetic.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}


SAME_STACK_K0 = "k0@auto"


def stack_of(mode: str) -> str:
    """The mode whose stack serves `mode`."""
    return "auto" if mode == SAME_STACK_K0 else mode


def request_body(mode: str, run: str = "") -> dict:
    """Fields every request of `mode` adds to its body, in the client run named `run` (its level, and its half
    under --order abba). Each run's requests carry a prefix-cache salt of their own (the gateway's cache_salt, as
    vLLM's): the clients draw the same synthetic prompts for every run, so a run would find the prompts of any
    run before it on the stack cached (about a second less to its first token here, and no prefill work): another
    mode's on a shared stack, the same mode's at another level of as many requests, or its own first half."""
    salt = f"{mode}/{run}" if run else mode
    return {"cache_salt": salt, **({"num_speculative_tokens": 0} if mode == SAME_STACK_K0 else {})}


def stack_groups(modes: list[str]) -> dict[str, list[str]]:
    """Stack -> the modes measured on it, stacks in the order their first mode is given."""
    groups: dict[str, list[str]] = {}
    for mode in modes:
        mode_args(stack_of(mode))  # refuses an unknown mode before anything starts
        if modes.count(mode) > 1:
            raise ValueError(f"mode {mode!r} is given twice")
        groups.setdefault(stack_of(mode), []).append(mode)
    return groups


def mode_args(mode: str) -> list[str]:
    """The draft service's flags for a mode."""
    if mode == "k0":
        return ["--num-speculative-tokens", "0"]
    if mode == "auto":
        return ["--speculation", "auto"]
    if mode.startswith("fixed-"):
        return ["--speculation", "fixed", "--num-speculative-tokens", mode.removeprefix("fixed-")]
    raise ValueError(f"unknown mode {mode!r}: k0, auto, {SAME_STACK_K0} or fixed-K")


REQUESTS = {"per_stream": 2, "min": 8}  # --requests-per-stream, --min-requests
# The clients share the services' cores here, and take only what the services leave: a load generator on the
# host it measures must not take the verifier's core. aiperf (0.13, --concurrency without a request rate) polls
# for a free slot in a loop that yields to its event loop and never sleeps, a whole core until it has issued
# its last request (measured on 2 cores, 4 streams, 8 requests: 10 CPU seconds in every 10 s until the second
# wave started, then about 0.1). Beside it, a verifier's step and a draft's forward most likely took turns on the
# other core: auto's plain steps of 4 tokens ran at a median of 721 ms where k = 0's, right after, ran at 576, and
# the draft spent a few seconds of CPU on its probes (2026-12-06; docs/bench/external-clients-what-the-clients-
# cost-2026-12-06.md). Niced, a client waits whenever both cores are busy, which only auto's draft makes them
# beside the verifier: if anything, that leans against auto.
CLIENT_NICE = 19


def requests_for(concurrency: int) -> int:
    return max(REQUESTS["min"], REQUESTS["per_stream"] * concurrency)


# -- guidellm ---------------------------------------------------------------------------------------------------

def guidellm_command(url: str, model: str, tokenizer: Path, concurrency: int, prompt_tokens: int,
                     output_tokens: int, out: Path, body: dict | None = None) -> list[str]:
    n = requests_for(concurrency)
    # as JSON (guidellm reads YAML, JSON or key=value): its extras' body is merged into every request's
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
               "timeout": 3600, **({"extras": {"body": body}} if body else {})}
    return [str(VENVS["guidellm"] / "bin" / "guidellm"), "run",
            "--backend", json.dumps(backend),
            "--profile", f"kind=concurrent,streams={concurrency}",
            "--constraint", f"kind=max_requests,count={n}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out / 'benchmarks.json'}",
            "--output", f"kind=csv,path={out / 'benchmarks.csv'}",
            "--disable-console-interactive"]


def guidellm_figures(out: Path) -> dict:
    """TTFT, ITL (ms) and output tokens/s of the one benchmark in guidellm's JSON report."""
    report = json.loads((out / "benchmarks.json").read_text())
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def dist(name: str) -> dict:
        return metrics[name]["successful"]

    ttft, itl, tps = dist("time_to_first_token_ms"), dist("inter_token_latency_ms"), dist("output_tokens_per_second")
    totals = metrics["request_totals"]
    return {"ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "itl_p50_ms": _pct(itl, 50),
            "itl_p99_ms": _pct(itl, 99), "output_tok_s": tps["mean"],
            "requests_ok": totals["successful"], "requests_errored": totals["errored"]}


def _pct(dist: dict, q: int) -> float:
    pcts = dist["percentiles"]
    return float(pcts.get(f"p{q}", pcts.get(f"p{q:02d}", math.nan)))


# -- aiperf -----------------------------------------------------------------------------------------------------

def aiperf_command(url: str, model: str, tokenizer: Path, concurrency: int, prompt_tokens: int,
                   output_tokens: int, out: Path, body: dict | None = None) -> list[str]:
    n = requests_for(concurrency)
    # ignore_eos: without it aiperf's --output-tokens-mean is only max_tokens (it warns so). No --server-metrics:
    # aiperf would poll the gateway's /metrics about twice a second, work that guidellm's runs do not pay.
    # --use-server-token-count: the output's tokens are the stream's usage (the gateway's count of the tokens it
    # generated), as guidellm's are. Left to count them itself, aiperf tokenizes the streamed text again, and
    # sampled text need not tokenize back into the tokens that made it: one request of 48 tokens (its verifier
    # steps emitted 48) counted 21 (auto at one stream, 2026-12-06), which took the level's output tokens/s to
    # 1.35 against k = 0's 1.57 and its inter-token latency p99, which aiperf divides by that count, to 1,407 ms
    # against 604, where the verifier's first to last step took 119.7 s in both.
    return [str(VENVS["aiperf"] / "bin" / "aiperf"), "profile",
            "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--concurrency", str(concurrency), "--request-count", str(n),
            "--synthetic-input-tokens-mean", str(prompt_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true",
            *(a for key, value in (body or {}).items()
              for a in ("--extra-inputs", f"{key}:{value if isinstance(value, str) else json.dumps(value)}")),
            "--tokenizer", AIPERF_TOKENIZER, "--artifact-dir", str(out),
            "--ui-type", "none", "--random-seed", "0", "--no-server-metrics", "--use-server-token-count"]


# NOTE: aiperf 0.13 offline (HF_HUB_OFFLINE) looks every --tokenizer up in the Hugging Face cache by repository id,
# a local directory too (HFValidationError), and online it may ask the hub to resolve the name. So the target's
# tokenizer files are linked into a cache of our own under a made-up id, which it finds with no network at all.
AIPERF_TOKENIZER = "local/specwire-target"
_SNAPSHOT = "0" * 40
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                    "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt")


def aiperf_hub_cache(root: Path, tokenizer: Path) -> Path:
    """A Hugging Face hub cache holding only `tokenizer`'s files (links), as AIPERF_TOKENIZER."""
    repo = root / ("models--" + AIPERF_TOKENIZER.replace("/", "--"))
    snapshot = repo / "snapshots" / _SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT)
    for name in _TOKENIZER_FILES:
        link = snapshot / name
        if (tokenizer / name).exists() and not link.exists():
            link.symlink_to((tokenizer / name).resolve())
    return root


def aiperf_figures(out: Path) -> dict:
    """TTFT, ITL (ms) and output tokens/s from aiperf's JSON export."""
    path = next(out.rglob("profile_export_aiperf.json"))
    report = json.loads(path.read_text())
    records = report.get("records", report)

    def metric(name: str) -> dict:
        return records.get(name) or {}

    ttft, itl = metric("time_to_first_token"), metric("inter_token_latency")
    tps = metric("output_token_throughput")
    if "avg" not in tps:  # counting the server's usage, aiperf has none where the stream reports none
        raise ValueError("aiperf reported no output token throughput (did the stream carry usage?)")
    return {"ttft_p50_ms": float(ttft.get("p50", math.nan)), "ttft_p99_ms": float(ttft.get("p99", math.nan)),
            "itl_p50_ms": float(itl.get("p50", math.nan)), "itl_p99_ms": float(itl.get("p99", math.nan)),
            "output_tok_s": float(tps.get("avg", math.nan)),
            "requests_ok": int(metric("request_count").get("avg", 0)),
            "requests_errored": int(metric("error_request_count").get("avg", 0))}


CLIENTS = {"guidellm": (guidellm_command, guidellm_figures), "aiperf": (aiperf_command, aiperf_figures)}


# -- the stack and the runs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Served:
    """A mode's running stack: the gateway's base URL, the services' process ids, the draft's /metrics."""

    url: str
    pids: Mapping[str, int]  # verifier, draft, gateway
    draft_metrics_url: str


def start_stack(stack: Stack, mode: str, models: Path, log_dir: Path, verifier_args: list[str],
                draft_args: list[str]) -> Served:
    """verifier + draft (in `mode`) + gateway, the gateway warmed by one request."""
    target, draft = models / "target", models / "draft"
    verifier = stack.start(f"verifier-{mode}", ["verifier", "--model", str(target), *verifier_args],
                           log_dir=log_dir)
    dmetrics = free_port()
    d = stack.start(f"draft-{mode}", ["draft", "--model", str(draft), "--verifier", verifier.address,
                                      "--metrics-port", str(dmetrics), *mode_args(mode), *draft_args],
                    log_dir=log_dir)
    gateway = stack.start_gateway(d.address, tokenizer=target, log_dir=log_dir)
    url = gateway.address
    # k = 0: the warm-up's drafts would enter the auto verifier's acceptance counts as its first evidence
    body = json.dumps({"model": target.name, "prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True,
                       "num_speculative_tokens": 0})
    request = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        json.load(reply)
    pids = {"verifier": verifier.proc.pid, "draft": d.proc.pid, "gateway": gateway.proc.pid}
    return Served(url, pids, f"http://127.0.0.1:{dmetrics}/metrics")


def measured(served: Served, run: Callable[[], dict]) -> dict:
    """`run()`'s row, with what each service used meanwhile: CPU seconds (`cpu_s`: the verifier's, the draft's
    and the gateway's processes, and the client's, a lower bound: its processes that ended and were waited for,
    start-up included) and the draft model's rows by kind (`draft_rows`). The client runs on the services' cores,
    and whatever any of them spends the verifier's forward may not get."""
    rows_before = draft_rows(served.draft_metrics_url)
    cpu_before = {name: cpu_seconds(pid) for name, pid in served.pids.items()}
    client_before = children_cpu_seconds()
    row = run()
    cpu = {name: round(cpu_seconds(pid) - cpu_before[name], 1) for name, pid in served.pids.items()}
    cpu["client"] = round(children_cpu_seconds() - client_before, 1)
    return {**row, "cpu_s": cpu, "draft_rows": rows_between(rows_before, draft_rows(served.draft_metrics_url))}


def run_client(name: str, url: str, model: str, tokenizer: Path, concurrency: int, prompt_tokens: int,
               output_tokens: int, out: Path, timeout_s: float, body: dict | None = None,
               nice: int = CLIENT_NICE) -> dict:
    """One client run, at niceness `nice` (added to this process's; see CLIENT_NICE)."""
    command, figures = CLIENTS[name]
    out.mkdir(parents=True, exist_ok=True)
    argv = command(url, model, tokenizer, concurrency, prompt_tokens, output_tokens, out, body)
    if nice:
        argv = ["nice", "-n", str(nice), *argv]
    (out / "command.json").write_text(json.dumps(argv, indent=1))
    env = {**os.environ, **OFFLINE, "HOME": str(out / "home"), "MPLCONFIGDIR": str(out / "home" / "mpl"),
           "GUIDELLM__DEFAULT_RESULTS_DIR": str(out),
           "HF_HUB_CACHE": str(aiperf_hub_cache(out.parent / "hf-cache", tokenizer))}
    t0 = time.perf_counter()
    with open(out / "client.log", "wb") as log:
        # a session of its own: past the timeout the whole client goes (its workers too), and the level is a
        # failed row rather than the end of the run
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    row = {"client": name, "concurrency": concurrency, "requests": requests_for(concurrency), "nice": nice,
           "wall_s": round(time.perf_counter() - t0, 1), "exit_code": proc.returncode}
    try:
        if timed_out:
            raise TimeoutError(f"stopped after {timeout_s:g} s")
        row.update(figures(out))
    except (OSError, KeyError, StopIteration, ValueError, IndexError, TypeError, TimeoutError) as err:
        row["error"] = f"{type(err).__name__}: {err}"
        tail = (out / "client.log").read_text(errors="replace")[-2000:]
        print(f"{name} at concurrency {concurrency}: no figures ({row['error']})\n{tail}", file=sys.stderr)
    return row


FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def level_order(group: list[str], level_index: int, order: str) -> list[tuple[str, int]]:
    """(mode, half) in the order a level runs the modes of one stack for one client: under "alternate" each mode
    once, in the order given at even levels and reversed at odd ones; under "abba" twice, that order and then its
    reverse, so that a drift linear over the level falls on both modes alike (the inner mode's two runs are back to
    back, the outer's furthest apart)."""
    first = group if level_index % 2 == 0 else group[::-1]
    if order != "abba":
        return [(mode, 0) for mode in first]
    return [(mode, 0) for mode in first] + [(mode, 1) for mode in first[::-1]]


def merge_halves(first: dict, second: dict) -> dict:
    """One mode's level run twice by one client (--order abba) as one row, each run's own figures in `halves`.
    Output tokens/s over both runs: their requests' tokens (equal per request: a fixed output length, EOS
    ignored) over their summed times, weighted by the requests each completed; the latency percentiles are the
    mean of the two runs' (the clients report percentiles, not each request); requests, CPU seconds and draft rows
    summed. A run that failed, or measured no output, fails the row: only its error and the runs' own figures stay."""
    halves = [{key: run[key] for key in ("output_tok_s", *FIGURES, "requests_ok", "wall_s", "error") if key in run}
              for run in (first, second)]
    merged = {key: first[key] for key in ("mode", "client", "concurrency", "nice") if key in first}
    merged.update(halves=halves, wall_s=round(first.get("wall_s", 0.0) + second.get("wall_s", 0.0), 1),
                  exit_code=next((run["exit_code"] for run in (first, second) if run.get("exit_code")),
                                 first.get("exit_code")))
    failed = next((run["error"] for run in (first, second) if "error" in run), None)
    rates = [run.get("output_tok_s", 0.0) for run in (first, second)]
    counts = [run.get("requests_ok", 0) for run in (first, second)]
    if failed is None and not all(rate > 0 and count > 0 for rate, count in zip(rates, counts, strict=True)):
        failed = f"ValueError: a run measured no output (output tok/s {rates[0]} and {rates[1]})"
    if failed is not None:
        return {**merged, "error": failed}
    merged["output_tok_s"] = sum(counts) / sum(n / rate for n, rate in zip(counts, rates, strict=True))
    merged.update({key: (first[key] + second[key]) / 2 for key in FIGURES})
    merged.update({key: first[key] + second[key] for key in ("requests", "requests_ok", "requests_errored")})
    merged["cpu_s"] = {key: round(value, 1) for key, value in summed(first["cpu_s"], second["cpu_s"]).items()}
    merged["draft_rows"] = summed(first["draft_rows"], second["draft_rows"])
    return merged


def _tok_s_cell(row: dict) -> str:
    """Output tokens/s; for a merged row (--order abba) to two places, each run's after it in the order run."""
    halves = row.get("halves")
    if not halves:
        return f"{row['output_tok_s']:.1f}"
    return f"{row['output_tok_s']:.2f} (" + " / ".join(f"{h['output_tok_s']:.2f}" for h in halves) + ")"


def table(rows: list[dict]) -> str:
    head = ("| mode | client | streams | requests ok/err | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s | "
            "CPU s: verifier / draft / gateway / client | draft rows: prompt / catch-up / round / draft |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['client']} | {r['concurrency']} | failed: {r['error'][:60]} | | | | | |")
            continue
        cpu = r.get("cpu_s") or {}
        cpu_cell = " / ".join(f"{cpu[k]:.1f}" if k in cpu else "" for k in ("verifier", "draft", "gateway", "client"))
        lines.append(f"| {r['mode']} | {r['client']} | {r['concurrency']} | {r['requests_ok']}/"
                     f"{r['requests_errored']} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} | {_tok_s_cell(r)} | {cpu_cell} | "
                     f"{rows_cell(r.get('draft_rows')) if 'draft_rows' in r else ''} |")
    return "\n".join(lines)


def auto_over_k0(run: dict) -> dict[tuple[str, int], float]:
    """A run's summary.json as auto / k = 0 output tokens/s by (client, streams): k = 0 is SAME_STACK_K0 where the
    run has that mode (the ratio within one stack), else "k0". A cell counts only where both rows completed (no
    error, exit code 0, every request counted by the client and none errored) with output above 0: a failed
    SAME_STACK_K0 row leaves the cell out, it does not fall back to "k0". (guidellm has counted 3 of 4 requests at
    one stream, and its tokens/s over those is not the level's.)"""
    rows = {(r["mode"], r["client"], r["concurrency"]): r for r in run["rows"]}
    plain_mode = SAME_STACK_K0 if any(mode == SAME_STACK_K0 for mode, _, _ in rows) else "k0"
    out: dict[tuple[str, int], float] = {}
    for (mode, client, level), auto in rows.items():
        plain = rows.get((plain_mode, client, level))
        if mode == "auto" and plain is not None and all(_complete(r) for r in (auto, plain)):
            out[(client, level)] = auto["output_tok_s"] / plain["output_tok_s"]
    return out


def _complete(row: dict) -> bool:
    """A row every request of which the client counted, with none errored, and output measured."""
    return ("error" not in row and row.get("exit_code") == 0 and positive(row.get("output_tok_s"))
            and row.get("requests_ok") == row.get("requests") and not row.get("requests_errored"))


def pool_table(runs: list[tuple[str, dict]], goal: float = 0.95) -> str:
    """Several runs' summary.json ((label, run), in the order given) as one table (bench/pooling.py): by client
    and level, auto / k = 0 over the runs that measured it; then the runs that reached `goal` in every cell (of
    those that measured every cell any of them did)."""
    ratios = [(label, auto_over_k0(run)) for label, run in runs]
    clients = list(dict.fromkeys(client for _, r in ratios for client, _ in r))  # in the order the runs list them
    cells = sorted({cell for _, r in ratios for cell in r}, key=lambda cell: (clients.index(cell[0]), cell[1]))
    lines = [f"| client | streams | runs | auto / k = 0: mean | median | lowest | runs at {goal:g}x or more |",
             "|---|---|---|---|---|---|---|"]
    for client, level in cells:
        got = [(r[(client, level)], label) for label, r in ratios if (client, level) in r]
        lines.append(f"| {client} | {level} | {summary_cells(got, goal)} |")
    every = everywhere_line(ratios, goal, "every cell")
    return "\n".join(lines) + (f"\n\n{every}" if every else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="k0,auto", help=f"k0, auto, {SAME_STACK_K0}, fixed-K (comma-separated)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--clients", default="guidellm,aiperf")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per level: this many per stream")
    p.add_argument("--min-requests", type=int, default=8, help="and at least this many")
    p.add_argument("--models", type=Path, default=ROOT / ".models")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "external")
    p.add_argument("--timeout", type=float, default=3600.0, help="longest one client run may take (seconds)")
    p.add_argument("--client-nice", type=int, default=CLIENT_NICE, choices=range(20), metavar="0..19",
                   help=f"niceness the clients run at, added to this process's ({CLIENT_NICE}: they take only the "
                        "CPU the services leave; 0: as the services, as the runs before 2026-12-06 evening)")
    p.add_argument("--verifier-args", default="", help="extra flags for `specwire verifier` (one string)")
    p.add_argument("--draft-args", default="", help="extra flags for `specwire draft` (one string)")
    p.add_argument("--order", choices=["alternate", "abba"], default="alternate",
                   help="for the modes of one stack (k0@auto beside auto): alternate (default) runs each level's modes "
                        "once, in an order reversed at every second level; abba runs them twice a level, in that "
                        "order and then in reverse, each time with the level's requests, and merges each mode's two "
                        "runs (merge_halves); it needs a stack of two modes")
    p.add_argument("--serve", action="store_true", help="start the first mode's stack, print its URL, and wait")
    p.add_argument("--pool", type=Path, nargs="+", default=None, metavar="JSON",
                   help="print auto / k = 0 by client and level over several runs' summary JSON (pool_table) and run "
                        "nothing")
    args = p.parse_args()
    if args.pool:
        try:
            runs = load_runs(args.pool, ("mode", "client", "concurrency"))
        except ValueError as err:
            p.error(str(err))
        print(pool_table(runs))
        return 0
    REQUESTS.update(per_stream=args.requests_per_stream, min=args.min_requests)
    # SIGTERM (and SIGINT, which a background job inherits ignored) end the run through the stacks' cleanup, so no
    # verifier or draft outlives it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    modes, clients = args.modes.split(","), args.clients.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        groups = stack_groups(modes)
    except ValueError as err:
        p.error(str(err))
    if args.order == "abba" and all(len(group) < 2 for group in groups.values()):
        p.error("--order abba alternates the modes of one stack: give two (--modes k0@auto,auto)")
    for name in clients:
        if name not in CLIENTS:
            p.error(f"unknown client {name!r}")
        if not (VENVS[name] / "bin" / name).exists():
            p.error(f"{name} is not installed in {VENVS[name]}: run bench/external_clients.sh")
    tokenizer, model = args.models / "target", (args.models / "target").name
    log_dir = Path(tempfile.mkdtemp(prefix="specwire-external-"))
    try:
        rows = run_all(args, modes, clients, levels, tokenizer, model, log_dir)
    except KeyboardInterrupt:
        print("interrupted; services stopped", file=sys.stderr)
        return 130
    if args.serve:
        return 0
    title = (f"outside clients against `specwire gateway`, default pair, {args.prompt_tokens} prompt tokens "
             f"(synthetic), {args.output_tokens} output tokens, streamed /v1/completions"
             + (", each level's modes run twice (ABBA): output tok/s over both runs, then each run's; TTFT and ITL "
                "the mean of the two runs' percentiles" if args.order == "abba" else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    md = table(rows)
    (args.out / "summary.md").write_text(f"{title}\n\n{md}\n")
    print(f"\n{title}\n\n{md}\n\nlogs: {log_dir}\nsummary: {args.out / 'summary.json'}")
    return 0 if rows and all("error" not in r and r["exit_code"] == 0 for r in rows) else 1


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def run_all(args, modes: list[str], clients: list[str], levels: list[int], tokenizer: Path, model: str,
            log_dir: Path) -> list[dict]:
    rows: list[dict] = []
    order = args.order
    for stack_mode, group in stack_groups(modes).items():
        with Stack() as stack:
            served = start_stack(stack, stack_mode, args.models, log_dir, args.verifier_args.split(),
                                 args.draft_args.split())
            if args.serve:
                print(f"gateway for mode {stack_mode}: {served.url} (model {model}); logs in {log_dir}", flush=True)
                while True:
                    time.sleep(3600)
            for i, c in enumerate(levels):
                for name in clients:
                    runs: dict[str, list[dict]] = {mode: [] for mode in group}
                    for mode, half in level_order(group, i, order):
                        run = f"c{c}" + (f"-half{half}" if order == "abba" else "")
                        row = {"mode": mode, **measured(served, partial(
                            run_client, name, served.url, model, tokenizer, c, args.prompt_tokens, args.output_tokens,
                            args.out / mode / f"{name}-{run}", args.timeout, request_body(mode, run),
                            nice=args.client_nice))}
                        print(json.dumps({**row, **({"half": half} if order == "abba" else {})}), flush=True)
                        runs[mode].append(row)
                    # the level's rows in the order the modes were given, whichever ran first
                    rows.extend(merge_halves(*runs[mode]) if order == "abba" else runs[mode][0] for mode in group)
    return rows


if __name__ == "__main__":
    sys.exit(main())
