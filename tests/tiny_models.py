"""Tiny random Llama / Qwen2 models and local tokenizers, built and saved by the tests (no downloads): specwire.testing's
builders, and the target-only greedy reference."""

from __future__ import annotations

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
from specwire.testing.models import greedy_reference as greedy_continuation  # noqa: F401
from specwire.testing.models import text_pair as make_text_pair  # noqa: F401
