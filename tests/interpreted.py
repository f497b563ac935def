"""Running the CUDA kernels' tests on CPU memory: a script in a process of its own under Triton's
interpreter (it must be set before Triton is imported), with the tests folder importable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def run_under_triton_interpreter(script: str) -> subprocess.CompletedProcess:
    """``script`` run by this Python with ``TRITON_INTERPRET=1``; skipped where CUDA is present
    (the kernels run on the GPU there, in the CUDA tests, and older Tritons cannot interpret
    them). Triton itself must be installed (make installs it): a missing Triton fails."""
    import triton  # noqa: F401

    if torch.cuda.is_available():
        pytest.skip("the kernels run on the GPU in the CUDA tests (older Tritons cannot interpret them)")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
