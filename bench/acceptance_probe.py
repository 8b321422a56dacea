"""Does the default draft know more about its misses than its own probabilities say? (issue 26, token trees)

A greedy tree of N nodes beats the chain of N tokens only where it places its few branches where the draft misses
(bench/tree_ceiling.py: at most 1.41x the chain's tokens a round at N = 16 on code, B = 2; the services measured
1.18x with calibrated probabilities). The calibration (draft_service.tree_calibration) reads the draft's
probability of a child alone. This asks whether anything else the draft computes tells its misses better: a learnt
acceptance head on the draft's hidden state, as SpecDec++ (Huang et al. 2024) trains one to stop drafting.

1. Positions, teacher-forced (no services; transformers, target float32 and draft bfloat16 as bench/tree_ceiling.py
   runs them). Training: tokens 16 to `--train-tokens` of `--train-files` Python files of the standard library of
   the interpreter that runs this (site-packages, dist-packages and encodings left out; shuffled with a fixed
   seed; files shorter than 256 tokens skipped), the last `--held-out` of them kept apart; the label is the rank
   of the target's argmax among the draft's tokens (0, 1, or 2 for further). Evaluation: the target's greedy
   continuation (`--tokens`) of the first `--prompts` code prompts of specwire/bench_prompts.json, the text trees
   are measured on, labelled by the continuation's own tokens. At each position: the draft's hidden state after
   its last layer and after its middle one, and its three likeliest tokens' probabilities.
2. Heads fitted on the training positions, each giving the chance of each label: a softmax regression on the
   draft's probabilities alone (log p1, log(1 - p1), log p2, log p3, p1, p2); the same with a hidden state
   besides (the last layer's, the middle one's), its ridge on the hidden state only and chosen by the loss on the
   last VALIDATION_FILES training files; an MLP on the probabilities and the last hidden state (early stopping on
   those files). The draft's raw p1 and p2, and p1 and p2 calibrated by bands on the training positions (offline,
   in the spirit of the service's online calibration, not its code), are the baselines.
3. How well each separates the draft's hits from its misses (AUC of its chance of label 0) and, where the draft
   missed, the target's token at rank 1 from further ones, on the held-out files and on the code continuations;
   the mean negative log-likelihood of the labels; for the hit AUC, the difference from raw p1 with a 95 %
   interval from a paired bootstrap over files (held-out) and prompts (code).
4. A replay of greedy trees over the evaluation continuations (tree_rounds): best-first by path score, B = 2,
   the child of rank r scored by the head's chance of label r, against the chain and an oracle (a head that knows
   the labels, and may hold a second child without its first sibling). The replay knows the draft's rows along
   the target's path only: the children of a node off it are scored at the head's mean chances of labels 0 and 1
   over the evaluation positions. Medians over a few prompts of 96 tokens take few values (96 / rounds): the
   replay tells heads apart only where they differ a lot.

    python bench/acceptance_probe.py [--train-files 48] [--prompts 8] [--out DIR]

Prints markdown and writes acceptance_probe.json (the training files' paths too) and acceptance_probe.md into --out.
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

from tree_ceiling import TOP, chain_rounds, greedy_continuation  # noqa: E402

P1_BANDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995)
P2_BANDS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5)
RIDGES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
VALIDATION_FILES = 8  # of the training files, the last: the ridge's and the MLP's choice
BOOTSTRAP = 500
LEFT_OUT = {"site-packages", "dist-packages", "encodings"}
PROBABILITIES = "regression, probabilities"
HIDDEN_HEADS = ("regression, + last hidden state", "regression, + middle hidden state")


def tree_rounds(labels: Sequence[int], first: Sequence[float], second: Sequence[float], n: int, depth: int,
                off: tuple[float, float] = (0.9, 0.05)) -> int:
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


def gather(target, draft, ids_list: list, starts: list[int], limits: list[int], *, generated: bool) -> list[dict]:
    """Per sequence of token ids (1 x n): from row starts[i] on (row t predicts token t + 1), limits[i] rows of the
    draft's hidden states after its last and its middle layer (float16), its TOP likeliest tokens' probabilities
    and the label. `generated`: the ids past the prompt are the target's own greedy tokens, and the label is their
    rank (the target's argmax of a forward over them may differ at a near-tie, and is counted in "disagree");
    else the target's argmax of that forward is the truth."""
    import torch

    out = []
    for ids, start, limit in zip(ids_list, starts, limits, strict=True):
        with torch.no_grad():
            target_next = target(ids).logits[0].argmax(-1)
            run = draft(ids, output_hidden_states=True)
        rows = slice(start, start + limit)
        probs = torch.softmax(run.logits[0].float(), -1)[rows]
        top = torch.topk(probs, TOP, -1)
        argmax = target_next[rows]
        truth = ids[0, start + 1:start + 1 + limit] if generated else argmax
        label = torch.full_like(truth, 2)
        label[top.indices[:, 1] == truth] = 1
        label[top.indices[:, 0] == truth] = 0
        middle = len(run.hidden_states) // 2
        out.append({"last": run.hidden_states[-1][0, rows].half(), "middle": run.hidden_states[middle][0, rows].half(),
                    "top_p": top.values, "label": label, "disagree": int((truth != argmax).sum())})
    return out


def training_texts(tokenizer, files: int, tokens: int) -> tuple[list[str], list]:
    """(paths, token ids) of the training files (module docstring)."""
    import torch

    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not LEFT_OUT & set(p.relative_to(root).parts))
    random.Random(0).shuffle(paths)
    chosen, out = [], []
    for path in paths:
        if len(out) >= files:
            break
        ids = tokenizer(path.read_text(errors="ignore"), return_tensors="pt", add_special_tokens=False).input_ids
        if ids.shape[1] >= 256:
            chosen.append(str(path.relative_to(root)))
            out.append(torch.as_tensor(ids[:, :tokens]))
    return chosen, out


