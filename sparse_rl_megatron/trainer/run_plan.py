"""Everything about a ``sparse-rl train`` config that can be wrong, checked before any model loads.

Each problem is one ``UserError`` line naming the field (or file) and the valid values: the model directory and
its ``config.json``, the parallel layout against the model and the world size, the task, template, reward and
engine names, where the rollout engines run (``rollout.gpus_per_engine`` against the ranks per node), the data
sets (named, files, tasks: loaded here, so an empty or label-less file is caught now), an explicit resume
checkpoint; the limits a run would otherwise hit after its models load: the longest prompt + ``max_new_tokens``
of the rollouts and of every evaluation set against the model's context (``max_position_embeddings`` of its
``config.json``, and the SGLang engine's ``context_length`` if set; prompts measured with the model's tokenizer
when the directory has one), and a 16-bit learner on a machine without CUDA. Every rank runs it (on several
nodes each checks its own files).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparse_rl_megatron.utils.device import DeviceFacts, cuda_present, resolve
from sparse_rl_megatron.utils.errors import UserError
from pathlib import Path
from sparse_rl_megatron.data.sets import load_dataset
from sparse_rl_megatron.data.templates import TEMPLATES, render_prompt
from sparse_rl_megatron.learner.learner import check_moe_training
from sparse_rl_megatron.models.arch import arch_from_hf_config
from sparse_rl_megatron.rewards.registry import REWARDS
from sparse_rl_megatron.rollout.engine_registry import ENGINES
from sparse_rl_megatron.rollout.layout import LayoutError, RolloutLayout
from sparse_rl_megatron.tasks import HELDOUT_SEED, get_task, is_task_ref
from sparse_rl_megatron.trainer.checkpointing.checkpoints import resolve_resume
from sparse_rl_megatron.trainer.config import TINY_MODELS
from sparse_rl_megatron.utils.file_checks import MEGATRON_ASSETS_DIR, check_model_dir, has_tokenizer
from sparse_rl_megatron.utils.registry import UnknownNameError

if TYPE_CHECKING:
    from sparse_rl_megatron.data.loader import Dataset
    from sparse_rl_megatron.rollout.layout import RolloutLayout
    from sparse_rl_megatron.tasks.base import Task
    from sparse_rl_megatron.trainer.config import TrainConfig

DEFAULT_TEMPLATE = "qwen25_chat"
DEFAULT_REWARD = "math"


@dataclass
class RunPlan:
    """What preflight resolved: the names and data the run will use."""

    task: "Task | None"
    """The task of ``model_path`` / ``data.dataset`` (``task:<name>``), if any."""
    template: str
    """Prompt template name."""
    reward: str
    """Reward name."""
    train_data: "Dataset"
    """Training problems."""
    eval_data: dict[str, "Dataset"] = field(default_factory=dict)
    """Held-out problems by data set name (empty: no evaluation)."""
    hf_config: dict[str, Any] | None = None
    """The model's HF config when it exists before the run (None for ``tiny`` / task models)."""
    layout: "RolloutLayout | None" = None
    """Where the rollout engines run (what starts, and what the start-up line says)."""
    device_facts: DeviceFacts = field(default_factory=DeviceFacts.detect)
    """This machine's device facts, resolved once by ``preflight`` and passed down (learner, checkpoints, probe)."""


def rollout_layout(cfg: "TrainConfig", world_size: int, ranks_per_node: int | None = None,
                   on_gpu: bool | None = None) -> "RolloutLayout":
    """The run's rollout engines at ``world_size`` ranks, ``ranks_per_node`` per node (default: torchrun's
    ``LOCAL_WORLD_SIZE``, else all on one node), on GPUs or not (default: ``cuda_present()``)."""
    import os

    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if on_gpu is None:
        on_gpu = cuda_present()
    r = cfg.rollout
    urls = list(r.sglang.urls) if r.engine == "sglang" else []
    try:
        return RolloutLayout.build(engine=r.engine, world=world_size, ranks_per_node=ranks_per_node,
                                   gpus_per_engine=r.gpus_per_engine, groups=r.prompts_per_step, urls=urls,
                                   on_gpu=on_gpu, tensor_parallel=ENGINES.get(r.engine).tensor_parallel)
    except LayoutError as err:
        raise UserError(str(err)) from None


def _task(name: str, option: str):
    try:
        return get_task(name)
    except UnknownNameError as err:
        raise UserError(f"{option}: {err}") from None


def _load(name: str, cfg: "TrainConfig", option: str, split: str, limit: int | None) -> "Dataset":
    if is_task_ref(name):
        task = _task(name, option)
        return task.records(split, limit=limit, seed=cfg.seed if split == "train" else HELDOUT_SEED)
    try:
        return load_dataset(name, root=cfg.data.data_root, input_key=cfg.data.input_key,
                            label_key=cfg.data.label_key, limit=limit, root_option="data.data_root")
    except (OSError, ValueError, KeyError) as err:  # missing file or root, unknown name, no usable row
        raise UserError(f"{option}: {err}") from None


