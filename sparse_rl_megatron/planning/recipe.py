"""Plan a training recipe as it is written: ``sparse-rl plan --config configs/recipes/qwen2.5-7b/rkv.yaml``.

The recipe (``TrainConfig``, with its includes and ``key=value`` overrides, as ``sparse-rl train`` reads it) gives the
layout (``learner.*_parallel_size``, ``launch.gpus``), the batch (prompts x samples, ``rollout.sampling.max_new_tokens``),
the learner's memory choices (``max_tokens_per_device``, ``logprob_chunk_tokens``, ``params_dtype``, the layer spec,
the distributed optimizer, ``megatron_overrides.recompute_granularity``, ``offload``, a KL reference when
``loss.kl_coef > 0``) and the engines' (``rollout.gpus_per_engine``, ``rollout.compression`` as the server is started,
``rollout.sglang``: ``mem_fraction_static``, ``memory_saver``, ``max_running_requests``, ``max_total_tokens``,
``kept_digest``; ``sync.bucket_mb``). What a recipe does not say comes from the command line: the GPU's memory and
GPUs per node, the prompt length (``--prompt-len``), and ``--mem-fraction`` when ``mem_fraction_static`` is unset.

The model: ``--model``, else the recipe's ``model_path`` when it is an HF directory here, else the bundled config its
directory name starts with (``/models/Qwen2.5-7B-Instruct`` -> ``qwen2.5-7b``; the longest bundled name followed by
the end or ``-``). GPU recipes' settings resolve as on CUDA: ``params_dtype: auto`` is bfloat16, ``layer_spec: auto``
Transformer Engine (fused kernels), an unset distributed optimizer on.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparse_rl_megatron.planning.inputs import GIB, BatchShape, Layout, LearnerSetting, RolloutSetting

DEFAULT_MEM_FRACTION = RolloutSetting.mem_fraction
"""The planner's ``--mem-fraction`` default, for a recipe that leaves ``mem_fraction_static`` to SGLang."""


@dataclass(frozen=True)
class RecipePlan:
    """What ``build_plan`` takes, read from a recipe."""

    model: str
    layout: Layout
    batch: BatchShape
    learner: LearnerSetting
    rollout: RolloutSetting
    compression: object
    """The ``CompressionConfig`` the engines' servers start with (dense: method ``none``)."""


def bundled_name_of(model_path: str) -> str:
    """The bundled config a model directory's name starts with (case-insensitive, the longest such name followed
    by the end or ``-``), e.g. ``/models/Qwen2.5-7B-Instruct`` -> ``qwen2.5-7b``."""
    from sparse_rl_megatron.models.catalog import known_models

    base = Path(model_path.rstrip("/")).name.lower()
    matches = [n for n in known_models() if base == n or base.startswith(n + "-")]
    if not matches:
        raise ValueError(f"the recipe's model_path '{model_path}' names no bundled config (valid names: "
                         f"{', '.join(known_models())}); give --model NAME or an HF checkpoint directory")
    return max(matches, key=len)


def recipe_model(model_path: str) -> str:
    """``model_path`` when it is an HF directory here (its config.json is read), else its bundled name."""
    if (Path(model_path) / "config.json").is_file():
        return model_path
    return bundled_name_of(model_path)


def _recompute(overrides: dict) -> bool:
    granularity = overrides.get("recompute_granularity")
    if granularity not in (None, "full"):
        raise ValueError(f"learner.megatron_overrides.recompute_granularity={granularity!r} is not planned; "
                         "valid: full or unset")
    return granularity == "full"


def read_recipe(path: str | Path, overrides: list[str] | None = None, *, model: str | None = None,
                gpus_per_node: int = 8, gpu_memory_gib: float = 80.0, prompt_len: int = 512,
                mem_fraction: float | None = None) -> RecipePlan:
    """The plan inputs of the recipe at ``path`` (``overrides``: ``key=value`` as ``sparse-rl train`` takes them);
    ``mem_fraction`` (``--mem-fraction``) only for a recipe without ``rollout.sglang.mem_fraction_static``."""
    from sparse_rl_megatron.planning.kv import kv_bytes_per_token
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.models.catalog import hf_config
    from sparse_rl_megatron.trainer.config import TrainConfig
    from sparse_rl_megatron.utils.config_io import load_config

    cfg = load_config(TrainConfig, path, overrides)
    if cfg.rollout.engine != "sglang":
        raise ValueError(f"the recipe's rollout.engine is '{cfg.rollout.engine}'; sparse-rl plan plans colocated "
                         "SGLang engines (valid: sglang)")
    if cfg.launch.gpus is None:
        raise ValueError("the recipe has no launch.gpus; give it as an override: launch.gpus=N")
    le, ro, sg = cfg.learner, cfg.rollout, cfg.rollout.sglang
    tp, pp = le.tensor_parallel_size, le.pipeline_parallel_size
    if cfg.launch.gpus % (tp * pp):
        raise ValueError(f"launch.gpus={cfg.launch.gpus} is not a multiple of the learner's TP x PP = {tp * pp}")
    layout = Layout(tp, pp, cfg.launch.gpus // (tp * pp), gpus_per_node, gpu_memory_gib, ep=le.expert_parallel_size,
                    etp=le.expert_tensor_parallel_size)
    batch = BatchShape(ro.prompts_per_step, ro.samples_per_prompt, prompt_len, ro.sampling.max_new_tokens)
    dist_opt = le.optim.use_distributed_optimizer
    learner = LearnerSetting(
        params_dtype="bfloat16" if le.params_dtype == "auto" else le.params_dtype,
        distributed_optimizer=True if dist_opt is None else dist_opt, recompute=_recompute(le.megatron_overrides),
        kernels="local" if le.layer_spec == "local" else "fused", max_tokens_per_device=le.max_tokens_per_device,
        logprob_chunk_tokens=le.logprob_chunk_tokens, reference_model=le.loss.kl_coef > 0, offload=le.offload)
    if sg.mem_fraction_static is not None and mem_fraction is not None:
        raise ValueError("--mem-fraction is the recipe's rollout.sglang.mem_fraction_static with --config; change it "
                         "with the override rollout.sglang.mem_fraction_static=F")
    fraction = sg.mem_fraction_static if sg.mem_fraction_static is not None else mem_fraction or DEFAULT_MEM_FRACTION
    name = model or recipe_model(cfg.model_path)
    kv_pool = None
    if sg.max_total_tokens is not None:  # a pool given in tokens
        arch = arch_from_hf_config(hf_config(name))
        kv_pool = sg.max_total_tokens * kv_bytes_per_token(arch, ro.dtype, ro.gpus_per_engine) / GIB
    rollout = RolloutSetting(tp=ro.gpus_per_engine, kv_dtype=ro.dtype,
                             mem_fraction=fraction,
                             kv_pool_gib=kv_pool, max_running_requests=sg.max_running_requests,
                             kept_digest=sg.kept_digest, memory_saver=sg.memory_saver, bucket_mb=cfg.sync.bucket_mb)
    return RecipePlan(model=name, layout=layout, batch=batch, learner=learner, rollout=rollout,
                      compression=ro.server_compression())
