# The two commands of the README. Both are idempotent: set-up installs nothing new on a second run.
.PHONY: setup setup-test run test

setup:
	bash launch/setup_env.sh

setup-test:
	bash launch/setup_env.sh --test

# The embedded CPU default run.
run: setup
	.venv/bin/sparse-rl train --config configs/cpu_default.yaml

# The whole test suite, every tier (unit, megatron, sglang, e2e). One tier: make test PYTEST_ARGS="-m unit".
test: setup-test
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest $(PYTEST_ARGS)
