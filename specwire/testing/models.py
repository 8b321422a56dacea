"""Models and tokenizers for tests, built on the spot (no download): the services load them like any HF model.

- `text_pair`: a tiny random Llama or Qwen2 target and a perturbed draft sharing a byte-level BPE tokenizer (with a
  chat template): realistic code paths, arbitrary text.
- `table_model`: a model whose next-token distribution is a table you choose, indexed by the last token.
- `acceptance_pair`: a target and a draft table model whose sampled (rejection-sampling) acceptance per draft
  token is exactly the rate you choose.
- `text_model`: a model that emits a given text after any prompt, greedy.

Table models are exact by construction: one Llama layer whose attention and MLP write nothing (zero output
projections), a one-hot embedding (hidden size: the vocabulary rounded up to 16) and an lm_head holding the
log-table, so the logits
after token t are log table[t] (up to the RMS norm's epsilon, 1e-12). They run through every real code path of
both services: paging, batching, rejection sampling, streaming.
"""

from __future__ import annotations

import math
import re
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
# ChatML, as Qwen's tokenizers carry it: enough for the gateway's chat endpoint
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LOG_ZERO = -60.0  # the logit of a probability-0 entry: e^-60 is below float32's resolution next to 1


def byte_bpe_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a small built-in corpus: any text round-trips. Has a ChatML chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    out.chat_template = CHAT_TEMPLATE
    return out


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
    if family in ARCHITECTURES:
        return architecture_config(family, vocab_size, eos_token_id=eos_token_id, hidden=hidden, layers=layers,
                                   heads=heads, kv_heads=kv_heads, init=init)
    raise ValueError(f"family must be llama, qwen2 or one of {', '.join(ARCHITECTURES)}, got {family!r}")


# Tiny configs of architectures beyond Llama and Qwen2, each with what makes it differ switched on and strong
# enough to matter at this size: per-head q/k norms (qwen3), MoE routing (qwen3_moe, mixtral, gpt_oss), attention
# and final logit softcaps (gemma2, small caps so tanh bends), sliding-window layers shorter than the test prompts
# (gemma2, gemma3_text, gpt_oss, starcoder2), attention sinks (gpt_oss), fused projections (phi3), whole-projection
# q/k norms (olmo2), scaling multipliers (granite), LayerNorm with biases (starcoder2).
ARCHITECTURES = {
    "mistral": dict(sliding_window=8),  # every layer windowed (no layer_types)
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=4.0,
                   final_logit_softcapping=3.0, sliding_window=8, hidden_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(sliding_window=None),
    "olmo2": dict(),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=2.0),
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "original_max_position_embeddings": 16}),
    "starcoder2": dict(sliding_window=8, use_bias=True),
    # MLA: keys of qk_nope + qk_rope dims, values of v_head_dim (another head dim), a dense first layer, then MoE
    "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                        topk_group=1),
}


def architecture_config(model_type: str, vocab_size: int, *, eos_token_id: int | None, hidden: int = 64,
                        layers: int = 2, heads: int = 4, kv_heads: int = 2, init: float = 0.3):
    """A tiny random config of `model_type` (a key of ARCHITECTURES): hidden 64, 2 layers by default."""
    from transformers import AutoConfig

    params = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  initializer_range=init, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    params.update(ARCHITECTURES[model_type])
    if "layer_types" in params:
        kinds = params["layer_types"]
        params["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    return AutoConfig.for_model(model_type, **params)


def build_model(config, seed: int, dtype: torch.dtype = torch.float64):
    torch.manual_seed(seed)
    if dtype == torch.float64:  # transformers' grouped expert matmul (MoE) has no float64 kernel; its loop does
        config._experts_implementation = "eager"
    if config.model_type == "llama":
        model = LlamaForCausalLM(config)
    elif config.model_type == "qwen2":
        model = Qwen2ForCausalLM(config)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


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
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def text_pair(root: Path, family: str = "qwen2", *, noise: float = 0.03, dtype=torch.float64,
              seed: int = 0) -> tuple[Path, Path]:
    """(target_dir, draft_dir): a tiny random target and a draft perturbed from it, sharing a byte-level BPE
    tokenizer. The draft agrees with the target most of the time (greedy acceptance around 0.8 at noise 0.03)."""
    tok = byte_bpe_tokenizer()
    config = model_config(family, len(tok), eos_token_id=tok.eos_token_id)
    target = build_model(config, seed, dtype)
    draft = perturbed(target, seed + 1, noise)
    root = Path(root)
    return save(target, tok, root / f"{family}-target"), save(draft, tok, root / f"{family}-draft")


# -- table models ------------------------------------------------------------------------------------------------

def table_model(path: Path, table: torch.Tensor, tokenizer: PreTrainedTokenizerFast | None = None, *,
                dtype: torch.dtype = torch.float32) -> Path:
    """A model whose next-token distribution after token t is table[t] (rows: probability vectors over the
    vocabulary, [vocab, vocab]); the tokenizer defaults to word_tokenizer(vocab). Saved to `path`."""
    table = torch.as_tensor(table, dtype=torch.float64)
    vocab = table.shape[0]
    if table.dim() != 2 or table.shape[1] != vocab:
        raise ValueError(f"table must be [vocab, vocab], got {list(table.shape)}")
    if (table < 0).any() or not torch.allclose(table.sum(1), torch.ones(vocab, dtype=torch.float64), atol=1e-6):
        raise ValueError("every row of table must be a probability vector")
    tokenizer = tokenizer or word_tokenizer(vocab)
    if len(tokenizer) != vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the table {vocab}")
    hidden = -(-vocab // 16) * 16
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=hidden // 16, num_key_value_heads=hidden // 16, head_dim=16,
                         max_position_embeddings=4096, rms_norm_eps=1e-12, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    log_table = torch.where(table > 0, table.clamp_min(1e-300).log(), torch.full_like(table, LOG_ZERO))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden, dtype=torch.float64))
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()  # attention writes nothing to the residual stream
        layer.mlp.down_proj.weight.zero_()  # nor does the MLP
        model.model.norm.weight.fill_(1.0)
        # the final RMS norm turns the one-hot e_t into sqrt(hidden) e_t
        head = torch.zeros(vocab, hidden, dtype=torch.float64)
        head[:, :vocab] = log_table.T / math.sqrt(hidden)
        model.lm_head.weight.copy_(head)
    return save(model.to(dtype), tokenizer, path)


