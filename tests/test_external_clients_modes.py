"""bench/external_clients.py's modes: k0@auto measures plain decoding through the auto stack's own verifier process,
every request of both clients asking for num_speculative_tokens 0, and the modes of one stack share it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow kernels/

import external_clients as ec  # noqa: E402

ARGS = ("http://127.0.0.1:1", "target", Path("/models/target"), 4, 64, 48, Path("/tmp/out"))


def _guidellm_body(argv: list[str]) -> dict:
    backend = json.loads(argv[argv.index("--backend") + 1])
    assert backend["kind"] == "openai_http" and backend["target"] == ARGS[0] and backend["model"] == "target"
    return backend.get("extras", {}).get("body", {})


def _aiperf_extras(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--extra-inputs"]


def test_k0_on_the_auto_stack_asks_every_request_for_k0_through_both_clients():
    """And every mode's requests carry a prefix-cache salt of their own: on a shared stack a mode measured second
    must not find the first's prompts (the clients draw the same ones every run) in the cache."""
    body = ec.request_body(ec.SAME_STACK_K0)
    assert body == {"num_speculative_tokens": 0, "cache_salt": "k0@auto"}
    assert _guidellm_body(ec.guidellm_command(*ARGS, body)) == body
    assert _aiperf_extras(ec.aiperf_command(*ARGS, body)) == ["ignore_eos:true", "cache_salt:k0@auto",
                                                              "num_speculative_tokens:0"]
    # auto's own requests leave k to the draft
    assert ec.request_body("auto") == {"cache_salt": "auto"} and ec.request_body("k0") == {"cache_salt": "k0"}
    assert _guidellm_body(ec.guidellm_command(*ARGS, ec.request_body("auto"))) == {"cache_salt": "auto"}
    assert _aiperf_extras(ec.aiperf_command(*ARGS, ec.request_body("auto"))) == ["ignore_eos:true", "cache_salt:auto"]


def test_modes_of_one_stack_share_it_and_the_others_get_their_own():
    assert ec.stack_of(ec.SAME_STACK_K0) == "auto" and ec.stack_of("k0") == "k0"
    assert ec.mode_args(ec.stack_of(ec.SAME_STACK_K0)) == ["--speculation", "auto"]
    groups = ec.stack_groups(["k0@auto", "fixed-4", "auto", "k0"])
    assert list(groups.items()) == [("auto", ["k0@auto", "auto"]), ("fixed-4", ["fixed-4"]), ("k0", ["k0"])]
    with pytest.raises(ValueError, match="unknown mode"):
        ec.stack_groups(["auto", "k9"])


class FakeStack:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _run_all_without_services(monkeypatch, tmp_path, client, order: str, clients: list[str], calls: list) -> list:
    """run_all over modes k0@auto and auto at 1 and 4 streams, with no stack started (each start recorded in
    `calls`) and `client` standing in for run_client."""
    from types import SimpleNamespace

    monkeypatch.setattr(ec, "Stack", FakeStack)
    served = ec.Served("url", {}, "")
    monkeypatch.setattr(ec, "start_stack", lambda stack, mode, *a: calls.append(("start", mode)) or served)
    monkeypatch.setattr(ec, "draft_rows", lambda url: {})
    monkeypatch.setattr(ec, "run_client", client)
    args = SimpleNamespace(models=tmp_path, verifier_args="", draft_args="", serve=False, prompt_tokens=64,
                           output_tokens=48, out=tmp_path, timeout=1.0, client_nice=19, order=order)
    return ec.run_all(args, ["k0@auto", "auto"], clients, [1, 4], tmp_path, "m", tmp_path)


