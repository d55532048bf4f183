"""The complete layer of docs/pytorch.md, run as the page shows it.

The page's code block that follows the marker `<!-- tested: bindings/torch/tests/test_doc.py -->`
is executed on every rank of the job; its main() trains a few steps and returns the losses.
Checked: the loss goes down, and the dense (router) weights stay the same on every rank
(the dense hook averages their gradients over the batches).
"""

from __future__ import annotations

import pathlib
import re

import torch
import torch.distributed as dist

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "pytorch.md"
MARKER = "<!-- tested: bindings/torch/tests/test_doc.py -->"


def extract() -> str:
    text = DOC.read_text()
    at = text.index(MARKER)
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, at)
    if m is None:
        raise AssertionError(f"no python block after the marker in {DOC}")
    return m.group(1)


def run_example():
    code = extract()
    ns: dict = {"__name__": "epx_doc_example"}
    exec(compile(code, str(DOC), "exec"), ns)
    losses, model = ns["main"]()
    if not losses[-1] < losses[0]:
        raise AssertionError(f"the example's loss did not go down: {losses}")
    w = model.router.weight.detach().clone()
    all_w = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(all_w, w)
    for r, other in enumerate(all_w):
        if not torch.equal(other, w):
            raise AssertionError(f"router weights differ between this rank and rank {r}")


def cases(W: int):
    return [("docs/pytorch.md: the complete layer runs and trains", run_example)]
