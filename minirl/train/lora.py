"""LoRA on the TorchTitan model: each targeted weight W computes as W + s·B·A with s = α/r, where
A [r, in] and B [out, r] are the only parameters that train (Hu et al., 2021). B starts at zero, so
the adapted model is the base model exactly until the first update.

The adapters are parameters of the module whose weight they adapt: `lora_A` and `lora_B` of a
linear layer (its output gains s·(x Aᵀ) Bᵀ through a forward hook), `lora_A_<w>` and `lora_B_<w>`
of the grouped experts, one A and B per expert for each of its three weights <w>, applied inside
the experts' grouped matrix products. Being the experts' own parameters, they are sharded with the
experts under expert parallelism (the same placement as the weight they adapt) and by FSDP2 with
the rest of their layer. The base's parameters keep their names, so everything that reads them by
name (the HF conversion, checkpoints, routing replay) is unchanged; the rollout engine gets
W + s·B·A (`Merged`), never the adapters themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = {"q": "qkv_linear.wq", "k": "qkv_linear.wk", "v": "qkv_linear.wv", "o": "wo"}
MLP = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")  # gate [E, F, D], down [E, D, F], up [E, F, D]
KEY = ".lora_"  # in every adapter parameter's name, in no base parameter's


def is_adapter(name: str) -> bool:
    return KEY in f".{name}"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the experts under EP compute on their local shards)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def init_a(a: torch.Tensor) -> torch.Tensor:
    """A as PEFT initialises it: each [r, in] slice uniform in ±1/√in (Kaiming with a = √5)."""
    with torch.no_grad():
        return a.uniform_(-1.0 / math.sqrt(a.shape[-1]), 1.0 / math.sqrt(a.shape[-1]))


def init_b(b: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return b.zero_()


def _linear_hook(module: nn.Linear, args, out: torch.Tensor) -> torch.Tensor:
    x = args[0]
    A, B = module.lora_A.to(x.dtype), module.lora_B.to(x.dtype)
    return out + module.lora_scale * F.linear(F.linear(x, A), B)


@functools.cache
def _adapted_experts_cls(base: type) -> type:
    """The experts' class with its forward extended by the adapters: for each matrix W of expert e,
    x Wᵀ + s·(x Aₑᵀ) Bₑᵀ over the same grouped offsets (the rows are sorted by expert)."""

    class AdaptedExperts(base):
        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            offs_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            x = x_RD.to(_local(self.w1_EFD).dtype)

            def mm(h: torch.Tensor, name: str) -> torch.Tensor:
                W = _local(getattr(self, name))
                A = _local(getattr(self, f"lora_A_{name}")).to(h.dtype)
                B = _local(getattr(self, f"lora_B_{name}")).to(h.dtype)
                pad = -A.shape[1] % (16 // h.element_size())  # grouped GEMMs want 16-byte rows: zero rank padding
                if pad:
                    A, B = F.pad(A, (0, 0, 0, pad)), F.pad(B, (0, pad))
                base_out = torch._grouped_mm(h, W.transpose(-2, -1), offs=offs_E)
                low = torch._grouped_mm(torch._grouped_mm(h, A.transpose(-2, -1), offs=offs_E),
                                        B.transpose(-2, -1), offs=offs_E)
                return base_out + self.lora_scale * low

            hidden = F.silu(mm(x, "w1_EFD")) * mm(x, "w3_EFD")
            return mm(hidden, "w2_EDF").type_as(x_RD)

    AdaptedExperts.__name__ = AdaptedExperts.__qualname__ = f"Adapted{base.__name__}"
    return AdaptedExperts


def _is_experts(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), torch.Tensor) for n in EXPERT_WEIGHTS)


def targets_in(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """(module name, module) of every weight the targets name, in the model's order."""
    suffixes = [f"attention.{ATTENTION[t]}" for t in targets if t in ATTENTION]
    if "mlp" in targets:
        suffixes += list(MLP)
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(name.endswith(s) for s in suffixes):
            found.append((name, module))
        elif "experts" in targets and _is_experts(module):
            found.append((name, module))
    return found


def adapter_shapes(module: nn.Module, rank: int) -> dict[str, tuple[int, ...]]:
    """The adapter parameters `attach` gives one targeted module, by name: shape."""
    if isinstance(module, nn.Linear):
        return {"lora_A": (rank, module.in_features), "lora_B": (module.out_features, rank)}
    out = {}
    for w in EXPERT_WEIGHTS:
        E, n_out, n_in = getattr(module, w).shape
        out[f"lora_A_{w}"], out[f"lora_B_{w}"] = (E, rank, n_in), (E, n_out, rank)
    return out


