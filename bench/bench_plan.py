"""``sparse-rl plan`` against what this machine measures: the CPU learner and the HF reference engine.

For toy models (fp32, megatron-core local spec, TP = PP = 1, the planner's ``local`` kernels):

1. Saved activations: the bytes autograd keeps for backward in one train step's micro-batch
   (``planning.measure.SavedTensorMeter``), without and with full recompute, vs the plan's kept activations.
2. Peak memory: the rise of the process's peak RSS (VmHWM, reset just before) over the RSS before one train
   step (after a warm-up step, so weights, gradients and Adam state exist), vs the plan's activations + the
   larger temporary.
3. KV: bytes of K and V the reference engine allocates per sequence, dense vs rkv, vs the plan.

Each learner cell runs in a fresh process.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_plan.py
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# name -> tiny model, batch, learner knobs
CELLS = {
    "wide-vocab chunked": dict(family="qwen2", vocab=151936, hidden=64, ffn=128, layers=1, heads=2, kv=1,
                               rows=1, prompt=16, response=4096, chunk=512, recompute=False),
    "wide-vocab unchunked": dict(family="qwen2", vocab=151936, hidden=64, ffn=128, layers=1, heads=2, kv=1,
                                 rows=1, prompt=16, response=4096, chunk=0, recompute=False),
    "deep qwen2": dict(family="qwen2", vocab=8192, hidden=256, ffn=768, layers=4, heads=8, kv=2,
                       rows=4, prompt=64, response=960, chunk=512, recompute=False),
    "deep qwen2, recompute": dict(family="qwen2", vocab=8192, hidden=256, ffn=768, layers=4, heads=8, kv=2,
                                  rows=4, prompt=64, response=960, chunk=512, recompute=True),
    "deep qwen3": dict(family="qwen3", vocab=8192, hidden=256, ffn=768, layers=4, heads=8, kv=2,
                       rows=4, prompt=64, response=960, chunk=512, recompute=False),
}


def _setting(cell: dict):
    from sparse_rl_megatron.planning.inputs import LearnerSetting

    return LearnerSetting(params_dtype="float32", distributed_optimizer=False, recompute=cell["recompute"],
                          kernels="local", max_tokens_per_device=cell["rows"] * (cell["prompt"] + cell["response"]),
                          logprob_chunk_tokens=cell["chunk"])


def worker(cell: dict, model_dir: str) -> None:
    import bench_learner as bl

    from sparse_rl_megatron.learner import Learner, LearnerConfig, TrainBatch
    from sparse_rl_megatron.planning.measure import SavedTensorMeter

    torch.set_num_threads(1)
    setting = _setting(cell)
    overrides = {}
    if cell["recompute"]:
        overrides = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    lrn = Learner(LearnerConfig(model_path=model_dir, params_dtype="float32", layer_spec="local",
                                max_tokens_per_device=setting.max_tokens_per_device,
                                logprob_chunk_tokens=cell["chunk"], megatron_overrides=overrides))
    small = bl.make_batch(1, 16, 16, cell["vocab"])
    lrn.train_step(TrainBatch(small, bl._prepared_like(small)))  # warm-up: Adam state, buffers
    seqs = bl.make_batch(cell["rows"], cell["prompt"], cell["response"], cell["vocab"])
    batch = TrainBatch(seqs, bl._prepared_like(seqs))
    bl._reset_peak_rss()
    base = bl._rss_bytes()
    with SavedTensorMeter(lrn.model.parameters()) as meter:
        lrn.train_step(batch)
    peak = bl._max_rss_bytes() - base
    print("RESULT " + json.dumps(dict(saved=meter.phases[0], phases=len(meter.phases), peak=peak)), flush=True)


def predicted(cell: dict) -> dict:
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.planning.inputs import BatchShape, Layout
    from sparse_rl_megatron.planning.learner_memory import learner_memory

    arch = arch_from_hf_config(_config(cell).to_dict())
    setting = _setting(cell)
    st = learner_memory(arch, Layout(1, 1, 1), BatchShape(cell["rows"], 1, cell["prompt"], cell["response"]), setting)[0]
    kept = st.activations_recompute if cell["recompute"] else st.activations
    static = st.weights + st.gradients + st.optimizer
    return dict(kept=kept, peak=st.total(setting) - static)


def _config(cell: dict):
    from sparse_rl_megatron.models.tiny import tiny_config

    return tiny_config(cell["family"], vocab_size=cell["vocab"], hidden_size=cell["hidden"],
                       intermediate_size=cell["ffn"], num_layers=cell["layers"], num_heads=cell["heads"],
                       num_kv_heads=cell["kv"], tie_word_embeddings=True)


def _write_model(cell: dict, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(cell), dtype=torch.float32).save_pretrained(out)
    return out


def kv_rows() -> list[tuple]:
    """(setting, response, engine bytes / sequence, planned bytes / sequence) from the HF reference engine."""
    from sparse_rl_megatron.compression import CompressionConfig
    from sparse_rl_megatron.models.arch import arch_from_hf_config
    from sparse_rl_megatron.planning.inputs import BatchShape
    from sparse_rl_megatron.planning.kv import kv_bytes_per_token, kv_tokens_per_sequence
    from sparse_rl_megatron.rollout.engine_protocol import SamplingParams
    from sparse_rl_megatron.rollout.hf_engine import HFRolloutEngine
    from sparse_rl_megatron.models.tiny import build_tiny_model, build_tiny_tokenizer

    model, tok = build_tiny_model("qwen2", seed=0), build_tiny_tokenizer()
    arch = arch_from_hf_config(model.config.to_dict())
    rows = []
    for method in ("none", "rkv"):
        comp = CompressionConfig(method=method, budget=64, window=8, buffer=32)
        for response in (64, 512):
            engine = HFRolloutEngine(model, tok, compression=comp, show_progress=False)
            caches = []
            new_cache = engine._new_cache
            engine._new_cache = lambda *a: caches.append(new_cache(*a)) or caches[-1]
            samples = engine.generate(["The answer is"], 2, SamplingParams(max_new_tokens=response, seed=0,
                                                                           ignore_eos=True))
            held = (caches[0].k.nbytes + caches[0].v.nbytes) // caches[0].k.shape[1]
            batch = BatchShape(1, 2, len(samples[0].prompt_ids), response)
            planned = kv_tokens_per_sequence(batch, comp) * kv_bytes_per_token(arch, "float32")
            rows.append((comp.describe(), response, held, planned))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", nargs="+", default=list(CELLS), help="learner cells to run")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(CELLS[args.worker], args.model_dir)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    print("| cell | saved, measured | saved, plan | plan / measured | peak rise, measured | plan | plan / measured |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    mib = lambda x: f"{x / 2 ** 20:,.1f} MiB"  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        for name in args.cells:
            cell = CELLS[name]
            model = _write_model(cell, Path(tmp) / name.replace(" ", "_").replace(",", ""))
            proc = subprocess.run([sys.executable, __file__, "--worker", name, "--model-dir", str(model)],
                                  cwd=ROOT, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                raise RuntimeError(f"cell {name!r} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            got, want = json.loads(lines[-1][7:]), predicted(cell)
            print(f"| {name} | {mib(got['saved'])} | {mib(want['kept'])} | {want['kept'] / got['saved']:.3f} | "
                  f"{mib(got['peak'])} | {mib(want['peak'])} | {want['peak'] / got['peak']:.2f} |", flush=True)
    print("\n| KV setting | response | engine bytes / sequence | plan | plan / engine |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for setting, response, held, planned in kv_rows():
        print(f"| {setting} | {response} | {held:,} | {planned:,} | {planned / held:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
