import os

# Test processes share 2 cores with their own worker processes: OpenMP threads that spin at
# barriers while a peer thread is descheduled make every parallel region cost a time slice.
# Sleeping waiters avoid that. Set before torch (and its OpenMP runtime) is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Triton kernels run on CPU tensors only under the interpreter, and the interpreter is chosen
# when a kernel is decorated: set it before any tpserve.kernels module is imported.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
