"""HF config -> ModelArch per family, and refusal of bad layouts / configs with messages naming the field."""
import json

import pytest

from sparse_rl_megatron.learner.batch import SequenceBatch, plan_micro_batches
from sparse_rl_megatron.learner.config import LearnerConfig, OptimConfig
from sparse_rl_megatron.models.arch import arch_from_hf_config

QWEN25_7B = {  # the fields of Qwen2.5-7B-Instruct's config.json (older transformers: top-level rope_theta)
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 32768, "hidden_act": "silu",
    "use_sliding_window": False, "torch_dtype": "bfloat16",
}


def test_qwen25_7b_config():
    a = arch_from_hf_config(QWEN25_7B)
    assert (a.family, a.num_attention_heads, a.num_query_groups, a.heads_per_group, a.head_dim) == ("qwen2", 28, 4, 7, 128)
    assert a.qkv_bias and not a.tie_word_embeddings and a.rope_theta == 1e6 and a.hf_dtype == "bfloat16"
    assert a.padded_vocab_size(4) == 152064


def test_transformers5_rope_parameters_and_llama():
    cfg = dict(QWEN25_7B, model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg.pop("rope_theta")
    a = arch_from_hf_config(cfg)
    assert a.family == "llama" and a.rope_theta == 5e5 and not a.qkv_bias


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral"}, "unknown model family.*'mistral'; valid names: llama, qwen2"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported; valid: default"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported for qwen2"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias=True is not supported for llama"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias=True is not supported for llama"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(dict(QWEN25_7B, **change))


def test_tp_that_does_not_divide_heads_is_refused_before_any_process_group(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN25_7B, num_attention_heads=14, num_key_value_heads=2,
                                                          hidden_size=112, intermediate_size=128)))
    from sparse_rl_megatron.learner import Learner

    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide num_attention_heads=14, "
                                         r"num_query_groups \(num_key_value_heads\)=2"):
        Learner(LearnerConfig(model_path=str(tmp_path), tensor_parallel_size=4))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 does not divide num_layers=28; valid values: "
                                         r"\[1, 2, 4, 7, 14, 28\]"):
        Learner(LearnerConfig(model_path=str(tmp_path), pipeline_parallel_size=3))


@pytest.mark.parametrize("kwargs,message", [
    (dict(params_dtype="fp8"), "params_dtype must be one of auto, float32, bfloat16"),
    (dict(batch_layout="ragged"), "LearnerConfig.batch_layout: unknown batch layout 'ragged'; valid names: packed, padded"),
    (dict(layer_spec="fused"), "LearnerConfig.layer_spec: unknown layer spec 'fused'; valid names: auto, local, te"),
    (dict(max_tokens_per_device=0), "max_tokens_per_device must be >= 1"),
    (dict(megatron_overrides={"context_parallel_size": 2}),
     r"megatron_overrides.context_parallel_size: context parallel is not supported .* valid: 1, got 2"),
    (dict(megatron_overrides={"sequence_parallel": True}),
     "sequence_parallel=True splits the sequence over the tensor-parallel ranks and needs tensor_parallel_size >= 2"),
    (dict(optim=None), None),
])
def test_learner_config_validation(kwargs, message):
    if message is None:
        with pytest.raises(ValueError, match="lr_decay_style must be one of constant, linear, cosine"):
            OptimConfig(lr_decay_style="step")
        return
    with pytest.raises(ValueError, match=message):
        LearnerConfig(model_path="x", **kwargs)


def test_sequence_batch_validation():
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        SequenceBatch.from_lists([[1], []], [[2], [3]])
    with pytest.raises(ValueError, match=r"row 0: token ids must be in \[0, 10\), got min 1, max 12"):
        SequenceBatch.from_lists([[1]], [[12]]).check_vocab(10)
    with pytest.raises(ValueError, match="unknown batch layout 'ragged'; valid names: packed, padded"):
        plan_micro_batches([3], [0], 8, "ragged")


def test_train_batch_shapes_are_checked():
    import torch

    from sparse_rl_megatron.algo import prepare_correction
    from sparse_rl_megatron.learner import TrainBatch

    seqs = SequenceBatch.from_lists([[1, 2], [3]], [[4, 5, 6], [7]])
    wide = torch.ones(2, 5, dtype=torch.bool)
    prepared = prepare_correction(torch.zeros(2, 5) - 1, torch.zeros(2, 5) - 1, wide, torch.tensor([1.0, 0.0]),
                                  torch.tensor([0, 0]))
    TrainBatch(seqs, prepared)  # T = 5 >= the longest response (3): fine, extra columns are padding
    short = prepare_correction(torch.zeros(2, 2) - 1, torch.zeros(2, 2) - 1, torch.ones(2, 2, dtype=torch.bool),
                               torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"shape \[2, 2\], but the sequences need \[B, T\] with B = 2 and T >= 3"):
        TrainBatch(seqs, short)
    with pytest.raises(ValueError, match="ref_log_probs has shape"):
        TrainBatch(seqs, prepared, ref_log_probs=torch.zeros(2, 3))
