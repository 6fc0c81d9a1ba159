"""GGUF files as models, the torch-free half: reading a file safely (``reader.py``), its
metadata as a Hugging Face config (``config.py``) and the model directory made from it
(``model_dir.py``). The tensors are read by ``tpserve/models/gguf/``."""
from tpserve.gguf_file.model_dir import gguf_files, materialize, model_dir
from tpserve.gguf_file.reader import GGUFFileError, is_gguf, model_stem

__all__ = ["GGUFFileError", "gguf_files", "is_gguf", "materialize", "model_dir", "model_stem"]
