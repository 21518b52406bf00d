"""Real model shapes on the meta device: the megatron-core model of every rank of a cluster layout, built in
ONE process without GPUs, weights or real process groups.

usage: w_meta.py RESULT_DIR     runs the checks of ``test_meta_layouts.py`` (launch ``meta``: its CASES of
                               MODEL and TPxPP[xEPxETP], a mixture of experts: expert parallel x expert TP)

How: torch.distributed's ``fake`` backend (torch >= 2.x, ``FakeProcessGroup``: no communication, it only
reports a rank and a world size) is initialised as rank r of a world of TP x PP, and megatron-core's
``parallel_state.initialize_model_parallel(tp, pp)`` builds its TP / PP groups on it exactly as on a cluster
(without the gloo side groups, which need a real store). ``build_stage_model`` (the learner's own model
provider) then builds that rank's stage under ``torch.device("meta")`` with ``perform_initialization=False``
(no init kernels, no CPU master weights): every module and shape is megatron-core's, no byte is allocated.
Ranks are built one after another (TP ranks 0 and TP-1 of every stage: all TP ranks of a stage have the same
shapes, and rank TP-1 is the one holding the vocabulary padding). A mixture of experts is laid out on a world of
PP x max(TP, EP x ETP) ranks (the data-parallel ranks EP needs); the first and the last rank of each stage are
built (TP rank 0, EP rank 0 and TP rank TP-1, EP rank EP-1): they must hold routed experts [0, E / EP) and
[E - E / EP, E) by global index, and every EP rank holds the same shapes, so the coverage check places the other
EP ranks' experts by that offset.

Checks per model: the HF model built on meta (``AutoModelForCausalLM.from_config``) has exactly the tensors
and shapes the weight map expects. Per layout: every parameter of every stage is a known canonical name
whose shape is the weight map's shard shape for that TP rank (``hf_to_mcore`` run on meta tensors); every
canonical parameter lives on exactly one stage (the tied LM-head copy on the last stage at PP > 1 aside);
the model's shards merge back (``mcore_to_hf``) to every HF tensor exactly once with the HF shapes; and the
parameter count (TP shards summed, replicated weights once, vocab padding and the tied copy dropped) equals
the HF model's.
"""
from __future__ import annotations

import contextlib
import sys

import torch

torch.set_num_threads(1)


@contextlib.contextmanager
def fake_rank(tp: int, pp: int, rank: int, world: int, ep: int = 1, etp: int | None = None):
    """megatron-core parallel state of global rank ``rank`` of a TP x PP (x DP) world, on a fake process group;
    yields ``(tp_rank, pp_rank, ep_rank, etp_rank)``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                     create_gloo_process_groups=False)
        yield (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
               ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def meta_stage_shapes(arch, tp: int, pp: int, rank: int, world: int, ep: int = 1, etp: int | None = None):
    """``({canonical name: local shape}, (tp_rank, pp_rank, ep_rank, etp_rank))`` of one rank's stage, built by
    megatron-core on the meta device."""
    from sparse_rl_megatron.learner.model_provider import build_stage_model, expert_offset, layer_offset_of
    from sparse_rl_megatron.models import weight_map as wm

    with fake_rank(tp, pp, rank, world, ep, etp) as ranks, torch.device("meta"):
        model = build_stage_model(arch, params_dtype=torch.bfloat16, spec="local",
                                  overrides={"perform_initialization": False})
        first_expert = expert_offset(model)
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" for p in params.values()), "a parameter was allocated off the meta device"
    offset = layer_offset_of(model)
    shapes = {wm.canonical_name(n, offset, first_expert): tuple(p.shape) for n, p in params.items()}
    assert len(shapes) == len(params), "two parameters share a canonical name"
    return shapes, ranks


def hf_meta_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of the HF checkpoint of ``cfg``: the model's parameters, with transformers' fused routed experts
    (``mlp.experts.gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``) written per expert as ``save_pretrained`` and
    the hub checkpoints hold them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = {}
    for n, p in model.named_parameters():  # a tied lm_head is listed once
        layer, _, fused = n.rpartition(".")
        if layer.endswith(".mlp.experts") and fused == "gate_up_proj":
            experts, rows, cols = p.shape
            for e in range(experts):
                out.update({f"{layer}.{e}.gate_proj.weight": (rows // 2, cols), f"{layer}.{e}.up_proj.weight": (rows // 2, cols)})
        elif layer.endswith(".mlp.experts") and fused == "down_proj":
            out.update({f"{layer}.{e}.down_proj.weight": tuple(p.shape[1:]) for e in range(p.shape[0])})
        else:
            out[n] = tuple(p.shape)
    return out


def check_hf(name: str, state: dict) -> None:
    from sparse_rl_megatron.models import weight_map as wm
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.models.catalog import bundled_config

    cfg = bundled_config(name)
    arch = arch_from_hf_config(cfg)
    hf = hf_meta_shapes(cfg)
    expected = wm.expected_hf_shapes(arch)
    assert hf == expected, (sorted(set(hf) ^ set(expected))[:6],
                            [(k, hf[k], expected[k]) for k in hf if k in expected and hf[k] != expected[k]][:6])
    state[name] = (arch, hf)


def _shifted(name: str, by: int) -> str:
    """A routed expert's canonical name with its expert index moved by ``by``."""
    from sparse_rl_megatron.models import weight_map as wm

    e = wm.expert_index(name)
    return name.replace(f".local_experts.{e}.", f".local_experts.{e + by}.")