def table_distribution(table: torch.Tensor) -> torch.Tensor:
    """What a table model computes: softmax of its log-table (a probability-0 entry becomes e^-60, not 0)."""
    table = torch.as_tensor(table, dtype=torch.float64)
    log_table = torch.where(table > 0, table.clamp_min(1e-300).log(), torch.full_like(table, LOG_ZERO))
    return log_table.softmax(dim=1)


def acceptance_pair(root: Path, acceptance: float, *, vocab: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """(target_dir, draft_dir): table models whose rejection-sampling acceptance per draft token is `acceptance`
    at temperature 1, whatever the context. After each token the target spreads its mass over the first half of
    the vocabulary; the draft is q = a p + (1 - a) u with u on the second half, so sum min(p, q) = a exactly."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    half = vocab // 2
    g = torch.Generator().manual_seed(seed)
    p = torch.zeros(vocab, vocab, dtype=torch.float64)
    u = torch.zeros(vocab, vocab, dtype=torch.float64)
    p[:, :half] = torch.rand(vocab, half, generator=g, dtype=torch.float64) + 0.1
    u[:, half:] = torch.rand(vocab, vocab - half, generator=g, dtype=torch.float64) + 0.1
    p /= p.sum(1, keepdim=True)
    u /= u.sum(1, keepdim=True)
    q = acceptance * p + (1 - acceptance) * u
    tok = word_tokenizer(vocab)
    root = Path(root)
    return table_model(root / "accept-target", p, tok), table_model(root / "accept-draft", q, tok)


_PIECES = re.compile(r"\s*\S+|\s+")


def text_tokenizer(pieces: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer whose tokens are `pieces` (whitespace-led words) plus an end-of-sequence token; decoding
    concatenates them."""
    vocab = {EOS: 0}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(_PIECES.pattern, behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=EOS, pad_token=EOS)


def text_model(path: Path, text: str, *, dtype: torch.dtype = torch.float32) -> Path:
    """A table model that, greedy, continues any prompt ending in one of the text's pieces with the rest of the
    text and then its end-of-sequence token; after any other token it starts the text. Pieces are whitespace-led
    words ("Hello", " world", "!"), and each may appear once, so its successor is defined."""
    pieces = _PIECES.findall(text)
    if not pieces:
        raise ValueError("text is empty")
    if len(set(pieces)) != len(pieces):
        repeated = sorted({p for p in pieces if pieces.count(p) > 1})
        raise ValueError(f"text_model needs every piece of the text to appear once; {repeated} repeat")
    tok = text_tokenizer(pieces)
    vocab = len(tok)
    ids = [tok.convert_tokens_to_ids(p) for p in pieces]
    table = torch.zeros(vocab, vocab, dtype=torch.float64)
    table[:, ids[0]] = 1.0  # any token: start the text
    for a, b in zip(ids, ids[1:], strict=False):
        table[a] = 0.0
        table[a, b] = 1.0
    table[ids[-1]] = 0.0
    table[ids[-1], tok.eos_token_id] = 1.0
    return table_model(path, table, tok, dtype=dtype)


def greedy_reference(model_dir: Path, prompt_ids: list[int], n: int, dtype: torch.dtype = torch.float64) -> list[int]:
    """Target-alone greedy decoding with transformers' own forward over the full sequence: what any speculative
    greedy output must equal, token for token."""
    from transformers import AutoModelForCausalLM

    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}  # MoE in float64, as above
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
