"""The plan as Markdown tables (terminal-readable, and pasted as is into docs)."""
from __future__ import annotations

from sparse_rl_megatron.planning.inputs import GIB
from sparse_rl_megatron.planning.plan import Plan


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def render_learner(plan: Plan) -> list[str]:
    s, lay, mb = plan.learner, plan.layout, plan.micro_batch
    stages = [plan.stages[0]] + ([plan.stages[-1]] if lay.pp > 1 else [])
    header = ["learner, per GPU (GiB)"] + (["GPU"] if lay.pp == 1 else ["stage 0 (first)", f"stage {lay.pp - 1} (last)"])
    chunk = f"{s.logprob_chunk_tokens}-token chunks" if 0 < s.logprob_chunk_tokens < mb.scored else "unchunked"
    used = lambda label, on: f"{label} (*)" if on else label  # noqa: E731
    master = " + fp32 master weights" if s.param_bytes == 2 else ""
    rows = [
        [f"parameters, {s.params_dtype} (count)"] + [f"{_gib(x.weights)} ({x.params / 1e9:.2f}B)" for x in stages],
        ["gradients, fp32"] + [_gib(x.gradients) for x in stages],
        [used(f"optimizer: Adam moments{master}", not s.distributed_optimizer)] + [_gib(x.optimizer) for x in stages],
        [used(f"same, distributed optimizer over DP={lay.dp}"
              + (f" (routed experts over expert DP={lay.expert_dp})" if plan.arch.is_moe else ""), s.distributed_optimizer)]
        + [_gib(x.optimizer_distributed) for x in stages],
    ]
    if s.reference_model:
        rows.append(["KL reference policy weights"] + [_gib(x.reference) for x in stages])
    rows += [
        [used("activations, no recompute (micro-batches in flight)", not s.recompute)]
        + [f"{_gib(x.activations)} ({x.in_flight})" for x in stages],
        [used("activations, full recompute", s.recompute)] + [_gib(x.activations_recompute) for x in stages],
        [f"temporary: log-prob buffers (LM head, {chunk})"] + [_gib(x.head_temporary) for x in stages],
        ["temporary: one recomputed layer + its attention" if s.recompute else "temporary: one layer's attention"]
        + [_gib(x.recompute_temporary if s.recompute else x.layer_temporary) for x in stages],
        ["**total**: weights + gradients + (*) rows + the larger temporary"] + [f"**{_gib(x.total(s))}**" for x in stages],
    ]
    peak = plan.peak.total(s)
    verdict = (f"learner fits: peak {_gib(peak)} GiB of {lay.gpu_memory_gib:g} GiB per GPU" if plan.fits else
               f"learner DOES NOT FIT: peak {_gib(peak)} GiB > {lay.gpu_memory_gib:g} GiB per GPU (stage {plan.peak.stage})")
    lines = [f"Micro-batch: {mb.rows} row(s) x {mb.row_len} tokens ({s.max_tokens_per_device}-token budget), "
             f"{mb.count} per DP rank per step; kernels: {s.kernels}.", ""]
    lines += _table(header, rows) + ["", verdict]
    return lines


def render_rollout(plan: Plan) -> list[str]:
    r = plan.rollout
    header = ["rollout KV"] + [k.label for k in plan.kv]
    mib = lambda x: f"{x / 2 ** 20:,.1f} MiB"  # noqa: E731
    rows = [
        ["KV tokens per sequence (peak, per layer and KV head)"] + [f"{k.tokens_per_sequence:,}" for k in plan.kv],
        [f"KV per sequence ({r.kv_dtype}, all layers)"] + [mib(k.bytes_per_sequence) for k in plan.kv],
        [f"KV per sequence per GPU (rollout TP={r.tp})"] + [mib(k.bytes_per_sequence_per_gpu) for k in plan.kv],
        ["KV pool per GPU" + (" (given)" if r.kv_pool_gib else
                              f" ({r.mem_fraction:g} x (GPU - {_gib(plan.resident)} GiB the sleeping learner keeps)"
                              " - bf16 weights / TP; compressed: - the plugin)")]
        + [f"{_gib(k.pool_per_gpu)} GiB" for k in plan.kv],
        ["sparse_kv plugin per GPU (SGLang, request rows)"]
        + ["-" if k.plugin is None else f"{_gib(k.plugin.total)} GiB ({k.plugin.rows:,})" for k in plan.kv],
        ["concurrent sequences per engine"] + [f"{k.concurrent_per_engine:,}" for k in plan.kv],
        [f"concurrent sequences, {plan.kv[0].engines} engine(s)"] + [f"{k.concurrent:,}" for k in plan.kv],
        [f"decode waves for {plan.batch.rollouts:,} rollouts"] + [str(k.waves) if k.waves else "none fit" for k in plan.kv],
    ]
    lines = _table(header, rows)
    if plan.engines is not None:
        lines += ["", plan.engines.describe()]
    if not plan.rollout_fits:
        lines += ["", f"rollout DOES NOT FIT: not one sequence fits the KV pool at rollout TP={r.tp}"
                  + (f"; smallest rollout TP that fits: {plan.rollout_tp_hint}" if plan.rollout_tp_hint else "")]
    return lines


