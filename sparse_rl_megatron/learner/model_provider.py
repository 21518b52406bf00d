"""Build this pipeline stage's megatron-core ``GPTModel`` for a ``ModelArch``.

The Transformer Engine layer spec is used when megatron-core could import TE and CUDA is present ("auto"),
the local (pure megatron-core) spec otherwise. "Could import" is megatron's own ``HAVE_TE`` flag: a TE
that is installed but broken (e.g. built against another CUDA) is not usable, and "auto" then falls back
to the local spec with a warning. The vocabulary is padded to a multiple that TP divides; the true
size is kept on the model (``true_vocab_size``) so log-probs and exports never expose padded rows.
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import torch

from sparse_rl_megatron.models.arch import DEFAULT_VOCAB_MULTIPLE, ModelArch
from sparse_rl_megatron.models.megatron_config import transformer_config
from sparse_rl_megatron.models.rope import apply_rope_scaling

from sparse_rl_megatron.utils.device import DeviceFacts, resolve
from sparse_rl_megatron.utils.registry import Registry
from sparse_rl_megatron.learner import cpu_compat
from sparse_rl_megatron.learner.moe_aux_loss import LoadBalancingShare, router_class

LAYER_SPECS: Registry[str] = Registry("layer spec")
LAYER_SPECS.add("auto", "Transformer Engine when megatron-core can use it with CUDA, else local")
LAYER_SPECS.add("local", "megatron-core's own modules (runs on CPU)")
LAYER_SPECS.add("te", "Transformer Engine modules (GPU)")

EXPERT_KERNELS: Registry[str] = Registry("expert kernels")
EXPERT_KERNELS.add("auto", "grouped with the Transformer Engine spec, sequential with the local one")
EXPERT_KERNELS.add("grouped", "Transformer Engine's TEGroupedMLP: a layer's local experts in one grouped GEMM (GPU)")
EXPERT_KERNELS.add("sequential", "megatron-core's SequentialMLP: one GEMM per local expert, one after the other")


def te_installed() -> bool:
    """A ``transformer_engine`` package is on the path (it may still fail to import)."""
    return importlib.util.find_spec("transformer_engine") is not None


def te_available(facts: DeviceFacts | None = None) -> bool:
    """Transformer Engine usable: a GPU is present (``facts``, default: this machine; TE has no CPU kernels) and
    megatron-core imported TE (its ``HAVE_TE`` flag, which its TE layer spec needs)."""
    if not resolve(facts).cuda:
        return False
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def _te_missing_reason(facts: DeviceFacts) -> str:
    if not facts.cuda:
        return "no CUDA device"
    if te_installed():
        return ("transformer_engine is installed but megatron-core cannot import it (its HAVE_TE is False; "
                "`python -c 'import transformer_engine.pytorch'` shows why)")
    return "transformer_engine is not installed"


def resolve_layer_spec(name: str = "auto", facts: DeviceFacts | None = None) -> str:
    """``te`` or ``local``: the spec ``name`` (``te``, ``local``, ``auto``) stands for on the device ``facts``
    (default: this machine).

    ``te`` without a usable TE is refused with the reason; ``auto`` falls back to ``local``, with a warning
    when a TE is installed but unusable (its kernels were expected and will not run).
    """
    LAYER_SPECS.check(name, "layer_spec")
    if name == "local":
        return "local"
    facts = resolve(facts)
    if te_available(facts):
        return "te"
    if name == "te":
        raise RuntimeError(f"layer_spec='te' needs Transformer Engine and a CUDA device "
                           f"({_te_missing_reason(facts)}); use 'local' or 'auto'")
    if facts.cuda and te_installed():
        warnings.warn(f"layer_spec='auto': {_te_missing_reason(facts)}; using the local megatron-core spec",
                      RuntimeWarning, stacklevel=2)
    return "local"


def resolve_expert_kernels(name: str, spec: str) -> str:
    """``grouped`` or ``sequential``: the experts' kernels ``name`` (of ``EXPERT_KERNELS``) stands for under the
    resolved layer ``spec`` (``te`` or ``local``). ``auto``: grouped GEMM with Transformer Engine (the GPU default),
    the sequential experts otherwise; ``grouped`` without TE is refused (megatron-core's legacy ``GroupedMLP`` of
    the local spec needs the ``grouped_gemm`` package and a GPU, and is not offered)."""
    EXPERT_KERNELS.check(name, "learner.moe.experts")
    if name == "auto":
        return "grouped" if spec == "te" else "sequential"
    if name == "grouped" and spec != "te":
        raise ValueError(f"learner.moe.experts='grouped' needs the Transformer Engine layer spec (layer_spec 'te', or "
                         f"'auto' on a GPU with TE); the layer spec here is {spec!r}; valid: auto, sequential")
    return name


def layer_spec(name: str = "auto", qk_layernorm: bool = False, facts: DeviceFacts | None = None,
               num_experts: int | None = None, moe_grouped_gemm: bool = False, router=None):
    """The transformer-layer ``ModuleSpec`` of ``resolve_layer_spec(name, facts)``; ``qk_layernorm``: per-head
    RMSNorm of q and k (Qwen3); ``num_experts``: a mixture-of-experts MLP (megatron-core's ``MoELayer``; local
    spec: one ``SequentialMLP`` expert after the other, ``moe_grouped_gemm`` needs Transformer Engine), with
    ``router`` (a ``MoESubmodules.router`` builder) in place of megatron-core's ``TopKRouter`` when given."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if resolve_layer_spec(name, facts) == "te":
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                          qk_layernorm=qk_layernorm)
    else:
        if moe_grouped_gemm:
            raise ValueError("moe_grouped_gemm=True needs the Transformer Engine layer spec ('te'); the local spec runs "
                             "the experts one after the other (SequentialMLP)")
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                        qk_layernorm=qk_layernorm)
    if num_experts is not None and router is not None:
        spec.submodules.mlp.submodules.router = router
    return spec


