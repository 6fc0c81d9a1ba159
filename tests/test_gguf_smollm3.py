"""SmolLM3 GGUF files (llama.cpp's `smollm3` architecture: Llama's tensors, q/k rows permuted,
no rotary in every fourth layer). transformers reads no such file, so the reference is
transformers' SmolLM3ForCausalLM holding the same weights: greedy tokens equal it in float32,
and the layers without rotary are the ones the config says."""
from __future__ import annotations

import pytest
import torch
from test_gguf_files import (HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, greedy_dequantized,
                             write_model)

from tpserve.config import EngineConfig
from tpserve.gguf_file import materialize
from tpserve.models.loader import load_config
from tpserve.models.spec import model_spec

LAYERS = 4  # the fourth without rotary


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TPSERVE_GGUF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


def test_greedy_equals_transformers_smollm3(tmp_path, monkeypatch):
    import test_gguf_files
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    monkeypatch.setattr(test_gguf_files, "LAYERS", LAYERS)
    path = tmp_path / "tiny-smollm3.gguf"
    expected = write_model(path, "smollm3", types={}, seed=4)  # every tensor F32
    hf = EngineConfig(model=str(path), quantization="none").resolve().hf_config
    assert hf["architectures"] == ["SmolLM3ForCausalLM"] and hf["no_rope_layers"] == [1, 1, 1, 0]
    spec = model_spec(load_config(materialize(path)))
    assert spec.rope_layers == (True, True, True, False)
    prompts = [[5, 17, 99, 3, 8, 1], [200, 201, 7], [42]]
    generated = greedy_dequantized(path, prompts, 6)
    config = SmolLM3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           head_dim=HEAD_DIM,
                           rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                           max_position_embeddings=512, no_rope_layer_interval=4, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    ref = SmolLM3ForCausalLM(config).eval()
    state = {k: torch.from_numpy(v) for k, v in expected.items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    for ids, gen in zip(prompts, generated):
        with torch.no_grad():
            logits = ref(torch.tensor([ids + gen])).logits[0]
        assert logits[len(ids) - 1:-1].argmax(-1).tolist() == gen
