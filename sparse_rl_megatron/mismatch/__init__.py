"""``sparse-rl mismatch``: choose a KV budget before training.

For a run's model, data, template, sampling, learner layout and correction (a train recipe plus overrides), sample
the same prompts with the same sampler seed under dense attention and under the KV compressor at each budget,
recompute the dense log-probs with the learner, and report the distribution of rho = pi_old / pi_sparse (its lower
tail), what Sparse-RL's rejection would drop, response lengths and the KV memory held, side by side. The samples
and log-probs come from the trainer's own step functions (``trainer/step.py``), so the numbers are the ones the
first training step would see.

- ``study.py``: the rows (dense + budgets), the correction used to count rejections, each row's statistics;
- ``measure.py``: set-up (models, learner, engine, reward) and the loop over rows, under torchrun like the trainer;
- ``report.py``: the results JSON, the table, the log-rho histograms (PNG);
- ``cli.py``: the command line.
"""
