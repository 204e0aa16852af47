"""The reference policy's compression section is a valid CompressionConfig."""

from pathlib import Path

import yaml

from snapkv_sessions import CompressionConfig


def test_default_policy_compression_section_validates():
    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "policies" / "default.yaml").read_text())
    cfg = CompressionConfig.make(**data["compression"])
    assert cfg.budget == 1024 and cfg.window == 32 and cfg.strategy == "uniform"
