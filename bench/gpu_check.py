"""The one-shot GPU check (issue 9): one command, under 8 minutes on one GPU, fails loudly and never skips.

    bash bench/gpu_check.sh                      # on the GPU machine: installs .gpu-wheels, runs this, writes $OUT
    TRITON_INTERPRET=1 python bench/gpu_check.py --smoke     # CPU, tiny shapes: what CI runs

Steps, each recorded in $OUT/gpu_check.json (or --out), and a table on stdout:
1. the environment: torch, triton, device, platform;
2. every kernel against its reference on the device, and the Philox generator bit for bit (bench/kernels.py);
3. the end-to-end tests through both services on the device (tests/test_e2e_triton.py with SPECWIRE_TEST_DEVICE),
   eagerly, with --cuda-graphs and with the flag unset (the default: graphs, which the test checks), and a
   verifier that sizes its KV pool by --gpu-memory-utilization;
4. a captured graph's replay against the eager step (logits, argmax, the KV it writes);
5. kernel timings against the measured copy bandwidth (bench/kernels.py);
6. verify-step timings of random-weight bf16 models shaped like Qwen2.5-1.5B and a 7B (Qwen2.5-7B): batch 1, 8,
   32 and 64, k + 1 = 1 and 5: step time, tokens/s, the share of the weight-read floor (weight bytes / copy
   bandwidth), the host time per step (block copies and the batch built, before any device work) and the
   device's own time (CUDA events), eagerly through the static buffers and replayed as graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab (Qwen2.5 configs)
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064),
}
SMOKE_SHAPES = {"tiny": (64, 128, 2, 4, 2, 1000)}


class CheckFailed(RuntimeError):
    pass


def environment(device: str) -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": device,
           "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                   platform=f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}")
        try:  # the driver: nvidia-smi where there is one (ROCm has rocm-smi; not read)
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def kernels(smoke: bool, out_dir: Path) -> dict:
    """bench/kernels.py: exactness of every kernel on the device, then (on a GPU) timings vs copy bandwidth."""
    path = out_dir / "kernels.json"
    cmd = [sys.executable, str(ROOT / "bench" / "kernels.py"), "--json", str(path)] + (["--smoke"] if smoke else [])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(run.stdout)
    if run.returncode != 0:
        raise CheckFailed(f"bench/kernels.py failed:\n{run.stderr[-3000:]}")
    results = json.loads(path.read_text())
    for key in ("rejection_sample_exact", "write_kv_exact", "uniform64_exact"):
        if results.get(key) is not True:
            raise CheckFailed(f"{key} is {results.get(key)!r}")
    if results["paged_attention_max_abs_err"] > 2e-2 or results["sampling_probs_max_abs_err"] > 1e-5:
        raise CheckFailed(f"kernel error too large: {results}")
    return results


def end_to_end(out_dir: Path, *, graphs: bool | None = False) -> dict:
    """tests/test_e2e_triton.py on the GPU: both services with --device cuda (--cuda-graphs false, true, or unset:
    the default, which the test checks is graphs on CUDA), greedy identity, seeded reproducibility and the
    statistical test with its negative control; with the captures each service logged."""
    env = {**os.environ, "SPECWIRE_TEST_DEVICE": "cuda"}
    env.pop("TRITON_INTERPRET", None)
    env.pop("SPECWIRE_TEST_CUDA_GRAPHS", None)
    if graphs is not None:
        env["SPECWIRE_TEST_CUDA_GRAPHS"] = "1" if graphs else "0"
    name = {None: "e2e-default", True: "e2e-graphs", False: "e2e"}[graphs]
    basetemp = out_dir / f"{name}-tmp"
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           str(ROOT / "tests" / "test_e2e_triton.py"), f"--junitxml={out_dir / (name + '.xml')}",
           f"--basetemp={basetemp}"]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    print(run.stdout[-3000:])
    if run.returncode != 0:
        raise CheckFailed(f"end-to-end tests ({name}) failed on the device:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}")
    if " skipped" in run.stdout:
        raise CheckFailed(f"an end-to-end test ({name}) skipped on the GPU")
    captures = []
    for log in sorted(basetemp.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if '"graphs_captured"' in line:
                event = json.loads(line[line.index("{"):])
                captures.append({k: event.get(k) for k in ("service", "sizes", "seconds", "memory_bytes")})
    return {"passed": True, "seconds": round(time.perf_counter() - t0, 1), "graphs_captured": captures}


def gpu_pool_sizing(out_dir: Path) -> dict:
    """A verifier started without --kv-cache-memory or --num-blocks sizes its pool by --gpu-memory-utilization
    after a profiling forward: its log must say so, with a positive number of blocks."""
    import re

    from specwire.launch import Stack

    from tiny_models import make_text_pair

    target, _ = make_text_pair(out_dir / "models", "qwen2", dtype=torch.float32)
    with Stack() as stack:
        service = stack.start("sizing-verifier", ["verifier", "--model", str(target), "--device", "cuda",
                                                  "--gpu-memory-utilization", "0.5"], log_dir=out_dir, timeout_s=180)
        log = service.log_text()
    sizing = re.search(r"\{[^\n]*\"kv_cache_sizing\"[^\n]*\}", log)
    blocks = re.search(r"num_blocks[\"=: ]+(\d+)", log)
    if not sizing or not blocks or int(blocks.group(1)) < 1:
        raise CheckFailed(f"the verifier did not size its pool from the GPU's memory:\n{log[-3000:]}")
    event = json.loads(sizing.group(0))
    return {"num_blocks": int(blocks.group(1)), "budget_bytes": event.get("budget_bytes"),
            "peak_bytes": event.get("peak_bytes"), "gpu_memory_utilization": event.get("gpu_memory_utilization")}


def build_random_model(shape: tuple, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, inter, layers, heads, kv_heads, vocab = shape
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32768,
                         tie_word_embeddings=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def verify_step_timings(shape_name: str, shape: tuple, device: str, bandwidth: float, *, smoke: bool) -> list[dict]:
    """Step time of one verification step: B sequences with a 512-token context each feed k + 1 tokens, through
    the service's path (static buffers, eager) and, on a GPU, replayed as CUDA graphs (--cuda-graphs)."""
    from common.block_manager import BlockManager
    from common.kv_cache import KVCache
    from common.paged_model import PagedCausalLM, kv_cache_spec
    from common.sampling import SamplingParams
    from common.static_forward import StaticForward
    from verifier_service.model_runner import VerifierRunner
    from verifier_service.sequence import Sequence, SequenceStatus
    from verifier_service.types import ProposeCmd, ScheduledSeq, SchedulerOutput, SeqKey

    dtype = torch.float32 if smoke else torch.bfloat16
    model = build_random_model(shape, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    floor_s = weight_bytes / bandwidth if bandwidth else 0.0
    context, block = (32, 16) if smoke else (512, 16)
    batches = (1, 2) if smoke else (1, 8, 32, 64)
    spec = kv_cache_spec(model)
    max_batch = max(batches)
    blocks_per_seq = -(-(context + 8) // block)
    num_blocks = max_batch * blocks_per_seq
    paged = PagedCausalLM(model, KVCache(spec, num_blocks, block, device))
    eager = StaticForward(paged, max_tokens=max_batch * 5, max_blocks_per_seq=blocks_per_seq)
    graphs = (StaticForward(paged, max_tokens=max_batch * 5, max_blocks_per_seq=blocks_per_seq, graphs=True)
              if device == "cuda" else None)
    runner = VerifierRunner(paged, BlockManager(num_blocks, block), eager)
    vocab = shape[-1]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        for width in (1, 5):  # k + 1
            k = width - 1
            blocks = BlockManager(num_blocks, block)
            runner.blocks = blocks
            out = SchedulerOutput()
            for i in range(batch):
                prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
                seq = Sequence(SeqKey(1, i), prompt, context, SamplingParams(temperature=0.8, seed=i),
                               num_cached=context - 1, status=SequenceStatus.RUNNING)
                blocks.allocate(seq.key, context + k)
                drafts = tuple(torch.randint(0, vocab, (k,), generator=gen).tolist())
                out.scheduled.append(ScheduledSeq(seq, context - 1, context + k, ProposeCmd(seq.key, context, drafts,
                                                                                            None), 0))
            row = {"model": shape_name, "batch": batch, "k_plus_1": width}
            for mode, static in (("eager", eager), ("graphs", graphs)):
                if static is None:
                    continue
                runner.static = static
                times, hosts, devices = [], [], []
                for rep in range(2 if smoke else 8):
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ran = runner.run(out)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if rep:  # the first is warm-up (Triton compiles)
                        times.append(time.perf_counter() - t0)
                        hosts.append(ran.host_s)
                        devices.append(ran.device_s or 0.0)
                    if len(ran.sampled) != batch or not ran.static:
                        raise CheckFailed(f"{shape_name} {batch}x{width} {mode}: the step did not run static")
                step, host, dev = (sorted(v)[len(v) // 2] for v in (times, hosts, devices))
                prefix = "" if mode == "eager" else "graph_"
                row.update({f"{prefix}step_ms": round(step * 1e3, 3), f"{prefix}tokens_per_s": round(batch * width / step, 1),
                            f"{prefix}host_ms": round(host * 1e3, 3), f"{prefix}host_share": round(host / step, 3),
                            f"{prefix}device_ms": round(dev * 1e3, 3),
                            f"{prefix}floor_share": round(floor_s / step, 3) if floor_s else None})
            rows.append(row)
            print(f"| {shape_name} | {batch} | {width} | {row['step_ms']} | {row['tokens_per_s']} | "
                  f"{row['host_ms']} ({100 * row['host_share']:.0f} %) | {row['device_ms']} | {row['floor_share']} | "
                  f"{row.get('graph_step_ms', '-')} | {row.get('graph_floor_share', '-')} |", flush=True)
    del runner, model, eager, graphs, paged
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def graph_replay(device: str) -> dict:
    """A captured step computes what the eager step computes: Qwen2.5-1.5B-shaped random bf16 weights (4 layers),
    a verification step of 3 sequences (9 tokens, padded to the 16-token graph), logits and the KV it writes."""
    from common.block_manager import BlockManager
    from common.kv_cache import KVCache
    from common.paged_model import ForwardBatch, PagedCausalLM, kv_cache_spec
    from common.static_forward import StaticForward

    hidden, inter, _, heads, kv_heads, vocab = SHAPES["qwen2.5-1.5b"]
    model = build_random_model((hidden, inter, 4, heads, kv_heads, vocab), device, torch.bfloat16)
    block = 16
    runners = [PagedCausalLM(model, KVCache(kv_cache_spec(model), 32, block, device)) for _ in range(2)]
    contexts = [100, 7, 33]
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, vocab, (n + 8,), generator=gen).tolist() for n in contexts]
    blocks = BlockManager(32, block)

    def batch(feeds, every_row=True):
        ids, pos, slots, qs = [], [], [], [0]
        for seq, start, end in feeds:
            blocks.allocate(seq, end)
            ids += tokens[seq][start:end]
            pos += range(start, end)
            slots += blocks.slots(seq, start, end)
            qs.append(qs[-1] + end - start)
        return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), qs, [e for _, _, e in feeds],
                            [blocks.table(s) for s, _, _ in feeds],
                            None if every_row else torch.tensor([q - 1 for q in qs[1:]]))

    prefill = batch([(i, 0, n) for i, n in enumerate(contexts)], every_row=False)
    for runner in runners:
        runner.forward(prefill)
    step = batch([(i, n, n + w) for i, (n, w) in enumerate(zip(contexts, (5, 3, 1), strict=True))])
    expected = runners[0].forward(step).float()
    static = StaticForward(runners[1], max_tokens=64, max_blocks_per_seq=8, graphs=True)
    got = static.forward(step).float()
    if static.num_replays != 1:
        raise CheckFailed("the graph step did not replay")
    err = (got - expected).abs().max().item()
    same_argmax = bool((got.argmax(1) == expected.argmax(1)).all())
    kv_err = max((a.float() - b.float()).abs().max().item() for a, b in zip(
        runners[0].kv_cache.key_caches + runners[0].kv_cache.value_caches,
        runners[1].kv_cache.key_caches + runners[1].kv_cache.value_caches, strict=True))
    scale = expected.abs().max().item()
    if err > 0.05 * scale or kv_err > 0.05 or not same_argmax:
        raise CheckFailed(f"graph replay differs from the eager step: logits max err {err} (scale {scale}), KV max "
                          f"err {kv_err}, same argmax {same_argmax}")
    captured = sorted(static.graphs)
    del static, runners, model
    torch.cuda.empty_cache()
    return {"logits_max_abs_err": err, "logits_scale": scale, "kv_max_abs_err": kv_err, "same_argmax": same_argmax,
            "captured_sizes": captured}


