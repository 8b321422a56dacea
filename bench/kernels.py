"""GPU check of the Triton kernels (issue 4): correctness against the torch references on the device, then
timing with triton.testing.do_bench at serving shapes, as achieved bytes/s against the device's measured copy
bandwidth (goal: paged attention and rejection sampling >= 70 % of it).

Usage on a GPU machine:  python bench/kernels.py [--json OUT]
Smoke run on CPU:         TRITON_INTERPRET=1 python bench/kernels.py --smoke   (tiny shapes, correctness only)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kernels.kv_cache_write import write_kv_reference, write_kv_triton  # noqa: E402
from kernels.paged_attention import paged_attention_reference, paged_attention_tensors  # noqa: E402
from kernels.philox import uniform64_reference, uniform64_triton  # noqa: E402
from kernels.rejection_sampler import (  # noqa: E402
    SamplingMetadata,
    SpecDecodeMetadata,
    rejection_sample_reference,
    rejection_sample_triton,
)
from kernels.sampling_probs import compute_probs_reference, compute_probs_triton  # noqa: E402


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(seqs=3, q=5, ctx=40, heads=4, kv_heads=2, dim=32, page=16, vocab=1000, dtype=torch.float32)
    return dict(seqs=64, q=5, ctx=2048, heads=32, kv_heads=8, dim=128, page=16, vocab=151936, dtype=torch.bfloat16)


def copy_bandwidth(device) -> float:
    import triton.testing

    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x))
    return 2 * x.numel() / (ms * 1e-3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("no GPU: run with --smoke under TRITON_INTERPRET=1 for a CPU correctness check")
        return 2
    s = shapes(args.smoke)
    gen = torch.Generator(device=device).manual_seed(0)
    dt, seqs, q, ctx = s["dtype"], s["seqs"], s["q"], s["ctx"]
    pages_per_seq = -(-ctx // s["page"])
    num_blocks = seqs * pages_per_seq
    k_cache = torch.randn(num_blocks, s["page"], s["kv_heads"], s["dim"], generator=gen, device=device).to(dt)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(seqs, pages_per_seq).to(torch.int32)
    query = torch.randn(seqs * q, s["heads"], s["dim"], generator=gen, device=device).to(dt)
    qs = torch.arange(0, seqs * q + 1, q, dtype=torch.int32, device=device)
    ctx_t = torch.full((seqs,), ctx, dtype=torch.int32, device=device)
    scale = s["dim"] ** -0.5
    results = {}

    out = paged_attention_tensors(query, k_cache, v_cache, tables, qs, ctx_t, q, scale)
    ref = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(), tables.tolist(), qs.tolist(),
                                    ctx_t.tolist(), scale)
    results["paged_attention_max_abs_err"] = float((out.float() - ref).abs().max())

    vocab, rows = s["vocab"], seqs * (q - 1)
    target_probs = torch.rand(rows + seqs, vocab, generator=gen, device=device).softmax(1)
    draft_probs = torch.rand(rows, vocab, generator=gen, device=device).softmax(1)
    spec = SpecDecodeMetadata(torch.multinomial(draft_probs, 1, generator=gen).squeeze(1),
                              torch.arange(0, rows + 1, q - 1, device=device), draft_probs,
                              torch.zeros(seqs, dtype=torch.bool, device=device))
    sampling = SamplingMetadata(torch.zeros(seqs, dtype=torch.bool, device=device),
                                torch.arange(seqs, device=device) * 7919 + 2**40,
                                torch.full((seqs,), 1000, dtype=torch.int64, device=device))
    inputs = dict(target_probs=target_probs, target_argmax=target_probs.argmax(1), spec=spec, sampling=sampling)
    ref = rejection_sample_reference(target_probs.cpu(), target_probs.argmax(1).cpu(), spec.to("cpu"),
                                     sampling.to("cpu"))[0]
    results["rejection_sample_exact"] = bool(torch.equal(rejection_sample_triton(**inputs)[0], ref.to(device)))
    seeds = torch.tensor([0, 1, 2**32 + 5, 2**63 - 1], dtype=torch.int64, device=device)
    positions = torch.tensor([0, 7, 7, 2**31], dtype=torch.int64, device=device)
    results["uniform64_exact"] = bool(torch.equal(
        uniform64_triton(seeds, positions, 3, vocab).cpu(),
        uniform64_reference(seeds.cpu().unsqueeze(1), positions.cpu().unsqueeze(1), 3, torch.arange(vocab).unsqueeze(0))))
    logits = torch.randn(seqs, vocab, generator=gen, device=device) * 3
    t, k, p = (torch.full((seqs,), 0.8, device=device), torch.full((seqs,), 50, device=device, dtype=torch.int64),
               torch.full((seqs,), 0.9, device=device))
    results["sampling_probs_max_abs_err"] = float((compute_probs_triton(logits, t, k, p)
                                                   - compute_probs_reference(logits, t, k, p)).abs().max())
    key = torch.randn(seqs * q, s["kv_heads"], s["dim"], generator=gen, device=device).to(dt)
    slots = torch.randperm(num_blocks * s["page"], generator=gen, device=device)[: seqs * q]
    a, b = k_cache.clone(), v_cache.clone()
    write_kv_triton(key, key, a, b, slots)
    write_kv_reference(key, key, k_cache, v_cache, slots)
    results["write_kv_exact"] = bool(torch.equal(a, k_cache))
    print(json.dumps(results, indent=2))
    if args.smoke:
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return 0

    import triton.testing

    bw = copy_bandwidth(device)
    elem = torch.empty((), dtype=dt).element_size()
    timings = {
        "paged_attention": (lambda: paged_attention_tensors(query, k_cache, v_cache, tables, qs, ctx_t, q, scale),
                            2 * seqs * ctx * s["kv_heads"] * s["dim"] * elem + 2 * query.numel() * elem),
        "rejection_sample": (lambda: rejection_sample_triton(**inputs),
                             (rows + seqs) * vocab * 4 + rows * vocab * 4),  # noise is drawn in-kernel
        "sampling_probs": (lambda: compute_probs_triton(logits, t, k, p), 2 * seqs * vocab * 4),
        "write_kv": (lambda: write_kv_triton(key, key, a, b, slots), 4 * key.numel() * elem),
    }
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s")
    print("| kernel | median ms | GB/s | % of copy |\n|---|---|---|---|")
    for name, (fn, nbytes) in timings.items():
        ms = triton.testing.do_bench(fn)
        results[name] = {"ms": ms, "gbps": nbytes / (ms * 1e-3) / 1e9, "fraction_of_copy": nbytes / (ms * 1e-3) / bw}
        print(f"| {name} | {ms:.4f} | {results[name]['gbps']:.0f} | {100 * results[name]['fraction_of_copy']:.0f} % |")
    results["copy_gbps"] = bw / 1e9
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
