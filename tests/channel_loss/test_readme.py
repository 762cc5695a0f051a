"""The README and docs examples run as printed, and their links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CHANNEL_LOSS_DOC = ROOT / "docs" / "channel_loss.md"


def python_block_after(path: Path, heading: str) -> str:
    """The first fenced python block after ``heading`` (a whole line of ``path``)."""
    text = path.read_text()
    match = re.search(rf"^{re.escape(heading)}$(.*?)^```python\n(.*?)^```$", text, re.M | re.S)
    assert match, f"no python block under {heading!r} in {path.relative_to(ROOT)}"
    return match.group(2)


def run_block(path: Path, heading: str) -> dict:
    code = python_block_after(path, heading)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, f"{path.name}:{heading}", "exec"), namespace)
    return namespace


def test_readme_quick_check_runs():
    namespace = run_block(README, "## One quick check per product")
    obs = namespace["cap"].observations
    assert len(obs) == 1
    assert obs[0].token_losses.shape == namespace["labels"].shape
    assert not obs[0].token_losses.requires_grad
    # What its comment says (regression: it said "0.0 where ignored" with nothing ignored):
    # labels are shifted by one, so position 2 (target labels[3], ignored) and 7 (no next
    # label) are 0.0, every other position is scored.
    zero = (obs[0].token_losses == 0).nonzero().flatten().tolist()
    assert zero == [2, 7]


def test_plain_pytorch_example_runs(capsys):
    metrics = run_block(CHANNEL_LOSS_DOC, "### Plain PyTorch")["metrics"]
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

    code = python_block_after(CHANNEL_LOSS_DOC, "### Hugging Face transformers")
    # The example is exercised for real in test_transformers.py; here: it still uses real names.
    for name in re.findall(r"\b(ChannelLossCallback|patch_model|attach)\b", code):
        assert hasattr(hf, name) or hasattr(hf.ChannelLossCallback, name), name


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


DOCS = [README, ROOT / "harness" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    """Every relative link in the README and docs names a file that exists, and an anchor that
    is one of that file's headings."""
    text = doc.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)