def test_modes_sharing_a_stack_alternate_their_order_by_level(monkeypatch, tmp_path):
    """Both modes of the auto stack run each level back to back, and neither always goes first."""
    calls = []
    rows = _run_all_without_services(
        monkeypatch, tmp_path, lambda name, url, model, tok, c, pt, ot, out, timeout, body, nice:
        calls.append((name, c, body, nice)) or {}, "alternate", ["guidellm"], calls)
    k0, auto = ec.request_body("k0@auto", "c1"), ec.request_body("auto", "c1")
    assert k0 != auto
    assert calls == [("start", "auto"), ("guidellm", 1, k0, 19), ("guidellm", 1, auto, 19),
                     ("guidellm", 4, ec.request_body("auto", "c4"), 19), ("guidellm", 4, ec.request_body("k0@auto", "c4"), 19)]
    # each level's requests are salted apart from the other level's (the same prompts when as many requests)
    assert ec.request_body("auto", "c4")["cache_salt"] != auto["cache_salt"]
    assert [r["mode"] for r in rows] == ["k0@auto", "auto", "k0@auto", "auto"]


def test_abba_runs_each_levels_modes_twice_in_mirrored_order_and_merges_each_modes_two_runs(monkeypatch, tmp_path):
    """--order abba: per level and client, the modes of a stack in the level's order and then in reverse, each run
    with the level's requests, a prefix-cache salt and an output directory of its own (a mode's second run must
    not find its first run's prompts cached); each mode's two runs become one row, in the order the modes were
    given."""
    calls = []
    rates = iter([2.0, 3.0, 6.0, 4.0, 1.0, 1.0, 1.0, 1.0])

    def client(name, url, model, tok, c, pt, ot, out, timeout, body, nice):
        calls.append((name, c, body["cache_salt"], out.name))
        n = len(calls)
        return {"client": name, "concurrency": c, "requests": 4, "requests_ok": 4, "requests_errored": 0,
                "exit_code": 0, "wall_s": 10.0, "output_tok_s": next(rates), "ttft_p50_ms": 100.0 * n,
                "ttft_p99_ms": 10.0 * n, "itl_p50_ms": 1.0 * n, "itl_p99_ms": 2.0 * n}

    rows = _run_all_without_services(monkeypatch, tmp_path, client, "abba", ["aiperf"], [])
    assert [(c, salt) for _, c, salt, _ in calls] == [
        (1, "k0@auto/c1-half0"), (1, "auto/c1-half0"), (1, "auto/c1-half1"), (1, "k0@auto/c1-half1"),
        (4, "auto/c4-half0"), (4, "k0@auto/c4-half0"), (4, "k0@auto/c4-half1"), (4, "auto/c4-half1")]
    assert [out for *_, out in calls][:2] == ["aiperf-c1-half0", "aiperf-c1-half0"] and calls[2][3] == "aiperf-c1-half1"
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("k0@auto", 1), ("auto", 1), ("k0@auto", 4), ("auto", 4)]
    auto = rows[1]
    # 3.0 then 6.0 tokens/s over equal tokens: 4.0 over both; every percentile the mean of the two runs'
    assert auto["output_tok_s"] == pytest.approx(4.0) and [h["output_tok_s"] for h in auto["halves"]] == [3.0, 6.0]
    assert (auto["ttft_p50_ms"], auto["ttft_p99_ms"], auto["itl_p50_ms"], auto["itl_p99_ms"]) == (250.0, 25.0, 2.5, 5.0)
    assert auto["requests_ok"] == 8 and auto["wall_s"] == 20.0
    assert rows[0]["output_tok_s"] == pytest.approx(2 / (1 / 2.0 + 1 / 4.0))
    assert "| 4.00 (3.00 / 6.00) |" in ec.table(rows)
    # without --order abba (alternate), one run a mode and level
    assert ec.level_order(["a", "b"], 1, "alternate") == [("b", 0), ("a", 0)]


