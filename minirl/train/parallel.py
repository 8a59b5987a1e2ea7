"""TorchTitan's parallelism for the trainer under torchrun: FSDP2 over every rank, experts sharded
over `ep` of them (expert parallel). Only `train.Trainer` calls this; ranks and meshes stay there.

What it takes, learned on gloo CPU ranks (the PLATFORM.md notes said EP = 2 "failed"; the three
causes were ours):
- TorchTitan keeps the SPMD backend in a process-wide setting that its token dispatcher reads
  (`get_spmd_backend()`, default "spmd_types"); it must be set to the backend the mesh is built
  for, or the dispatcher asks a mesh that does not exist for its process group.
- Sharding plans live on the model *config* (`set_qwen3_sharding_config`), filled before build;
  without them FSDP2 and EP find plain tensors where they expect DTensors.
- minirl's CPU experts (models/titan.py) must compute on `to_local()` shards, as TorchTitan's own do.
gloo has no PREMUL_SUM, so FSDP2 reduces gradients by sum on every backend, and the trainer
scales each rank's loss by its share of the global batch: the result equals one process's mean.
"""

from __future__ import annotations

import torch

from minirl.train.lora import init_adapters


def full_ac(model) -> None:
    """TorchTitan's full activation checkpointing, applied in place to every decoder layer."""
    import tempfile

    from torchtitan.distributed.activation_checkpoint import FullAC

    FullAC.Config().build(dump_folder=tempfile.gettempdir()).apply(model)


def parallelize(model_cfg, *, ep: int, device: torch.device, seed: int, param_dtype: str = "float32",
                activation_checkpoint: str = "none", adapt=None):
    """Build `model_cfg` on the meta device, shard it (FSDP2 over the world, experts over `ep`
    ranks), then allocate each rank's shards on `device` and initialise them (TorchTitan's own
    order: no rank ever holds the whole model). Returns the model (an FSDP module).

    device "meta" stops before allocating: the sharded layout of any model under a fake process
    group (tests/fake_mesh_worker.py). param_dtype: the dtype FSDP2 gathers parameters in for
    compute; the sharded parameters, gradients and optimizer state stay float32 (master weights).
    activation_checkpoint "full": every decoder layer recomputed in backward (TorchTitan's FullAC).
    adapt: called with the model on the meta device before anything is sharded (LoRA's adapters,
    which are then sharded with the weights they adapt)."""
    import tempfile

    import torch.distributed as dist
    import torchtitan.tools.utils as titan_utils
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.qwen3 import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    world = dist.get_world_size()
    if device.type != "cuda":  # TorchTitan assumes "cuda" when no accelerator is found, and its modules
        import torchtitan.distributed.parallel_dims as titan_dims  # copied that name at import time

        titan_utils.device_type = titan_dims.device_type = dist_utils.device_type = "cpu"
    backend = "partial_dtensor"
    dist_utils.set_spmd_backend(backend)
    set_qwen3_sharding_config(model_cfg, enable_sp=False, enable_ep=ep > 1)
    with torch.device("meta"):
        model = model_cfg.build()
        if adapt is not None:
            adapt(model)
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=ep, world_size=world,
                        spmd_backend=backend)
    training = TrainingConfig()
    training.mixed_precision_param = param_dtype
    training.mixed_precision_reduce = "float32"
    parallelism = ParallelismConfig()
    parallelism.spmd_backend = backend
    parallelism.data_parallel_shard_degree = world
    parallelism.expert_parallel_degree = ep
    # TorchTitan wraps the layers for AC after EP and before FSDP2
    ac = FullAC.Config() if activation_checkpoint == "full" else None
    model = parallelize_qwen3(model, parallel_dims=dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=ac, dump_folder=tempfile.gettempdir())
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    torch.manual_seed(seed)  # the same seed on every rank: DTensor's RNG gives each shard its part
    with torch.no_grad():
        model.init_states()
        if adapt is not None:  # modules initialised by `reset_parameters` leave their adapters as allocated
            init_adapters(model)
    return model


def global_count(n: int) -> int:
    """The sum of `n` over all ranks."""
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t)
    return int(t.item())


def global_max(n: int) -> int:
    """The largest `n` over all ranks."""
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective for a DTensor), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a whole tensor (DTensors gathered), on every rank."""
    return {k: whole(v) for k, v in model.state_dict().items()}