def attach(model: nn.Module, *, rank: int, alpha: float, targets: tuple[str, ...]) -> list[nn.Parameter]:
    """Adapters on the targeted weights of `model`, every other parameter frozen; returns the
    adapters' parameters (what the optimizer steps). Call before any wrapper renames modules and
    before TorchTitan parallelizes the model (its sharding and init plans learn the adapters here);
    on the meta device the adapters are initialised by the model's `init_states`."""
    found = targets_in(model, targets)
    if not found:
        raise ValueError(f"no weight of this model matches the LoRA targets {', '.join(targets)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for _, module in found:
        like = next(module.parameters())
        shapes = adapter_shapes(module, rank)
        for name, shape in shapes.items():
            p = torch.empty(shape, device=like.device)
            if p.device.type != "meta":
                (init_a if "lora_A" in name else init_b)(p)
            module.register_parameter(name, nn.Parameter(p))
        module.lora_scale = alpha / rank
        _declare(module, shapes)
        if isinstance(module, nn.Linear):
            module.register_forward_hook(_linear_hook)
        else:
            module.__class__ = _adapted_experts_cls(type(module))
    return [p for n, p in model.named_parameters() if is_adapter(n)]


def _declare(module: nn.Module, shapes: dict[str, tuple]) -> None:
    """Tell a TorchTitan module's sharding and init plans about its adapters: placed as the weight
    they adapt (the experts' dim 0 over EP; minirl plans no tensor parallelism), initialised as PEFT
    does. The plans may be shared by every layer's module: each gets copies."""
    sharding = getattr(module, "_sharding_config", None)
    if sharding is not None and sharding.state_shardings:
        states = dict(sharding.state_shardings)
        for name in shapes:
            weight = "weight" if name in ("lora_A", "lora_B") else name.split("_", 2)[2]
            if weight in states:
                states[name] = states[weight]
        module._sharding_config = dataclasses.replace(sharding, state_shardings=states)
    inits = getattr(module, "_param_init", None)
    if inits is not None:
        module._param_init = {**inits, **{n: init_a if "lora_A" in n else init_b for n in shapes}}


def init_adapters(model: nn.Module) -> None:
    """Every adapter as `attach` starts it: A as PEFT initialises it, B = 0."""
    for n, p in model.named_parameters():
        if is_adapter(n):
            (init_a if ".lora_A" in f".{n}" else init_b)(p)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by name (what a PEFT export and a LoRA checkpoint hold)."""
    return {k: v.detach() for k, v in model.state_dict().items() if is_adapter(k)}


def adapted(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """weight name -> (A's name, B's name) for every adapted weight of a TorchTitan state dict."""
    out = {}
    for k in state:
        if k.endswith(".lora_A"):
            out[k.removesuffix("lora_A") + "weight"] = (k, k.removesuffix("A") + "B")
        elif ".lora_A_" in k:
            prefix, w = k.rsplit(".lora_A_", 1)
            out[f"{prefix}.{w}"] = (k, f"{prefix}.lora_B_{w}")
    return out


class Merged(Mapping):
    """A state dict's weights with every adapted one as W + s·B·A, merged when read, the adapters
    left out: a sync that reads them a few layers at a time never holds more than those merged.
    `state`: the model's own; sharded, `whole` gathers each of W, A and B first (a collective:
    every rank reads the same keys in the same order)."""

    def __init__(self, state: Mapping[str, torch.Tensor], scale: float, *, whole=None):
        self._state, self._scale, self._whole = state, scale, whole or (lambda t: t)
        self._pairs = adapted(state)
        self._keys = [k for k in state if not is_adapter(k)]

    def __getitem__(self, key: str) -> torch.Tensor:
        if is_adapter(key):
            raise KeyError(key)
        w = self._whole(self._state[key])
        pair = self._pairs.get(key)
        if pair is None:
            return w
        A, B = (self._whole(self._state[n]) for n in pair)
        with torch.no_grad():
            return w + (self._scale * torch.matmul(B, A)).to(w.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def record(lora: dict) -> dict:
    """A trainer's `lora` as a checkpoint's minirl.json records it."""
    return {"rank": lora["rank"], "alpha": float(lora["alpha"]), "targets": list(lora["targets"])}


def settings(rec, shape) -> dict | None:
    """The Trainer's `lora` argument for a recipe's [train.lora] (None: every weight trains)."""
    lora = rec.train.lora
    if not lora.rank:
        return None
    from minirl.models.shapes import lora_targets  # deferred: only where LoRA is on

    return {"rank": lora.rank, "alpha": lora.alpha, "targets": lora_targets(lora.targets, shape)}
