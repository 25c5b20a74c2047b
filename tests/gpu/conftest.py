"""Kernel tests run on CPU tensors through Triton's interpreter unless told otherwise.

``TRITON_INTERPRET`` must be set before any module creates its kernels (``triton.jit`` reads it at
decoration time); ``setdefault`` lets a GPU run choose ``TRITON_INTERPRET=0``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
