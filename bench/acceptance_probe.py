"""Does the default draft know more about its misses than its own probabilities say? (issue 26, token trees)

A greedy tree of N nodes beats the chain of N tokens only where it places its few branches where the draft misses
(bench/tree_ceiling.py: at most 1.41x the chain's tokens a round at N = 16 on code, B = 2; the services measured
1.18x with calibrated probabilities). The calibration (draft_service.tree_calibration) reads the draft's
probability of a child alone. This asks whether anything else the draft computes tells its misses better: a learnt
acceptance head on the draft's last hidden state, as SpecDec++ (Huang et al. 2024) trains one to stop drafting.

1. Positions, teacher-forced (no services; transformers, target float32 and draft bfloat16 as bench/tree_ceiling.py
   runs them). Training: the first `--train-tokens` tokens of `--train-files` Python files of the standard library
   of the interpreter that runs this (shuffled with a fixed seed; files shorter than 256 tokens are skipped), the
   last `--held-out` of them kept apart. Evaluation: the target's greedy continuation (`--tokens`) of the first
   `--prompts` code prompts of specwire/bench_prompts.json, the text trees are measured on. At each position:
   the draft's last hidden state, its four likeliest tokens and their probabilities, and the target's argmax; the
   label is the rank of the target's token among the draft's (0, 1, or further).
2. Heads fitted on the training positions, each giving the chance of each label: a softmax regression on the
   draft's probabilities alone (log p1, log(1 - p1), log p2, log p3, p1, p2), the same with the hidden state
   besides (ridge `--ridge`), and a small MLP on both (early stopping on a tenth of the training positions).
3. How well each separates the draft's hits from its misses (AUC of its chance of label 0; the draft's p1 as the
   baseline), and the target's token at rank 1 from further ones where the draft missed, on the held-out files
   and on the evaluation positions; the mean negative log-likelihood of the labels.
4. A replay of greedy trees over the evaluation continuations (tree_rounds): best-first by path score, B = 2,
   the child of rank r scored by the head's chance of label r, against the chain and the oracle (the head that
   knows the labels). The replay knows the draft's rows along the target's path only: the nodes under a child
   that is not the target's token are scored `OFF_PATH` times their parent's score (rank 1) and `OFF_PATH_SECOND`
   times it (rank 2), alike for every head. The binned baseline calibrates p1 and p2 on the training positions by
   bands, as the service's calibration does online.

    python bench/acceptance_probe.py [--train-files 48] [--prompts 8] [--out DIR]

Prints markdown and writes acceptance_probe.json and acceptance_probe.md into --out.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "bench"))

from tree_ceiling import chain_rounds  # noqa: E402

TOP = 4
OFF_PATH, OFF_PATH_SECOND = 0.9, 0.05
P1_BANDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995)
P2_BANDS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5)


def tree_rounds(labels: Sequence[int], first: Sequence[float], second: Sequence[float], n: int, depth: int,
                off: tuple[float, float] = (OFF_PATH, OFF_PATH_SECOND)) -> int:
    """Rounds a greedy tree of at most n nodes, depth `depth`, two children a node, grown best-first by path score,
    takes over a continuation whose position t has label labels[t] (the rank of the target's token among the
    draft's: 0, 1, or 2 for further). first[t] and second[t] score the children of ranks 0 and 1 of the node at
    position t on the target's path; a node off it scores its children `off` times its own score. A round accepts
    the deepest node on the target's path in the tree, and emits one token more (the verifier's own)."""
    start = rounds = 0
    while start < len(labels):
        start += accepted_in_round(labels, first, second, start, n, depth, off) + 1
        rounds += 1
    return rounds


def accepted_in_round(labels: Sequence[int], first: Sequence[float], second: Sequence[float], start: int, n: int,
                      depth: int, off: tuple[float, float]) -> int:
    """tree_rounds' round from position `start`: the tokens its tree accepts."""
    frontier: list[tuple[float, int, int, bool]] = []  # (-score, order pushed, depth of the node, on the path)
    order = itertools.count()

    def push(score: float, at: int, on_path: bool) -> None:
        if at >= depth:
            return
        t = start + at
        if on_path and t < len(labels):
            kids = ((score * first[t], labels[t] == 0), (score * second[t], labels[t] == 1))
        else:
            kids = ((score * off[0], False), (score * off[1], False))
        for child_score, child_on_path in kids:
            heapq.heappush(frontier, (-child_score, next(order), at + 1, child_on_path))

    push(1.0, 0, True)
    nodes = accepted = 0
    while frontier and nodes < n:
        neg, _, at, on_path = heapq.heappop(frontier)
        nodes += 1
        if on_path:
            accepted = at  # the path's nodes come out parent first
        push(-neg, at, on_path)
    return accepted


