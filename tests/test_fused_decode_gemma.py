"""Gemma 2 and Gemma 3 decode steps through the fused layer stack: the (1 + w) norms, the
post-attention and post-feedforward norms, GELU-tanh, the embedding scale, and each layer reading
its KV-cache group's block tables (sliding and full layers) give the module path's logits bit for
bit, through the engine (tokens and logprobs), with forced preemption too."""
from __future__ import annotations

import types

import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_arch_models import CASES, PROMPTS
from test_models import PagedKV, tpserve_model
from tpserve import LLM, SamplingParams
from tpserve.kernels import cpu_extension
from tpserve.models.fused_decode import why_not_fused
from tpserve.models.packed_gemm import prepack_model

assert cpu_extension.available(), cpu_extension._state.get("error")


def _path(root, name):
    arch, narrow, _ = CASES[name]
    return make_tiny_model(root, arch, **narrow)


def _generate(path, dtype: str, fused: bool, monkeypatch, **options):
    """Greedy tokens and top-3 logprobs of PROMPTS, and the engine's stats; asserts which path
    the decode steps took."""
    monkeypatch.setenv("TPSERVE_FUSED_DECODE", "1" if fused else "0")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    with LLM(str(path), dtype=dtype, block_size=4, **options) as llm:
        runner = llm.engine.executor.runner
        assert runner.kv_group_layout.split  # sliding and full layers: two KV-cache groups
        model = runner.model
        calls = []
        if fused:
            one_process = options.get("tensor_parallel_size", 1) == 1  # else the layer ops
            assert model.fused_decode is not None and (model.fused_decode.stack is not None) == one_process
            real = model.fused_decode
            model.fused_decode = lambda *a: calls.append(1) or real(*a)
        else:
            assert model.fused_decode is None
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert bool(calls) == fused
        stats = llm.stats()
    return [(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items())
                                      for d in o.outputs[0].logprobs]) for o in outs], stats


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma_fused_decode_equals_the_module_path(tiny_models_root, monkeypatch, name, dtype):  # noqa: F811
    path = _path(tiny_models_root, name)
    module, _ = _generate(path, dtype, False, monkeypatch, num_kv_blocks=512)
    fused, _ = _generate(path, dtype, True, monkeypatch, num_kv_blocks=512)
    assert fused == module


def test_gemma3_fused_decode_under_forced_preemption(tiny_models_root, monkeypatch):  # noqa: F811
    path = _path(tiny_models_root, "gemma3")
    # The longest sequence needs 13 blocks of 4 in each of 3 groups at admission: 40 is tight.
    # (A recomputed prompt's keys are the prompt path's, not the decode steps' bits: so the
    # module path under the same preemptions is the reference.)
    module, module_stats = _generate(path, "float32", False, monkeypatch, num_kv_blocks=40)
    fused, stats = _generate(path, "float32", True, monkeypatch, num_kv_blocks=40)
    assert stats["num_preemptions"] > 0 and stats["num_preemptions"] == module_stats["num_preemptions"]
    assert fused == module


def test_gemma_stack_checks_its_groups_and_norms(tiny_models_root):  # noqa: F811
    model = tpserve_model(_path(tiny_models_root, "gemma3"), backend="cpu")
    prepack_model(model)
    PagedKV(model, 1, 16)
    assert model.enable_fused_decode() is None
    stack = model.fused_decode.stack
    stack.set_group(1, 1)  # layer 1 reads a second group's tables
    ids = torch.tensor([3])
    rows = model.model.embed(ids)
    one = [torch.zeros(1, dtype=torch.int32)]
    tables = [torch.zeros(1, 4, dtype=torch.int32)]
    with pytest.raises(ValueError, match="fewer groups"):
        stack.run_groups(rows, torch.tensor([0]), one, tables, torch.tensor([0, 1], dtype=torch.int32),
                         torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="one of each per KV-cache group"):
        stack.run_groups(rows, torch.tensor([0]), one * 2, tables, torch.tensor([0, 1], dtype=torch.int32),
                         torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="layer"):
        stack.set_group(99, 0)
    hidden = model.model.layers[0].input_layernorm.weight
    with pytest.raises(ValueError, match="set_gemma"):
        stack.set_gemma(0, hidden[:-1].contiguous(), hidden)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_fused_decode_under_tensor_parallelism(tiny_models_root, monkeypatch, name):  # noqa: F811
    """TP=2: each layer's two fused ops per rank, each reading its KV-cache group's tables, and
    Gemma's post-norms after the all-reduces, give the module path's tokens and logprobs."""
    path = _path(tiny_models_root, name)
    module, _ = _generate(path, "float32", False, monkeypatch, num_kv_blocks=512, tensor_parallel_size=2)
    fused, _ = _generate(path, "float32", True, monkeypatch, num_kv_blocks=512, tensor_parallel_size=2)
    assert fused == module


def test_several_kv_groups_under_tensor_parallelism_take_the_layer_ops(tiny_models_root):  # noqa: F811
    from tpserve.workers.kv_group_runner import GroupBackend
    model = tpserve_model(make_tiny_model(tiny_models_root, "llama"), backend="cpu")
    prepack_model(model)
    PagedKV(model, 1, 16)
    attn = model.model.layers[1].self_attn
    attn.backend = GroupBackend(attn.backend, 1)  # layer 1 reads a second group
    assert why_not_fused(model) is None  # one process: the stack takes each group's tables
    model.tp = types.SimpleNamespace(size=2, rank=0)
    assert why_not_fused(model) is None  # the layer ops take them under tensor parallelism
