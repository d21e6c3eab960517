"""A ``transformers.Trainer`` script under orch: a tiny randomly initialised BERT trained on synthetic tokens.

Under orch (preemption notices, emergency and periodic checkpoints, resume, metrics and goodput in the run dir)::

    pip install 'orch[hf]'
    orch launch conf=cpu_elastic launcher=local entrypoint.script=examples/hf_trainer.py trainer.max_steps=40

The length comes from ``trainer.max_steps``, the save interval from ``checkpoint.every_n_steps`` and the batch from
``trainer.micro_batch_size`` / ``trainer.global_batch_size`` (:func:`orch_training_args`). The same file runs
without orch::

    python examples/hf_trainer.py --output-dir /tmp/hf-out --max-steps 20

Nothing is downloaded: the model is built from a config and the data is generated from a seed.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForMaskedLM

from orchestrator.integrations.hf import (OrchCallback, OrchTrainer, averages_its_own_loss, latest_checkpoint,
                                          orch_training_args)

VOCAB, SEQ = 128, 16


class SyntheticTokens(Dataset):
    """Random token sequences from a fixed seed, labels = inputs (a masked-LM objective without masking)."""

    def __init__(self, num_samples: int = 2048, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (num_samples, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", help="default: <checkpoint.url or run dir/checkpoints>/hf under orch")
    parser.add_argument("--max-steps", type=int, help="default: trainer.max_steps of the run's config")
    cli = parser.parse_args()

    overrides = {k: v for k, v in (("output_dir", cli.output_dir), ("max_steps", cli.max_steps)) if v is not None}
    args = orch_training_args(learning_rate=1e-3, warmup_steps=2, dataloader_num_workers=0, **overrides)

    torch.manual_seed(0)  # the same initial weights on every rank
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ)
    model = averages_its_own_loss(BertForMaskedLM(config))  # its loss is a mean: no world x accumulation scaling
    # OrchTrainer is transformers.Trainer under fault_tolerance.mode=restart (and outside orch), and steps through
    # the quorum under per_step; with a plain Trainer the script runs in restart mode only.
    trainer = OrchTrainer(model=model, args=args, train_dataset=SyntheticTokens(), callbacks=[OrchCallback()])
    resume = latest_checkpoint(args.output_dir)  # the newest complete checkpoint; None: a fresh start
    if args.process_index == 0:
        print(f"world size {args.world_size}, resuming from {resume or 'nothing'}", flush=True)
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()
