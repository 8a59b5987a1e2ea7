"""One rank of tests/test_async.py's weight broadcast: rank 0 a trainer that moves its weights and
sends them, rank 1 a vLLM engine that receives them (rollout/broadcast.py) and scores fixed pairs
before and after. Each writes what it computed to --out as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[4, 5, 6, 13, 7, 8, 9, 16], [5, 5, 5, 13, 3, 3, 3, 16]]
RESPONSES = [[11, 29, 31, 14, 2], [24, 26, 7, 30]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=Path, required=True, help="rank 0 writes the port it hosts on here; rank 1 reads it")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import torch

    from minirl.rollout.broadcast import WeightChannel

    if a.rank == 0:  # a port the OS picks as the store binds it, published by a rename once bound
        channel = WeightChannel.host(2)
        a.port.with_suffix(".tmp").write_text(str(channel.address[1]))
        a.port.with_suffix(".tmp").rename(a.port)
    else:
        channel = WeightChannel.join("127.0.0.1", int(a.port.read_text()), 1, 2)
    if a.rank == 0:
        from minirl.models.shapes import TINY
        from minirl.train.batch import build_batch
        from minirl.train.trainer import Trainer

        tr = Trainer(TINY, lr=0.0)
        tr.load_hf(a.model)
        with torch.no_grad():
            for p in tr.model.parameters():
                p.mul_(1.5)
        channel.send(tr.hf_views())
        batch = build_batch(PROMPTS, RESPONSES, None, None, pad_id=0)
        lp, _, _ = tr.logprobs(batch)
        out = {"trainer": [lp[i][batch.mask_BT[i] > 0].tolist() for i in range(len(PROMPTS))]}
    else:
        from minirl.rollout.vllm import VLLMEngine

        engine = VLLMEngine(a.model, dtype="float32", seed=0, max_model_len=32, kv_cache_gib=0.25)
        before = engine.score(PROMPTS, RESPONSES)
        assert engine.load_live_weights(channel.receive())
        out = {"before": before, "after": engine.score(PROMPTS, RESPONSES)}
    a.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
