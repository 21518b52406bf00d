#!/usr/bin/env bash
# Download the cp312 wheels the GPU check (bench/gpu_check.py) installs on a lent device machine into
# bench/gpu_wheels/ (git-ignored; carried with the working tree: run tool carry=["bench/gpu_wheels"]).
#
# The device has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, triton 3.6, numpy, safetensors, pyyaml,
# rich, tqdm and no network. Of what the kit imports, it lacks megatron-core; megatron-core 0.16.1 itself
# imports torch, numpy and packaging (>= 24.2), and its checkpoint writer processes import psutil (without it
# they die and the save waits for them forever). packaging and psutil are installed there only when the
# device's own copy is missing or older (bench/gpu_kit/wheels.py). The three wheels: about 3 MB of the
# 64 MiB carry.
# Checked by running `bench/gpu_check.py --cpu` in a Python 3.12 venv holding only the device's packages
# (bench/README.md, "GPU acceptance kit").
#
#   bash bench/gpu_wheels.sh            # idempotent: a wheel already there is not fetched again
set -euo pipefail
cd "$(dirname "$0")"
DEST=gpu_wheels
PYTHON=${PYTHON:-python3}
WHEELS=(megatron-core==0.16.1 packaging==26.0 psutil==7.2.2)
mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
du -sh "$DEST"
