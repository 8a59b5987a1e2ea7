"""The end of a run's weights: the final HF folder, streamed from every rank (#80).

A run's last weights become `checkpoints/step_N/hf` a few decoder layers at a time, by the weight
sync's own bucket iterator (rollout/sync.py `trainer_buckets`): each layer's shards are gathered
whole on every rank (a collective, so every rank walks the same layers in the same order), rank 0
copies the bucket to host memory in the export's dtype and writes it as a safetensors shard, and
the gathered tensors go before the next layer is gathered. What the end holds beyond each rank's
shard is one bucket and the layer gathered after it, never the model: gathering every fp32 master
weight at once (`full_state_dict`) is ~122 GB per GPU on Qwen3-30B-A3B, which ran the run out of
memory after its final checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minirl import faults
from minirl.rollout.sync import trainer_buckets
from minirl.train.hf_io import write_hf_folder


def write(trainer, out: Path, *, main: bool, tokenizer_dir: Path, bucket_bytes: int,
          dtype: torch.dtype = torch.float32) -> Path | None:
    """The trainer's weights as an HF folder at `out`, written by the main rank (its path; None on
    the others, which take part in each layer's gather). A write that fails on the main rank still
    walks the remaining layers, so that no rank waits in a gather for it, then raises."""
    buckets = trainer_buckets(trainer, dtype=dtype, bucket_bytes=bucket_bytes)
    try:
        if main:
            faults.at_end()
            return write_hf_folder(out, trainer.shape, buckets, tokenizer_dir=tokenizer_dir, dtype=dtype)
        return None
    finally:
        for _ in buckets:
            pass
