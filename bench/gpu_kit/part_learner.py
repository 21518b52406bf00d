"""Parts ``logprobs``, ``lm_head_memory``, ``train`` and ``train_recompute``: the megatron-core learner.

Every learner here is TP = PP = 1 on one device with megatron-core's local layer spec (no Transformer
Engine), the distributed optimizer on (one rank: it shards nothing, but its code paths and its checkpoint
format run), and the fusions ``fusion_settings`` picks on this machine (``Learner.describe()`` is recorded).
"""
from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path

import torch

from gpu_kit.part_model import MODEL_DIR
from gpu_kit.records import Deadline, PeakMeter, Recorder, gib, sync
from gpu_kit.sizes import H200_BF16_DENSE_PEAK_FLOPS, Sizes

KIT_LR = 1e-3
"""Large enough that one Adam step moves bf16 weights (1e-6 would leave every bf16 copy unchanged, and the
checkpoint check below would then pass on a load that restored nothing)."""
JIT_FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion")
"""megatron-core's torch.compile'd fusions: turned off when the model part's compile probe failed."""
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def make_learner(sizes_or_dir, *, dtype: str, trainable: bool, max_tokens: int, chunk: int,
                 recompute: bool = False, jit_fusions: bool = True, offload: str = "none"):
    from sparse_rl_megatron.learner import Learner, LearnerConfig, OptimConfig

    overrides = dict(RECOMPUTE) if recompute else {}
    if not jit_fusions:
        overrides.update({name: False for name in JIT_FUSIONS})
    cfg = LearnerConfig(model_path=str(sizes_or_dir), params_dtype=dtype, layer_spec="local",
                        max_tokens_per_device=max_tokens, logprob_chunk_tokens=chunk, megatron_overrides=overrides,
                        optim=OptimConfig(lr=KIT_LR, use_distributed_optimizer=True), offload=offload)
    return Learner(cfg, trainable=trainable)