def check_model(cfg: "TrainConfig", world_size: int) -> dict[str, Any] | None:
    """The model path and the parallel layout (against the model's shape and the world size)."""
    tp, pp = cfg.learner.tensor_parallel_size, cfg.learner.pipeline_parallel_size
    ep, etp = cfg.learner.expert_parallel_size, cfg.learner.expert_tensor_parallel
    if world_size % (tp * pp):
        raise UserError(
            f"learner.tensor_parallel_size x learner.pipeline_parallel_size = {tp} x {pp} = {tp * pp} does not divide "
            f"the world size {world_size} (torchrun --nnodes x --nproc-per-node); valid: a divisor of {world_size}")
    if world_size % (tp * pp) == 0 and (world_size // pp) % (ep * etp):
        raise UserError(
            f"learner.expert_parallel_size x learner.expert_tensor_parallel_size = {ep} x {etp} (null: the TP size) does "
            f"not divide the ranks of one pipeline stage, world size / learner.pipeline_parallel_size = {world_size} / "
            f"{pp} = {world_size // pp}")
    hf_config = None
    if cfg.model_path in TINY_MODELS:
        from sparse_rl_megatron.models.tiny import tiny_config

        hf_config = tiny_config(TINY_MODELS[cfg.model_path]).to_dict()
    elif is_task_ref(cfg.model_path):
        _task(cfg.model_path, "model_path")
        return None
    else:
        hf_config = check_model_dir(cfg.model_path, "model_path")
    try:
        arch = arch_from_hf_config(hf_config)
        arch.check_tensor_parallel(tp)
        arch.check_pipeline_parallel(pp)
        arch.check_expert_parallel(ep, etp)
        check_moe_training(arch, cfg.learner, trainable=True)
    except KeyError as err:
        raise UserError(f"model_path: the config of {cfg.model_path} has no {err} field") from None
    except ValueError as err:
        raise UserError(f"learner: {err} (model {cfg.model_path})") from None
    if cfg.rollout.engine == "sglang":
        from sglang_ext.refusals import refuse_tied_moe_head

        try:
            refuse_tied_moe_head(hf_config)
        except ValueError as err:
            raise UserError(f"rollout.engine=sglang: {err} (model {cfg.model_path})") from None
    return None if cfg.model_path in TINY_MODELS else hf_config


def host_memory_available() -> int | None:
    """This node's available memory in bytes (``MemAvailable`` of ``/proc/meminfo``; None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def offload_host_bytes(cfg: "TrainConfig", hf_config: dict[str, Any], world_size: int, mode: str,
                       on_gpu: bool) -> int:
    """Host bytes one learner rank (the stage that keeps the most) holds while it sleeps in offload ``mode``: the
    sleeping weights and optimizer state and a KL reference's weights when weights sleep (gradients are not copied:
    ``learner/offload.py``), from the planner's figures (``planning/residency.py``)."""
    from sparse_rl_megatron.learner.offload import offload_parts
    from sparse_rl_megatron.planning.inputs import BatchShape, Layout, LearnerSetting
    from sparse_rl_megatron.planning.learner_memory import learner_memory
    from sparse_rl_megatron.planning.residency import reference_resident, stage_parts

    lrn = cfg.learner
    tp, pp = lrn.tensor_parallel_size, lrn.pipeline_parallel_size
    arch = arch_from_hf_config(hf_config)
    dtype = lrn.params_dtype if lrn.params_dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    distopt = on_gpu if lrn.optim.use_distributed_optimizer is None else lrn.optim.use_distributed_optimizer
    setting = LearnerSetting(params_dtype=dtype, distributed_optimizer=distopt, reference_model=lrn.loss.kl_coef > 0,
                             offload=mode)
    layout = Layout(tp, pp, world_size // (tp * pp), ep=lrn.expert_parallel_size, etp=lrn.expert_tensor_parallel)
    parts = offload_parts(mode) - {"gradients"}
    most = 0
    for stage in learner_memory(arch, layout, BatchShape(1, 1, 1, 1), setting):
        held = sum(n for part, n in stage_parts(stage, setting).items() if part in parts)
        if "weights" in parts:
            held += int(stage.reference) - reference_resident(stage, setting)
        most = max(most, held)
    return most


def check_offload_host_memory(cfg: "TrainConfig", hf_config: dict[str, Any] | None, world_size: int,
                              ranks_per_node: int | None, on_gpu: bool, available: int | None = None) -> None:
    """``learner.offload`` needs host memory for what sleeps, on every rank of a node: refuse a setting this node
    cannot hold (``available``: its free bytes, default ``MemAvailable``), naming what each mode would need.
    Nothing to check for a model built in the run (``tiny``, ``task:``): ``hf_config`` None."""
    import os

    from sparse_rl_megatron.learner.offload import OFFLOAD_MODES

    mode = cfg.learner.offload
    if hf_config is None or not OFFLOAD_MODES.get(mode).parts:
        return
    available = host_memory_available() if available is None else available
    if available is None:
        return
    ranks = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if ranks * offload_host_bytes(cfg, hf_config, world_size, mode, on_gpu) <= available:
        return
    need = {name: ranks * offload_host_bytes(cfg, hf_config, world_size, name, on_gpu) for name in OFFLOAD_MODES.names()}
    gib = lambda b: f"{b / 2 ** 30:.1f} GiB"  # noqa: E731
    fits = [f"{name} ({gib(b)})" for name, b in sorted(need.items(), key=lambda kv: kv[1]) if b <= available]
    raise UserError(f"learner.offload={mode} keeps {gib(need[mode] // ranks)} per rank in host memory (its sleeping "
                    f"weights and optimizer state), {gib(need[mode])} for the {ranks} ranks of this node, but the node "
                    f"has {gib(available)} available; valid here: {', '.join(fits) or 'none of the modes'} (or more GPUs)")


def check_launch_layout(cfg: "TrainConfig", world_size: int, ranks_per_node: int | None = None) -> None:
    """A recipe's ``launch.layout`` that names its rollout engines (``rollout: ...``) must say what this launch
    starts when it is the recipe's size (``launch.gpus``): the line ``RolloutLayout`` prints on GPUs."""
    said = cfg.launch.layout
    if cfg.launch.gpus != world_size or "rollout:" not in said:
        return
    said = " ".join(said[said.index("rollout:"):].split())
    starts = rollout_layout(cfg, world_size, ranks_per_node, on_gpu=True).describe()
    if said != starts:
        raise UserError(f"launch.layout says '{said}', but this launch of {world_size} GPUs starts '{starts}'; "
                        "correct the recipe's launch.layout")


def check_learner_dtype(cfg: "TrainConfig", on_gpu: bool, training: bool = True) -> None:
    """Megatron's CPU path trains float32 parameters only (its DDP wrapper refuses CPU bf16/fp16 tensors); a command
    that only computes log-probs (``training`` False: ``sparse-rl mismatch``) runs a bfloat16 learner on CPU too."""
    dtype = cfg.learner.params_dtype
    if not on_gpu and training and dtype in ("bfloat16", "float16"):
        raise UserError(f"learner.params_dtype={dtype} needs a GPU: this machine has no CUDA device, and the learner "
                        "on CPU takes float32 parameters only; set learner.params_dtype=float32 (or auto: bfloat16 "
                        "on GPUs, float32 on CPU)")


def context_limit(cfg: "TrainConfig", hf_config: dict[str, Any] | None) -> tuple[int, str] | None:
    """The most tokens (prompt + response) one sequence may have, and where that limit comes from: the model's
    ``max_position_embeddings`` and the SGLang engine's ``context_length`` (``rollout.sglang.extra_args``), the
    smaller; None when neither is known (a task's model is built by the run)."""
    limits = []
    if hf_config and isinstance(hf_config.get("max_position_embeddings"), int):
        limits.append((hf_config["max_position_embeddings"],
                       f"the model's context (max_position_embeddings of {cfg.model_path})"))
    engine_context = cfg.rollout.sglang.extra_args.get("context_length") if cfg.rollout.engine == "sglang" else None
    if isinstance(engine_context, int):
        limits.append((engine_context, "the engine's context (rollout.sglang.extra_args.context_length)"))
    return min(limits, key=lambda x: x[0]) if limits else None


def _prompt_tokenizer(cfg: "TrainConfig"):
    """The tokenizer of ``model_path`` when the directory (or a Megatron checkpoint's ``hf_assets``) has one."""
    for directory in (Path(cfg.model_path), Path(cfg.model_path) / MEGATRON_ASSETS_DIR):
        if directory.is_dir() and has_tokenizer(directory):
            from transformers import AutoTokenizer

            try:
                return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            except (OSError, ValueError) as err:
                raise UserError(f"model_path: the tokenizer of {directory} does not load: {err}") from None
    return None


def longest_prompt(data: "Dataset", template: str, tokenizer, room: int | None = None) -> int:
    """Tokens of ``data``'s longest prompt under ``template`` (as the engines render and tokenize it). With
    ``room``: when no prompt can be longer than that (a token covers at least one UTF-8 byte; +1 for a
    SentencePiece word-start marker), the bound is returned without tokenizing."""
    if tokenizer is None or not len(data):
        return 0
    prompts = [render_prompt(template, r.prompt, tokenizer) for r in data.records]
    bound = max(len(p.encode()) for p in prompts) + 1
    if room is not None and bound <= room:
        return bound
    return max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])


