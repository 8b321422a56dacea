"""Helpers for service configs (no torch import: the CLI uses them).

A service's config is one frozen dataclass. Each field declared with `option()` carries its default, help and
parser, and becomes the CLI flag `--field-name` (with an environment twin `SPECWIRE_FIELD_NAME`), so every
default is written once: in the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Any

DTYPES = ("float32", "bfloat16", "float16", "float64")
QUANTIZATIONS = ("none", "int8", "int4")
QUANTIZATION_HELP = ("weight-only quantization of every linear layer on CPU: none; int8 (per output channel, "
                     "activations in --dtype float32 or bfloat16); int4 (affine per group of 32, bfloat16 "
                     "activations). The quantized model is the one verified against")
DEVICE_CHOICES_HELP = "auto (the GPU when torch sees one, else CPU), cpu, cuda, cuda:N (ROCm GPUs are cuda too)"
CPU_WAIT_POLICIES = ("passive", "active")
MODEL_IMPLS = ("auto", "native", "transformers")
MODEL_IMPL_HELP = ("how the model's layers run: native (specwire's own forward for llama, qwen2, mistral and qwen3: "
                   "the fast path, with --quantization and GGUF int4 blocks), transformers (transformers' own "
                   "modules for any decoder-only architecture it has, MoE included, with specwire's paged attention "
                   "and KV cache under them), auto (native where it exists, else transformers)")


def check_weights(dtype: str, quantization: str, model_impl: str = "auto") -> None:
    """--dtype, --quantization and --model-impl, as both services take them."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    if model_impl == "transformers" and quantization != "none":
        raise ValueError(f"--quantization {quantization} is a path of the native implementation; the transformers "
                         "backend runs the model's own weights (use --model-impl native or auto with a llama, "
                         "qwen2, mistral or qwen3 model)")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def option(default: Any, help: str, *, parse: Any = None, choices: tuple[str, ...] | None = None,
           flag: str | None = None, show: Any = None) -> Any:
    """A config field that is also a CLI flag. `parse` reads the flag's text (default: the type of `default`;
    bool accepts true/false/1/0 and a bare `--flag`); `flag` overrides the flag's name; `show` formats the
    default in the help."""
    metadata = {"help": help, "parse": parse, "choices": choices, "flag": flag, "show": show}
    return dataclasses.field(default=default, metadata={"option": metadata})


@dataclasses.dataclass(frozen=True)
class ServerSecurityConfig:
    """The flags both servers share for TLS, bearer tokens and reflection (checked by common.security)."""

    tls_cert: str | None = option(None, "PEM certificate chain: serve TLS (with --tls-key)", parse=str)
    tls_key: str | None = option(None, "PEM private key of --tls-cert", parse=str)
    tls_client_ca: str | None = option(None, "PEM CA bundle: require client certificates it signed (mutual TLS)",
                                       parse=str)
    auth_token_file: str | None = option(None, "file of accepted bearer tokens, one per line, re-read when it "
                                         "changes; calls without one get UNAUTHENTICATED (health stays open)",
                                         parse=str)
    reflection: bool = option(True, "serve gRPC server reflection")

    def check_security(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")


@dataclasses.dataclass(frozen=True)
class StaticForwardConfig:
    """The flags both model services share for static device buffers and CUDA/HIP graphs
    (common.static_forward)."""

    cuda_graphs: bool | None = option(None, "capture the forward of decode-sized steps (every token's logits "
                                      "wanted, <= 16 tokens per sequence) as CUDA/HIP graphs at start-up, one per "
                                      "size bucket up to --cuda-graph-max-tokens, and replay them; true/false; "
                                      "unset: on for a CUDA GPU with the native implementation, off on ROCm (no "
                                      "HIP GPU has run a capture yet), CPU and the transformers backend",
                                      parse=parse_bool)
    cuda_graph_max_tokens: int = option(512, "largest decode-sized step run through static device buffers on the "
                                        "Triton path (with --cuda-graphs: the largest captured bucket)")

    def check_static_forward(self) -> None:
        if self.cuda_graph_max_tokens < 1:
            raise ValueError(f"cuda_graph_max_tokens must be >= 1, got {self.cuda_graph_max_tokens}")


@dataclasses.dataclass(frozen=True)
class CpuThreadsConfig:
    """The flags both model services share for their CPU threads (applied by common.threads before torch loads).
    Each flag, given, wins over the OpenMP variable it sets; not given, an OpenMP variable already in the
    environment is kept, so `OMP_NUM_THREADS=4 specwire verifier` still means 4 threads."""

    num_threads: int = option(0, "intra-op CPU threads of this service's forward passes (torch.set_num_threads and "
                              "OMP_NUM_THREADS); 0: OMP_NUM_THREADS when the environment sets it, else the cores "
                              "this process may run on. Services sharing a host should split its cores")
    cpu_wait_policy: str | None = option(None, "how idle OpenMP threads wait (OMP_WAIT_POLICY): passive (sleep, so a "
                                         "colocated service gets the cores) or active (spin: the lowest latency on a "
                                         "host of its own); unset: OMP_WAIT_POLICY when the environment sets it, "
                                         "else passive", parse=str.lower, choices=CPU_WAIT_POLICIES)

    def check_cpu_threads(self) -> None:
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: the cores this process may run on), got {self.num_threads}")
        if self.cpu_wait_policy is not None and self.cpu_wait_policy not in CPU_WAIT_POLICIES:
            raise ValueError(f"cpu_wait_policy must be one of {', '.join(CPU_WAIT_POLICIES)}, "
                             f"got {self.cpu_wait_policy!r}")


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One flag per field of `config_cls` declared with option(); a field without a default (the model path)
    becomes an optional flag, and the command checks it."""
    for f in dataclasses.fields(config_cls):
        meta = f.metadata.get("option")
        if meta is None:
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        parse = meta["parse"] or (parse_bool if isinstance(default, bool) else type(default) if default is not None
                                  else str)
        extra: dict[str, Any] = {"choices": meta["choices"]} if meta["choices"] else {}
        if parse is parse_bool:
            extra.update(nargs="?", const=True)
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        add_flag(parser, flag, default=default, type=parse, help=meta["help"], dest=f.name, show=meta["show"],
                 **extra)


def config_from_args(config_cls: type, args: argparse.Namespace) -> Any:
    """The config the parsed flags describe; its __post_init__ validates it (ValueError)."""
    names = [f.name for f in dataclasses.fields(config_cls) if "option" in f.metadata]
    return config_cls(**{name: getattr(args, name) for name in names})


def env_name(flag: str) -> str:
    return "SPECWIRE_" + flag.lstrip("-").upper().replace("-", "_")


def add_flag(parser: argparse.ArgumentParser, flag: str, *, default=None, type=str, help: str = "",
             show: Any = None, **kwargs) -> None:
    """Add `--flag`, whose default comes from SPECWIRE_FLAG when that is set; `show` formats it for the help."""
    env = env_name(flag)
    if type is bool:
        type = parse_bool
    raw = os.environ.get(env)
    if raw:  # an empty value (a compose override's way to unset) keeps the built-in default
        default = type(raw)
    shown = show(default) if show is not None and default is not None else default
    parser.add_argument(flag, default=default, type=type, help=f"{help} [env {env}; default {shown}]", **kwargs)


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1_000_000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9_.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use a number with an optional unit (K, M, G, GiB...)")
    return int(float(m.group(1).replace("_", "")) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    """1073741824 -> '1GiB' (exact multiples only; otherwise bytes)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def parse_dtype(name: str):  # -> torch.dtype; torch is imported here so the CLI starts without it
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)