def oracle_scores(labels: Sequence[int]) -> tuple[list[float], list[float]]:
    """Scores of a head that knows the labels (nearly 1 for the target's token, nearly 0 elsewhere)."""
    return ([1.0 - 1e-3 if v == 0 else 1e-3 for v in labels], [1.0 - 1e-3 if v == 1 else 1e-3 for v in labels])


def gather(target, draft, ids_list: list, starts: list[int], limits: list[int]) -> list[dict]:
    """Per sequence of token ids: from row starts[i] on (the row that predicts the next token), limits[i] rows of
    the draft's last hidden state (float16), its TOP likeliest tokens' probabilities, and the label."""
    import torch

    out = []
    for ids, start, limit in zip(ids_list, starts, limits, strict=True):
        with torch.no_grad():
            target_next = target(ids).logits[0].argmax(-1)
            run = draft(ids, output_hidden_states=True)
        rows = slice(start, start + limit)
        probs = torch.softmax(run.logits[0].float(), -1)[rows]
        top = torch.topk(probs, TOP, -1)
        truth = target_next[rows]
        label = torch.full_like(truth, 2)
        label[top.indices[:, 1] == truth] = 1
        label[top.indices[:, 0] == truth] = 0
        out.append({"hidden": run.hidden_states[-1][0, rows].half(), "top_p": top.values, "label": label})
    return out


def training_texts(tokenizer, files: int, tokens: int) -> list:
    import torch

    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    random.Random(0).shuffle(paths)
    out = []
    for path in paths:
        if len(out) >= files:
            break
        ids = tokenizer(path.read_text(errors="ignore"), return_tensors="pt", add_special_tokens=False).input_ids
        if ids.shape[1] >= 256:
            out.append(torch.as_tensor(ids[:, :tokens]))
    return out


def features(batch: list[dict]):
    """(hidden state and probability features, probability features alone, labels) of the positions of `batch`."""
    import torch

    hidden = torch.cat([b["hidden"] for b in batch]).float()
    top_p = torch.cat([b["top_p"] for b in batch])
    p1, p2 = top_p[:, 0].clamp(1e-6, 1 - 1e-6), top_p[:, 1].clamp(1e-6, 1.0)
    probs = torch.stack([p1.log(), (1 - p1).log(), p2.log(), top_p[:, 2].clamp(1e-6).log(), p1, p2], 1)
    return torch.cat([hidden, probs], 1), probs, top_p, torch.cat([b["label"] for b in batch])


def fit_linear(x, y, ridge: float) -> Callable:
    """A softmax regression over the 3 labels on standardized x; returns x -> label probabilities."""
    import torch

    mean, scale = x.mean(0), x.std(0) + 1e-6
    xs = (x - mean) / scale
    weight = torch.zeros(x.shape[1], 3, requires_grad=True)
    bias = torch.zeros(3, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xs @ weight + bias, y) + ridge * (weight ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lambda z: torch.softmax(((z - mean) / scale) @ weight + bias, 1).detach()


def fit_mlp(x, y, hidden: int = 64, epochs: int = 40) -> Callable:
    """One hidden layer, dropout on the input, AdamW; the epoch with the best loss on a held-out tenth is kept."""
    import torch

    torch.manual_seed(0)
    mean, scale = x.mean(0), x.std(0) + 1e-6
    xs = (x - mean) / scale
    order = torch.randperm(len(xs))
    check, train = order[:len(xs) // 10], order[len(xs) // 10:]
    net = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(),
                              torch.nn.Linear(hidden, 3))
    opt = torch.optim.AdamW(net.parameters(), 1e-3, weight_decay=1e-3)
    best = (float("inf"), None)
    for _ in range(epochs):
        net.train()
        for part in torch.randperm(len(train)).split(256):
            rows = train[part]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xs[rows]), y[rows]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(net(xs[check]), y[check]).item()
        if loss < best[0]:
            best = (loss, {k: v.clone() for k, v in net.state_dict().items()})
    net.load_state_dict(best[1])
    net.eval()

    def predict(z):
        with torch.no_grad():
            return torch.softmax(net((z - mean) / scale), 1)

    return predict


