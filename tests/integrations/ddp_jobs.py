"""Rank functions for the 2-process Trainer test (run by ``tests.distributed.launch.run_ranks``)."""

from __future__ import annotations

from pathlib import Path


def trainer_ddp(rank: int, world: int, out: str) -> dict:
    """3 optimizer steps of a tiny GPT-2 under DDP (gloo, CPU) with GradtraceCallback writing one store."""
    import os

    import torch
    from datasets import Dataset
    from transformers import Trainer

    from gradtrace.integrations.hf import GradtraceCallback
    from tests import tiny
    from tests.integrations.common import WeightRecorder, lm_rows, pad_collate, training_args

    # the process group exists already; accelerate still asks for the rendezvous variables
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    torch.manual_seed(0)
    model = tiny.gpt2()
    recorder = WeightRecorder()
    callback = GradtraceCallback(Path(out) / "store")
    trainer = Trainer(model=model, args=training_args(str(Path(out) / "trainer"), ddp_backend="gloo"),
                      train_dataset=Dataset.from_list(lm_rows(24)), data_collator=pad_collate,
                      callbacks=[recorder, callback])
    trainer.train()
    if rank == 0:
        torch.save(recorder.states, Path(out) / "states.pt")
    return {"wrapped": type(trainer.model_wrapped).__name__, "processes": trainer.accelerator.num_processes}