def test_merging_two_runs_weighs_each_by_its_completed_requests_and_fails_with_either():
    """Output tok/s over both runs' tokens: a run that completed 3 of its 4 requests weighs 3 (each request's
    output is the same length). A failed run, or one that measured nothing, fails the merged row, which then
    carries no figures of the other run as its own."""
    def run(rate, ok=4, **extra):
        return {"mode": "auto", "client": "guidellm", "concurrency": 4, "requests": 4, "requests_ok": ok,
                "requests_errored": 4 - ok, "exit_code": 0, "wall_s": 5.0, "output_tok_s": rate, "ttft_p50_ms": 1.0,
                "ttft_p99_ms": 1.0, "itl_p50_ms": 1.0, "itl_p99_ms": 1.0, "cpu_s": {"verifier": 1.0},
                "draft_rows": {"a": 2.0}, **extra}

    both = ec.merge_halves(run(2.0, ok=3), run(4.0, cpu_s={"verifier": 2.5, "draft": 1.0}, draft_rows={"b": 1.0}))
    assert both["output_tok_s"] == pytest.approx(7 / (3 / 2.0 + 4 / 4.0)) and both["requests_errored"] == 1
    assert both["cpu_s"] == {"draft": 1.0, "verifier": 3.5} and both["draft_rows"] == {"a": 2.0, "b": 1.0}
    failed = {"mode": "auto", "client": "guidellm", "concurrency": 4, "error": "TimeoutError: stopped after 1 s",
              "exit_code": -9, "wall_s": 1.0}
    for first, second in ((run(2.0), failed), (failed, run(2.0))):
        row = ec.merge_halves(first, second)
        assert row["error"].startswith("TimeoutError") and row["exit_code"] == -9
        assert "output_tok_s" not in row and "cpu_s" not in row and "requests_ok" not in row
        assert "failed: TimeoutError" in ec.table([row])
    for nothing in (run(0.0), run(2.0, ok=0)):
        assert "no output" in ec.merge_halves(run(2.0), nothing)["error"]


def test_abba_needs_a_stack_of_two_modes_and_no_mode_twice(monkeypatch, capsys):
    monkeypatch.setattr(ec, "VENVS", {})
    with pytest.raises(ValueError, match="given twice"):
        ec.stack_groups(["auto", "k0@auto", "auto"])
    for argv in (["--modes", "k0,auto", "--order", "abba"], ["--modes", "auto,auto"]):
        monkeypatch.setattr(sys, "argv", ["external_clients.py", *argv])
        with pytest.raises(SystemExit):
            ec.main()
    assert "give two" in capsys.readouterr().err


def test_aiperf_counts_the_tokens_the_server_reports():
    """aiperf's own count tokenizes the streamed text again, which sampled text need not give back (48 generated
    tokens counted 21): the stream's usage is the count, as guidellm's."""
    assert "--use-server-token-count" in ec.aiperf_command(*ARGS)


def test_a_run_records_what_each_service_and_the_client_used(monkeypatch, tmp_path):
    """CPU seconds of the verifier, the draft and the gateway over the run (their process ids), the client's from
    the children that ended meanwhile, and the draft model's rows that moved."""
    import subprocess

    clock = {"verifier": [10.0, 12.5], "draft": [3.0, 3.0], "gateway": [1.0, 1.25]}
    pids = {"verifier": 11, "draft": 22, "gateway": 33}
    by_pid = {pid: iter(clock[name]) for name, pid in pids.items()}
    monkeypatch.setattr(ec, "cpu_seconds", lambda pid: next(by_pid[pid]))
    scrapes = iter([{"prompt/warming": 64.0, "draft/drafting": 5.0},
                    {"prompt/warming": 128.0, "draft/drafting": 5.0, "catch_up/drafting": 70.0}])
    monkeypatch.setattr(ec, "draft_rows", lambda url: next(scrapes))

    def run():  # a client that burns some CPU in a child process
        subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
        return {"client": "aiperf", "output_tok_s": 2.0}

    row = ec.measured(ec.Served("url", pids, "metrics"), run)
    assert row["client"] == "aiperf" and row["output_tok_s"] == 2.0
    assert {k: v for k, v in row["cpu_s"].items() if k != "client"} == {"verifier": 2.5, "draft": 0.0,
                                                                       "gateway": 0.2}
    assert row["cpu_s"]["client"] > 0
    assert row["draft_rows"] == {"catch_up/drafting": 70.0, "prompt/warming": 64.0}
    line = ec.table([{"mode": "auto", "concurrency": 4, "requests_ok": 8, "requests_errored": 0, "ttft_p50_ms": 1.0,
                      "ttft_p99_ms": 2.0, "itl_p50_ms": 3.0, "itl_p99_ms": 4.0, **row}]).splitlines()[-1]
    assert line.endswith(f"| 2.0 | 2.5 / 0.0 / 0.2 / {row['cpu_s']['client']:.1f} | 0+64 / 70 / 0 / 0 |")


