"""Learner log-probs == log_softmax of the HF model's logits on SmolLM2-135M-Instruct, at TP 1 and PP 2.

usage: torchrun --nproc_per_node 2 w_parity.py MODEL_DIR OUT_JSON: TP 1 x PP 2, then TP 1 x PP 1 (x DP 2) in the
same ranks (one megatron-core import). Rank 0 writes one ``{"layout", "max_abs_diff", ...}`` per layout for a
[2, ~30] batch of real text.
"""
from __future__ import annotations

import json
import sys

import torch

torch.set_num_threads(1)


def main() -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparse_rl_megatron.learner import Learner, SequenceBatch
    from sparse_rl_megatron.learner.config import LearnerConfig

    model_dir, out = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    rows = [("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
             " In May she sold 48 / 2 = 24 clips, so altogether she sold 48 + 24 = 72 clips. The answer is 72."),
            ("What is the capital of France?", " The capital of France is Paris.")]
    prompts = [torch.tensor(tok(p, add_special_tokens=False)["input_ids"]) for p, _ in rows]
    responses = [torch.tensor(tok(r, add_special_tokens=False)["input_ids"]) for _, r in rows]
    batch = SequenceBatch(prompts, responses)
    want = None
    results = []
    for pp in (2, 1):
        learner = Learner(LearnerConfig(model_path=model_dir, pipeline_parallel_size=pp, params_dtype="float32",
                                        layer_spec="local"), trainable=False)
        got = learner.logprobs(batch)
        del learner
        if dist.get_rank() != 0:
            continue
        if want is None:
            want = torch.zeros_like(got)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
            with torch.no_grad():
                for i, (p, r) in enumerate(zip(prompts, responses)):
                    logits = hf(input_ids=torch.cat([p, r]).unsqueeze(0)).logits[0, p.numel() - 1:-1].float()
                    want[i, : r.numel()] = torch.log_softmax(logits, -1).gather(-1, r.unsqueeze(-1)).squeeze(-1)
        mask = batch.response_mask()
        results.append({"layout": f"TP1xPP{pp}", "max_abs_diff": float((got - want).abs()[mask].max()),
                        "padding_zero": bool(torch.all(got[~mask] == 0)), "tokens": int(mask.sum()),
                        "mean_logprob": float(want[mask].mean())})
    if dist.get_rank() == 0:
        json.dump(results, open(out, "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
