"""`specwire bench`: what speculation buys for a model pair on a prompt set, measured in one invocation.

Through the services (verifier and draft service started on loopback): target-only decoding (k = 0) and
speculative decoding for each k, greedy and sampled (the sweep); the wire modes side by side at the default k and
one temperature (sparse-q, one-hot, coupled: acceptance, tokens per round, speedup, proposal bytes, and whether the
coupled seeded outputs are the k = 0 ones); variants at the default k (adaptive k, n-gram drafts) and concurrency
(8 streams against 1). --sections picks which of these run. In-process, after the services stop: transformers' plain `generate` of the
target and its assisted generation with the draft (greedy), the peers a user would otherwise run.
Next to each measured speedup: the Leviathan bound (1 - a^(k+1)) / ((1 - a)(k c + 1)) from the measured
acceptance a and cost ratio c (seconds per draft token / seconds per target-only step).
Writes bench.json and bench.png into --out.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from specwire.client import AsyncClient, Client, Result
from specwire.demo import _default_model
from specwire.launch import Stack


def load_prompts(path: str | None, categories: list[str], per_category: int) -> dict[str, list[str]]:
    data = json.loads(Path(path).read_text() if path else
                      resources.files("specwire").joinpath("bench_prompts.json").read_text())
    return {c: data[c][:per_category] for c in categories}


@dataclass
class Cell:
    """Aggregate of one (mode, k, category) over its prompts."""

    mode: str
    k: int
    category: str
    tokens: int = 0
    wall_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected_rounds: int = 0
    proposal_bytes: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wait_s: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, r: Result) -> None:
        s = r.stats
        self.tokens += s.num_generated_tokens
        self.wall_s += s.wall_time_s
        self.rounds += s.num_rounds
        self.drafted += s.num_draft_tokens
        self.accepted += s.num_accepted_tokens
        self.rejected_rounds += s.num_rejected_rounds
        self.proposal_bytes += s.proposal_bytes
        self.draft_s += s.draft_time_s
        self.verify_s += s.verify_time_s
        self.wait_s += s.verify_wait_s
        for mine, theirs in ((self.accepted_per_position, s.accepted_per_position),
                             (self.drafted_per_position, s.drafted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.outputs.append(r.token_ids)

    def summary(self) -> dict:
        rounds = max(self.rounds, 1)
        return {
            "mode": self.mode, "k": self.k, "category": self.category, "tokens": self.tokens,
            "tokens_per_s": self.tokens / self.wall_s if self.wall_s else 0.0,
            "mean_acceptance_length": self.tokens / rounds,
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "rejected_rounds": self.rejected_rounds,
            # per-token acceptance: accepted drafts over accepted drafts plus rejections (the truncated-geometric
            # estimate; accepted / drafted would understate it, since drafts after a rejection are never tried)
            "acceptance_rate": (self.accepted / (self.accepted + self.rejected_rounds)
                                if self.accepted + self.rejected_rounds else None),
            "acceptance_per_position": [a / d if d else 0.0 for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position, strict=False)],
            "round_ms": {"draft": 1e3 * self.draft_s / rounds, "verify": 1e3 * self.verify_s / rounds,
                         "network": 1e3 * max(0.0, self.wait_s - self.verify_s) / rounds,
                         "total": 1e3 * self.wall_s / rounds},
            "draft_s_per_token": self.draft_s / self.drafted if self.drafted else None,
            "verify_s_per_round": self.verify_s / rounds,
        }


SECTIONS = ("sweep", "wire-modes", "concurrency", "variants", "hf")


def leviathan_bound(a: float, k: int, c: float) -> float:
    if a >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def _hf_baselines(target: Path, draft: Path, prompts: dict[str, list[str]], max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    tgt = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    dft = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    out: dict = {}
    for category, items in prompts.items():
        for name, kwargs in (("hf_generate", {}), ("hf_assisted", {"assistant_model": dft})):
            tokens, wall = 0, 0.0
            for prompt in items:
                ids = tok(prompt, return_tensors="pt")
                t0 = time.perf_counter()
                with torch.no_grad():
                    gen = tgt.generate(**ids, max_new_tokens=max_tokens, do_sample=False, **kwargs)
                wall += time.perf_counter() - t0
                tokens += gen.shape[1] - ids["input_ids"].shape[1]
            out.setdefault(category, {})[name] = tokens / wall
    return out


async def _concurrent(address: str, prompts: list[str], k: int, max_tokens: int) -> float:
    async with AsyncClient(address) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[client.generate(p, max_tokens=max_tokens, temperature=0.0,
                                                         num_speculative_tokens=k, ignore_eos=True) for p in prompts])
        wall = time.perf_counter() - t0
    return sum(r.stats.num_generated_tokens for r in results) / wall


def run_bench(args) -> int:
    target = Path(args.target) if args.target else _default_model("target")
    draft = Path(args.draft) if args.draft else _default_model("draft")
    categories = args.categories.split(",")
    prompts = load_prompts(args.prompts, categories, args.num_prompts)
    k_list = [int(k) for k in args.k_list.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    default_k = args.default_k
    cells: dict[tuple[str, int, str], Cell] = {}
    started = time.time()

    sections = set(args.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown --sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    wire_modes = args.wire_modes.split(",")

    def run(client: Client, mode: str, k: int, temperature: float, *, wire_mode: str | None = None) -> None:
        for category, items in prompts.items():
            cell = cells.setdefault((mode, k, category), Cell(mode, k, category))
            for i, prompt in enumerate(items):
                cell.add(client.generate(prompt, max_tokens=args.max_tokens, temperature=temperature, seed=1000 + i,
                                         num_speculative_tokens=None if k < 0 else k, wire_mode=wire_mode))

    print(f"specwire bench: target {target}, draft {draft}, k in {k_list}, temperatures {temperatures}, "
          f"{args.num_prompts} prompts x {categories}, {args.max_tokens} tokens each", flush=True)
    log_dir = out_dir / "logs"
    concurrency = {}
    with Stack() as stack:
        verifier = stack.start("verifier", ["verifier", "--model", str(target), "--max-draft-tokens",
                                            str(max(k_list + [16]))], log_dir=log_dir)
        base = ["draft", "--model", str(draft), "--verifier", verifier.address, "--dtype", args.draft_dtype]
        # the sweep measures each k as asked: a fixed k (the services' default, --speculation auto, would let the
        # verifier shorten it)
        drafter = stack.start("draft", [*base, "--speculation", "fixed", "--num-speculative-tokens", str(default_k)],
                              log_dir=log_dir)
        with Client(drafter.address) as client:
            client.generate("warm up", max_tokens=4, temperature=0.0)
            for temperature in temperatures if "sweep" in sections else ():
                mode = "greedy" if temperature == 0 else f"t{temperature}"
                for k in [0, *k_list]:
                    t0 = time.perf_counter()
                    run(client, mode, k, temperature)
                    print(f"  {mode} k={k}: {time.perf_counter() - t0:.0f}s", flush=True)
            if "wire-modes" in sections:  # one run of k = 0, then each mode at the default k, same seeds
                t = args.wire_mode_temperature
                for wire_mode, k in [("k0", 0), *((m, default_k) for m in wire_modes)]:
                    t0 = time.perf_counter()
                    run(client, f"wire:{wire_mode}", k, t, wire_mode=None if k == 0 else wire_mode)
                    print(f"  wire mode {wire_mode} k={k} t={t}: {time.perf_counter() - t0:.0f}s", flush=True)
            if "concurrency" in sections:
                print("  concurrency: 8 streams vs 1", flush=True)
                code = load_prompts(args.prompts, ["code"], 8)["code"]
                n = args.concurrency_tokens  # long enough that decoding, not the 8 prefills, dominates
                concurrency = {"one_stream_tok_s": asyncio.run(_concurrent(drafter.address, code[:1], default_k, n)),
                               "eight_streams_tok_s": asyncio.run(_concurrent(drafter.address, code, default_k, n)),
                               "tokens_per_stream": n, "k": default_k}
                concurrency["ratio"] = concurrency["eight_streams_tok_s"] / concurrency["one_stream_tok_s"]
        variants = (("adaptive", ["--adaptive-k", "--num-speculative-tokens", "8",
                                  "--draft-confidence-threshold", "0.4"]),
                    ("ngram", ["--proposer", "ngram", "--num-speculative-tokens", str(default_k)]))
        for variant, flags in variants if "variants" in sections else ():
            service = stack.start(variant, [*base, *flags], log_dir=log_dir)
            with Client(service.address) as client:
                client.generate("warm up", max_tokens=4, temperature=0.0)
                t0 = time.perf_counter()
                run(client, variant, -1, 0.0)
                print(f"  variant {variant}: {time.perf_counter() - t0:.0f}s", flush=True)
            service.stop()
    hf = {} if args.skip_hf or "hf" not in sections else _hf_baselines(target, draft, prompts, args.max_tokens)
    report = _report(cells, k_list, temperatures if "sweep" in sections else [], prompts, hf, concurrency)
    if "wire-modes" in sections:
        report.update(_wire_mode_report(cells, wire_modes, default_k, args.wire_mode_temperature, prompts))
        report["table"] += "\n\n" + report["wire_mode_table"]
    report["config"] = {"target": str(target), "draft": str(draft), "draft_dtype": args.draft_dtype,
                        "sections": sorted(sections), "wire_modes": wire_modes,
                        "wire_mode_temperature": args.wire_mode_temperature,
                        "k_list": k_list, "temperatures": temperatures,
                        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "categories": categories,
                        "default_k": default_k, "wall_s": time.time() - started}
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    if "sweep" in sections:
        _plot(report, out_dir / "bench.png")
    print(report["table"])
    print(f"\nwrote {out_dir / 'bench.json'}" + (f" and {out_dir / 'bench.png'}" if "sweep" in sections else ""))
    return 0 if report["greedy_outputs_identical"] and report.get("coupled_outputs_identical", True) else 1


def _report(cells, k_list, temperatures, prompts, hf, concurrency) -> dict:
    summaries = [c.summary() for c in cells.values()]
    by = {(s["mode"], s["k"], s["category"]): s for s in summaries}
    identical = all(cells[("greedy", k, cat)].outputs == cells[("greedy", 0, cat)].outputs
                    for k in k_list for cat in prompts if ("greedy", k, cat) in cells)
    identical &= all(cells[(v, -1, cat)].outputs == cells[("greedy", 0, cat)].outputs
                     for v in ("adaptive", "ngram") for cat in prompts if (v, -1, cat) in cells)
    rows = ["| mode | category | k | tok/s | speedup vs k=0 | bound | tokens/round | acceptance per position | "
            "round ms: draft / verify / network |", "|" + "---|" * 9]
    for temperature in temperatures:
        mode = "greedy" if temperature == 0 else f"t{temperature}"
        for cat in prompts:
            if (mode, 0, cat) not in by:
                continue
            base = by[(mode, 0, cat)]
            step_s = base["verify_s_per_round"]  # one target-only step
            for k in [0, *k_list]:
                s = by[(mode, k, cat)]
                s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"]
                if k and s["acceptance_rate"] is not None and s["draft_s_per_token"]:
                    s["cost_ratio_c"] = s["draft_s_per_token"] / step_s
                    s["leviathan_bound"] = leviathan_bound(s["acceptance_rate"], k, s["cost_ratio_c"])
                rows.append(_row(mode, cat, k, s))
    for v in ("adaptive", "ngram"):
        for cat in prompts:
            s = by.get((v, -1, cat))
            if s and ("greedy", 0, cat) in by:
                s["speedup"] = s["tokens_per_s"] / by[("greedy", 0, cat)]["tokens_per_s"]
                rows.append(_row(v, cat, "auto" if v == "adaptive" else "4", s))
    best = {}
    for cat in prompts if 0 in temperatures else ():
        ks = [by[("greedy", k, cat)] for k in k_list]
        top = max(ks, key=lambda s: s["tokens_per_s"])
        best[cat] = {"k": top["k"], "speedup": top["speedup"], "bound": top.get("leviathan_bound"),
                     "fraction_of_bound": top["speedup"] / top["leviathan_bound"] if top.get("leviathan_bound")
                     else None, "tokens_per_s": top["tokens_per_s"]}
        if cat in hf:
            best[cat]["vs_hf_generate"] = top["tokens_per_s"] / hf[cat]["hf_generate"]
            best[cat]["vs_hf_assisted"] = top["tokens_per_s"] / hf[cat]["hf_assisted"]
    table = "\n".join(rows)
    if hf:
        table += "\n\n| category | best k | specwire tok/s | HF generate tok/s | HF assisted tok/s | vs generate | vs assisted |"
        table += "\n|---|---|---|---|---|---|---|"
        for cat, b in best.items():
            table += (f"\n| {cat} | {b['k']} | {b['tokens_per_s']:.2f} | {hf[cat]['hf_generate']:.2f} | "
                      f"{hf[cat]['hf_assisted']:.2f} | {b['vs_hf_generate']:.2f}x | {b['vs_hf_assisted']:.2f}x |")
    if concurrency:
        table += (f"\n\nconcurrency (greedy, code, k={concurrency.get('k')}, {concurrency['tokens_per_stream']} tokens "
                  f"per stream): 1 stream {concurrency['one_stream_tok_s']:.2f} tok/s, 8 streams "
                  f"{concurrency['eight_streams_tok_s']:.2f} tok/s aggregate = {concurrency['ratio']:.2f}x")
    table += f"\ngreedy outputs identical to k=0 for every k and variant: {identical}"
    return {"cells": summaries, "best_greedy": best, "hf": hf, "concurrency": concurrency,
            "greedy_outputs_identical": identical, "table": table}


def _wire_mode_report(cells, wire_modes: list[str], k: int, temperature: float, prompts) -> dict:
    """The wire modes side by side: per category, k = 0 and each mode at k, same prompts and seeds."""
    rows = [f"wire modes at temperature {temperature}, k = {k} (same prompts and seeds; k = 0 is target alone)", "",
            "| wire mode | category | k | tok/s | speedup vs k=0 | tokens/round | per-token acceptance | "
            "acceptance per position | proposal bytes per draft token |", "|" + "---|" * 9]
    out: dict = {"wire_modes": {}}
    for cat in prompts:
        base = cells[("wire:k0", 0, cat)]
        base_s = base.summary()
        rows.append(f"| target alone | {cat} | 0 | {base_s['tokens_per_s']:.2f} | 1.00x | 1.00 | - | - | - |")
        for mode in wire_modes:
            cell = cells[(f"wire:{mode}", k, cat)]
            s = cell.summary()
            s["speedup"] = s["tokens_per_s"] / base_s["tokens_per_s"]
            s["proposal_bytes_per_draft_token"] = cell.proposal_bytes / cell.drafted if cell.drafted else None
            out["wire_modes"].setdefault(cat, {})[mode] = s
            acc = " ".join(f"{a:.2f}" for a in s["acceptance_per_position"]) or "-"
            rate = f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] is not None else "-"
            size = (f"{s['proposal_bytes_per_draft_token']:.0f}" if s["proposal_bytes_per_draft_token"] is not None
                    else "-")
            rows.append(f"| {mode} | {cat} | {k} | {s['tokens_per_s']:.2f} | {s['speedup']:.2f}x | "
                        f"{s['mean_acceptance_length']:.2f} | {rate} | {acc} | {size} |")
    if "coupled" in wire_modes:
        same = all(cells[("wire:coupled", k, cat)].outputs == cells[("wire:k0", 0, cat)].outputs for cat in prompts)
        out["coupled_outputs_identical"] = same
        rows.append(f"\ncoupled seeded outputs identical to k=0 (target alone) in every category: {same}")
    out["wire_mode_table"] = "\n".join(rows)
    return out


def _row(mode, cat, k, s) -> str:
    acc = " ".join(f"{a:.2f}" for a in s["acceptance_per_position"]) or "-"
    r = s["round_ms"]
    bound = f"{s['leviathan_bound']:.2f}" if s.get("leviathan_bound") else "-"
    return (f"| {mode} | {cat} | {k} | {s['tokens_per_s']:.2f} | {s.get('speedup', 0):.2f}x | {bound} | "
            f"{s['mean_acceptance_length']:.2f} | {acc} | {r['draft']:.0f} / {r['verify']:.0f} / {r['network']:.0f} |")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in report["cells"] if c["mode"] == "greedy" and c["k"] > 0]
    cats = sorted({c["category"] for c in cells})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for cat in cats:
        mine = sorted((c for c in cells if c["category"] == cat), key=lambda c: c["k"])
        ks = [c["k"] for c in mine]
        line, = ax1.plot(ks, [c["speedup"] for c in mine], marker="o", label=f"{cat} measured")
        ax1.plot(ks, [c.get("leviathan_bound") or 0 for c in mine], linestyle="--", color=line.get_color(),
                 label=f"{cat} bound")
        top = max(mine, key=lambda c: c["k"])
        ax2.plot(range(1, len(top["acceptance_per_position"]) + 1), top["acceptance_per_position"], marker="o",
                 label=f"{cat} (k={top['k']})")
    ax1.axhline(1.0, color="grey", linewidth=0.8)
    ax1.set_xlabel("draft tokens per round k")
    ax1.set_ylabel("speedup over target alone (greedy)")
    ax1.set_title("measured speedup and Leviathan bound")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("position in the draft block")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("acceptance per position")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)