def check_layout(arch, hf: dict, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    from sparse_rl_megatron.models import weight_map as wm
    from sparse_rl_megatron.planning.params import stage_params

    meta = lambda n: torch.empty(hf[n], device="meta")  # noqa: E731
    padded = arch.padded_vocab_size(tp)
    tied_copy = arch.tie_word_embeddings and pp > 1
    etp_size = tp if etp is None else etp
    per_stage = max(tp, ep * etp_size)  # TP x DP ranks of a stage: enough data parallelism for EP x expert TP
    planned = stage_params(arch, tp, pp, ep, etp_size)  # what ``sparse-rl plan`` counts per GPU
    local = arch.moe.num_experts // ep if arch.moe is not None else 0
    owner: dict[str, tuple[int, ...]] = {}  # canonical name -> its (per TP rank) shape, on the one owning stage
    count = 0
    for stage in range(pp):
        built = [meta_stage_shapes(arch, tp, pp, stage * per_stage + r, pp * per_stage, ep, etp)
                 for r in sorted({0, per_stage - 1})]
        first, last = built[0][0], built[-1][0]
        assert [r[1] for _, r in built] == [stage] * len(built)
        assert {(_shifted(n, -(ep - 1) * local) if wm.expert_index(n) is not None else n): s
                for n, s in last.items()} == first, f"stage {stage}: its first and last ranks differ in shapes"
        for shapes, (tp_rank, _, ep_rank, etp_rank) in built:
            experts = sorted({wm.expert_index(n) for n in shapes} - {None})
            assert experts == list(range(ep_rank * local, (ep_rank + 1) * local)), (ep_rank, experts[:4])
            for n, shape in shapes.items():
                rank, size = (etp_rank, etp_size) if wm.param_kind(n) in wm.EXPERT_KINDS else (tp_rank, tp)
                want = tuple(wm.hf_to_mcore(arch, n, meta, tp_rank=rank, tp_size=size, padded_vocab=padded).shape)
                assert want == shape, f"stage {stage} TP rank {tp_rank}: {n} is {shape}, the weight map gives {want}"
        if tied_copy and stage == pp - 1:
            assert wm.OUTPUT_LAYER in first, "the last stage has no copy of the tied LM head"
        held = sum(int(torch.Size(shape).numel()) for shape in first.values())
        assert held == planned[stage], f"stage {stage}: {held} parameters per GPU, the planner says {planned[stage]}"
        everywhere = dict(first)  # every EP rank's experts, placed by their offset
        for n, shape in first.items():
            if wm.expert_index(n) is not None:
                everywhere.update({_shifted(n, k * local): shape for k in range(1, ep)})
        for n, shape in everywhere.items():
            if n == wm.OUTPUT_LAYER and tied_copy:
                continue  # the last stage's copy of the tied embedding (kept in sync by megatron-core)
            assert n not in owner, f"{n} is on two stages"
            owner[n] = shape
            kind = wm.param_kind(n)
            numel = int(torch.Size(shape).numel())
            count += numel if kind == "replicated" else numel * (etp_size if kind in wm.EXPERT_KINDS else tp)
            if kind == "vocab":
                count -= (padded - arch.vocab_size) * arch.hidden_size
    want_names = [n for n in wm.mcore_param_names(arch) if not (n == wm.OUTPUT_LAYER and arch.tie_word_embeddings)]
    assert sorted(owner) == sorted(want_names), sorted(set(owner) ^ set(want_names))[:6]
    merged: dict[str, tuple[int, ...]] = {}
    for n in want_names:  # the inverse map, fed the model's own shard shapes
        shards = etp_size if wm.param_kind(n) in wm.EXPERT_KINDS else tp
        for h, t in wm.mcore_to_hf(arch, n, [torch.empty(owner[n], device="meta")] * shards).items():
            assert h not in merged, f"HF tensor {h} produced twice"
            merged[h] = tuple(t.shape)
    assert merged == hf, sorted(set(merged) ^ set(hf))[:6]
    hf_count = sum(int(torch.Size(s).numel()) for s in hf.values())
    assert count == hf_count, f"megatron parameters {count} != HF {hf_count}"


def main() -> None:
    from types import SimpleNamespace

    from mcore_worker import run_launch

    from sparse_rl_megatron.learner import cpu_compat

    cpu_compat.apply()
    run_launch("meta", ["test_meta_layouts"], SimpleNamespace(state={}), sys.argv[1])


if __name__ == "__main__":
    main()
