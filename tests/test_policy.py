"""Policies: the reference YAMLs validate; invalid ones raise PolicyError naming the field path and value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from snapkv_sessions.policy import POLICY_DIR, Policy, PolicyError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["default", "rag-qa", "agent-strict"])
def test_reference_policies_validate(name):
    policy = Policy.load(name)
    assert policy.name == name
    assert Policy.load(POLICY_DIR / f"{name}.yaml") == policy
    assert len(policy.sha256) == 64 and Policy.from_yaml(policy.canonical_json()) == policy


def test_default_yaml_is_the_default_policy():
    assert Policy.load("default") == Policy() == Policy.load(None)
    strict = Policy.load("agent-strict")
    assert strict.pins.roles == ("system", "developer", "tool_schema") and strict.compression.budget == 2048
    rag = Policy.load("rag-qa")
    assert rag.compression.budget is None and rag.compression.budget_ratio == 0.2


@pytest.mark.parametrize(
    ("yaml_text", "field", "value"),
    [
        ("compression: {budget: 64, windw: 8}", "compression.windw", 8),
        ("bogus: 1", "bogus", 1),
        ("compression: {budget: -5}", "compression.budget", -5),
        ("compression: {budget: 32, window: 32}", "compression.budget", 32),
        ("compression: {budget: 16, window: 32}", "compression.budget", 16),
        ("pins: {patterns: ['(unclosed']}", "pins.patterns", ["(unclosed"]),
        ("pins: {roles: [admin]}", "pins.roles", ["admin"]),
        ("pins: {sink_tokens: -1}", "pins.sink_tokens", -1),
        ("drift: {action: explode}", "drift.action", "explode"),
        ("drift: {threshold: 3}", "drift.threshold", 3),
        ("compression: {budget: 64, window: 8}\npins: {sink_tokens: 60}", "pins.sink_tokens", 60),
        ("limits: {max_document_tokens: 0}", "limits.max_document_tokens", 0),
    ],
)
def test_invalid_policy_names_field(yaml_text, field, value):
    with pytest.raises(PolicyError) as err:
        Policy.from_yaml(yaml_text)
    assert err.value.param == field and err.value.value == value
    assert str(err.value).startswith(f"{field}={value!r}: ")


def test_yaml_goes_through_safe_load():
    with pytest.raises(PolicyError, match="not valid YAML"):
        Policy.from_yaml("!!python/object/apply:os.system ['true']")


def test_unknown_policy_name():
    with pytest.raises(PolicyError, match=r"^policy='no-such-policy': no such file"):
        Policy.load("no-such-policy")


def test_policy_and_store_import_no_torch():
    code = ("import sys, snapkv_sessions.policy, snapkv_sessions.store; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
