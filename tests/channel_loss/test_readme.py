"""The README's plain-PyTorch "Channel loss in your loop" example runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_block_after(heading: str) -> str:
    """The first fenced python block after ``heading`` (a whole line of the README)."""
    text = README.read_text()
    match = re.search(rf"^{re.escape(heading)}$(.*?)^```python\n(.*?)^```$", text, re.M | re.S)
    assert match, f"no python block under {heading!r} in README.md"
    return match.group(2)


def test_plain_pytorch_example_runs(capsys):
    code = python_block_after("### Plain PyTorch")
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md:Plain PyTorch", "exec"), namespace)
    metrics = namespace["metrics"]
    # Sample 0 (5 tokens) and 2 (3 tokens) are "web": 4 + 2 scored targets; "code": 3.
    assert metrics["channel_loss_tokens/web"] == 6.0
    assert metrics["channel_loss_tokens/code"] == 3.0
    assert metrics["channel_loss_samples/web"] == 2.0
    assert metrics["channel_loss_dropped_micro_batches"] == 0.0
    assert metrics["channel_loss/web"] > 0
    assert str(metrics["channel_loss/web"]) in capsys.readouterr().out


def test_hf_example_names_the_public_api():
    pytest.importorskip("transformers")
    from channel_loss.integrations import transformers as hf

    code = python_block_after("### Hugging Face transformers")
    # The example is exercised for real in test_transformers.py
    # (test_real_trainer_logs_channel_loss_keys); here: it still uses real names.
    for name in re.findall(r"\b(ChannelLossCallback|patch_model|attach)\b", code):
        assert hasattr(hf, name) or hasattr(hf.ChannelLossCallback, name), name
