"""Training checkpoints: ``checkpoints`` (``run_dir/checkpoints/step_<k>/``: save, find, prune, the trainer state
and RNG streams), ``integrity`` (is a checkpoint intact, checked on its files before anything loads) and
``resume`` (which checkpoint a run resumes from, and loading it). The learner's own state inside a checkpoint:
``learner/checkpoint.py``."""
