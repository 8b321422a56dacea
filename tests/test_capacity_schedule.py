"""bench/capacity.py's run order: with --order level every level runs all modes back to back, alternating their
order, so a drift of the host's speed over a 40-minute run does not fall on one mode; with --order abba each
level's modes run twice, half its requests each, the second time in reverse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow kernels/

from capacity import schedule  # noqa: E402

MODES = ["0", "4", "auto"]
LEVELS = [1, 2, 4, 8]


class FakeClient:
    """What run_level uses of AsyncClient, less `stream` (each test's own): a context manager whose warm-up
    request does nothing."""

    def __init__(self, address, timeout):
        pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def generate(self, **_):
        return None


def test_level_order_runs_each_levels_modes_together_in_alternating_order():
    runs = schedule(MODES, LEVELS, "level")
    assert sorted(runs) == sorted((m, c) for m in MODES for c in LEVELS)  # each pair once
    assert [c for _, c in runs] == [c for c in LEVELS for _ in MODES]  # a level's modes back to back
    assert [m for m, _ in runs[:3]] == MODES
    assert [m for m, _ in runs[3:6]] == MODES[::-1]
    assert [m for m, _ in runs[6:9]] == MODES
    # over two levels each mode's mean position in the level is the same: no mode is always measured last
    positions = {m: [i % 3 for i, (mm, c) in enumerate(runs) if mm == m and c in LEVELS[:2]] for m in MODES}
    assert len({sum(p) for p in positions.values()}) == 1


def test_abba_order_runs_each_levels_modes_then_again_in_reverse():
    """--order abba: a level's modes, then the same reversed (ABC CBA), each half the level's requests; levels
    alternate as in level order. Each mode's two halves then sit at the same mean time within the level."""
    runs = schedule(MODES, LEVELS, "abba")
    assert runs[:6] == [("0", 1), ("4", 1), ("auto", 1), ("auto", 1), ("4", 1), ("0", 1)]
    assert runs[6:12] == [("auto", 2), ("4", 2), ("0", 2), ("0", 2), ("4", 2), ("auto", 2)]
    assert sorted(runs) == sorted((m, c) for m in MODES for c in LEVELS for _ in range(2))
    for level in LEVELS:
        at = {m: [i for i, run in enumerate(runs) if run == (m, level)] for m in MODES}
        assert len({sum(i) for i in at.values()}) == 1


def test_a_levels_halves_take_its_requests_and_prompts_once_each():
    import capacity

    assert capacity.part_of(8, 0) == (0, 4) and capacity.part_of(8, 1) == (4, 4)
    assert capacity.part_of(9, 0) == (0, 4) and capacity.part_of(9, 1) == (4, 5)


def test_two_halves_merge_into_the_levels_figures_from_their_counts():
    """A level measured in two parts reads as one: tokens over the summed wall time (not the mean of two rates),
    percentiles over all requests, drafted tokens per verification from the summed counts."""
    import capacity

    def half(generated, wall, ttfts, drafts, draft_tokens, accepted, cpu):
        raw = {"requests": len(ttfts), "generated": generated, "wall_s": wall, "full_tokens": generated,
               "full_span_s": wall / 2, "ttfts_s": ttfts, "itls_s": [t / 10 for t in ttfts], "drafts": drafts,
               "draft_tokens": draft_tokens, "accepted": accepted}
        return {"mode": "auto", "concurrency": 2, **capacity.figures(raw), "raw": raw, "verifier_cpu_s": cpu,
                "draft_cpu_s": cpu / 2, "draft_rows": {"prompt/drafting": 10.0}}

    first = half(100, 10.0, [0.1, 0.2], 10, 40, 30, 4.0)
    second = half(100, 30.0, [0.3, 0.4, 0.5, 0.6], 30, 0, 0, 6.0)
    second["draft_rows"] = {"catch_up/drafting": 5.0}
    row = capacity.merge_parts(first, second)
    assert row["tok_s"] == 200 / 40.0 and row["full_load_tok_s"] == 200 / 20.0
    assert row["requests"] == 6 and row["wall_s"] == 40.0 and row["parts"] == 2
    assert row["ttft_p50_ms"] == 1e3 * capacity.percentile([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0.5)
    assert row["ttft_p99_ms"] == 600.0
    assert row["draft_tokens_per_verification"] == 40 / 40 and row["acceptance"] == 30 / 40
    assert row["verifier_cpu_s"] == 10.0 and row["draft_cpu_s"] == 5.0
    assert row["draft_rows"] == {"catch_up/drafting": 5.0, "prompt/drafting": 10.0}


def test_mode_order_runs_one_modes_levels_after_another():
    assert schedule(MODES, LEVELS, "mode") == [(m, c) for m in MODES for c in LEVELS]


def test_k0_on_the_auto_stack_runs_on_that_stack_with_k0_requests(monkeypatch):
    """SAME_STACK_K0: plain decoding measured through the auto stack's own verifier process (a ratio between two
    processes carries their spread), its requests asking for k = 0; auto's own requests leave k to the draft."""
    import os
    from types import SimpleNamespace

    import capacity

    asked = []

    async def run_level(address, concurrency, prompts, tokens, k, fixed=False, **_):
        asked.append((k, fixed))
        return {"tok_s": 1.0, "raw": {"requests": 1, "generated": 8, "wall_s": 8.0, "full_tokens": 8,
                                      "full_span_s": 8.0, "ttfts_s": [0.5], "itls_s": [1.0]}}

    monkeypatch.setattr(capacity, "run_level", run_level)
    monkeypatch.setattr(capacity, "_spec_counters", lambda url: dict.fromkeys(("drafts", "draft_tokens", "accepted"), 0.0))
    # the draft's model rows before and after each level: the level's are the difference, kinds that did not move
    # left out
    scrapes = iter([{"catch_up/drafting": 10.0, "draft/drafting": 3.0},
                    {"catch_up/drafting": 25.0, "draft/drafting": 3.0, "prompt/warming": 4.0}] + [{}] * 4)
    monkeypatch.setattr(capacity, "draft_rows", lambda url: next(scrapes))
    stack = object.__new__(capacity.ModeStack)
    process = SimpleNamespace(proc=SimpleNamespace(pid=os.getpid()), address="127.0.0.1:1")
    stack.mode, stack.k, stack.metrics_url, stack.verifier, stack.draft = "auto", None, "", process, process
    stack.draft_metrics_url = ""
    assert capacity.stack_of(capacity.SAME_STACK_K0) == "auto" and capacity.stack_of("4") == "4"
    row = stack.measure(2, [], 8, 1, 1, capacity.SAME_STACK_K0)
    assert row["mode"] == capacity.SAME_STACK_K0
    assert row["draft_rows"] == {"catch_up/drafting": 15.0, "prompt/warming": 4.0}
    assert capacity._rows_cell(dict(row, draft_cpu_s=1.5)) == "1.5 s; 0+4 / 15 / 0 / 0"
    assert stack.measure(2, [], 8, 1, 1)["mode"] == "auto"
    # `K@auto`: requests of a fixed k = K on the same stack (its draft started with --allow-request-fixed)
    assert capacity.stack_of("4@auto") == "auto" and capacity.label_of("4@auto") == "k = 4 on auto's stack"
    assert stack.measure(2, [], 8, 1, 1, "4@auto")["mode"] == "4@auto"
    assert asked == [(0, False), (None, False), (4, True)]
    assert capacity._request("p", 4, True) == {"prompt": "p", "num_speculative_tokens": 4, "speculation": "fixed"}


def test_full_load_rate_counts_only_the_span_before_the_first_stream_runs_out():
    import capacity

    # two streams: 10 tokens a second each until t = 10, when the first finds no request left; the second then
    # runs a tail of 4 s at 5 tokens a second (a request that drafted and finished out of step, say)
    arrivals = [(t + 0.5, 10) for t in range(10) for _ in range(2)] + [(10 + t + 0.5, 5) for t in range(4)]
    assert capacity.full_load_tok_s(arrivals, 0.0, 10.0) == 20.0
    assert capacity.full_load_tok_s(arrivals, 0.0, 0.0) == 0.0
    # a chunk at the very moment counts
    assert capacity.full_load_tok_s([(1.0, 3), (1.5, 3)], 0.0, 1.0) == 3.0


def test_the_table_gives_auto_against_the_best_mode_over_the_level_and_at_full_load():
    import capacity

    rows = [{"mode": m, "concurrency": 8, "tok_s": tok, "full_load_tok_s": full, "ttft_p50_ms": 1, "ttft_p99_ms": 2,
             "itl_p50_ms": 3, "itl_p99_ms": 4, "draft_tokens_per_verification": 0.5}
            for m, tok, full in (("0@auto", 16.0, 17.0), ("4@auto", 15.0, 16.0), ("auto", 14.4, 17.34))]
    text = capacity.table(rows, ["0@auto", "4@auto", "auto"], [8])
    head, _, row = text.splitlines()
    assert "the same at full load" in head
    cells = [c.strip() for c in row.split("|")]
    # auto / best fixed (own stacks: none here), auto / best on auto's stack, and that at full load
    assert cells[5:8] == ["0.90x", "0.90x", "1.02x"]
    assert head.count("|") == row.count("|")
    # modes on stacks of their own: the full-load ratio is against them; a row without the figure (an older run's
    # JSON) leaves the cell empty
    rows = [dict(r, mode={"0@auto": "0", "4@auto": "4"}.get(r["mode"], r["mode"])) for r in rows]
    cells = [c.strip() for c in capacity.table(rows, ["0", "4", "auto"], [8]).splitlines()[2].split("|")]
    assert cells[5:7] == ["0.90x", "1.02x"]
    # with modes on auto's stack among them, the full-load ratio is against those, as the ratio before it
    mixed = [dict(rows[0], mode="0@auto"), dict(rows[1], full_load_tok_s=20.0), rows[2]]
    cells = [c.strip() for c in capacity.table(mixed, ["0@auto", "4", "auto"], [8]).splitlines()[2].split("|")]
    assert cells[5:8] == ["0.90x", "0.90x", "1.02x"]
    rows[0].pop("full_load_tok_s")
    head, _, row = capacity.table(rows, ["0", "4", "auto"], [8]).splitlines()
    assert [c.strip() for c in row.split("|")][5:7] == ["0.90x", ""] and head.count("|") == row.count("|")


def test_the_table_gives_auto_against_the_best_in_each_half_beside_k0_s_own_halves_apart(tmp_path):
    """Under abba: auto over the best on its stack in each half, in time order, and how far apart k = 0's two
    halves came out (the run's resolution: a fixed k's halves differ by their acceptance too, and are not it); a
    run without halves has no such column. --table-from renders a run's JSON so, the modes in the order measured."""
    import capacity

    def row(mode, halves, **extra):
        tok = sum(halves) / 2
        return {"mode": mode, "concurrency": 32, "tok_s": tok, "full_load_tok_s": tok, "ttft_p50_ms": 1,
                "ttft_p99_ms": 2, "itl_p50_ms": 3, "itl_p99_ms": 4, "draft_tokens_per_verification": 0.0,
                "halves": [{"tok_s": h} for h in halves], **extra}

    # k = 0 20.0 then 21.6 (8.0 % apart), k = 4 19.0 then 22.0 (15.8 %: not the figure), auto 19.0 then 21.6
    rows = [row("0@auto", (20.0, 21.6)), row("4@auto", (19.0, 22.0)), row("auto", (19.0, 21.6))]
    head, _, line = capacity.table(rows, ["0@auto", "4@auto", "auto"], [32]).splitlines()
    cells = [c.strip() for c in line.split("|")]
    assert "auto / best in each half; k = 0's halves apart" in head and head.count("|") == line.count("|")
    assert cells[8] == "0.95x / 0.98x; 8.0 %"
    # without k = 0 among the modes, no spread; a mode without halves leaves the cell empty
    _, _, line = capacity.table(rows[1:], ["4@auto", "auto"], [32]).splitlines()
    assert [c.strip() for c in line.split("|")][7] == "1.00x / 0.98x"
    _, _, line = capacity.table([dict(rows[0], halves=None), *rows[1:]], ["0@auto", "4@auto", "auto"],
                                [32]).splitlines()
    assert [c.strip() for c in line.split("|")][8] == ""
    # rows measured whole (level order): no column
    whole = [{k: v for k, v in r.items() if k != "halves"} for r in rows]
    assert "each half" not in capacity.table(whole, ["0@auto", "4@auto", "auto"], [32])
    run = tmp_path / "run.json"
    run.write_text(capacity.json.dumps({"title": "a run", "rows": [rows[2], rows[0], rows[1]]}))
    text = capacity.table_of_run(capacity.json.loads(run.read_text()))
    assert text.startswith("a run\n\n| streams | auto tok/s | k = 0 on auto's stack tok/s")
    assert "0.95x / 0.98x; 8.0 %" in text


def test_a_level_s_full_load_span_ends_when_the_first_stream_finds_no_request_left(monkeypatch):
    """run_level with a client whose chunks move a clock: two streams, three requests; the second stream's
    request ends after the first's first request, and it then finds none left while the first runs a slow tail."""
    import asyncio
    from types import SimpleNamespace

    import capacity

    clock = [0.0]
    chunks = {"a": (2, 1.0), "b": (3, 1.0), "c": (6, 2.0)}  # per prompt: chunks of one token, clock step each

    class Client(FakeClient):
        async def _chunks(self, prompt):
            count, step = chunks[prompt]
            for _ in range(count):
                await asyncio.sleep(0)
                clock[0] += step
                yield SimpleNamespace(token_ids=[1])

        def stream(self, prompt, **_):
            return self._chunks(prompt)

    monkeypatch.setattr(capacity, "AsyncClient", Client)
    monkeypatch.setattr(capacity.time, "perf_counter", lambda: clock[0])
    row = asyncio.run(capacity.run_level("x", 2, ["a", "b", "c"], 48, None, per_stream=1, min_requests=3))
    # chunks at 1 (a), 2 (b), 3 (a, done: its stream takes c), 4 (b), 6 (c), 7 (b, done: none left), then c's
    # tail every 2 up to 17
    assert clock[0] == 17.0
    assert row["tok_s"] == 11 / 17
    assert row["full_load_tok_s"] == 6 / 7


def test_the_benches_read_every_kind_of_row_the_draft_counts():
    import dataclasses

    import service_usage

    from draft_service.draft_model import RowCounts

    assert service_usage.DRAFT_ROW_KINDS == tuple(f.name for f in dataclasses.fields(RowCounts))


def test_a_part_of_a_level_sends_its_own_requests_prompts(monkeypatch):
    """run_level's `part` (first, count): that many requests, whose prompts go on from the level's `first`, so a
    level's two halves send the prompts one whole level sends, each once."""
    import asyncio
    from types import SimpleNamespace

    import capacity

    sent = []

    class Client(FakeClient):
        async def stream(self, prompt, **kwargs):
            sent.append(prompt)
            for token in (1, 2, 3):
                yield SimpleNamespace(token_ids=[token])

    prompts = [f"p{i}" for i in range(10)]
    monkeypatch.setattr(capacity, "AsyncClient", Client)
    whole = asyncio.run(capacity.run_level("a", 2, prompts, 3, 0, per_stream=3, min_requests=1))
    assert sorted(sent) == prompts[:6] and whole["raw"]["requests"] == 6
    sent.clear()
    for half in (0, 1):
        row = asyncio.run(capacity.run_level("a", 2, prompts, 3, 0, per_stream=3, min_requests=1,
                                             part=capacity.part_of(6, half)))
        assert row["raw"]["requests"] == 3 and row["raw"]["generated"] == 9
    assert sorted(sent) == prompts[:6]


def test_a_levels_second_half_replaces_its_first_with_both_in_one_row():
    """Rows: under abba a level's first half is a row marked part 0 until its second comes, and then one row of
    both, where the first stood; without halves a repeated level is a row of its own; a third half is refused."""
    import capacity

    def row(mode, c, generated, warning=None):
        raw = {"requests": 1, "generated": generated, "wall_s": 1.0, "full_tokens": 0, "full_span_s": 0.0,
               "ttfts_s": [0.1], "itls_s": [0.01]}
        return {"mode": mode, "concurrency": c, **capacity.figures(raw), "raw": raw, "verifier_cpu_s": 1.0,
                "draft_cpu_s": 0.0, "draft_rows": {}, **({"warning": warning} if warning else {})}

    rows = capacity.Rows()
    assert rows.half_next("0", 1) == 0
    assert rows.add(row("0", 1, 10), 0)["part"] == 0
    rows.add(row("auto", 1, 20, "w1"), rows.half_next("auto", 1))
    assert rows.half_next("auto", 1) == 1
    merged = rows.add(row("auto", 1, 40, "w2"), 1)
    assert merged["tok_s"] == 30.0 and merged["parts"] == 2 and "part" not in merged
    assert merged["warning"] == "w1; w2"
    assert rows.add(row("0", 1, 30), rows.half_next("0", 1))["tok_s"] == 20.0
    assert [(r["mode"], r["tok_s"]) for r in rows.rows] == [("0", 20.0), ("auto", 30.0)]
    with pytest.raises(ValueError):
        rows.half_next("0", 1)
    whole = capacity.Rows()
    whole.add(row("0", 1, 10))
    whole.add(row("0", 1, 30))
    assert [r["tok_s"] for r in whole.rows] == [10.0, 30.0]


def test_the_auto_stack_lives_through_level_and_abba_order():
    import capacity

    for order in ("level", "abba"):
        assert capacity.stacks_to_close(["auto"], "4", ["0", "4", "auto"], order) == []
        assert capacity.stacks_to_close(["auto", "0"], "4", ["0", "4", "auto"], order) == ["0"]
    assert capacity.stacks_to_close(["auto"], "4", ["0", "4", "auto"], "mode") == ["auto"]
    assert capacity.stacks_to_close(["auto"], "4", ["0@auto", "4", "auto"], "mode") == []


def test_a_run_plan_is_refused_before_anything_starts_where_it_cannot_pair_its_rows():
    """plan_refusal: a mode or a level listed twice, and under abba a level whose half (the smaller, total // 2)
    leaves a stream with nothing to send at first; Rows.plan: under abba the halves in turn, with their requests."""
    import capacity

    modes = ["0@auto", "4@auto", "auto"]
    assert capacity.plan_refusal(modes, [1, 2, 4, 8, 16, 32, 64], "abba", 2, 8) is None
    assert "8" in capacity.plan_refusal(modes, [4, 8], "abba", 1, 8)  # 8 requests at 8 streams: halves of 4
    assert capacity.plan_refusal(modes, [4, 8], "level", 1, 8) is None
    assert capacity.plan_refusal(modes, [5], "abba", 1, 11) is None  # 11 // 2 = 5: every stream busy
    assert capacity.plan_refusal(modes, [6], "abba", 1, 11) is not None
    assert "twice" in capacity.plan_refusal(modes, [4, 4], "level", 2, 8)
    assert "twice" in capacity.plan_refusal(["0", "0", "auto"], [4], "abba", 2, 8)
    assert capacity.level_requests(16, 2, 8) == 32 and capacity.level_requests(2, 2, 8) == 8
    rows = capacity.Rows()
    assert rows.plan("auto", 4, "level", 8) == (None, None)
    assert rows.plan("auto", 4, "abba", 9) == (0, (0, 4))
    rows._halves[("auto", 4)] = 1  # (Rows.add's record of the first half)
    assert rows.plan("auto", 4, "abba", 9) == (1, (4, 5))


def test_several_runs_pool_into_auto_against_the_best_by_level(tmp_path, capsys, monkeypatch):
    """pool_table: by level, auto / the best other mode over the runs that measured it (mean, median, lowest and
    which run, runs at the goal), auto / k = 0 at one stream against its goal, and the runs that met the goal at
    every level (a run of fewer levels is named, not counted there). A level counts only where every mode of the
    run is whole: a first half alone (a run cut within the level) or a mode missing there is no measurement.
    --pool prints it for files, each labelled by what its name adds to the names' shared prefix."""
    import capacity
    import pooling

    def run(*levels):
        rows = []
        for c, k0, k4, auto in levels:
            rows += [{"mode": m, "concurrency": c, "tok_s": tok} for m, tok in
                     (("0@auto", k0), ("4@auto", k4), ("auto", auto))]
        return {"title": "t", "rows": rows}

    a = run((1, 1.0, 2.0, 1.9), (16, 10.0, 9.0, 9.7))  # 0.95 and 0.97: met at both; 1.9x k = 0 at one stream
    b = run((1, 1.0, 2.0, 1.7), (16, 10.0, 11.0, 10.89))  # 0.85 and 0.99: against k = 4 at 16, the better there
    c = run((1, 1.0, 1.0, 5.0), (16, 10.0, 9.0, 9.0))  # 0.90 at 16; at one stream auto's first half alone:
    c["rows"][2]["part"] = 0  # no measurement (else 5.0x, counted)
    assert capacity.auto_ratios(c) == {16: (0.9, 0.9)}
    assert capacity.auto_ratios(run((2, 0.0, 2.0, 1.0))) == {}  # a figure of 0: not a measurement
    assert capacity.auto_ratios(run((2, float("nan"), 2.0, 1.0))) == {}  # nor NaN
    cut = run((16, 10.0, 9.0, 9.0))
    cut["rows"][0]["part"] = 0  # k = 0's first half alone: auto against k = 4 only would be 1.00x
    assert capacity.auto_ratios(cut) == {}
    short = run((1, 1.0, 2.0, 1.9), (16, 10.0, 9.0, 9.0))
    del short["rows"][4]  # k = 4 missing at 16 streams: 0.90x against k = 0 alone would count
    assert capacity.auto_ratios(short) == {1: (0.95, 1.9)}
    both = {"rows": [*run((4, 4.0, 3.0, 5.0))["rows"], {"mode": "0", "concurrency": 4, "tok_s": 2.0}]}
    assert capacity.auto_ratios(both) == {4: (1.25, 1.25)}  # k = 0 on auto's stack, not the one of its own
    text = capacity.pool_table([("a", a), ("b", b), ("c", c)])
    lines = text.splitlines()
    assert lines[2] == "| 1 | 2 | 0.900x | 0.900x | 0.850x (b) | 1 of 2 |"
    assert lines[3] == "| 16 | 3 | 0.953x | 0.970x | 0.900x (c) | 2 of 3 |"
    assert "auto / k = 0 at one stream: mean 1.80x, lowest 1.70x (b), 1 of 2 runs at 1.8x or more" in text
    assert text.endswith("every level (1, 16 streams) at 0.95x or more: 1 of 2 runs that measured them all (a); "
                         "not counted there, measured in part: c")
    assert capacity.pool_table([("b", b), ("x", run())]).endswith(
        "0 of 1 runs that measured them all; nothing measured: x")
    paths = []
    for name, body in (("default-colocated-abba-7ac262e", a), ("default-colocated-abba-c16-744ae9a", c)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(capacity.json.dumps(body))
    assert pooling.run_labels(paths) == ["7ac262e", "c16-744ae9a"]
    assert pooling.run_labels(paths[:1]) == ["default-colocated-abba-7ac262e"]
    # the shared prefix is cut at a "-", not within a word; two files of one name keep their paths
    assert pooling.run_labels([Path("ab-c16-run1-cf5e93f.json"), Path("ab-c16-run2-f32e36a.json")]) == [
        "run1-cf5e93f", "run2-f32e36a"]
    assert pooling.run_labels([Path("x/summary.json"), Path("y/summary.json")]) == ["x/summary.json",
                                                                                      "y/summary.json"]
    monkeypatch.setattr(capacity.sys, "argv", ["capacity.py", "--pool", *map(str, paths)])
    assert capacity.main() == 0
    assert "| 16 | 2 | 0.935x | 0.935x | 0.900x (c16-744ae9a) | 1 of 2 |" in capsys.readouterr().out
    steps = tmp_path / "steps.json"
    steps.write_text(capacity.json.dumps({"levels": {}, "source": "a log"}))  # a bench's extracted steps, say
    monkeypatch.setattr(capacity.sys, "argv", ["capacity.py", "--pool", str(paths[0]), str(steps)])
    with pytest.raises(SystemExit):
        capacity.main()
    assert f"{steps}: not a run's JSON" in capsys.readouterr().err
