"""The trainer: the model as TorchTitan builds it, HF ↔ TorchTitan weights, parallelism (FSDP2,
expert parallel), routing replay (R2/R3), packing, the objective, the output head, LoRA, optimizer
offload, checkpoints and the cold start's SFT.

May import: minirl's top-level modules and the base rooms (disk, models, envs, data, config). Must not import the
rollout engine or anything above it: the rollout side reads the trainer's weights, never the reverse.
"""
