"""Tiny random Llama / Qwen2 models and local tokenizers, built and saved by the tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them.",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())\n",
    "Le cœur a ses raisons que la raison ne connaît point. Ça va très bien, merci ! 日本語のテキスト。",
    "for i in range(100):\n    total += i * i\nreturn total\n",
] * 4

EOS = "<|endoftext|>"


def byte_bpe_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token i is the word 't{i}': a tokenizer for small-vocabulary statistical tests."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def model_config(family: str, vocab_size: int, *, eos_token_id: int | None, hidden: int = 64, layers: int = 2,
                 heads: int = 4, kv_heads: int = 2, init: float = 0.3):
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  initializer_range=init, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    raise ValueError(family)


def build_model(config, seed: int, dtype: torch.dtype = torch.float64):
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if config.model_type == "llama" else Qwen2ForCausalLM
    return cls(config).to(dtype).eval()


def perturbed(model, seed: int, scale: float):
    """A copy of `model` with relative Gaussian noise on every weight: a draft that mostly agrees."""
    g = torch.Generator().manual_seed(seed)
    clone = type(model)(model.config).to(model.dtype).eval()
    state = {}
    for name, w in model.state_dict().items():
        noise = torch.randn(w.shape, generator=g, dtype=torch.float64).to(w.dtype)
        state[name] = w + scale * w.abs().mean() * noise
    clone.load_state_dict(state)
    return clone


def save(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_text_pair(root: Path, family: str, *, noise: float = 0.03, dtype=torch.float64, seed: int = 0):
    """(target_dir, draft_dir) sharing a byte-level BPE tokenizer."""
    tok = byte_bpe_tokenizer()
    config = model_config(family, len(tok), eos_token_id=tok.eos_token_id)
    target = build_model(config, seed, dtype)
    draft = perturbed(target, seed + 1, noise)
    return save(target, tok, root / f"{family}-target"), save(draft, tok, root / f"{family}-draft")


def greedy_continuation(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    """The target-only reference: n argmax steps of transformers' own forward over the full sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
