"""Torch intra-op threads for a block of code, restored after.

Evaluation here runs small batches (a few prompts, sequences or 16x16 grids at a time): with two threads the hand-
offs cost more than the arithmetic (wash's evaluate: 26.5 CPU s on two threads, 3.8 on one, same metrics). The
runtime therefore evaluates on `Paper.eval_threads` threads (default 1); a block that times or runs large tensors
asks for more with `torch_threads(available_cpus())`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def available_cpus() -> int:
    return len(os.sched_getaffinity(0))


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` torch intra-op threads (None: leave the count as it is)."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