def check_sequence_parallel(spec_name: str, overrides: dict[str, Any] | None,
                            facts: DeviceFacts | None = None) -> None:
    """Refuse ``sequence_parallel`` (a megatron override) where megatron-core cannot run it.

    Sequence parallel needs norms that take part in it (their weight gradients are all-reduced over the TP
    ranks): Transformer Engine's. megatron's torch norm, which the local spec builds without TE (and apex),
    asserts instead, deep inside the model build; this says so first, naming the setting.
    """
    if not (overrides or {}).get("sequence_parallel", False):
        return
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub = layer_spec(spec_name, facts=facts).submodules
    norms = {"input_layernorm": sub.input_layernorm, "pre_mlp_layernorm": sub.pre_mlp_layernorm,
             "final_layernorm": transformer_block.LayerNormImpl}
    torch_norms = [name for name, n in norms.items() if getattr(n, "module", n) is WrappedTorchNorm]
    if torch_norms:
        raise ValueError(
            "LearnerConfig.megatron_overrides.sequence_parallel=True needs Transformer Engine norms (layer_spec "
            f"'te', or 'auto' on a GPU with TE); the {spec_name!r} spec here builds megatron's torch norm for "
            f"{', '.join(torch_norms)}, which does not support sequence parallel"
        )


def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class LearnerGPTModel(GPTModel):
        """``GPTModel`` that can stop before the LM head and return the final hidden states.

        With ``return_hidden=True`` the last stage's forward returns ``[s, b, h]`` (after the final norm);
        ``learner/logprobs.py`` then applies the vocab-parallel head in sequence chunks, so full
        ``[s, b, vocab]`` logits are never built. ``_postprocess`` is the one private megatron-core hook
        used; it receives the decoder output as ``hidden_states`` in 0.16 and later.
        """

        return_hidden: bool = False
        true_vocab_size: int = 0
        load_balancing = None  # LoadBalancingShare of the MoE routers (learner/moe_aux_loss.py)

        def _postprocess(self, hidden_states, *args, **kwargs):
            if self.return_hidden and self.post_process and not self.mtp_process:
                return hidden_states
            return super()._postprocess(hidden_states, *args, **kwargs)

        def output_weight(self):
            """The LM-head weight of this stage (the embedding when tied), ``[padded_vocab / tp, h]``."""
            if self.share_embeddings_and_output_weights:
                return self.shared_embedding_or_output_weight()
            return self.output_layer.weight

    return LearnerGPTModel


