"""Loading a causal LM and its tokenizer from a local path: an HF directory (safetensors) or a GGUF file.

GGUF files are dequantised by transformers, which takes minutes for a 1.5B model; the result is converted once
into a safetensors directory in the cache folder and reloaded from there in seconds afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from common.tokenizer import tokenizer_fingerprint

log = structlog.get_logger(__name__)


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel (…ForCausalLM)
    tokenizer: Any
    model_id: str
    tokenizer_fingerprint: str
    vocab_size: int  # rows of the logits
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    gguf_path: Path | None = None  # the GGUF file the weights were converted from, if any
    model_fingerprint: str = ""  # model_fingerprint() of its directory: which weights these are
    model_impl: str = "native"  # what runs its layers: native (common.paged_model) or transformers


def cache_dir() -> Path:
    return Path(os.environ.get("SPECWIRE_CACHE_DIR", Path.home() / ".cache" / "specwire"))


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """An HF directory for `path`: the directory itself, or the safetensors conversion of a GGUF file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist (models load from local paths only)")
    if p.is_dir():
        if not (p / "config.json").exists():
            ganged = sorted(p.glob("*.gguf"))
            if len(ganged) == 1:
                return resolve_model_dir(ganged[0])
            raise FileNotFoundError(f"{p} has no config.json and no single .gguf file")
        return p
    if p.suffix != ".gguf":
        raise ValueError(f"{p}: expected an HF model directory or a .gguf file")
    st = p.stat()
    key = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{p.stem}-{key}"
    if not (out / "config.json").exists():
        convert_gguf(p, out)
    return out


SOURCE_MARKER = "specwire_source.json"


def source_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file a model path stands for, or None: the file itself, a directory's single .gguf, or the file
    a converted directory records in its SOURCE_MARKER, while that file is still there with the same size."""
    p = Path(path).expanduser()
    if p.is_dir():
        marker = p / SOURCE_MARKER
        if (p / "config.json").exists():
            if not marker.exists():
                return None
            source = json.loads(marker.read_text())
            gguf = (p / source["gguf"]).resolve()
            return gguf if gguf.is_file() and gguf.stat().st_size == source["size"] else None
        ganged = sorted(p.glob("*.gguf"))
        return ganged[0] if len(ganged) == 1 else None
    return p if p.suffix == ".gguf" and p.is_file() else None


def record_source(model_dir: Path, gguf_path: Path) -> None:
    """Note in a converted directory which GGUF file it came from (relative, so the pair can move together)."""
    (model_dir / SOURCE_MARKER).write_text(json.dumps({
        "gguf": os.path.relpath(gguf_path.resolve(), model_dir.resolve()), "size": gguf_path.stat().st_size}))


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantise a GGUF file into a float32 safetensors directory (config, weights, tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("gguf_convert_start", gguf=str(gguf_path), out=str(out))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # NOTE: rebuild from the plain config so the saved directory carries no GGUF quantisation metadata.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    record_source(out, gguf_path)
    log.info("gguf_convert_done", out=str(out))


# -- model identity ------------------------------------------------------------------------------------------

# NOTE: the fingerprint reads the config, every safetensors header and FINGERPRINT_SAMPLES slices of
# FINGERPRINT_SAMPLE_BYTES from each tensor (its start, middle and end), at most FINGERPRINT_MAX_TENSORS
# tensors across all the files (spread evenly over them): a few hundred KB of reads for any model size and shard
# count, where hashing every byte would read a 140 GB
# checkpoint at each start. Headers alone would not do: two fine-tunes of one base (or two random inits) have
# identical headers. Training or re-initialising changes practically every element of a tensor, so its sampled
# bytes change too; an edit of a few weights away from the samples would go unseen. -- specwire
FINGERPRINT_SAMPLES = 3
FINGERPRINT_SAMPLE_BYTES = 64
FINGERPRINT_MAX_TENSORS = 4096
# other weight formats transformers loads, sampled as plain files
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth")
_OTHER_WEIGHTS_SAMPLES = 256
# config keys that say nothing about the weights (they change on a re-save)
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version")


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 (hex) of what makes a model directory compute what it computes, in bounded time whatever its size:
    config.json and generation_config.json (canonical JSON, volatile keys dropped), then per weights file its
    name, size, header (safetensors: every tensor's name, dtype, shape and offsets) and a bounded sample of its
    bytes (see the NOTE above). The directory's path is not part of it: a copy or a move keeps the fingerprint.
    A GGUF model's directory is its deterministic conversion (resolve_model_dir), so the fingerprint follows
    the GGUF file's contents."""
    d = Path(model_dir)
    h = hashlib.sha256(b"specwire-model-fingerprint-v1\0")
    for name in ("config.json", "generation_config.json"):
        if (d / name).is_file():
            config = json.loads((d / name).read_text())
            for key in _VOLATILE_CONFIG_KEYS:
                config.pop(key, None)
            h.update(f"{name}\0{json.dumps(config, sort_keys=True)}\0".encode())
    weights = sorted(d.glob("*.safetensors"))
    headers = [_safetensors_header(path) for path in weights]
    quotas = _spread(FINGERPRINT_MAX_TENSORS, [len(tensors) for _, _, tensors in headers])
    for path, header, quota in zip(weights, headers, quotas, strict=True):
        _fingerprint_safetensors(h, path, header, quota)
    if not weights:
        for path in sorted(p for pattern in _OTHER_WEIGHTS for p in d.glob(pattern)):
            _fingerprint_plain(h, path)
    return h.hexdigest()


