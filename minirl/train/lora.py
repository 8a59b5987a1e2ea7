"""LoRA on the TorchTitan model: each targeted weight W computes as W + s·B·A with s = α/r, where
A [r, in] and B [out, r] are the only parameters that train (Hu et al., 2021). B starts at zero, so
the adapted model is the base model exactly until the first update.

The adapters ride beside the weights they adapt, as a child module `lora` of each targeted linear
layer (its output gains s·(x Aᵀ) Bᵀ through a forward hook) or of the grouped experts (one A and B per
expert and matrix, applied inside the experts' grouped matrix products). The base's parameters keep
their names, so everything that reads them by name (the HF conversion, checkpoints, routing replay)
is unchanged; the rollout engine gets W + s·B·A (`merged`), never the adapters themselves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = {"q": "qkv_linear.wq", "k": "qkv_linear.wk", "v": "qkv_linear.wv", "o": "wo"}
MLP = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")  # gate [E, F, D], down [E, D, F], up [E, F, D]
KEY = ".lora."  # in every adapter parameter's name, in no base parameter's


class LinearAdapter(nn.Module):
    """A [r, in] and B [out, r] of one linear layer's weight [out, in]."""

    def __init__(self, out_features: int, in_features: int, rank: int, scale: float):
        super().__init__()
        self.scale = scale
        self.A = nn.Parameter(_init_a(torch.empty(rank, in_features)))
        self.B = nn.Parameter(torch.zeros(out_features, rank))

    def delta(self) -> torch.Tensor:
        """s·B·A, the adapter's part of the merged weight."""
        return self.scale * (self.B @ self.A)


class ExpertAdapter(nn.Module):
    """One A and B per expert for each of the grouped experts' three weights."""

    def __init__(self, experts: nn.Module, rank: int, scale: float):
        super().__init__()
        self.scale = scale
        for name in EXPERT_WEIGHTS:
            E, out_features, in_features = getattr(experts, name).shape
            setattr(self, f"A_{name}", nn.Parameter(_init_a(torch.empty(E, rank, in_features))))
            setattr(self, f"B_{name}", nn.Parameter(torch.zeros(E, out_features, rank)))

    def pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"A_{name}"), getattr(self, f"B_{name}")

    def delta(self, name: str) -> torch.Tensor:
        A, B = self.pair(name)
        return self.scale * torch.bmm(B, A)


def _init_a(a: torch.Tensor) -> torch.Tensor:
    """A as PEFT initialises it: each [r, in] slice uniform in ±1/√in (Kaiming with a = √5)."""
    bound = 1.0 / math.sqrt(a.shape[-1])
    return a.uniform_(-bound, bound)


def _linear_hook(module: nn.Linear, args, out: torch.Tensor) -> torch.Tensor:
    ad = module.lora
    x = args[0]
    return out + ad.scale * F.linear(F.linear(x, ad.A.to(x.dtype)), ad.B.to(x.dtype))


@functools.cache
def _adapted_experts_cls(base: type) -> type:
    """The experts' class with its forward extended by the adapters: for each matrix W of expert e,
    x Wᵀ + s·(x Aₑᵀ) Bₑᵀ over the same grouped offsets (the rows are sorted by expert)."""

    class AdaptedExperts(base):
        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            from torch.distributed.tensor import DTensor

            ad = self.lora
            w = {n: (p.to_local() if isinstance(p, DTensor) else p) for n in EXPERT_WEIGHTS for p in [getattr(self, n)]}
            offs_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            x = x_RD.to(w["w1_EFD"].dtype)

            def mm(h: torch.Tensor, name: str) -> torch.Tensor:
                A, B = (t.to(h.dtype) for t in ad.pair(name))
                base_out = torch._grouped_mm(h, w[name].transpose(-2, -1), offs=offs_E)
                low = torch._grouped_mm(torch._grouped_mm(h, A.transpose(-2, -1), offs=offs_E),
                                        B.transpose(-2, -1), offs=offs_E)
                return base_out + ad.scale * low

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


def attach(model: nn.Module, *, rank: int, alpha: float, targets: tuple[str, ...]) -> list[nn.Parameter]:
    """Adapters on the targeted weights of `model`, every other parameter frozen; returns the
    adapters' parameters (what the optimizer steps). Call before any wrapper renames modules."""
    scale = alpha / rank
    found = targets_in(model, targets)
    if not found:
        raise ValueError(f"no weight of this model matches the LoRA targets {', '.join(targets)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for _, module in found:
        like = next(module.parameters())
        if isinstance(module, nn.Linear):
            module.lora = LinearAdapter(module.out_features, module.in_features, rank, scale).to(like.device)
            module.register_forward_hook(_linear_hook)
        else:
            module.lora = ExpertAdapter(module, rank, scale).to(like.device)
            module.__class__ = _adapted_experts_cls(type(module))
    return [p for n, p in model.named_parameters() if KEY in f".{n}"]


def is_adapter(name: str) -> bool:
    return KEY in f".{name}"


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by name (what a PEFT export and a LoRA checkpoint hold)."""
    return {k: v.detach() for k, v in model.state_dict().items() if is_adapter(k)}


class Merged(Mapping):
    """The model's weights by TorchTitan name with every adapted one as W + s·B·A, merged when read:
    a sync that reads them a few layers at a time never holds more than those merged."""

    def __init__(self, model: nn.Module):
        self._state = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
        self._delta = {}
        for name, module in model.named_modules():
            name = name.replace("_checkpoint_wrapped_module.", "")  # activation checkpointing's wrapper: not in state-dict names
            ad = getattr(module, "lora", None)
            if isinstance(ad, LinearAdapter):
                self._delta[f"{name}.weight"] = ad.delta
            elif isinstance(ad, ExpertAdapter):
                for w in EXPERT_WEIGHTS:
                    self._delta[f"{name}.{w}"] = functools.partial(ad.delta, w)

    def __getitem__(self, key: str) -> torch.Tensor:
        w = self._state[key]
        delta = self._delta.get(key)
        if delta is None:
            return w
        with torch.no_grad():
            return w + delta().to(w.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)