def goals(rows: list[dict]) -> dict:
    """The issue's goals, computed (figures for the note, not pass/fail), eager and with graphs."""
    by = {(r["model"], r["batch"], r["k_plus_1"]): r for r in rows}
    out = {}
    if ("qwen2.5-7b", 64, 5) in by:
        big, one, single = by[("qwen2.5-7b", 64, 5)], by[("qwen2.5-7b", 64, 1)], by[("qwen2.5-7b", 1, 1)]
        for prefix in ("", "graph_"):
            if f"{prefix}step_ms" not in big:
                continue
            out[f"{prefix}7b_64x5_over_64x1"] = round(big[f"{prefix}step_ms"] / one[f"{prefix}step_ms"], 3)
            out[f"{prefix}7b_batch1_step_over_floor"] = round(1 / single[f"{prefix}floor_share"], 3)
            out[f"{prefix}7b_batch64_host_share"] = big[f"{prefix}host_share"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, interpreter (CI)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--skip-e2e", action="store_true", help="(smoke only) leave the end-to-end tests to pytest")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("FAIL: no GPU visible to torch (this check never skips; use --smoke on CPU)", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"environment": environment(device)}
    print(json.dumps(report["environment"]))
    try:
        report["kernels"] = kernels(args.smoke, args.out)
        if not (args.smoke and args.skip_e2e):
            report["end_to_end"] = end_to_end(args.out)
            if not args.smoke:
                report["end_to_end_graphs"] = end_to_end(args.out, graphs=True)
                report["end_to_end_default"] = end_to_end(args.out, graphs=None)
        if not args.smoke:
            report["pool_sizing"] = gpu_pool_sizing(args.out)
            report["graph_replay"] = graph_replay("cuda")
            print(json.dumps(report["graph_replay"]))
        bandwidth = report["kernels"].get("copy_gbps", 0.0) * 1e9
        print("| model | batch | k+1 | step ms | tokens/s | host ms (share) | device ms | floor share | graph step ms | "
              "graph floor share |\n|---|---|---|---|---|---|---|---|---|---|")
        rows = []
        if args.smoke:  # the services' GPU path on CPU tensors: static buffers feed the (interpreted) kernels
            os.environ["SPECWIRE_KERNELS"] = "triton"
        for name, shape in (SMOKE_SHAPES if args.smoke else SHAPES).items():
            rows += verify_step_timings(name, shape, device, bandwidth, smoke=args.smoke)
        report["verify_step"] = rows
        report["goals"] = goals(rows)
        print(json.dumps(report["goals"]))
    except CheckFailed as err:
        report["failure"] = str(err)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"FAIL: {err}", file=sys.stderr)
        return 1
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"OK: {args.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
