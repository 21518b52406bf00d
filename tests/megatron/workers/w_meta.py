"""Real model shapes on the meta device: the megatron-core model of every rank of a cluster layout, built in
ONE process without GPUs, weights or real process groups.

usage: w_meta.py RESULT_DIR CASES     CASES: comma-separated MODEL:TPxPP, e.g. qwen2.5-7b:4x1,qwen2.5-72b:8x4

How: torch.distributed's ``fake`` backend (torch >= 2.x, ``FakeProcessGroup``: no communication, it only
reports a rank and a world size) is initialised as rank r of a world of TP x PP, and megatron-core's
``parallel_state.initialize_model_parallel(tp, pp)`` builds its TP / PP groups on it exactly as on a cluster
(without the gloo side groups, which need a real store). ``build_stage_model`` (the learner's own model
provider) then builds that rank's stage under ``torch.device("meta")`` with ``perform_initialization=False``
(no init kernels, no CPU master weights): every module and shape is megatron-core's, no byte is allocated.
Ranks are built one after another (TP ranks 0 and TP-1 of every stage: all TP ranks of a stage have the same
shapes, and rank TP-1 is the one holding the vocabulary padding).

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
def fake_rank(tp: int, pp: int, tp_rank: int, pp_rank: int):
    """megatron-core parallel state of rank (tp_rank, pp_rank) of a TP x PP world, on a fake process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("fake", rank=pp_rank * tp + tp_rank, world_size=tp * pp)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     create_gloo_process_groups=False)
        assert (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()) == (tp_rank, pp_rank)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def meta_stage_shapes(arch, tp: int, pp: int, tp_rank: int, pp_rank: int) -> dict[str, tuple[int, ...]]:
    """{canonical name: local shape} of one rank's stage, built by megatron-core on the meta device."""
    from sparse_rl_megatron.learner.model_provider import build_stage_model, layer_offset_of
    from sparse_rl_megatron.models import weight_map as wm

    with fake_rank(tp, pp, tp_rank, pp_rank), torch.device("meta"):
        model = build_stage_model(arch, params_dtype=torch.bfloat16, spec="local",
                                  overrides={"perform_initialization": False})
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" for p in params.values()), "a parameter was allocated off the meta device"
    offset = layer_offset_of(model)
    shapes = {wm.canonical_name(n, offset): tuple(p.shape) for n, p in params.items()}
    assert len(shapes) == len(params), "two parameters share a canonical name"
    return shapes


def hf_meta_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied lm_head is listed once


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


def check_layout(arch, hf: dict, tp: int, pp: int) -> None:
    from sparse_rl_megatron.models import weight_map as wm
    from sparse_rl_megatron.planning.params import stage_params

    meta = lambda n: torch.empty(hf[n], device="meta")  # noqa: E731
    padded = arch.padded_vocab_size(tp)
    tied_copy = arch.tie_word_embeddings and pp > 1
    planned = stage_params(arch, tp, pp)  # what ``sparse-rl plan`` counts per GPU
    owner: dict[str, tuple[int, ...]] = {}  # canonical name -> its (per TP rank) shape, on the one owning stage
    count = 0
    for stage in range(pp):
        ranks = sorted({0, tp - 1})
        per_rank = {r: meta_stage_shapes(arch, tp, pp, r, stage) for r in ranks}
        assert per_rank[ranks[0]] == per_rank[ranks[-1]], f"stage {stage}: TP ranks {ranks} differ in shapes"
        for r, shapes in per_rank.items():
            for n, shape in shapes.items():
                want = tuple(wm.hf_to_mcore(arch, n, meta, tp_rank=r, tp_size=tp, padded_vocab=padded).shape)
                assert want == shape, f"stage {stage} TP rank {r}: {n} is {shape}, the weight map gives {want}"
        if tied_copy and stage == pp - 1:
            assert wm.OUTPUT_LAYER in per_rank[0], "the last stage has no copy of the tied LM head"
        held = sum(int(torch.Size(shape).numel()) for shape in per_rank[0].values())
        assert held == planned[stage], f"stage {stage}: {held} parameters per GPU, the planner says {planned[stage]}"
        for n, shape in per_rank[0].items():
            if n == wm.OUTPUT_LAYER and tied_copy:
                continue  # the last stage's copy of the tied embedding (kept in sync by megatron-core)
            assert n not in owner, f"{n} is on two stages"
            owner[n] = shape
            kind = wm.param_kind(n)
            numel = int(torch.Size(shape).numel())
            count += numel if kind == "replicated" else numel * tp
            if kind == "vocab":
                count -= (padded - arch.vocab_size) * arch.hidden_size
    want_names = [n for n in wm.mcore_param_names(arch) if not (n == wm.OUTPUT_LAYER and arch.tie_word_embeddings)]
    assert sorted(owner) == sorted(want_names), sorted(set(owner) ^ set(want_names))[:6]
    merged: dict[str, tuple[int, ...]] = {}
    for n in want_names:  # the inverse map, fed the model's own shard shapes
        for h, t in wm.mcore_to_hf(arch, n, [torch.empty(owner[n], device="meta")] * tp).items():
            assert h not in merged, f"HF tensor {h} produced twice"
            merged[h] = tuple(t.shape)
    assert merged == hf, sorted(set(merged) ^ set(hf))[:6]
    hf_count = sum(int(torch.Size(s).numel()) for s in hf.values())
    assert count == hf_count, f"megatron parameters {count} != HF {hf_count}"


def main() -> None:
    from mcore_worker import run_checks

    from sparse_rl_megatron.learner import cpu_compat

    cpu_compat.apply()
    result_dir, cases = sys.argv[1], [c.split(":") for c in sys.argv[2].split(",")]
    state: dict = {}
    checks = []
    for name in dict.fromkeys(m for m, _ in cases):
        checks.append((f"hf_{name}", lambda name=name: check_hf(name, state)))
    for name, layout in cases:
        tp, pp = (int(x) for x in layout.split("x"))
        checks.append((f"{name}_tp{tp}pp{pp}", lambda name=name, tp=tp, pp=pp: check_layout(*state[name], tp, pp)))
    run_checks(checks, result_dir)


if __name__ == "__main__":
    main()