def free() -> None:
    """Return the memory of objects the caller has just dropped (``del x; free()``)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """``rows`` rows of equal length (so an HF forward can batch them without padding)."""
    from sparse_rl_megatron.learner import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    return SequenceBatch([torch.randint(0, vocab, (prompt,), generator=g) for _ in range(rows)],
                         [torch.randint(0, vocab, (response,), generator=g) for _ in range(rows)])


def train_batch(learner, seqs):
    """A corrected-GRPO batch: old log-probs from the learner, a sampler 0.05 nats off, rewards 0/1 in groups of 4."""
    from sparse_rl_megatron.algo import prepare_correction
    from sparse_rl_megatron.learner import TrainBatch

    old = learner.logprobs(seqs)
    mask = seqs.response_mask()
    g = torch.Generator().manual_seed(1)
    sampler = torch.where(mask, old + 0.05 * torch.randn(old.shape, generator=g), torch.zeros(()))
    rewards = (torch.arange(len(seqs)) % 2).float()
    groups = torch.arange(len(seqs)) // 4
    return TrainBatch(seqs, prepare_correction(old, sampler, mask, rewards, groups))


@torch.no_grad()
def hf_logprobs(model, seqs) -> torch.Tensor:
    """``[B, T]`` fp32 log-probs of the response tokens under an HF causal LM (rows of equal length)."""
    p, r = seqs.prompts[0].numel(), seqs.responses[0].numel()
    device = next(model.parameters()).device
    ids = torch.stack([torch.cat([a, b]) for a, b in zip(seqs.prompts, seqs.responses)]).to(device)
    logits = model(ids[:, :-1]).logits[:, p - 1:p + r - 1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, p:, None]).squeeze(-1).cpu()


def diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a - b).abs()[mask.bool()]
    return dict(max_abs=float(d.max()), mean_abs=float(d.mean()), tokens=int(d.numel()))


# ------------------------------------------------------------------------------------------------ parts
def run_logprobs(rec: Recorder, sizes: Sizes, work: Path, device: torch.device, jit_fusions: bool) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = work / MODEL_DIR
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).to(device)
    vocab = hf.config.vocab_size
    seqs = random_batch(sizes.lp_rows, sizes.lp_prompt, sizes.lp_response, vocab)
    mask = seqs.response_mask()
    refs = {"float32": hf_logprobs(hf, seqs)}
    refs["bfloat16"] = hf_logprobs(hf.to(torch.bfloat16), seqs)  # the same values: the checkpoint is bf16
    del hf
    free()
    rec.write("HF bf16 vs HF fp32 (scale of bf16 error)", **diff(refs["bfloat16"], refs["float32"], mask))
    budget = sizes.lp_rows * (sizes.lp_prompt + sizes.lp_response)
    for dtype in ("float32", "bfloat16"):
        with rec.item(f"learner {dtype} vs HF {dtype}") as m:
            learner = make_learner(model_dir, dtype=dtype, trainable=False, max_tokens=budget, chunk=sizes.mem_chunk,
                                   jit_fusions=jit_fusions)
            m["learner"] = learner.describe()
            start = time.perf_counter()
            lp = learner.logprobs(seqs)
            m["logprobs_s"] = round(time.perf_counter() - start, 3)
            m.update(diff(lp, refs[dtype], mask))
            if dtype == "bfloat16":
                m["vs_hf_fp32"] = diff(lp, refs["float32"], mask)
        learner = None
        free()


def run_lm_head_memory(rec: Recorder, sizes: Sizes, work: Path, device: torch.device, jit_fusions: bool) -> None:
    """One row of ``mem_response`` response tokens: peak memory of log-probs and of a train step with the LM head
    chunked (``mem_chunk`` tokens) and unchunked, on one bf16 learner (``logprob_chunk_tokens`` is read per call)."""
    rows_tokens = 16 + sizes.mem_response
    learner = make_learner(work / MODEL_DIR, dtype="bfloat16", trainable=True, max_tokens=rows_tokens,
                           chunk=sizes.mem_chunk, jit_fusions=jit_fusions)
    seqs = random_batch(1, 16, sizes.mem_response, learner.arch.vocab_size)
    batch = train_batch(learner, seqs)
    learner.train_step(batch)  # warm-up at the measured shape: Adam's moments, compiled kernels
    rec.write("learner", learner=learner.describe(), response_tokens=sizes.mem_response,
              vocab=learner.arch.vocab_size, weights_and_optimizer_gib=gib(_allocated()))
    for call in ("logprobs", "train_step"):
        for chunk in (sizes.mem_chunk, 0):
            with rec.item(f"{call}, LM head {'chunked ' + str(chunk) if chunk else 'unchunked'}") as m:
                learner.config.logprob_chunk_tokens = chunk
                with PeakMeter() as meter:
                    start = time.perf_counter()
                    learner.logprobs(seqs) if call == "logprobs" else learner.train_step(batch)
                m.update(chunk=chunk, peak_rise_gib=gib(meter.rise), peak_rise_bytes=meter.rise,
                         call_s=round(time.perf_counter() - start, 3))
    del learner, batch
    free()


def run_train(rec: Recorder, sizes: Sizes, work: Path, device: torch.device, jit_fusions: bool,
              recompute: bool) -> None:
    from sparse_rl_megatron.learner.flops import forward_flops, train_step_flops

    learner = make_learner(work / MODEL_DIR, dtype="bfloat16", trainable=True, max_tokens=sizes.train_row_tokens,
                           chunk=sizes.mem_chunk, recompute=recompute, jit_fusions=jit_fusions, offload="all")
    seqs = random_batch(sizes.train_rows, sizes.train_prompt, sizes.train_response, learner.arch.vocab_size)
    fed, scored = seqs.lengths, int(seqs.response_mask().sum())
    peak = H200_BF16_DENSE_PEAK_FLOPS if device.type == "cuda" else None
    with rec.item("log-probs (forward only)") as m:
        batch = train_batch(learner, seqs)  # first forward: warm-up
        sync()
        start = time.perf_counter()
        learner.logprobs(seqs)
        sync()
        seconds = time.perf_counter() - start
        m.update(_throughput(sum(fed), seconds, forward_flops(learner.arch, fed, scored), peak))
    with rec.item("train step" + (" (full recompute)" if recompute else "")) as m:
        m.update(learner=learner.describe(), rows=len(seqs), row_tokens=sizes.train_row_tokens,
                 micro_batches=len(learner.micro_batches(seqs)))
        learner.train_step(batch)  # warm-up
        times, metrics = [], {}
        with PeakMeter() as meter:
            for _ in range(sizes.train_iters):
                if rec.left() < 5 + 2 * (times[-1] if times else 0):
                    break
                sync()
                start = time.perf_counter()
                metrics = learner.train_step(batch)
                sync()
                times.append(time.perf_counter() - start)
        if not times:
            raise Deadline("no time left for a timed step after the warm-up")
        m.update(_throughput(sum(fed), min(times), train_step_flops(learner.arch, fed, scored), peak),
                 timed_steps=len(times), peak_rise_gib=gib(meter.rise), total_allocated_gib=gib(meter.peak),
                 grad_norm=metrics.get("train/grad_norm"), skipped=metrics.get("train/skipped"))
    if not recompute:
        with rec.item("checkpoint save + load (distributed optimizer)") as m:
            m.update(_checkpoint_round_trip(learner, work / "ckpt"))
        with rec.item("offload all: device bytes per turn vs the ledger") as m:
            m.update(_offload_turns(learner, batch))
    del learner
    free()


def _throughput(tokens: int, seconds: float, flops: float, peak: float | None) -> dict:
    out = dict(tokens=tokens, seconds_per_call=round(seconds, 4), tokens_per_s=round(tokens / seconds, 1),
               model_tflops=float(f"{flops / 1e12:.4g}"), achieved_tflops_per_s=float(f"{flops / seconds / 1e12:.4g}"))
    if peak:
        out["mfu"] = round(flops / seconds / peak, 4)
    return out


RESTORE_TOL = 1e-5
"""Largest log-prob change a save + load may leave (exactly 0 expected: the same weights, a deterministic
forward); a replayed step from the loaded optimizer state must land within 10% of the first step's move."""


