"""Tasks built in code (problems, reward, model recipe, supervised warm start) by name: ``TASKS``.

A config refers to a task as ``task:<name>``; ``get_task`` resolves it (unknown names list the valid ones).

- ``modchain``: iterate ``x <- (a x + b) mod 10`` for 30 steps from tags in the prompt.
- ``modchain_weak``: the same problems, demonstrations from a weaker teacher (``modchain_teacher.py``): where
  x_27 is odd (and != x_30) they stop after step 27 with probability 0.7, so supervised training cannot reach
  what RL can. Both have a shortcut (``tasks/audit.py``): x_30 = x_10 on every problem, and = x0 on 62% of the
  held-out ones, so accuracy on them partly measures copying a prompt value.
- ``modchain31_weak``: the weak teacher on shortcut-free chains: mod 31, x <- x + a on odd steps and x + b on
  even ones (a, b in 1..9), N = 29 steps, 400 distinct held-out problems; responses open with ``sZero <x0>``
  (``ModChainSpec.restate_start``: without it x1 = x0 + a was the step seed 2's warm start never learned). Passes the audit; the 2-layer model
  learns it (about 50% held-out after its warm start's 1000 supervised steps of 32 sequences; 300 leave it at ~2%,
  measured), and the trainer checks each warm start (``tasks/warm_check.py``: the taught class right, boxes
  right on full chains). The embedded default from issue 26 to issue 38 (``modchain_weak`` was before).
- ``modchain31_wordbox_weak``: the same with the answer boxed as the last state's word (``\\boxed{ twentyone }``,
  a copy of the token just written) instead of its digits (``ModChainSpec.answer_format``): the embedded default
  (``configs/cpu_default.yaml``).
- ``modchain100_weak``: mod 100, a in {21, 41, 61, 81}, b a unit (periods 100), N = 29; passes the audit.
- ``lagchain31_weak``: 6 registers updated in turn mod 31, each step reading its register's value written 6 steps
  (11 positions) back in the response, plus a prompt increment (``lagchain.py``; issue 39: a task where a compressed
  cache must keep the right response tokens). The weaker teacher as above.
- ``lagchain31_var_weak``: the same with 2 to 6 registers, drawn per problem and told by the prompt (tag ``l<L>``),
  so the read lies 3 to 11 positions back and the share of problems whose reads a budget keeps grows with it.
- ``lagchain31_var_tags_weak``: the same problems with register i's states written with x_i's prompt tag letter
  (``LagChainSpec.register_letters``: restating x_i copies its tag; its own split), which the warm start learns where
  the own-letter design's did not (docs/experiments.md, "Fourth design").
- ``lagchain31_var_marker_weak``: the tags design with each state written after its register's bare letter
  (``LagChainSpec.register_marker``: the read an induction 3L - 1 back; 97 response tokens; its own split).
- ``lagchain31_var_regs_weak``: the same with each state written as its register's letter and its value word
  (``LagChainSpec.register_tokens``) and a word box; measured, not learned by its warm start (docs/experiments.md).
"""
from __future__ import annotations

from dataclasses import replace

from sparse_rl_megatron.tasks.base import HELDOUT_SEED, SPLITS, Task
from sparse_rl_megatron.tasks.lagchain import INITIAL_LETTERS, LagChainSpec, LagChainTask
from sparse_rl_megatron.tasks.modchain import ModChainSpec, ModChainTask
from sparse_rl_megatron.tasks.modchain_problems import ChainFamily
from sparse_rl_megatron.tasks.modchain_teacher import EarlyStopTeacher
from sparse_rl_megatron.tasks.warm_check import WarmStartExpectations
from sparse_rl_megatron.utils.registry import Registry

TASK_PREFIX = "task:"

TASKS: Registry[Task] = Registry("task")
TASKS.add("modchain", ModChainTask())
TASKS.add("modchain_weak", ModChainTask(ModChainSpec(teacher=EarlyStopTeacher()), name="modchain_weak"))
MODCHAIN31_WEAK = ModChainSpec(
    family=ChainFamily(modulus=31, rule="alternating", multipliers=tuple(range(1, 10)), offsets=tuple(range(1, 10))),
    steps=29, heldout_size=400, heldout_variants=1, train_variants=2,
    teacher=EarlyStopTeacher(stop_step=26, early_answer=False), restate_start=True, warm_start_steps=1000,
    # 32 sequences a step; the keys the compressed cache always holds (its window of 2 and the query itself) are the
    # ones never dropped, and the answer's queries keep the state they copy: with 16 sequences and the 4 most recent
    # kept, 2 of 8 seeds missed the first step, 5 of 10 draws boxed wrong digits, and with 6 kept 4 of 8 lost the
    # chain under the R-KV cache (docs/embedded-default.md, "Every draw"). A warm start sampled right (temperature 1,
    # the R-KV cache) on 54% of its taught records lost them under RL; one at 72% recovered, the others were 87-96%
    warm_start={"batch_size": 32, "key_dropout_keep_recent": 3, "key_dropout_answer_anchor": True},
    warm_check=WarmStartExpectations(max_loss=0.02, min_taught_accuracy=0.9, min_taught_full_chains=0.9,
                                     min_boxes_right=0.95, min_sparse_taught_accuracy=0.9,
                                     min_sampled_taught_accuracy=0.65))
