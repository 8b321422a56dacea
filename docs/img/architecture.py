"""Draws docs/img/architecture.png, the picture of the README and the docs' overview (matplotlib, offline).

    python docs/img/architecture.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_suffix(".png")
INK, VERIFIER, DRAFT, CLIENT, HOST = "#1f2933", "#dbeafe", "#dcfce7", "#fef3c7", "#f4f4f5"


def box(ax, x, y, w, h, title, lines, color, *, fontsize=9):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec=INK, lw=1.2))
    ax.text(x + w / 2, y + h - 0.17, title, ha="center", va="top", fontsize=fontsize + 1.5, weight="bold", color=INK)
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.55 - 0.27 * i, line, ha="center", va="top", fontsize=fontsize, color=INK)


def host(ax, x, y, w, h, label):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=HOST, ec="#a1a1aa",
                                lw=1, ls="--"))
    ax.text(x + 0.12, y + h - 0.1, label, ha="left", va="top", fontsize=8.5, style="italic", color="#52525b")


def arrow(ax, a, b, text="", *, both=False, offset=0.12, color=INK, lw=1.4):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="<|-|>" if both else "-|>", mutation_scale=12, color=color, lw=lw))
    if text:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + offset, text, ha="center", va="bottom", fontsize=8,
                color=color)


def main() -> None:
    fig, ax = plt.subplots(figsize=(12.8, 5.6))
    ax.set_xlim(0, 12.8)
    ax.set_ylim(0, 5.6)
    ax.axis("off")
    # clients
    box(ax, 0.2, 3.35, 2.2, 1.6, "clients", ["specwire SDK", "specwire generate", "OpenAI clients"], CLIENT)
    box(ax, 0.2, 0.8, 2.2, 1.6, "gateway", ["OpenAI HTTP API", "completions, chat", "(optional)"], CLIENT)
    # draft hosts
    host(ax, 3.0, 3.05, 3.3, 2.2, "draft host A (CPU or small GPU)")
    box(ax, 3.2, 3.2, 2.9, 1.7, "draft service", ["small model, its own paged cache",
                                                  "drafts k tokens per sequence", "pipelines the next block"], DRAFT)
    host(ax, 3.0, 0.5, 3.3, 2.2, "draft host B")
    box(ax, 3.2, 0.65, 2.9, 1.7, "draft service", ["another draft process", "(n-gram or model)", ""], DRAFT)
    # verifier host
    host(ax, 8.4, 0.5, 4.2, 4.75, "verifier host (the GPU)")
    box(ax, 8.6, 0.7, 3.8, 4.2, "verifier service", ["target model", "paged KV cache, prefix cache",
                                                      "scheduler: one batched forward", "over every ready block",
                                                      "rejection sampling (3 wire modes)", "goodput: chooses each k",
                                                      "Triton on CUDA / ROCm,", "torch on CPU"], VERIFIER)
    arrow(ax, (2.4, 4.15), (3.2, 4.15), "Generate")
    arrow(ax, (2.4, 1.6), (3.2, 1.6), "Generate")
    arrow(ax, (1.3, 3.35), (1.3, 2.4), "")
    arrow(ax, (6.1, 4.2), (8.6, 3.7), "", both=True)
    arrow(ax, (6.1, 1.5), (8.6, 2.1), "", both=True)
    ax.text(7.35, 4.45, "Verify: one bidi gRPC\nstream per draft process", ha="center", va="bottom", fontsize=8)
    ax.text(7.35, 2.9, "proposals (d1..dk, q) ->\n<- verdicts (accepted,\n    next token, next k)",
            ha="center", va="center", fontsize=7.5, family="monospace")
    ax.text(7.35, 0.75, "TLS, mutual TLS,\nbearer tokens", ha="center", va="bottom", fontsize=8, color="#52525b")
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