def check_context(cfg: "TrainConfig", hf_config: dict[str, Any] | None, template: str, train: "Dataset | None",
                  evals: dict[str, "Dataset"]) -> None:
    """The longest prompt + ``max_new_tokens`` of the rollouts (``train``; None: the command rolls out none) and of
    every evaluation set fits ``context_limit`` (SGLang refuses a request past it; past ``max_position_embeddings``
    a model is outside what it was trained on). Prompts count as 0 tokens when the model directory has no
    tokenizer."""
    limit = context_limit(cfg, hf_config)
    if limit is None:
        return
    context, where = limit
    tokenizer = _prompt_tokenizer(cfg)
    rollout_new = cfg.rollout.sampling.max_new_tokens
    eval_said = (f"eval.max_new_tokens={cfg.eval.max_new_tokens}" if cfg.eval.max_new_tokens else
                 f"eval.max_new_tokens (unset: rollout.sampling.max_new_tokens={rollout_new})")
    uses = [] if train is None else [(rollout_new, f"rollout.sampling.max_new_tokens={rollout_new}",
                                      "rollout.sampling.max_new_tokens", train, f"data.dataset {cfg.data.dataset}")]
    uses += [(cfg.eval.max_new_tokens or rollout_new, eval_said, "eval.max_new_tokens", data, f"eval.datasets {name}")
             for name, data in evals.items()]
    for new, said, option, data, what in uses:
        prompt = longest_prompt(data, template, tokenizer, room=context - new)
        if prompt + new > context:
            total = "" if tokenizer is None else f" + the longest prompt of {what} ({prompt} tokens) = {prompt + new}"
            raise UserError(f"{said}{total} > {context} tokens, {where}; set {option} to at most {context - prompt}")


