"""Tiny random Llama / Qwen2 models and local tokenizers, built and saved by the tests (no downloads): specwire.testing's
builders, and the target-only greedy reference."""

from __future__ import annotations

import torch

# the builders are specwire.testing's: the project's tests use the kit its users get
from specwire.testing.models import (  # noqa: F401 - re-exported for the tests
    CORPUS,
    EOS,
    build_model,
    byte_bpe_tokenizer,
    model_config,
    perturbed,
    save,
    word_tokenizer,
)
from specwire.testing.models import text_pair as make_text_pair  # noqa: F401


def greedy_continuation(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    """The target-only reference: n argmax steps of transformers' own forward over the full sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