def test_the_clients_run_at_the_niceness_asked(monkeypatch, tmp_path):
    """A client takes only the CPU the services leave (--client-nice): it runs niced, and its row says so."""
    import os

    def command(url, model, tokenizer, concurrency, prompt_tokens, output_tokens, out, body):
        return [sys.executable, "-c", f"import os; open({str(out / 'nice.txt')!r}, 'w').write(str(os.nice(0)))"]

    def figures(out):
        return {"client_niceness": int((out / "nice.txt").read_text())}

    monkeypatch.setitem(ec.CLIENTS, "fake", (command, figures))
    monkeypatch.setattr(ec, "aiperf_hub_cache", lambda root, tokenizer: root)
    base = os.nice(0)
    row = ec.run_client("fake", "url", "m", tmp_path, 1, 8, 8, tmp_path / "a", 60.0, nice=5)
    assert row["nice"] == 5 and row["client_niceness"] == min(19, base + 5)
    assert ec.run_client("fake", "url", "m", tmp_path, 1, 8, 8, tmp_path / "b", 60.0, nice=0)["client_niceness"] == base
    # by default the clients yield to the services
    row = ec.run_client("fake", "url", "m", tmp_path, 1, 8, 8, tmp_path / "c", 60.0)
    assert row["nice"] == ec.CLIENT_NICE and row["client_niceness"] == min(19, base + ec.CLIENT_NICE) > base


def test_a_client_past_its_timeout_is_stopped_whole_and_its_level_fails(monkeypatch, tmp_path):
    """The client and every process it started go (its session), and the run goes on with a failed row."""
    import time

    def command(url, model, tokenizer, concurrency, prompt_tokens, output_tokens, out, body):
        worker = f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); open({str(out / 'worker')!r}, 'w').write(str(p.pid)); time.sleep(60)"
        return [sys.executable, "-c", worker]

    monkeypatch.setitem(ec.CLIENTS, "fake", (command, lambda out: {"output_tok_s": 1.0}))
    monkeypatch.setattr(ec, "aiperf_hub_cache", lambda root, tokenizer: root)
    t0 = time.monotonic()
    row = ec.run_client("fake", "url", "m", tmp_path, 1, 8, 8, tmp_path / "a", 2.0, nice=0)
    assert time.monotonic() - t0 < 30
    assert "stopped after 2 s" in row["error"] and "output_tok_s" not in row
    worker = Path(f"/proc/{(tmp_path / 'a' / 'worker').read_text()}/stat")
    for _ in range(50):  # gone, or a zombie its new parent has not reaped yet
        try:
            if worker.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the client's worker outlived its timeout")
    assert "failed: TimeoutError" in ec.table([{"mode": "auto", "concurrency": 1, **row}])


def test_aiperf_without_usage_is_a_failed_level_not_nan(tmp_path):
    """Counting the server's usage, aiperf reports no throughput where the stream carried none."""
    (tmp_path / "profile_export_aiperf.json").write_text(json.dumps({"records": {
        "time_to_first_token": {"p50": 1.0, "p99": 2.0}, "inter_token_latency": {"p50": 1.0, "p99": 2.0},
        "request_count": {"avg": 4}}}))
    with pytest.raises(ValueError, match="usage"):
        ec.aiperf_figures(tmp_path)


