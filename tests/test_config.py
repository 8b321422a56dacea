"""Service configs: each dataclass field is a CLI flag with the same default, an environment twin, and the
dataclass's validation."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.config import add_config_flags, config_from_args, parse_bytes
from draft_service.config import DraftConfig
from verifier_service.config import VerifierConfig


def _parse(config_cls, argv, monkeypatch=None, env=None):
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_config_flags(parser, config_cls)
    return config_from_args(config_cls, parser.parse_args(argv))


@pytest.mark.parametrize("config_cls", [VerifierConfig, DraftConfig])
def test_flag_defaults_are_the_dataclass_defaults(config_cls):
    assert _parse(config_cls, ["--model", "m"]) == config_cls(model="m")


def test_every_field_is_a_flag():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, DraftConfig)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(DraftConfig)} <= dests


def test_flags_parse_sizes_bools_and_renamed_flags():
    config = _parse(DraftConfig, ["--model", "m", "--kv-cache-memory", "2GiB", "--adaptive-k", "--connect-timeout",
                                  "5", "--wire-mode", "one-hot"])
    assert config.kv_cache_memory == 2 << 30 and config.adaptive_k is True and config.connect_timeout_s == 5.0
    assert config.wire_mode == "one-hot"
    assert _parse(VerifierConfig, ["--model", "m", "--num-blocks", "12"]).num_blocks == 12


def test_environment_twins(monkeypatch):
    config = _parse(VerifierConfig, [], monkeypatch, {"SPECWIRE_MODEL": "/m", "SPECWIRE_KV_CACHE_MEMORY": "256MiB",
                                                      "SPECWIRE_MAX_DRAFT_TOKENS": "8"})
    assert (config.model, config.kv_cache_memory, config.max_draft_tokens) == ("/m", 256 << 20, 8)
    assert _parse(DraftConfig, ["--model", "m"], monkeypatch, {"SPECWIRE_ADAPTIVE_K": "true"}).adaptive_k is True


def test_validation_runs_on_parsed_flags():
    with pytest.raises(ValueError, match="model"):
        _parse(VerifierConfig, [])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _parse(VerifierConfig, ["--model", "m", "--max-draft-tokens", "64", "--max-num-batched-tokens", "32"])


def test_draft_prefill_budget_and_prompt_size_flags(monkeypatch):
    config = _parse(DraftConfig, ["--model", "m", "--max-num-batched-tokens", "512"], monkeypatch,
                    {"SPECWIRE_MAX_PROMPT_BYTES": "1MiB"})
    assert (config.max_num_batched_tokens, config.max_prompt_bytes) == (512, 1 << 20)
    assert DraftConfig(model="m").max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        DraftConfig(model="m", max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_prompt_bytes"):
        DraftConfig(model="m", max_prompt_bytes=0)


def test_the_opening_wait_flag_is_parsed_and_bounded(monkeypatch):
    assert DraftConfig(model="m").opening_wait_ms == 10.0
    assert _parse(DraftConfig, ["--model", "m", "--opening-wait-ms", "25"], monkeypatch).opening_wait_ms == 25.0
    assert _parse(DraftConfig, ["--model", "m", "--opening-wait-ms", "0"], monkeypatch).opening_wait_ms == 0.0
    for bad in ("-1", "1001", "nan"):
        with pytest.raises(ValueError, match="opening_wait_ms"):
            _parse(DraftConfig, ["--model", "m", "--opening-wait-ms", bad], monkeypatch)


@pytest.mark.parametrize("flag,value,fragment", [
    ("--max-streams", "0", "max_streams"),
    ("--max-sequences", "0", "max_sequences"),
    ("--max-waiting-tokens", "-1", "max_waiting_tokens"),
    ("--max-q-support", "0", "max_q_support"),
    ("--max-pending-commands", "0", "max_pending_commands"),
    ("--max-stream-backlog", "0", "max_stream_backlog"),
    ("--max-protocol-errors", "0", "max_protocol_errors"),
    ("--handshake-timeout", "0", "handshake_timeout_s"),
    ("--handshake-timeout", "nan", "handshake_timeout_s"),
])
def test_verifier_limits_are_validated(flag, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        _parse(VerifierConfig, ["--model", "m", flag, value])


def test_the_verifier_accepts_what_the_draft_sends_by_default():
    """A draft's q has at most --q-max-support tokens per position: the verifier's default takes it."""
    assert VerifierConfig(model="m").max_q_support >= DraftConfig(model="m").q_max_support


def test_speculation_modes_parse_and_adaptive_k_is_their_older_name(monkeypatch):
    assert DraftConfig(model="m").speculation_mode == "auto"  # the default: the verifier chooses
    assert _parse(DraftConfig, ["--model", "m", "--speculation", "fixed"], monkeypatch).speculation_mode == "fixed"
    assert _parse(DraftConfig, ["--model", "m", "--adaptive-k"], monkeypatch).speculation_mode == "adaptive"
    assert _parse(DraftConfig, ["--model", "m"], monkeypatch,
                  {"SPECWIRE_SPECULATION": "adaptive"}).speculation_mode == "adaptive"
    with pytest.raises(ValueError, match="speculation"):
        DraftConfig(model="m", speculation="sometimes")
    assert VerifierConfig(model="m").goodput is True
    assert _parse(VerifierConfig, ["--model", "m", "--goodput", "false"], monkeypatch).goodput is False
    assert _parse(VerifierConfig, ["--model", "m", "--goodput-switch-tolerance", "0.2"],
                  monkeypatch).goodput_switch_tolerance == 0.2
    with pytest.raises(ValueError, match="goodput_switch_tolerance"):
        VerifierConfig(model="m", goodput_switch_tolerance=-0.1)
    assert _parse(VerifierConfig, ["--model", "m", "--goodput-defer-tolerance", "0.3"],
                  monkeypatch).goodput_defer_tolerance == 0.3
    with pytest.raises(ValueError, match="goodput_defer_tolerance"):
        VerifierConfig(model="m", goodput_defer_tolerance=1.5)
    assert _parse(VerifierConfig, ["--model", "m", "--goodput-plain-margin", "0.05"],
                  monkeypatch).goodput_plain_margin == 0.05
    with pytest.raises(ValueError, match="goodput_plain_margin"):
        VerifierConfig(model="m", goodput_plain_margin=1.0)


def test_parse_bytes():
    assert parse_bytes("1GiB") == 1 << 30 and parse_bytes("512M") == 512 << 20 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.parametrize("config_cls", [VerifierConfig, DraftConfig])
def test_cuda_graphs_is_on_off_or_left_to_the_device(config_cls, monkeypatch):
    assert _parse(config_cls, ["--model", "m"]).cuda_graphs is None  # unset: common.static_forward chooses
    assert _parse(config_cls, ["--model", "m", "--cuda-graphs"]).cuda_graphs is True
    assert _parse(config_cls, ["--model", "m", "--cuda-graphs", "false"]).cuda_graphs is False
    assert _parse(config_cls, ["--model", "m"], monkeypatch, {"SPECWIRE_CUDA_GRAPHS": "0"}).cuda_graphs is False
    # compose's way to unset a variable: the default stays the device's choice
    assert _parse(config_cls, ["--model", "m"], monkeypatch, {"SPECWIRE_CUDA_GRAPHS": ""}).cuda_graphs is None
