"""The GPU acceptance kit behind ``bench/gpu_check.py``: one command on one lent GPU, every part time-boxed.

- ``sizes``: the H200 sizes and the toy (``--cpu``) sizes of every part, and each part's time box.
- ``records``: results as JSON lines written as they are measured (a killed part keeps what it had), the
  peak-memory meter (CUDA allocator, or peak RSS on CPU), the part deadline.
- ``wheels``: installs the carried wheels (``bench/gpu_wheels/``) with ``pip --no-index --no-deps --target``.
- ``part_model``, ``part_learner``, ``part_engine``: the parts; each runs in its own process.
- ``driver``: runs the parts in order under their boxes; ``report``: ``results.json`` + ``results.md``;
  ``estimate``: the expected H200 seconds of each part from its FLOPs and the engine's op count.

The kit imports only torch, transformers, megatron-core and the project's learner, rollout, compression,
algo, models and planning modules: never math-verify, SGLang or Transformer Engine.
"""