def fit_bands(top_p, y) -> Callable:
    """p1 and p2 calibrated by bands on the training positions (a band with at most 5 positions keeps the raw
    probability): the chance of labels 0 and 1."""
    import torch

    def table(values, hits, edges):
        bands = torch.bucketize(values.contiguous(), torch.tensor(edges))
        return [float(hits[bands == i].float().mean()) if int((bands == i).sum()) > 5 else None
                for i in range(len(edges) + 1)]

    t1, t2 = table(top_p[:, 0], y == 0, P1_BANDS), table(top_p[:, 1], y == 1, P2_BANDS)

    def look(values, rates, edges):
        bands = torch.bucketize(values.contiguous(), torch.tensor(edges)).tolist()
        return torch.tensor([rates[b] if rates[b] is not None else v for b, v in zip(bands, values.tolist(),
                                                                                     strict=True)])

    def predict(p):
        first, second = look(p[:, 0], t1, P1_BANDS), look(p[:, 1], t2, P2_BANDS)
        return torch.stack([first, second, (1 - first - second).clamp(min=0)], 1)

    return predict


def auc(score, positive) -> float:
    """The chance that a positive outranks a negative (ties half); nan without both."""
    pos = [float(s) for s, p in zip(score, positive, strict=True) if p]
    neg = [float(s) for s, p in zip(score, positive, strict=True) if not p]
    if not pos or not neg:
        return float("nan")
    ranked = sorted([(s, 1) for s in pos] + [(s, 0) for s in neg])
    wins = 0.0
    seen_neg = 0
    i = 0
    while i < len(ranked):  # runs of equal scores count half
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        run_pos = sum(flag for _, flag in ranked[i:j])
        run_neg = (j - i) - run_pos
        wins += run_pos * (seen_neg + run_neg / 2)
        seen_neg += run_neg
        i = j
    return wins / (len(pos) * len(neg))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=".models", help="directory with target/ and draft/")
    parser.add_argument("--train-files", type=int, default=48)
    parser.add_argument("--train-tokens", type=int, default=512)
    parser.add_argument("--held-out", type=int, default=10, help="of the training files, kept apart for scoring")
    parser.add_argument("--prompts", type=int, default=8, help="the first N code prompts")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--nodes", default="8,16")
    parser.add_argument("--ridge", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.held_out >= args.train_files:
        parser.error("--held-out must be below --train-files")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    models = Path(args.models)
    tokenizer = AutoTokenizer.from_pretrained(models / "target")
    target = AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(models / "draft", dtype=torch.bfloat16).eval()
    began = time.monotonic()

    prompts = json.loads(resources.files("specwire").joinpath("bench_prompts.json").read_text())["code"][:args.prompts]
    full, starts = [], []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            full.append(target.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                        top_k=None, top_p=None, temperature=None))
        starts.append(ids.shape[1] - 1)
    evaluation = gather(target, draft, full, starts, [args.tokens] * len(full))
    texts = training_texts(tokenizer, args.train_files, args.train_tokens)
    train = gather(target, draft, texts, [16] * len(texts), [t.shape[1] - 16 for t in texts])
    kept, held = train[:-args.held_out], train[-args.held_out:]
    x, probs, top_p, y = features(kept)

    heads = {
        "draft p1 (raw)": lambda xb, pb, tb: torch.stack([tb[:, 0], tb[:, 1], 1 - tb[:, 0] - tb[:, 1]], 1),
        "p1, p2 by bands": (lambda f: lambda xb, pb, tb: f(tb))(fit_bands(top_p, y)),
        "softmax regression, probabilities": (lambda f: lambda xb, pb, tb: f(pb))(fit_linear(probs, y, 1e-3)),
        "softmax regression, hidden state + probabilities":
            (lambda f: lambda xb, pb, tb: f(xb))(fit_linear(x, y, args.ridge)),
        "MLP, hidden state + probabilities": (lambda f: lambda xb, pb, tb: f(xb))(fit_mlp(x, y)),
    }
    sets = {"held-out library files": held, "code continuations": evaluation}
    result: dict = {"args": vars(args), "positions": {}, "heads": {}, "replay": []}
    for name, batch in sets.items():
        _, _, _, labels = features(batch)
        result["positions"][name] = [int((labels == r).sum()) for r in range(3)]
    result["positions"]["training"] = [int((y == r).sum()) for r in range(3)]
    scored = {}
    for head, predict in heads.items():
        row = {}
        for name, batch in sets.items():
            xb, pb, tb, labels = features(batch)
            chance = predict(xb, pb, tb).clamp(1e-9, 1.0)
            missed = labels != 0
            row[name] = {
                "auc_hit": auc(chance[:, 0].tolist(), (labels == 0).tolist()),
                "auc_second_given_miss": auc((chance[missed, 1] / (1 - chance[missed, 0]).clamp(1e-9)).tolist(),
                                             (labels[missed] == 1).tolist()),
                "nll": float(-chance[torch.arange(len(labels)), labels].log().mean()),
            }
            if name == "code continuations":
                scored[head] = chance
        result["heads"][head] = row
    labels_per = [b["label"].tolist() for b in evaluation]
    for n in [int(v) for v in args.nodes.split(",")]:
        chain = [len(lab) / chain_rounds([0 if v == 0 else 1 for v in lab], n) for lab in labels_per]
        line = {"N": n, "chain": statistics.median(chain)}
        line["oracle"] = statistics.median(len(lab) / tree_rounds(lab, *oracle_scores(lab), n, n) for lab in labels_per)
        for head, chance in scored.items():
            taken = []
            offset = 0
            for lab in labels_per:
                part = chance[offset:offset + len(lab)]
                offset += len(lab)
                taken.append(len(lab) / tree_rounds(lab, part[:, 0].tolist(), part[:, 1].tolist(), n, n))
            line[head] = statistics.median(taken)
        result["replay"].append(line)
    result["seconds"] = round(time.monotonic() - began)
    text = table(result)
    sys.stdout.write(text + "\n")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "acceptance_probe.json").write_text(json.dumps(result, indent=1))
        (out / "acceptance_probe.md").write_text(text + "\n")
    return 0