def preflight(cfg: "TrainConfig", world_size: int, ranks_per_node: int | None = None,
              on_gpu: bool | None = None, lengths: tuple[str, ...] = ("rollout", "eval"),
              device_facts: DeviceFacts | None = None, training: bool = True) -> RunPlan:
    """Check ``cfg`` against files, registries, ``world_size`` and the rollout layout (``rollout_layout``); load
    the data. ``lengths``: whose lengths must fit the model's context (what the command runs: ``rollout``,
    ``eval``). ``device_facts``: this machine's (default: detected here, once for the run; kept in the plan);
    ``on_gpu``: check the learner dtype and the rollout layout as on GPUs or not (default: ``device_facts.cuda``);
    ``training``: the command trains (False: log-probs only, a bfloat16 learner allowed on CPU). Raises ``UserError``."""
    device_facts = resolve(device_facts)
    if on_gpu is None:
        on_gpu = device_facts.cuda
    check_learner_dtype(cfg, on_gpu, training)
    hf_config = check_model(cfg, world_size)
    check_offload_host_memory(cfg, hf_config, world_size, ranks_per_node, on_gpu)
    task = None
    for name, option in ((cfg.model_path, "model_path"), (cfg.data.dataset, "data.dataset")):
        if is_task_ref(name):
            task = _task(name, option)
    if cfg.warm_start and not is_task_ref(cfg.model_path):
        raise UserError(f"warm_start: options are only used with model_path: task:<name>, not {cfg.model_path!r}")
    template = cfg.data.template or (task.template if task is not None else DEFAULT_TEMPLATE)
    reward = cfg.reward.name or (task.reward if task is not None else DEFAULT_REWARD)
    try:
        TEMPLATES.check(template, "data.template")
        REWARDS.check(reward, "reward.name")
        ENGINES.check(cfg.rollout.engine, "rollout.engine")
    except UnknownNameError as err:
        raise UserError(str(err)) from None
    layout = rollout_layout(cfg, world_size, ranks_per_node, on_gpu)
    check_launch_layout(cfg, world_size, ranks_per_node)
    if cfg.checkpoint.resume not in ("auto", "never"):
        resolve_resume(cfg.checkpoint.resume, cfg.run_dir)
    train = _load(cfg.data.dataset, cfg, "data.dataset", "train", cfg.data.limit)
    names = cfg.eval.datasets or ([f"task:{task.name}"] if task is not None and is_task_ref(cfg.data.dataset) else [])
    evals = {name: _load(name, cfg, "eval.datasets", "heldout", cfg.eval.limit) for name in names}
    check_context(cfg, hf_config, template, train if "rollout" in lengths else None,
                  evals if "eval" in lengths else {})
    return RunPlan(task=task, template=template, reward=reward, train_data=train, eval_data=evals,
                   hf_config=hf_config, layout=layout, device_facts=device_facts)