def _checkpoint_round_trip(learner, ckpt: Path) -> dict:
    """Save; step (the weights move); load: the probe's log-probs are back. Step again from the loaded state:
    it lands where the first step did only if the optimizer's main params and Adam moments were restored too."""
    probe = random_batch(4, 16, 64, learner.arch.vocab_size, seed=7)
    shutil.rmtree(ckpt, ignore_errors=True)
    before, steps, scheduled = learner.logprobs(probe), learner.steps, learner.scheduler.num_steps
    sync()
    start = time.perf_counter()
    learner.save(ckpt)
    sync()
    save_s = time.perf_counter() - start
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    batch = train_batch(learner, probe)
    learner.train_step(batch)
    after = learner.logprobs(probe)
    moved = float((after - before).abs().max())
    start = time.perf_counter()
    learner.load(ckpt)
    sync()
    load_s = time.perf_counter() - start
    back = float((learner.logprobs(probe) - before).abs().max())
    restored_steps, restored_scheduled = learner.steps, learner.scheduler.num_steps
    learner.train_step(batch)
    replay = float((learner.logprobs(probe) - after).abs().max())
    shutil.rmtree(ckpt, ignore_errors=True)
    out = dict(save_s=round(save_s, 2), load_s=round(load_s, 2), size_gib=gib(size), step_moved_logprobs=moved,
               restored_max_abs=back, replayed_step_max_abs=replay, steps=steps)
    if moved == 0.0:
        raise AssertionError(f"the step after the save left the probe's log-probs unchanged (a vacuous check): {out}")
    if back > RESTORE_TOL or (restored_steps, restored_scheduled) != (steps, scheduled):
        raise AssertionError(f"load did not restore the weights or the step counts (learner {restored_steps} vs "
                             f"{steps}, schedule {restored_scheduled} vs {scheduled}): {out}")
    if replay > 0.1 * moved:
        raise AssertionError(f"a step from the loaded state differs from the step from the saved one: {out}")
    return out