TASKS.add("modchain31_weak", ModChainTask(MODCHAIN31_WEAK, name="modchain31_weak"))
# The same chains, teacher and warm-start recipe (distractors and the teacher's draws are seeded by the task's name,
# so they are this task's own) with the answer boxed as the last state's own word, a copy of the token just written
# (`\boxed{ twentyone }`), not its digits: the word-to-digits lookup was where three of the six
# lotteries of modchain31_weak lived, the last one RL overwriting four of its entries on one draw in 16
# (docs/embedded-default.md, "Every draw"). The embedded default since issue 38's last pass.
TASKS.add("modchain31_wordbox_weak", ModChainTask(replace(MODCHAIN31_WEAK, answer_format="word"),
                                                  name="modchain31_wordbox_weak"))
TASKS.add("modchain100_weak", ModChainTask(ModChainSpec(
    family=ChainFamily(modulus=100, multipliers=(21, 41, 61, 81), offsets=tuple(b for b in range(100) if b % 2 and b % 5),
                       skip_fixed_points=True), steps=29,
    heldout_size=400, heldout_variants=1, train_variants=1, teacher=EarlyStopTeacher(stop_step=26)),
    name="modchain100_weak"))

TASKS.add("lagchain31_weak", LagChainTask(LagChainSpec(
    # the read 2L - 1 = 11 positions back is never dropped, nor the 3 keys the compressed cache always holds
    warm_start={"batch_size": 32, "key_dropout_keep_recent": 3, "key_dropout_answer_anchor": True},
    warm_check=WarmStartExpectations(max_loss=0.02, min_taught_accuracy=0.9, min_taught_full_chains=0.9,
                                     min_boxes_right=0.95)), name="lagchain31_weak"))
LAGCHAIN31_VAR = LagChainSpec(
    # each problem draws L in 2..6 registers, told in the prompt, so its read lies 2L - 1 = 3..11 positions back;
    # each example's read is never dropped (its own 2L - 1), nor the 3 keys the compressed cache always holds
    # 3000 steps, the last 70% decaying: 1000 steps left the loss at 0.047 and 77% of the taught records right
    # (docs/experiments.md, "Second design"); 3000 reached 0.007 and 89%, still short of the check on seed 0
    lags=(2, 3, 4, 5, 6), warm_start_steps=3000,
    warm_start={"batch_size": 32, "key_dropout_keep_recent": 3, "key_dropout_answer_anchor": True,
                "decay_fraction": 0.7},
    warm_check=WarmStartExpectations(max_loss=0.02, min_taught_accuracy=0.9, min_taught_full_chains=0.9,
                                     min_boxes_right=0.95))
TASKS.add("lagchain31_var_weak", LagChainTask(LAGCHAIN31_VAR, name="lagchain31_var_weak"))

# The same spec (its own split and teacher draws, by its name), register i's states written as x_i's prompt tag
# (`dFourteen`): restating x_i copies its tag, and a read finds its register's last value among tokens shared with
# the prompt. The own-letter design's warm start missed its check on every seed tried (taught 0.33-0.89); this one
# learns it on about half its first attempts (docs/experiments.md, "Fourth design"); 5000 supervised steps: at 3000
# one seed of two missed the check on its full chains (0.85)
TASKS.add("lagchain31_var_tags_weak", LagChainTask(replace(LAGCHAIN31_VAR, register_letters=INITIAL_LETTERS,
                                                           warm_start_steps=5000), name="lagchain31_var_tags_weak"))
# The same with each state written after its register's bare letter (`sFive d dTwentyTwo`, 97 response tokens): the read
# is an induction 3L - 1 back, the same mechanism for every L; its warm start found the reads by step ~1000 on seeds
# 0, 2 and 100, where the tags design's stayed on its plateau past step 3500 on seeds 0 and 100 (docs/experiments.md,
# "Fifth design")
TASKS.add("lagchain31_var_marker_weak", LagChainTask(replace(LAGCHAIN31_VAR, register_letters=INITIAL_LETTERS,
                                                             register_marker=True, warm_start_steps=3000),
                                                     name="lagchain31_var_marker_weak"))

TASKS.add("lagchain31_var_regs_weak", LagChainTask(LagChainSpec(
    # lagchain31_var_weak with each state written as two words, its register's letter and its value (`w eight`): the
    # read is the value word after the register's last letter (an induction over 31 shared value words, not 6 x 31
    # state tokens), 3L - 1 = 5..17 positions back; the answer boxes the last value word (a copy, as the default's);
    # its warm start did not learn it (3000 steps: taught 0.66; docs/experiments.md, "Third design tried")
    lags=(2, 3, 4, 5, 6), register_tokens=True, answer_format="word", warm_start_steps=1000,
    warm_start={"batch_size": 32, "key_dropout_keep_recent": 3, "key_dropout_answer_anchor": True},
    warm_check=WarmStartExpectations(max_loss=0.02, min_taught_accuracy=0.9, min_taught_full_chains=0.9,
                                     min_boxes_right=0.95)), name="lagchain31_var_regs_weak"))


def is_task_ref(name: str) -> bool:
    """True for ``task:<name>`` references."""
    return str(name).startswith(TASK_PREFIX)


def get_task(name: str) -> Task:
    """The task registered as ``name`` (with or without the ``task:`` prefix)."""
    name = str(name)
    return TASKS.get(name[len(TASK_PREFIX):] if is_task_ref(name) else name)


__all__ = ["HELDOUT_SEED", "SPLITS", "TASKS", "TASK_PREFIX", "Task", "get_task", "is_task_ref"]
