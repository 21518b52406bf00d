"""The Megatron learner: dense log-probs, the corrected GRPO train step, weight export, checkpoints.

SPMD: every rank of the job builds a ``Learner`` with the same config and calls the same methods with the
same (global) batch; results (log-probs, metrics, exported buckets) are identical on every rank.

    learner = Learner(LearnerConfig(model_path="Qwen2.5-3B/", tensor_parallel_size=2))
    old = learner.logprobs(seqs)                       # [B, T] dense old-policy log-probs
    prepared = prepare_correction(old, sampler_lp, seqs.response_mask(), rewards, groups)
    metrics = learner.train_step(TrainBatch(seqs, prepared))
    for bucket in learner.export_weights(): engine.update_weights(bucket, version)
    learner.save("ckpt/step_1")
    learner.sleep(); ...; learner.wake()              # learner.offload: hand the GPU to colocated engines

A reference policy for the KL term is a second ``Learner(..., trainable=False)`` (no optimizer, no DDP).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from sparse_rl_megatron.learner import checkpoint as ckpt
from sparse_rl_megatron.learner import cpu_compat
from sparse_rl_megatron.learner.batch import (
    MicroBatch, SequenceBatch, build_micro_batch, padding_micro_batch, plan_micro_batches, split_rows,
)
from sparse_rl_megatron.learner.config import LearnerConfig, LearnerSettings
from sparse_rl_megatron.learner.forward import run_schedule
from sparse_rl_megatron.learner.hf_io import HFCheckpointWriter, load_hf_into_model, read_arch, torch_dtype
from sparse_rl_megatron.learner.logprobs import to_response_aligned, token_logprobs
from sparse_rl_megatron.learner.offload import OFFLOAD_PARTS, Sleeper, part_storages, part_tensors, storage_bytes
from sparse_rl_megatron.learner.model_provider import (
    build_stage_model, check_sequence_parallel, expert_module_name, resolve_expert_kernels, resolve_layer_spec,
)
from sparse_rl_megatron.learner.parallel import current_layout, device, init_model_parallel
from sparse_rl_megatron.learner.routing_replay import replaying
from sparse_rl_megatron.learner.weight_export import DEFAULT_BUCKET_BYTES, Bucket, export_hf_buckets
from sparse_rl_megatron.models.arch import ModelArch
from sparse_rl_megatron.models.megatron_config import FUSION_SWITCHES
from sparse_rl_megatron.utils.device import DeviceFacts, resolve
from sparse_rl_megatron.learner.train_step import train_step


def _is_megatron_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / ckpt.META_FILE).is_file()


# the HF config field of the Qwen MoE models' load-balancing coefficient (0.001 in Qwen3-MoE)
HF_AUX_LOSS_FIELD = "router_aux_loss_coef"


def moe_aux_loss_coeff(config: LearnerConfig, hf_config: dict, arch: ModelArch) -> float:
    """megatron-core's per-layer load-balancing coefficient: ``config.moe.aux_loss_coeff`` as given (megatron's
    convention), or when that is None the one derived from the checkpoint's ``router_aux_loss_coef`` (HF's
    convention, one loss over all layers jointly): ``router_aux_loss_coef x top_k / layers``
    (``moe_aux_loss.per_layer_coeff``); 0 if the checkpoint has none."""
    if config.moe.aux_loss_coeff is not None:
        return float(config.moe.aux_loss_coeff)
    from sparse_rl_megatron.learner.moe_aux_loss import per_layer_coeff

    return per_layer_coeff(float(hf_config.get(HF_AUX_LOSS_FIELD) or 0.0), arch.moe.top_k, arch.num_layers)


def check_moe_training(arch: ModelArch, config: LearnerSettings, trainable: bool) -> None:
    """megatron-core's MoE layer refuses to train at TP > 1 without sequence parallel (a ValueError from inside the
    first forward); say so before anything is built, naming the settings. Log-probs (no training) run at any TP."""
    if not (arch.is_moe and trainable and config.tensor_parallel_size > 1):
        return
    if not config.megatron_overrides.get("sequence_parallel", False):
        raise ValueError(
            f"LearnerConfig.tensor_parallel_size={config.tensor_parallel_size} with the mixture of experts of this "
            f"{arch.family} model trains only with megatron_overrides.sequence_parallel=True (megatron-core's MoE "
            "layer refuses TP without it; sequence parallel needs Transformer Engine norms, on a GPU); valid without "
            "it: tensor_parallel_size=1, with expert_parallel_size and pipeline_parallel_size for the split")


class Learner:
    """``logprobs(batch)``, ``train_step(batch)``, ``export_weights()``, ``save(dir)``, ``load(dir)``."""

    def __init__(self, config: LearnerConfig, *, trainable: bool = True, device_facts: DeviceFacts | None = None):
        """``device_facts``: the machine's facts as the run resolved them (``RunPlan.device_facts``); None detects
        them here. Every device decision of the learner (dtype, layer spec, fusions, process group, DDP,
        optimizer) uses these."""
        self.config = config
        self.device_facts = resolve(device_facts)
        if _is_megatron_checkpoint(config.model_path):
            meta = ckpt.read_meta(config.model_path)
            self.arch, self.hf_config = ModelArch.from_dict(meta["arch"]), meta["hf_config"]
            assets = Path(config.model_path) / ckpt.ASSETS_DIR
            self.assets_dir = assets if assets.is_dir() else None
        else:
            self.arch, self.hf_config = read_arch(config.model_path)
            self.assets_dir = Path(config.model_path)
        # validate the layout against the architecture before any process group or model exists
        self.arch.check_tensor_parallel(config.tensor_parallel_size)
        self.arch.check_pipeline_parallel(config.pipeline_parallel_size)
        self.arch.check_expert_parallel(config.expert_parallel_size, config.expert_tensor_parallel)
        check_moe_training(self.arch, config, trainable)
        self.spec = resolve_layer_spec(config.layer_spec, self.device_facts)  # "te" or "local"
        check_sequence_parallel(self.spec, config.megatron_overrides, self.device_facts)
        if self.arch.is_moe:
            resolve_expert_kernels(config.moe.experts, self.spec)  # refused before any process group exists
        self.layout = init_model_parallel(config.tensor_parallel_size, config.pipeline_parallel_size, config.seed,
                                          facts=self.device_facts, ep=config.expert_parallel_size,
                                          etp=config.expert_tensor_parallel)
        self.params_dtype = config.torch_params_dtype(self.device_facts)
        # routing replay: the trainer hands the sampler's routes over (trainer/step.py); a batch with routes is replayed
        self.routing_replay = self.arch.is_moe and config.moe.routing_replay
        self.replayer = None  # while a batch with routes runs: arms the routers per micro-batch (routing_replay.py)
        self.moe_aux_loss_coeff = moe_aux_loss_coeff(config, self.hf_config, self.arch) if self.arch.is_moe else 0.0
        self.model = build_stage_model(
            self.arch, params_dtype=self.params_dtype, spec=self.spec,
            vocab_multiple=config.vocab_multiple, overrides=config.megatron_overrides, facts=self.device_facts,
            moe_aux_loss_coeff=self.moe_aux_loss_coeff, moe_router_dtype=config.moe.router_dtype,
            moe_experts=config.moe.experts, moe_routing_replay=self.arch.is_moe,
        )
        self.model.return_hidden = True
        self.use_thd = self.spec == "te"  # packed rows as THD (TE attention); the local spec takes a dense mask
        # sequence parallel splits every micro-batch's sequence over the TP ranks: lengths are padded to tp
        self.seq_multiple = self.layout.tp if self.model.config.sequence_parallel else 1
        self.steps = 0
        self.skipped_steps = 0
        self.trainable = trainable
        self.ddp = self.optimizer = self.scheduler = None
        if trainable:
            from sparse_rl_megatron.learner.optimizer import build_optimizer, wrap_ddp

            self.ddp = wrap_ddp(self.model, config, self.device_facts)
            self.optimizer, self.scheduler = build_optimizer(self.ddp, config, self.device_facts)
        self._sleeper = Sleeper(config.offload)
        if _is_megatron_checkpoint(config.model_path):
            self.load(config.model_path, load_optimizer=False)
        else:
            load_hf_into_model(self.model, self.arch, config.model_path)
            if trainable:  # fp32 main weights of bf16 params follow the loaded weights (no-op for fp32)
                self.optimizer.reload_model_params()

    # ------------------------------------------------------------------ sleep / wake
    @property
    def asleep(self) -> bool:
        """Some part of this learner is off its device (``sleep``)."""
        return self._sleeper.asleep

    @property
    def asleep_parts(self) -> frozenset[str]:
        """The parts (of ``offload.OFFLOAD_PARTS``) off the device now."""
        return self._sleeper.asleep_parts

    def sleep(self, parts: Iterable[str] | None = None) -> dict[str, int]:
        """Put ``parts`` (None: every part ``config.offload`` names; a part the mode keeps stays) to sleep
        (``learner/offload.py``) while others use the device; returns the device bytes freed per part. Local (no
        collective); a no-op for ``offload: none``."""
        return self._sleeper.sleep(self._part_tensors, device(), parts)

    def wake(self, parts: Iterable[str] | None = None) -> None:
        """Bring ``parts`` (None: every sleeping part) back, bit for bit (gradients as the zeros the next step
        starts from)."""
        self._sleeper.wake(parts)

    def resident_bytes(self) -> dict[str, int]:
        """Device bytes each part holds now, measured from the tensors' storages (a sleeping part: 0)."""
        storages = part_storages(self._part_tensors(), device())
        return {part: storage_bytes(storages[part]) for part in OFFLOAD_PARTS}

    def _part_tensors(self) -> dict[str, list[torch.Tensor]]:
        return part_tensors(self.model, self.ddp, self.optimizer)

    def _check_awake(self, what: str, parts: Iterable[str] = OFFLOAD_PARTS) -> None:
        asleep = [p for p in parts if p in self._sleeper.asleep_parts]
        if asleep:
            raise RuntimeError(f"Learner.{what} called while its {', '.join(asleep)} sleep (learner.offload="
                               f"{self.config.offload}); call wake() first")

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch, width: int | None = None) -> torch.Tensor:
        """Dense log-probs of every response token under the current weights: ``[B, T]`` fp32 on CPU,
        0 where ``batch.response_mask()`` is False. ``T = width`` (default: the longest response). A mixture of
        experts with ``batch.routes`` routes every fed token to those experts (``routing_replay.py``).
        Collective; identical on every rank."""
        from megatron.core import parallel_state as ps

        self._check_awake("logprobs", ("weights",))
        cfg = self.config
        batch.check_vocab(self.arch.vocab_size)
        mbs = self.micro_batches(batch)
        if width is not None and width < batch.max_response_len:
            raise ValueError(f"logprobs width={width} is shorter than the longest response ({batch.max_response_len})")
        width = width or batch.max_response_len
        model = self.ddp if self.ddp is not None else self.model
        model.eval()
        with replaying(self.model, batch, self.arch.is_moe) as replayer:
            outs = run_schedule(
                model, mbs,
                lambda mb, hidden: to_response_aligned(token_logprobs(self.model, hidden, mb, cfg.logprob_chunk_tokens), mb, width),
                forward_only=True, use_thd=self.use_thd, before_forward=replayer,
            )
        # Rows are disjoint across DP ranks and only one TP rank of the last stage writes them, so a SUM
        # over the world assembles the full [B, T] exactly (adding zeros).
        full = torch.zeros(len(batch), width, dtype=torch.float32, device=device())
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            for mb, lp in zip(mbs, outs):
                if not mb.padding:  # a rank without rows (B < DP) computed row 0 only to join the collectives
                    full[torch.tensor(mb.rows, device=full.device)] = lp.float()
        dist.all_reduce(full)
        return full.cpu()

    @torch.no_grad()
    def routes(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """The experts this learner's own routers pick for every fed token of every row (a mixture of experts, its
        dense forward; ``routing_replay.record_routes``): per row ``[P + R - 1, layers, top_k]`` int16, as
        ``Sample.routed_experts``. Collective; identical on every rank."""
        from sparse_rl_megatron.learner.routing_replay import record_routes

        self._check_awake("routes", ("weights",))
        (self.ddp if self.ddp is not None else self.model).eval()
        return record_routes(self, batch)

    def data_parallel_rows(self, batch: SequenceBatch) -> list[int]:
        """The rows of ``batch`` this data-parallel rank computes (token-balanced, see ``split_rows``); empty
        on the ranks left over when the batch has fewer rows than data-parallel ranks."""
        from megatron.core import parallel_state as ps

        return split_rows(batch.lengths, ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]

    def micro_batches(self, batch: SequenceBatch) -> list[MicroBatch]:
        """This rank's rows of ``batch`` cut by the token budget, in the configured layout; one padding
        micro-batch on a rank without rows (its outputs are discarded, its loss is 0)."""
        cfg = self.config
        rows = self.data_parallel_rows(batch)
        if not rows:
            mbs = [padding_micro_batch(batch, cfg.batch_layout, multiple=self.seq_multiple)]
        else:
            groups = plan_micro_batches(batch.lengths, rows, cfg.max_tokens_per_device, cfg.batch_layout)
            mbs = [build_micro_batch(batch, g, cfg.batch_layout, multiple=self.seq_multiple) for g in groups]
        if self.arch.is_moe:
            mbs += [padding_micro_batch(batch, cfg.batch_layout, multiple=self.seq_multiple)] * (
                self._most_micro_batches(len(mbs)) - len(mbs))
        return mbs

    def _most_micro_batches(self, count: int) -> int:
        """The largest micro-batch count of the data-parallel ranks. A mixture of experts exchanges tokens between
        ranks of different data-parallel replicas in every MoE layer (the expert-parallel all-to-all), so every
        rank must run as many micro-batches: the ones with fewer add padding micro-batches."""
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_world_size() == 1:
            return count
        most = torch.tensor([count], dtype=torch.long, device=device())
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        return int(most)

    # ------------------------------------------------------------------ training
    def train_step(self, batch) -> dict[str, float]:
        """One optimizer step on a ``TrainBatch``; metrics reduced over all ranks (``train_step.py``)."""
        if not self.trainable:
            raise RuntimeError("this Learner was built with trainable=False (a reference policy); it cannot train")
        self._check_awake("train_step")
        with replaying(self.model, batch.sequences, self.arch.is_moe) as self.replayer:
            try:
                return train_step(self, batch)
            finally:
                self.replayer = None

    def advance_schedule(self) -> float:
        """Move the lr schedule one optimizer step on without training (a slice the correction emptied), so a
        corrected run's lr follows the schedule of a run that took every step. Returns the new lr."""
        if not self.trainable:
            raise RuntimeError("this Learner was built with trainable=False (a reference policy); it has no schedule")
        self.scheduler.step(increment=1)
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ weights
    def export_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
        """Full HF-named tensors in buckets of ~``bucket_bytes`` (collective; every rank gets every bucket)."""
        self._check_awake("export_weights", ("weights",))
        return export_hf_buckets(self.model, self.arch, bucket_bytes=bucket_bytes, dtype=dtype)

    def save_hf(self, out_dir: str | os.PathLike, dtype: str | None = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
        """Write the current weights as an HF checkpoint (collective). Buckets stream through: rank 0 copies
        each to the host writer (``HFCheckpointWriter``, bounded by one safetensors shard), and every rank
        drops a bucket before the next one is built, so no device ever holds more than one."""
        target = torch_dtype(dtype or self.arch.hf_dtype)
        writer = None
        if dist.get_rank() == 0:
            writer = HFCheckpointWriter(out_dir, self.hf_config, assets_dir=self.assets_dir)
        for bucket in self.export_weights(bucket_bytes=bucket_bytes, dtype=target):
            if writer is not None:
                for name, tensor in bucket:
                    writer.add(name, tensor)
            del bucket
        if writer is not None:
            writer.close()
        dist.barrier()
        return Path(out_dir)

    # ------------------------------------------------------------------ checkpoints
    def save(self, ckpt_dir: str | os.PathLike) -> Path:
        """torch_dist checkpoint of model (+ optimizer, schedule and step counters when trainable).

        The optimizer is saved once it has state, i.e. after the first successful step (Adam creates its
        moments lazily; a checkpoint without them loads into a fresh optimizer)."""
        self._check_awake("save")
        with_opt = self.optimizer is not None and self.steps > 0
        return ckpt.save_checkpoint(
            ckpt_dir, self.model, self.arch, self.hf_config,
            optimizer=self.optimizer if with_opt else None, scheduler=self.scheduler if with_opt else None,
            extra={"steps": self.steps, "skipped_steps": self.skipped_steps},
            assets_dir=self.assets_dir,
        )

    def load(self, ckpt_dir: str | os.PathLike, load_optimizer: bool = True) -> None:
        """Load a checkpoint saved at any TP x PP layout (optimizer state too when present and asked for)."""
        self._check_awake("load")
        meta = ckpt.read_meta(ckpt_dir)
        with_opt = load_optimizer and self.optimizer is not None and meta.get("has_optimizer", False)
        extra = ckpt.load_checkpoint(
            ckpt_dir, self.model, self.arch,
            optimizer=self.optimizer if with_opt else None, scheduler=self.scheduler if with_opt else None,
        )
        self.steps = int(extra.get("steps", 0))
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        if self.optimizer is not None and not with_opt:
            self.optimizer.reload_model_params()

    def describe(self) -> str:
        lay = current_layout()
        cfg = self.model.config
        fused = [name for name in (*FUSION_SWITCHES, "moe_permute_fusion") if getattr(cfg, name, False)]
        if self.ddp is not None and self.ddp.ddp_config.overlap_grad_reduce:
            fused.append("overlap_grad_reduce")
        extras = [f"{k}={getattr(cfg, k)}" for k in ("sequence_parallel", "recompute_granularity") if getattr(cfg, k)]
        experts = (f" experts={self.arch.moe.num_experts} top-{self.arch.moe.top_k} EP={lay.ep} ETP={lay.etp}"
                   f" expert_mlp={expert_module_name(self.model) or 'none on this stage'}"
                   if self.arch.is_moe else "")
        patches = cpu_compat.applied_patches()  # megatron-core's CPU workarounds in this process (learner/cpu_compat.py)
        compat = f" cpu_compat={patches[0]}..{patches[-1]}" if patches else ""
        if self.config.offload != "none":
            extras.append(f"offload={self.config.offload}")
        if self.routing_replay:
            extras.append("routing_replay=sampler")
        return (f"{self.arch.family} L={self.arch.num_layers} H={self.arch.hidden_size} TP={lay.tp} PP={lay.pp} "
                f"DP={lay.dp}{experts} dtype={self.params_dtype}{compat} spec={self.spec} "
                f"fusions={','.join(fused) or 'none'}" + "".join(f" {e}" for e in extras))