def _offload_turns(learner, batch) -> dict:
    """``learner.offload: all`` through the turns of a colocated step (``learner/turns.py``): the bytes the
    allocator holds (``torch.cuda.memory_allocated``; on the CPU the learner's storages) awake, asleep (the engines'
    turn), with the weights alone woken (recompute, sync) and awake again, against the plan's
    ``learner_resident_bytes``; sleep and wake seconds (the host copies: pinned, over PCIe); log-probs equal before
    the sleep and after the wake; a step after the wake trains."""
    from sparse_rl_megatron.learner.offload import OFFLOAD_PARTS
    from sparse_rl_megatron.planning.inputs import Layout, LearnerSetting
    from sparse_rl_megatron.planning.residency import learner_resident_bytes

    def allocated() -> int:
        sync()
        return torch.cuda.memory_allocated() if torch.cuda.is_available() else sum(learner.resident_bytes().values())

    probe = random_batch(2, 16, 64, learner.arch.vocab_size, seed=11)
    setting = LearnerSetting(params_dtype="bfloat16", kernels="local", distributed_optimizer=True, offload="all")
    planned = {asleep: learner_resident_bytes(learner.arch, Layout(1, 1, 1), setting, asleep=asleep)
               for asleep in (False, True)}
    before_lp, awake_parts, awake = learner.logprobs(probe), learner.resident_bytes(), allocated()
    start = time.perf_counter()
    freed = learner.sleep()
    sleep_s = time.perf_counter() - start
    asleep_parts, asleep = learner.resident_bytes(), allocated()
    start = time.perf_counter()
    learner.wake(["weights"])
    weights_s = time.perf_counter() - start
    weights_only = allocated()
    learner.wake()
    wake_s = time.perf_counter() - start
    back_lp, woken = learner.logprobs(probe), allocated()
    metrics = learner.train_step(batch)
    out = dict(awake_parts=awake_parts, planned_awake=planned[False], asleep_parts=asleep_parts,
               freed=freed, allocated_awake_gib=gib(awake), allocated_asleep_gib=gib(asleep),
               allocated_weights_only_gib=gib(weights_only), allocated_woken_gib=gib(woken),
               allocated_drop_bytes=awake - asleep, freed_bytes=sum(freed.values()), host_gib=gib(learner._sleeper.host_bytes),
               sleep_s=round(sleep_s, 3), wake_weights_s=round(weights_s, 3), wake_s=round(wake_s, 3),
               logprobs_max_abs=float((back_lp - before_lp).abs().max()), step_after_wake_skipped=metrics["train/skipped"])
    if asleep_parts != dict.fromkeys(OFFLOAD_PARTS, 0) or planned[True] != dict.fromkeys(OFFLOAD_PARTS, 0):
        raise AssertionError(f"asleep, the learner still holds device bytes: {out}")
    # the allocator's bytes drop by what was freed (it rounds each block up to 512 bytes: one per storage at most)
    if abs((awake - asleep) - sum(freed.values())) > 512 * 4096:
        raise AssertionError(f"the allocated bytes fell by {awake - asleep}, not the {sum(freed.values())} freed: {out}")
    if out["logprobs_max_abs"] != 0.0 or woken != awake or metrics["train/skipped"]:
        raise AssertionError(f"woken, the learner is not the one that went to sleep: {out}")
    worst = max(abs(awake_parts[p] - planned[False][p]) / planned[False][p] for p in OFFLOAD_PARTS)
    if worst > 0.01:  # padding, fp32 norms and Adam's step counts: a fraction of a percent (test_offload.py)
        raise AssertionError(f"measured bytes per part differ from the plan's by {worst:.2%}: {out}")
    out["worst_part_vs_plan"] = round(worst, 5)
    return out


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
