"""Supervised fine-tuning of an HF causal LM on (prompt, worked solution) token pairs, bounded by steps.

The warm start of tasks built in code, and the equal-time supervised control of RL experiments (continue
from any HF checkpoint for a given number of steps). Plain torch on the HF module: this prepares a model
directory, it is not a second training loop of the RL system. Loss: mean cross-entropy over response tokens
(EOS included), prompt tokens masked. AdamW, constant learning rate then cosine decay to ``min_lr`` over the
last ``decay_fraction`` of the steps. Batches are drawn with replacement from the examples by ``seed``, so a
run is fixed by (model, examples, config, seed); only float rounding differs between thread counts.
"""
from __future__ import annotations

import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from sparse_rl_megatron.observability import metric_names as MN
from sparse_rl_megatron.utils.errors import StoppedEarly

StopCheck = Callable[[], "str | None"]
"""Asked before every supervised step: why to stop now (a run's stop request: a signal's name, the ``STOP`` file), or
None to go on."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass
class SFTConfig:
    """The supervised stage (defaults: what trained the ``modchain`` warm start, see docs/embedded-default.md)."""

    steps: int = 600
    """Optimizer steps (the stage's only bound: a run is deterministic in its length)."""
    batch_size: int = 16
    """Sequences per step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr: float = 0.0
    """Learning rate at the last step."""
    decay_fraction: float = 0.4
    """Cosine decay from ``lr`` to ``min_lr`` over this last fraction of the steps (0 = constant)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta2: float = 0.98
    """AdamW beta2 (beta1 0.9)."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0 = off)."""
    log_every: int = 50
    """Steps between progress lines (0 = none)."""
    key_dropout: float = 0.0
    """Largest key-dropout rate of response keys: each sequence draws u in [0, 1] and each of its queries loses
    each older response key with probability u * key_dropout (``key_dropout_mask``), so the model learns to
    tolerate a compressed KV cache. 0 = plain causal attention."""
    key_dropout_prompt: float = 0.0
    """Largest key-dropout rate of prompt keys (u * key_dropout_prompt); 0 = the prompt always stays visible."""
    key_dropout_keep_recent: int = 4
    """Keys this close to the query (itself included) are never dropped (the compressors' recent window)."""
    key_dropout_keep_offsets: tuple[int, ...] = ()
    """Keys at these distances before the query are never dropped either: the positions every step of a task reads
    (a lagged chain's state L steps back), so the model learns to find them among whatever else a cache kept. Where
    the distance differs between examples, ``supervised_finetune``'s ``example_keep_offsets`` gives it per example."""
    key_dropout_answer_anchor: bool = False
    """The final answer's queries never lose the key just before the answer (each example's ``answer_start``): the
    answer copies the chain's last state, which the dropout would hide from its later tokens (a two-digit answer's
    second digit is 4 positions after the state), leaving a digit to chance (docs/embedded-default.md). Their other
    keys drop as any query's, so the answer does not come to lean on keys a compressed cache may not keep."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"SFTConfig needs 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"SFTConfig.decay_fraction must be in [0, 1], got {self.decay_fraction}")
        for name in ("weight_decay", "clip_grad", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"SFTConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.adam_beta2 < 1:
            raise ValueError(f"SFTConfig.adam_beta2 must be in [0, 1), got {self.adam_beta2}")
        for name in ("key_dropout", "key_dropout_prompt"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"SFTConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.key_dropout_keep_recent < 1:
            raise ValueError(f"SFTConfig.key_dropout_keep_recent must be >= 1 (a query always sees itself), "
                             f"got {self.key_dropout_keep_recent}")
        if any(o < 1 for o in self.key_dropout_keep_offsets):
            raise ValueError(f"SFTConfig.key_dropout_keep_offsets must be distances >= 1, got {self.key_dropout_keep_offsets}")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        decay_steps = round(self.steps * self.decay_fraction)
        start = self.steps - decay_steps
        if decay_steps == 0 or step < start:
            return self.lr
        progress = (step - start + 1) / decay_steps
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [b, L], labels [b, L])``: rows right-padded with ``pad_id``; labels -100 off the responses."""
    length = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
    return ids, labels


def key_dropout_mask(prompt_lens: torch.Tensor, length: int, rate: float, prompt_rate: float = 0.0,
                     keep_recent: int = 1, generator: torch.Generator | None = None,
                     answer_from: torch.Tensor | None = None, keep_offsets: tuple[int, ...] = (),
                     row_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, 1, L, L]`` bool attention mask (True = visible): causal, minus a random subset of older keys.

    Row ``b`` (prompt length ``prompt_lens[b]``) draws ``u_b ~ U[0, 1]``; each query ``i`` then loses each
    key ``j <= i - keep_recent`` independently, with probability ``u_b * rate`` for a response key and
    ``u_b * prompt_rate`` for a prompt key (DropKey-style: masked before the softmax, so the kept keys are
    renormalised, as after a KV-cache eviction). Keys within ``keep_recent`` of the query are always visible, and
    those ``keep_offsets`` before it, and in row b those ``row_offsets[b]`` before it (``[b, k]``, 0 = none: a
    query always sees itself); a query at or after ``answer_from[b]`` (``[b]``: where row b's answer starts;
    None: no answer anchor) also keeps the key at ``answer_from[b] - 1``, the one the answer copies. No argument
    changes the random draws: the same generator drops the same keys, whichever are then spared.
    """
    batch = len(prompt_lens)
    i = torch.arange(length).view(1, 1, length, 1)
    j = torch.arange(length).view(1, 1, 1, length)
    u = torch.rand(batch, 1, 1, 1, generator=generator)
    in_prompt = j < prompt_lens.view(batch, 1, 1, 1)
    p_drop = u * torch.where(in_prompt, torch.tensor(prompt_rate), torch.tensor(rate))
    dropped = torch.rand(batch, 1, length, length, generator=generator) < p_drop
    if answer_from is not None:
        start = answer_from.view(batch, 1, 1, 1)
        dropped &= ~((i >= start) & (j == start - 1))
    for offset in keep_offsets:
        dropped &= i - j != offset
    if row_offsets is not None:
        if row_offsets.dim() != 2 or row_offsets.shape[0] != batch:
            raise ValueError(f"key_dropout_mask: row_offsets must be [batch={batch}, k], got {tuple(row_offsets.shape)}")
        for column in row_offsets.unbind(1):
            dropped &= i - j != column.view(batch, 1, 1, 1)
    return (j <= i) & ((i - j < keep_recent) | ~dropped)


def response_loss(model, ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (response) tokens. ``attention_mask``: None (causal) or
    a ``[b, 1, L, L]`` bool mask (True = visible; right padding needs no masking, it is never attended)."""
    logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def check_output_free(out_dir: str | os.PathLike) -> None:
    """Refuse an existing output directory (before any work, so a finished model is never overwritten)."""
    if Path(out_dir).exists():
        raise FileExistsError(f"model output directory {out_dir} already exists; remove it or choose another")


def save_model_dir(model, tokenizer_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write ``model`` and the tokenizer files of ``tokenizer_dir`` to ``out_dir`` (staged next to it, then
    renamed into place, so a crash never leaves a half-written model that looks finished)."""
    out = Path(out_dir)
    check_output_free(out)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy2(Path(tokenizer_dir) / name, staging / name)
    staging.rename(out)
    return out


def supervised_finetune(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    examples: Sequence[tuple[list[int], list[int]]],
    config: SFTConfig,
    *,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
    answer_starts: Sequence[int] | None = None,
    example_keep_offsets: Sequence[Sequence[int]] | None = None,
    should_stop: StopCheck | None = None,
) -> dict[str, float]:
    """Train the HF model of ``model_dir`` on ``examples`` (``(prompt_ids, response_ids)``, EOS included in the
    response) and write it, with ``model_dir``'s tokenizer, to ``out_dir``. ``answer_starts[i]``: where example i's
    final answer starts in its response (needed by ``key_dropout_answer_anchor``). ``example_keep_offsets[i]``: distances
    before each query of example i whose keys the key dropout never drops, beside ``config.key_dropout_keep_offsets``
    (a task whose read lies at a distance that varies between examples; None: none). ``should_stop``: asked before
    every step; when it names a reason (a run's stop request), training ends there with ``StoppedEarly`` and nothing
    is written to ``out_dir``.

    Returns ``sft/loss_first`` (mean of the first 10 steps), ``sft/loss_last`` (mean of the last 10),
    ``sft/steps``, ``sft/seconds`` (wall), ``sft/cpu_seconds`` (this process), ``sft/seconds_per_step``.
    """
    from transformers import AutoModelForCausalLM

    if not examples:
        raise ValueError("supervised_finetune: no examples")
    if config.key_dropout_answer_anchor and (answer_starts is None or len(answer_starts) != len(examples)):
        raise ValueError("supervised_finetune: key_dropout_answer_anchor needs answer_starts, one per example")
    if example_keep_offsets is not None and (len(example_keep_offsets) != len(examples)
                                             or any(o < 1 for e in example_keep_offsets for o in e)):
        raise ValueError(f"supervised_finetune: example_keep_offsets must give distances >= 1 for each of the "
                         f"{len(examples)} examples, got {len(example_keep_offsets)} entries")
    width = max((len(e) for e in example_keep_offsets), default=0) if example_keep_offsets is not None else 0
    check_output_free(out_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or name.endswith("bias") else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, betas=(0.9, config.adam_beta2))
    rng = random.Random(seed)
    losses: list[float] = []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(config.steps):
            if should_stop is not None and (reason := should_stop()):
                raise StoppedEarly(f"stopped by {reason} during the supervised warm start, before step {step + 1} of "
                                   f"{config.steps}; nothing of it was kept: a re-run builds it again")
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            picked = [rng.randrange(len(examples)) for _ in range(config.batch_size)]
            batch = [examples[k] for k in picked]
            ids, labels = collate(batch, pad_id)
            mask = None
            if config.key_dropout > 0 or config.key_dropout_prompt > 0:
                answer = (torch.tensor([len(examples[k][0]) + answer_starts[k] for k in picked])
                          if config.key_dropout_answer_anchor else None)
                rows = (torch.tensor([[*example_keep_offsets[k], *[0] * (width - len(example_keep_offsets[k]))]
                                      for k in picked])
                        if width else None)
                mask = key_dropout_mask(torch.tensor([len(p) for p, _ in batch]), ids.shape[1], config.key_dropout,
                                        config.key_dropout_prompt, config.key_dropout_keep_recent,
                                        answer_from=answer,
                                        keep_offsets=tuple(config.key_dropout_keep_offsets), row_offsets=rows)
            loss = response_loss(model, ids, labels, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
            optimizer.step()
            losses.append(loss.item())
            if log is not None and config.log_every and ((step + 1) % config.log_every == 0 or step + 1 == config.steps):
                elapsed = time.perf_counter() - wall0
                eta = elapsed / (step + 1) * (config.steps - step - 1)
                log(f"sft step {step + 1}/{config.steps} loss {sum(losses[-config.log_every:]) / len(losses[-config.log_every:]):.4f} "
                    f"lr {config.lr_at(step):.2e} elapsed {elapsed:.0f}s eta {eta:.0f}s")
    model.eval()
    save_model_dir(model, model_dir, out_dir)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {
        MN.SFT_LOSS_FIRST: sum(losses[:10]) / len(losses[:10]),
        MN.SFT_LOSS_LAST: sum(losses[-10:]) / len(losses[-10:]),
        MN.SFT_STEPS: float(config.steps),
        MN.SFT_SECONDS: wall,
        MN.SFT_CPU_SECONDS: cpu,
        MN.SFT_SECONDS_PER_STEP: wall / config.steps,
    }
