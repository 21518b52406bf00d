"""Calibrate TriAttention query centers of the embedded default's models (docs/algorithm.md, "TriAttention").

    PYTHONPATH=. python bench/triattention_centers.py RUN_DIR OUT_DIR [--records 64]

For each of RUN_DIR/model/init (weight version 0) and RUN_DIR/model/warm (after the supervised warm start), the
mean pre-RoPE query and pair modulus per layer and query head over the same token sequences: the prompts plus the
teacher's demonstrations of the task's first training records. Writes OUT_DIR/centers_{init,warm}.pt
(``rollout.centers.save_centers``), for ``rollout.compression.triattention_centers=file``.
"""
import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparse_rl_megatron.rollout.centers import calibrate_centers, save_centers
from sparse_rl_megatron.rollout.hf_forward import HFDecoder
from sparse_rl_megatron.tasks import TASKS
from sparse_rl_megatron.tasks.modchain import encode_demonstrations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--task", default="modchain31_wordbox_weak")
    parser.add_argument("--records", type=int, default=64)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(Path(args.run_dir) / "model" / "init")
    task = TASKS.get(args.task)
    records = list(task.records("train", limit=args.records))
    seqs = [p + r for p, r in encode_demonstrations(args.task, records, tokenizer)]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    for version in ("init", "warm"):
        model = AutoModelForCausalLM.from_pretrained(Path(args.run_dir) / "model" / version).eval()
        centers = calibrate_centers(HFDecoder(model), ids, lengths)
        save_centers(str(out / f"centers_{version}.pt"), centers)
        print(version, "tokens", int(lengths.sum()), "|E q| mean", float(centers[0].norm(dim=-1).mean()))


if __name__ == "__main__":
    main()