@cpu_compat.in_device_mode
def build_stage_model(
    arch: ModelArch,
    *,
    params_dtype: torch.dtype = torch.float32,
    spec: str = "auto",
    vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE,
    overrides: dict[str, Any] | None = None,
    facts: DeviceFacts | None = None,
    moe_aux_loss_coeff: float = 0.0,
    moe_router_dtype: str = "params",
    moe_experts: str = "auto",
    moe_routing_replay: bool = False,
):
    """This rank's stage of the model (parallel state must be initialised), on the GPU when ``facts`` (default:
    this machine) has CUDA. Weights are random until loaded. A mixture of experts takes the expert layout of the
    parallel state, ``moe_aux_loss_coeff``, ``moe_router_dtype``, the experts' kernels ``moe_experts``
    (``resolve_expert_kernels``) and ``moe_routing_replay`` (``models.megatron_config.moe_config``); its routers normalise the load-balancing loss through ``model.load_balancing`` (``learner/moe_aux_loss.py``)."""
    from megatron.core import parallel_state as ps

    facts = resolve(facts)
    spec = resolve_layer_spec(spec, facts)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    moe = None
    if arch.moe is not None:
        moe = dict(expert_parallel_size=ps.get_expert_model_parallel_world_size(),
                   expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
                   aux_loss_coeff=moe_aux_loss_coeff, router_dtype=moe_router_dtype,
                   grouped_gemm=resolve_expert_kernels(moe_experts, spec) == "grouped",
                   routing_replay=moe_routing_replay)
    config = transformer_config(
        arch, tensor_parallel_size=tp, pipeline_parallel_size=pp, params_dtype=params_dtype, overrides=overrides,
        cuda=facts.cuda, moe=moe,
    )
    load_balancing = LoadBalancingShare()
    cls = _gpt_model_class()
    model = cls(
        config=config,
        transformer_layer_spec=layer_spec(
            spec, qk_layernorm=arch.qk_norm, facts=facts,
            num_experts=arch.moe.num_experts if arch.moe is not None else None,
            moe_grouped_gemm=bool(config.moe_grouped_gemm), router=router_class(load_balancing)),
        vocab_size=arch.padded_vocab_size(tp, vocab_multiple),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    apply_rope_scaling(model, arch)
    model.true_vocab_size = arch.vocab_size
    model.load_balancing = load_balancing
    if facts.cuda:
        model.cuda(torch.cuda.current_device())
    return model


def expert_module_name(model) -> str | None:
    """The class of this stage's routed experts (``TEGroupedMLP``, ``SequentialMLP``, ...); None for a dense model
    (or a stage without MoE layers)."""
    for layer in unwrap(model).decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            return type(experts).__name__
    return None


def expert_offset(model) -> int:
    """The global index of this rank's first routed expert (``ep_rank x experts / EP``); 0 for a dense model."""
    from megatron.core import parallel_state as ps

    config = unwrap(model).config
    if config.num_moe_experts is None:
        return 0
    return ps.get_expert_model_parallel_rank() * (config.num_moe_experts // ps.get_expert_model_parallel_world_size())


def layer_offset_of(model):
    """local layer index -> global layer index, read from the layers themselves (``layer_number`` is 1-based)."""
    numbers = [layer.layer_number - 1 for layer in unwrap(model).decoder.layers]
    return lambda i: numbers[i]


def unwrap(model):
    """The ``LearnerGPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
