"""Triton kernels run compiled on a GPU and in Triton's interpreter elsewhere.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set here,
before any test module imports the kernels, whenever there is no GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