def table(result: dict) -> str:
    pos = result["positions"]
    lines = [f"Positions (target's token the draft's 1st / 2nd / further): training {pos['training']}, "
             f"held-out library files {pos['held-out library files']}, code continuations "
             f"{pos['code continuations']}.", "",
             "| head | AUC hit, held-out files | AUC hit, code | AUC 2nd given a miss, held-out | AUC 2nd given a miss, "
             "code | NLL held-out | NLL code |", "|---|---|---|---|---|---|---|"]
    for head, row in result["heads"].items():
        h, c = row["held-out library files"], row["code continuations"]
        lines.append(f"| {head} | {h['auc_hit']:.3f} | {c['auc_hit']:.3f} | {h['auc_second_given_miss']:.3f} | "
                     f"{c['auc_second_given_miss']:.3f} | {h['nll']:.3f} | {c['nll']:.3f} |")
    heads = list(result["heads"])
    lines += ["", "Replay, tokens a round (median over the code prompts; ratio to the chain):", "",
              "| N | chain | oracle | " + " | ".join(heads) + " |", "|---|---|---|" + "---|" * len(heads)]
    for line in result["replay"]:
        chain = line["chain"]
        cells = [str(line["N"]), f"{chain:.2f}", f"{line['oracle']:.2f} ({line['oracle'] / chain:.2f}x)"]
        cells += [f"{line[h]:.2f} ({line[h] / chain:.2f}x)" for h in heads]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
