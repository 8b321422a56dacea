"""Service configs: each dataclass field is a CLI flag with the same default, an environment twin, and the
dataclass's validation."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.config import add_config_flags, config_from_args
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
