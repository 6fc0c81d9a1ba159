import os

# Triton kernels run on CPU tensors only under the interpreter, and the interpreter is chosen
# when a kernel is decorated: set it before any tpserve.kernels module is imported.
try:
    import torch
    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
