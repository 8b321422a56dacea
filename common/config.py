"""Helpers for service configs (no torch import: the CLI uses them): every CLI flag `--foo-bar` has an environment twin `SPECWIRE_FOO_BAR`."""

from __future__ import annotations

import argparse
import os
import re

DTYPES = ("float32", "bfloat16", "float16", "float64")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def env_name(flag: str) -> str:
    return "SPECWIRE_" + flag.lstrip("-").upper().replace("-", "_")


def add_flag(parser: argparse.ArgumentParser, flag: str, *, default=None, type=str, help: str = "", **kwargs) -> None:
    """Add `--flag`, whose default comes from SPECWIRE_FLAG when that is set."""
    env = env_name(flag)
    if type is bool:
        type = parse_bool
    raw = os.environ.get(env)
    if raw is not None:
        default = type(raw)
    parser.add_argument(flag, default=default, type=type, help=f"{help} [env {env}; default {default}]", **kwargs)


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1_000_000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9_.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use a number with an optional unit (K, M, G, GiB...)")
    return int(float(m.group(1).replace("_", "")) * _UNITS[m.group(2).lower()])


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
