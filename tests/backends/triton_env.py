"""What every Triton test module needs first: the interpreter switched on before triton is
imported when there is no CUDA device, the device the kernels run on, and the gpu marks."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

TRITON_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (ci/requirements-gpu.txt)"),
]