def probability_features(top_p):
    """log p1, log(1 - p1), log p2, log p3, p1, p2 per position (the three likeliest tokens' probabilities)."""
    import torch

    p1, p2 = top_p[:, 0].clamp(1e-6, 1 - 1e-6), top_p[:, 1].clamp(1e-6, 1.0)
    return torch.stack([p1.log(), (1 - p1).log(), p2.log(), top_p[:, 2].clamp(1e-6).log(), p1, p2], 1)


def stacked(batch: list[dict]) -> dict:
    """The positions of `batch`, concatenated: probability features, hidden states, top probabilities, labels."""
    import torch

    top_p = torch.cat([b["top_p"] for b in batch])
    return {"probs": probability_features(top_p), "last": torch.cat([b["last"] for b in batch]).float(),
            "middle": torch.cat([b["middle"] for b in batch]).float(), "top_p": top_p,
            "label": torch.cat([b["label"] for b in batch])}


def fit_linear(x, y, penalty) -> Callable:
    """A softmax regression over the 3 labels on standardized x, `penalty` per column of x (its ridge); returns
    x -> label probabilities."""
    import torch

    mean, scale = x.mean(0), x.std(0) + 1e-6
    xs = (x - mean) / scale
    weight = torch.zeros(x.shape[1], 3, requires_grad=True)
    bias = torch.zeros(3, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xs @ weight + bias, y) + (penalty[:, None] * weight ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lambda z: torch.softmax(((z - mean) / scale) @ weight + bias, 1).detach()


def nll(chance, labels) -> float:
    import torch

    return float(-chance[torch.arange(len(labels)), labels].clamp(1e-9).log().mean())


def fit_with_hidden(probs, hidden, y, fit_rows, check_rows) -> tuple[Callable, float]:
    """fit_linear on the probabilities and a hidden state, the ridge on the hidden state only, chosen from RIDGES
    by the loss on `check_rows` of a fit on `fit_rows`, then fitted on all; returns (predict, ridge)."""
    import torch

    x = torch.cat([hidden, probs], 1)

    def penalty(ridge: float):
        return torch.cat([torch.full((hidden.shape[1],), ridge), torch.zeros(probs.shape[1])])

    losses = {r: nll(fit_linear(x[fit_rows], y[fit_rows], penalty(r))(x[check_rows]), y[check_rows]) for r in RIDGES}
    ridge = min(losses, key=losses.get)
    return fit_linear(x, y, penalty(ridge)), ridge


def fit_mlp(probs, hidden, y, fit_rows, check_rows, width: int = 64, epochs: int = 40) -> Callable:
    """One hidden layer on the probabilities and a hidden state (dropout on the hidden state's columns only),
    AdamW; the epoch with the best loss on `check_rows` is kept, then predict(hidden + probabilities)."""
    import torch

    torch.manual_seed(0)
    x = torch.cat([hidden, probs], 1)
    mean, scale = x[fit_rows].mean(0), x[fit_rows].std(0) + 1e-6
    xs = (x - mean) / scale
    droppable = torch.cat([torch.ones(hidden.shape[1]), torch.zeros(probs.shape[1])]).bool()  # the hidden state's
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], width), torch.nn.GELU(), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(net.parameters(), 1e-3, weight_decay=1e-3)
    best = (float("inf"), None)
    for _ in range(epochs):
        net.train()
        for part in torch.randperm(len(fit_rows)).split(256):
            rows = fit_rows[part]
            dropped = (torch.rand(len(rows), x.shape[1]) < 0.2) & droppable
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xs[rows].masked_fill(dropped, 0.0) / torch.where(
                droppable, 0.8, 1.0)), y[rows]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(net(xs[check_rows]), y[check_rows]).item()
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
    probability; where the two come to more than 1 they are scaled to 1): the chance of each label."""
    import torch

    def table(values, hits, edges):
        bands = torch.bucketize(values.contiguous(), torch.tensor(edges))
        return [float(hits[bands == i].float().mean()) if int((bands == i).sum()) > 5 else None
                for i in range(len(edges) + 1)]

    t1, t2 = table(top_p[:, 0], y == 0, P1_BANDS), table(top_p[:, 1], y == 1, P2_BANDS)

    def look(values, rates, edges):
        bands = torch.bucketize(values.contiguous(), torch.tensor(edges)).tolist()
        return torch.tensor([rates[b] if rates[b] is not None else v
                             for b, v in zip(bands, values.tolist(), strict=True)])

    def predict(p):
        first, second = look(p[:, 0], t1, P1_BANDS), look(p[:, 1], t2, P2_BANDS)
        over = (first + second).clamp(min=1.0)
        first, second = first / over, second / over
        return torch.stack([first, second, 1 - first - second], 1)

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


def paired_interval(score, baseline, positive, groups: list[int], rounds: int = BOOTSTRAP) -> tuple[float, float]:
    """A 95 % interval of auc(score) - auc(baseline), resampling whole groups (files, prompts) with replacement;
    `groups`: each group's number of positions, in order."""
    bounds = list(itertools.accumulate(groups, initial=0))
    spans = [range(a, b) for a, b in itertools.pairwise(bounds)]
    rng = random.Random(1)
    diffs = []
    for _ in range(rounds):
        rows = [i for g in rng.choices(range(len(spans)), k=len(spans)) for i in spans[g]]
        pick = [positive[i] for i in rows]
        if all(pick) or not any(pick):
            continue
        diffs.append(auc([score[i] for i in rows], pick) - auc([baseline[i] for i in rows], pick))
    if not diffs:  # every resample held only hits or only misses
        return float("nan"), float("nan")
    diffs.sort()
    return diffs[round(0.025 * (len(diffs) - 1))], diffs[round(0.975 * (len(diffs) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=".models", help="directory with target/ and draft/")
    parser.add_argument("--train-files", type=int, default=48)
    parser.add_argument("--train-tokens", type=int, default=512)
    parser.add_argument("--held-out", type=int, default=10, help="of the training files, kept apart for scoring")
    parser.add_argument("--prompts", type=int, default=8, help="the first N code prompts")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--nodes", default="8,16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.held_out + VALIDATION_FILES >= args.train_files:
        parser.error(f"--train-files must be above --held-out + {VALIDATION_FILES}")

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
        full.append(greedy_continuation(target, ids, args.tokens))
        starts.append(ids.shape[1] - 1)
    evaluation = gather(target, draft, full, starts, [args.tokens] * len(full), generated=True)
    paths, texts = training_texts(tokenizer, args.train_files, args.train_tokens)
    train = gather(target, draft, texts, [16] * len(texts), [t.shape[1] - 16 for t in texts], generated=False)
    kept, held = train[:-args.held_out], train[-args.held_out:]
    fitting = stacked(kept)
    y = fitting["label"]
    split = sum(len(b["label"]) for b in kept[:-VALIDATION_FILES])
    fit_rows, check_rows = torch.arange(split), torch.arange(split, len(y))

    ridges = {}

    def with_hidden(layer: str) -> Callable:
        predict, ridges[layer] = fit_with_hidden(fitting["probs"], fitting[layer], y, fit_rows, check_rows)
        return lambda d: predict(torch.cat([d[layer], d["probs"]], 1))

    mlp = fit_mlp(fitting["probs"], fitting["last"], y, fit_rows, check_rows)
    bands = fit_bands(fitting["top_p"], y)
    probs_only = fit_linear(fitting["probs"], y, torch.zeros(fitting["probs"].shape[1]))
    heads: dict[str, Callable] = {
        "draft p1, p2 (raw)": lambda d: torch.stack(
            [d["top_p"][:, 0], d["top_p"][:, 1], 1 - d["top_p"][:, 0] - d["top_p"][:, 1]], 1),
        "p1, p2 by bands": lambda d: bands(d["top_p"]),
        PROBABILITIES: lambda d: probs_only(d["probs"]),
        HIDDEN_HEADS[0]: with_hidden("last"),
        HIDDEN_HEADS[1]: with_hidden("middle"),
        "MLP, + last hidden state": lambda d: mlp(torch.cat([d["last"], d["probs"]], 1)),
    }
    sets = {"held-out library files": held, "code continuations": evaluation}
    result: dict = {"args": vars(args), "training_files": paths, "ridges": ridges, "positions": {}, "heads": {},
                    "replay": [], "disagree": sum(b["disagree"] for b in evaluation)}
    result["positions"]["training"] = [int((y == r).sum()) for r in range(3)]
    data = {name: stacked(batch) for name, batch in sets.items()}
    for name, d in data.items():
        result["positions"][name] = [int((d["label"] == r).sum()) for r in range(3)]
    chances = {head: {name: predict(d).clamp(1e-9, 1.0) for name, d in data.items()} for head, predict in heads.items()}
    raw = "draft p1, p2 (raw)"
    for head, by_set in chances.items():
        row = {}
        for name, chance in by_set.items():
            labels = data[name]["label"]
            hits = (labels == 0).tolist()
            missed = labels != 0
            row[name] = {
                "auc_hit": auc(chance[:, 0].tolist(), hits),
                "auc_hit_minus_raw_95": paired_interval(chance[:, 0].tolist(), chances[raw][name][:, 0].tolist(),
                                                        hits, [len(b["label"]) for b in sets[name]]),
                "auc_second_given_miss": auc((chance[missed, 1] / (1 - chance[missed, 0]).clamp(1e-9)).tolist(),
                                             (labels[missed] == 1).tolist()),
                "nll": nll(chance, labels),
            }
            if head in HIDDEN_HEADS:  # the hidden state's own share: against the same regression without it
                row[name]["auc_hit_minus_probabilities_95"] = paired_interval(
                    chance[:, 0].tolist(), chances[PROBABILITIES][name][:, 0].tolist(), hits,
                    [len(b["label"]) for b in sets[name]])
        result["heads"][head] = row
    labels_per = [b["label"].tolist() for b in evaluation]
    for n in [int(v) for v in args.nodes.split(",")]:
        chain = [len(lab) / chain_rounds([min(v, 1) for v in lab], n) for lab in labels_per]
        line = {"N": n, "chain": statistics.median(chain),
                "oracle": statistics.median(len(lab) / tree_rounds(lab, *oracle_scores(lab), n, n)
                                            for lab in labels_per)}
        for head, by_set in chances.items():
            chance = by_set["code continuations"]
            off = (float(chance[:, 0].mean()), float(chance[:, 1].mean()))
            taken, offset = [], 0
            for lab in labels_per:
                part = chance[offset:offset + len(lab)]
                offset += len(lab)
                taken.append(len(lab) / tree_rounds(lab, part[:, 0].tolist(), part[:, 1].tolist(), n, n, off))
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
    lines = [f"Positions (the target's token the draft's 1st / 2nd / further): training {pos['training']}, "
             f"held-out library files {pos['held-out library files']}, code continuations "
             f"{pos['code continuations']}. Ridges chosen (hidden state): {result['ridges']}. Continuation tokens "
             f"that a forward's argmax disagrees with: {result['disagree']}.", "",
             "| head | AUC hit, held-out files | minus raw p1, 95 % | AUC hit, code | minus raw p1, 95 % | "
             "AUC 2nd given a miss, held-out | AUC 2nd given a miss, code | NLL held-out | NLL code |",
             "|---|---|---|---|---|---|---|---|---|"]
    for head, row in result["heads"].items():
        h, c = row["held-out library files"], row["code continuations"]
        lo_h, hi_h = h["auc_hit_minus_raw_95"]
        lo_c, hi_c = c["auc_hit_minus_raw_95"]
        lines.append(f"| {head} | {h['auc_hit']:.3f} | {lo_h:+.3f} to {hi_h:+.3f} | {c['auc_hit']:.3f} | "
                     f"{lo_c:+.3f} to {hi_c:+.3f} | {h['auc_second_given_miss']:.3f} | "
                     f"{c['auc_second_given_miss']:.3f} | {h['nll']:.3f} | {c['nll']:.3f} |")
    lines += ["", "The hidden state's own share: AUC hit minus the regression on the probabilities alone, 95 %:", "",
              "| head | held-out files | code |", "|---|---|---|"]
    for head in HIDDEN_HEADS:
        h, c = (result["heads"][head][name]["auc_hit_minus_probabilities_95"]
                for name in ("held-out library files", "code continuations"))
        lines.append(f"| {head} | {h[0]:+.3f} to {h[1]:+.3f} | {c[0]:+.3f} to {c[1]:+.3f} |")
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