def _safetensors_header(path: Path) -> tuple[int, bytes, list[tuple[str, list[int]]]]:
    """(header length, header bytes, its tensors' names and data offsets, by name)."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = f.read(header_len)
    tensors = sorted((name, meta["data_offsets"]) for name, meta in json.loads(header).items()
                     if name != "__metadata__")
    return header_len, header, tensors


def _spread(total: int, counts: list[int]) -> list[int]:
    """How many tensors of each file to sample: at most `total` in all, shared evenly (a file with fewer tensors
    than its share gives the rest to the others; the smallest files are served first, ties in file order).
    Depends only on the counts, so a copy or a move of the directory samples the same tensors."""
    quotas = [0] * len(counts)
    left, files_left = total, len(counts)
    for i in sorted(range(len(counts)), key=lambda i: (counts[i], i)):
        quotas[i] = min(counts[i], left // files_left)
        left -= quotas[i]
        files_left -= 1
    return quotas


def _fingerprint_safetensors(h: Any, path: Path, header: tuple[int, bytes, list[tuple[str, list[int]]]],
                             quota: int) -> None:
    """The file's name, size and header, then samples of `quota` of its tensors, evenly strided (every tensor
    when the quota holds them all, as one file within the cap always is)."""
    header_len, header_bytes, tensors = header
    h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    h.update(header_bytes)
    if quota <= 0:
        return
    stride = max(1, -(-len(tensors) // quota))
    base = 8 + header_len
    with path.open("rb") as f:
        for _, (begin, end) in tensors[::stride]:
            for offset in _sample_offsets(begin, end):
                f.seek(base + offset)
                h.update(f.read(FINGERPRINT_SAMPLE_BYTES))


def _sample_offsets(begin: int, end: int) -> list[int]:
    """Where a tensor of bytes [begin, end) is sampled: its start, middle and end (all of it when small)."""
    n = end - begin
    if n <= FINGERPRINT_SAMPLES * FINGERPRINT_SAMPLE_BYTES:
        return list(range(begin, end, FINGERPRINT_SAMPLE_BYTES))
    last = end - FINGERPRINT_SAMPLE_BYTES
    return [begin + (last - begin) * i // (FINGERPRINT_SAMPLES - 1) for i in range(FINGERPRINT_SAMPLES)]


def _fingerprint_plain(h: Any, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        for i in range(_OTHER_WEIGHTS_SAMPLES):
            f.seek(size * i // _OTHER_WEIGHTS_SAMPLES)
            h.update(f.read(FINGERPRINT_SAMPLE_BYTES))


def load_tokenizer(path: str | os.PathLike) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(path))


def resolve_model_impl(config: Any, model_impl: str = "auto") -> str:
    """native or transformers for a model of this config (see common.config.MODEL_IMPL_HELP); raises
    UnsupportedModelError for what neither can serve, saying why."""
    from common.paged_model import NATIVE_MODEL_TYPES
    from common.transformers_model import UnsupportedModelError, check_config, check_rope

    model_type = getattr(config, "model_type", "?")
    check_rope(config)
    if model_impl == "native":
        if model_type not in NATIVE_MODEL_TYPES:
            raise UnsupportedModelError(f"model type {model_type!r} has no native implementation (native: "
                                        f"{', '.join(NATIVE_MODEL_TYPES)}); use --model-impl transformers or auto")
        return "native"
    if model_impl == "auto" and model_type in NATIVE_MODEL_TYPES:
        return "native"
    if model_impl not in ("auto", "transformers"):
        raise ValueError(f"model_impl must be auto, native or transformers, got {model_impl!r}")
    check_config(config)
    return "transformers"


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", model_impl: str = "auto") -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(path)
    impl = resolve_model_impl(AutoConfig.from_pretrained(model_dir), model_impl)
    extra: dict[str, Any] = {}
    if impl == "transformers":
        from common.transformers_model import ATTENTION_NAME, register_attention

        register_attention()
        extra["attn_implementation"] = ATTENTION_NAME
        if dtype == torch.float64:  # transformers' grouped expert matmul has no float64 kernel; its loop does
            extra["experts_implementation"] = "eager"
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra)
    except ValueError as err:
        if impl != "transformers":
            raise
        from common.transformers_model import UnsupportedModelError

        raise UnsupportedModelError(f"transformers cannot load {model_dir} as a causal LM with specwire's "
                                    f"attention: {err}") from err
    model.eval()
    if torch.device(device).type != "cpu":
        model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = _eos_token_ids(model, tokenizer)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=getattr(model.config, "name_or_path", None) or Path(path).name,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=model.get_output_embeddings().weight.shape[0],
        eos_token_ids=eos,
        max_model_len=int(getattr(model.config, "max_position_embeddings", 2048)),
        gguf_path=source_gguf(path),
        model_fingerprint=model_fingerprint(model_dir),
        model_impl=impl,
    )


def _eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.extend(value if isinstance(value, list | tuple) else [value])
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))