def render_ledger(plan: Plan) -> list[str]:
    """The per-GPU ledger: one column per phase, one row per item (``planning/phases.py``)."""
    led, s, r = plan.ledger, plan.learner, plan.rollout
    labels: list[str] = []
    for phase in led.phases:
        labels += [label for label in phase.items if label not in labels]
    where = f"stage {led.stage}, " if plan.layout.pp > 1 else ""
    header = [f"per GPU (GiB), {where}--offload {s.offload}"
              + ("" if r.memory_saver else ", --no-memory-saver")] + [p.name for p in led.phases]
    name = {"engine weights, bf16": f"engine weights, bf16 / rollout TP {r.tp}",
            "engine KV pool": "engine KV pool" + ("" if r.kv_pool_gib else
                                                  f" ({r.mem_fraction:g} x free at start - weights - plugin)")}
    rows = [[name.get(label, label)] + [_gib(p.items[label]) if label in p.items else "-" for p in led.phases]
            for label in labels]
    gpu = led.gpu_bytes
    rows.append(["**total**"] + [f"**{_gib(p.total)}**" for p in led.phases])
    rows.append([f"free of {plan.layout.gpu_memory_gib:g} GiB"] + [_gib(gpu - p.total) for p in led.phases])
    e = led.engine
    lines = _table(header, rows)
    lines += ["", f"engine start: {_gib(e.free)} GiB free per GPU after the learner went to sleep; SGLang leaves "
                  f"(1 - {r.mem_fraction:g}) x free = {_gib(e.headroom)} GiB for its activations and CUDA graphs"]
    problem = led.problem()
    lines.append(f"every phase fits {plan.layout.gpu_memory_gib:g} GiB per GPU: largest "
                 f"{max(led.phases, key=lambda p: p.total).name} "
                 f"{_gib(max(p.total for p in led.phases))} GiB" if problem is None else problem)
    return lines


def render_suggestion(plan: Plan) -> list[str]:
    if plan.all_fit:
        return []
    if plan.suggestion is None:
        return ["no layout or offload mode fits on up to 8x the GPUs; the model needs more memory per GPU"]
    return [f"nearest offload setting or layout that fits: {plan.suggestion.describe(plan.learner)}"]


def render(plan: Plan) -> str:
    a, b = plan.arch, plan.batch
    params = f"{plan.total_params / 1e9:.2f}B parameters"
    if a.moe is not None:
        lay = plan.layout
        params += (f" ({plan.activated_params / 1e9:.2f}B activated), {a.moe.num_experts} experts top-{a.moe.top_k}, "
                   f"{a.moe.num_experts // lay.ep} per EP rank")
    head = [
        f"Plan: {plan.model} ({a.family}, {params}, {a.num_layers} layers, "
        f"{a.num_attention_heads}/{a.num_query_groups} heads) on {plan.layout.describe()}",
        f"Step: {b.prompts} prompts x {b.samples} samples = {b.rollouts} rollouts of {b.prompt_len} + "
        f"{b.response_len} tokens",
        "",
    ]
    tail = [""] + render_ledger(plan) if plan.ledger is not None else []
    advice = render_suggestion(plan)
    return "\n".join(head + render_learner(plan) + [""] + render_rollout(plan) + tail
                     + ([""] + advice if advice else [])) + "\n"
