"""The megatron-core learner: model provider, CPU compatibility, parallel state, HF <-> Megatron checkpoints,
dense (vocab-parallel, chunked) log-probs, the corrected GRPO train step, optimizer and weight export.

megatron-core is imported lazily, inside the functions that need it.
"""
from sparse_rl_megatron.learner.batch import SequenceBatch
from sparse_rl_megatron.learner.config import LearnerConfig, OptimConfig
from sparse_rl_megatron.learner.convert import export_to_hf, import_from_hf
from sparse_rl_megatron.learner.learner import Learner
from sparse_rl_megatron.learner.train_step import TrainBatch

__all__ = ["Learner", "LearnerConfig", "OptimConfig", "SequenceBatch", "TrainBatch", "export_to_hf", "import_from_hf"]