def test_several_runs_pool_into_auto_against_k0_by_client_and_level(tmp_path, monkeypatch, capsys):
    """pool_table: by client and level, auto / k = 0 over the runs that measured both (k0@auto where a run has that
    mode, else k0; a failed row is no measurement, and a failed k0@auto does not fall back to k0), then the runs
    that met the goal in every cell; --pool prints it for files, each labelled by what its name adds to the names'
    shared prefix, before any client is looked for, and refuses a file that is not a run's."""
    def run(*cells, k0="k0@auto"):
        rows = []
        for client, level, plain, auto in cells:
            rows += [{"mode": m, "client": client, "concurrency": level, "exit_code": 0, "output_tok_s": tok}
                     for m, tok in ((k0, plain), ("auto", auto))]
        return {"title": "t", "rows": rows}

    a = run(("guidellm", 4, 10.0, 9.6), ("aiperf", 4, 10.0, 10.2))  # 0.96 and 1.02
    b = run(("guidellm", 4, 10.0, 9.0), ("aiperf", 4, 8.0, 8.0), k0="k0")  # 0.90 and 1.00, on stacks of their own
    c = run(("guidellm", 4, 10.0, 9.9))
    c["rows"] += [{"mode": "k0", "client": "guidellm", "concurrency": 4, "exit_code": 0, "output_tok_s": 5.0},
                  {"mode": "auto", "client": "aiperf", "concurrency": 4, "exit_code": 0, "output_tok_s": 9.0},
                  {"mode": "k0@auto", "client": "aiperf", "concurrency": 4, "exit_code": 1, "output_tok_s": 9.0},
                  {"mode": "k0", "client": "aiperf", "concurrency": 4, "exit_code": 0, "output_tok_s": 9.0}]
    short = run(("guidellm", 1, 10.0, 12.0))
    short["rows"][0].update(requests=4, requests_ok=3)  # k = 0's client counted 3 of its 4 requests
    assert ec.auto_over_k0(short) == {}
    assert ec.auto_over_k0(run(("guidellm", 1, float("nan"), 12.0))) == {}
    # within one stack (k0@auto, not k0); aiperf's k0@auto failed, and k0 does not stand in for it
    assert ec.auto_over_k0(c) == pytest.approx({("guidellm", 4): 0.99})
    text = ec.pool_table([("a", a), ("b", b), ("c", c)])
    lines = text.splitlines()
    # the clients in the order the runs list them
    assert lines[2] == "| guidellm | 4 | 3 | 0.950x | 0.960x | 0.900x (b) | 2 of 3 |"
    assert lines[3] == "| aiperf | 4 | 2 | 1.010x | 1.010x | 1.000x (b) | 2 of 2 |"
    assert text.endswith("every cell at 0.95x or more: 1 of 2 runs that measured them all (a); not counted there, "
                         "measured in part: c")
    paths = []
    for name, body in (("external-clients-abba-k0atauto-6d237cc", a), ("external-clients-abba-k0atauto-ffffff0", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(body))
    monkeypatch.setattr(sys, "argv", ["external_clients.py", "--pool", *map(str, paths)])
    monkeypatch.setattr(ec, "VENVS", {})  # no client is needed to pool
    assert ec.main() == 0
    assert "| guidellm | 4 | 2 | 0.930x | 0.930x | 0.900x (ffffff0) | 1 of 2 |" in capsys.readouterr().out
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"levels": {}, "source": "a log"}))
    monkeypatch.setattr(sys, "argv", ["external_clients.py", "--pool", str(steps)])
    with pytest.raises(SystemExit):
        ec.main()
    assert f"{steps}: not a run's JSON" in capsys.readouterr().err
    capacity_run = tmp_path / "capacity.json"  # bench/capacity.py's run: rows without a client
    capacity_run.write_text(json.dumps({"title": "t", "rows": [{"mode": "auto", "concurrency": 1, "tok_s": 2.0}]}))
    for path in (capacity_run, tmp_path / "missing.json"):
        monkeypatch.setattr(sys, "argv", ["external_clients.py", "--pool", str(path)])
        with pytest.raises(SystemExit):
            ec.main()
        assert str(path) in capsys.readouterr().err
