"""HF-named weights written straight into a CPU vLLM model's live tensors (the sync's fast path).

vLLM's `reload_weights` is general: it restores every layer's checkpoint-format parameters,
loads them through the model's `load_weights` and re-runs each layer's post-processing, most of a
small model's sync. The CPU backend's kernel format is simple, so this module writes it directly.

Two ways in: `write` takes an HF-named stream (checked name by name at every sync); `bind` keeps
HF-named tensors, checked once, and `write_bound` then copies from them with nothing renamed or
allocated: the trainer's own parameters' views (one process: `Trainer.hf_views`), or a snapshot
slot the trainer's process writes before each sync (the engine in a process of its own:
rollout/process.py `queue_weights`). What goes where:

- a linear layer: vLLM computes it with a kernel of its own (`cpu_linear`, set by
  `dispatch_cpu_unquantized_gemm`) that holds its own packed or reordered copy of the weight, and
  empties the `weight` parameter. We keep one weight tensor of the vLLM layout per such layer
  ("staging": stacked q/k/v rows for `qkv_proj`, gate/up rows for merged projections) and copy the
  new rows into it. A write relinks the layer to a `_Linear` over that tensor: where vLLM's packed
  small-GEMM kernel takes the shape (`vllm_internals.packed_linear`), that kernel over a copy packed at
  each sync (a few µs a layer); on a CPU with no bf16 arithmetic, `F.linear` in fp32 over a widened copy;
  elsewhere `F.linear` over the tensor itself, since rebuilding a oneDNN handle at every sync costs more
  than computing without one saves (docs/results/cpu-path.md);
- routed experts: the CPU MoE kernel pads and prepacks `w13_weight` / `w2_weight` into new
  tensors, so we keep both in the checkpoint layout too (gate_proj / up_proj as the two halves
  of `w13[e]`, down_proj as `w2[e]`), and prepack them with the kernel's own op straight into
  the packed weights it computes with; where its post-processing also pads, we hand them to that
  post-processing again instead;
- everything else (embeddings, norms) is copied into its parameter as is.

Until its first write an engine computes with the weights vLLM loaded (`minirl eval` never
writes), its linear layers with vLLM's kernels but for those that widen, which do from the start.
`Writer.build` returns None for what it does not know (biases, quantized layers, tensor
or expert parallel shards, a module kind not listed above); the engine then keeps
`reload_weights`. The names it accepts are exactly the model's, checked at every streamed sync
and at `bind`: a name it does not know, or one missing, is an error, never a silently stale
weight. tests/test_rollout.py holds it to `reload_weights` (equal log-probs after the same update).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from minirl.rollout import vllm_internals


class Writer:
    """Built once per engine (in its worker); `write` is one sync."""

    def __init__(self, targets: dict[str, torch.Tensor], relink: list[tuple[torch.nn.Module, _Linear]],
                 experts: list[tuple[str, torch.nn.Module, torch.Tensor, torch.Tensor, object]]):
        # HF name -> where it goes: a view of the live parameter, or of a linear layer's staging weight
        self.targets, self.relink, self.experts = targets, relink, experts

    @classmethod
    def build(cls, model: torch.nn.Module) -> "Writer | None":
        targets: dict[str, torch.Tensor] = {}
        relink = []
        experts = []
        owned: set[int] = set()  # parameters covered by a module-level rule
        for name, mod in model.named_modules():
            if hasattr(mod, "w13_weight") and hasattr(mod, "w2_weight"):  # routed experts
                if getattr(mod, "expert_map", None) is not None or getattr(mod, "tp_size", 1) != 1:
                    return None
                kernel = getattr(getattr(getattr(mod, "quant_method", None), "moe_kernel", None), "fused_experts", None)
                inter = getattr(getattr(kernel, "moe_config", None), "intermediate_size_per_partition", None)
                if kernel is None or inter is None or mod.w13_weight.dim() != 3 or hasattr(mod, "w13_bias"):
                    return None
                # the checkpoint layout, before the kernel pads and prepacks it
                n_exp, _, dim = mod.w13_weight.shape
                w13 = torch.zeros(n_exp, 2 * inter, dim, dtype=mod.w13_weight.dtype)
                w2 = torch.zeros(n_exp, dim, inter, dtype=mod.w2_weight.dtype)
                hf = name.split(".experts")[0] + ".experts"
                for e in range(n_exp):
                    for proj, dest in (("gate_proj", w13[e, :inter]), ("up_proj", w13[e, inter:]),
                                       ("down_proj", w2[e])):
                        targets[f"{hf}.{e}.{proj}.weight"] = dest
                owned.update({id(mod.w13_weight), id(mod.w2_weight)})
                experts.append((hf, mod, w13, w2, kernel))
            elif hasattr(mod, "cpu_linear"):  # a linear layer with a CPU kernel handle
                if getattr(mod, "bias", None) is not None or getattr(mod, "tp_size", 1) != 1:
                    return None
                if type(mod.quant_method).__name__ not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
                    return None
                w = mod.weight
                if id(w) in owned:  # tied: the embedding's weight, handled already
                    relink.append((mod, _Linear(w.data)))
                    continue
                if w.numel() == 0:  # emptied by vLLM (its handle holds the weight); TP 1: the whole shape
                    out, inp = getattr(mod, "output_size", None), getattr(mod, "input_size", None)
                    if out is None or inp is None:
                        return None
                    staging = torch.zeros(out, inp, dtype=w.dtype)
                else:
                    staging = w.data
                rows = _row_split(name, mod)
                if rows is None:
                    return None
                start = 0
                for hf_name, n in rows:
                    targets[hf_name] = staging[start:start + n]
                    start += n
                # an embedding's vocabulary is padded (to a multiple of 64): the pad rows stay as loaded
                if start != staging.shape[0] and not hasattr(mod, "org_vocab_size"):
                    return None
                relink.append((mod, _Linear(staging)))
                owned.add(id(w))
        for name, p in model.named_parameters():
            if id(p) in owned:
                continue
            if p.numel() == 0:  # an emptied weight of a kind not handled above
                return None
            targets[name] = p.data
        return cls(targets, relink, experts)

    def pairs(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) for every weight, checked: a name the engine does not have, a
        shape that differs or a weight left out is an error, never a silently stale weight."""
        out, seen = [], set()
        for name, t in weights:
            dest = self.targets.get(name)
            if dest is None:
                raise KeyError(f"the rollout engine has no weight {name!r}")
            if t.shape != dest.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the rollout engine's is {tuple(dest.shape)}")
            out.append((dest, t))
            seen.add(name)
        if missing := self.targets.keys() - seen:
            raise KeyError(f"the sync left {len(missing)} rollout weights stale, e.g. {sorted(missing)[:3]}")
        return out

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy every weight into place and rebuild the kernels' packed copies. Returns how many."""
        return self.copy(self.pairs(weights))

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """One sync from checked pairs: each source copied (and cast) into its destination, then
        the linear layers' and the experts' packed copies rebuilt. Returns how many."""
        with torch.no_grad():
            self._relink()  # from the first write on (again after a vLLM reload)
            if (packs := self._packs()) is not None:  # into the tensors the kernel computes with
                _copy_and_pack(pairs, packs)
            else:
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
                for _, mod, w13, w2, kernel in self.experts:  # the kernel pads and prepacks into new tensors
                    vllm_internals.replace_parameter(mod, "w13_weight", w13)
                    vllm_internals.replace_parameter(mod, "w2_weight", w2)
                    kernel.process_weights_after_loading(mod)
            for _, linear in self.relink:
                linear.repack()
        return len(pairs)

    def widen_loaded(self) -> None:
        """Before any write: the linear layers that widen (a CPU with no bf16 arithmetic) and still hold the
        weight vLLM loaded compute with it widened now, so an engine that never syncs (`minirl eval`) computes
        as a synced one does."""
        with torch.no_grad():
            for mod, linear in self.relink:
                if linear.widens and linear.weight.data_ptr() == mod.weight.data_ptr():
                    linear.repack()
                    mod.cpu_linear = linear

    def _relink(self) -> None:
        for mod, linear in self.relink:
            if mod.cpu_linear is not linear:
                mod.cpu_linear = linear

    def _packs(self) -> list[tuple[torch.Tensor, torch.Tensor, str]] | None:
        """Every expert layer's in-place prepacks (`_layer_packs`), or None where one layer's
        post-processing would also pad."""
        if not all(_prepacks_in_place(*e[1:]) for e in self.experts):
            return None
        return [pack for _, *layer in self.experts for pack in _layer_packs(*layer)]


def _layer_packs(mod: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor,
                 kernel) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """(checkpoint-layout weight, the packed weight the kernel computes with, its ISA) for one
    expert layer's in-place prepack."""
    return [(w13, mod.w13_weight.data, kernel.isa), (w2, mod.w2_weight.data, kernel.isa)]


def coalesced(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs with every run of consecutive ones that step through both
    storages by fixed strides (one expert after the next: gate_proj of experts 0..E-1 into the
    gate halves of `w13`) merged into one strided pair. Each element is copied exactly as before;
    a copy's fixed cost is paid once a run: 24 copies a layer become 3.

    >>> w = torch.zeros(4, 6); src = torch.arange(12.).view(4, 3)
    >>> merged = coalesced([(w[i, :3], src[i]) for i in range(4)])
    >>> len(merged), tuple(merged[0][0].shape)
    (1, (4, 3))
    """
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    run: list[tuple[torch.Tensor, torch.Tensor]] = []

    def steps(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int] | None:
        if any(x.shape != y.shape or x.stride() != y.stride() or x.dtype != y.dtype
               or x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x, y in zip(a, b)):
            return None
        step = tuple(y.storage_offset() - x.storage_offset() for x, y in zip(a, b))
        return step if min(step) > 0 else None

    def close() -> None:
        if len(run) > 1:
            step = steps(run[0], run[1])
            run[:] = [tuple(t.as_strided((len(run), *t.shape), (s, *t.stride())) for t, s in zip(run[0], step))]
        out.extend(run)
        run.clear()

    for pair in pairs:
        if run and ((step := steps(run[-1], pair)) is None or (len(run) > 1 and step != steps(run[0], run[1]))):
            close()
        run.append(pair)
    close()
    return out


def _copy_and_pack(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                   packs: list[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
    """Each source copied (and cast) into its destination, in one call (cheaper than a loop), then
    each expert weight prepacked straight into the packed tensor the kernel reads."""
    torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    for weight, packed, isa in packs:
        torch.ops._C.prepack_moe_weight(weight, packed, isa)


def _prepacks_in_place(mod: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor, kernel) -> bool:
    """Whether the MoE kernel's post-processing is its prepack alone (no padding of the
    intermediate size, no zentorch), so the prepack can write straight into the packed weights
    it computes with, instead of into new tensors."""
    cfg = getattr(kernel, "moe_config", None)
    return (hasattr(kernel, "isa") and hasattr(kernel, "_padded_intermediate_size") and cfg is not None
            and not getattr(kernel, "_use_zentorch", False)
            and kernel._padded_intermediate_size(cfg) == cfg.intermediate_size_per_partition
            and mod.w13_weight.shape == w13.shape and mod.w2_weight.shape == w2.shape
            and mod.w13_weight.dtype == w13.dtype and mod.w2_weight.dtype == w2.dtype)


class _Linear:
    """A linear layer's `cpu_linear` over `weight` as the last sync wrote it (vLLM passes the layer's
    own weight parameter, emptied where its kernel held a copy; it is not read). Where vLLM's packed
    small-GEMM kernel takes this shape (vLLM's own dispatch on AMX; minirl's on AVX-512 BF16 without it:
    `vllm_internals.packed_linear`), so does this, over a copy packed at each `repack`: faster than
    `F.linear`'s oneDNN call on small weights, with no cache of oneDNN primitives. A bf16 weight on a CPU
    with no bf16 arithmetic (AVX2 alone) is widened to fp32 at each `repack` instead: there `F.linear` in
    bf16 converts in software, many times slower than the same product in fp32, which sums in fp32 and
    rounds its output to bf16 as the bf16 call does (the figures: docs/results/speed.md). Elsewhere
    `F.linear` over `weight` itself."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.kernel = vllm_internals.packed_linear(*weight.shape, weight.dtype)
        self.packed: torch.Tensor | None = None
        self.widens = (self.kernel is None and weight.dtype == torch.bfloat16
                       and not vllm_internals.bf16_arithmetic())
        self.wide: torch.Tensor | None = None

    def repack(self) -> None:
        if self.kernel is not None:
            self.packed = torch.ops._C.convert_weight_packed(self.weight)
        elif self.widens:  # exact: every bf16 is an fp32; a sync's copy into the tensor it already has
            if self.wide is None:
                self.wide = self.weight.float()
            else:
                self.wide.copy_(self.weight)

    def __call__(self, x: torch.Tensor, _own: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.wide is not None:
            return F.linear(x.float(), self.wide, None if bias is None else bias.float()).to(x.dtype)
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        return self.kernel(x, self.packed, self.weight.shape[0], bias)


def _row_split(name: str, mod: torch.nn.Module) -> list[tuple[str, int]] | None:
    """HF names of a linear layer's weight, and the rows each takes in vLLM's stacked weight."""
    prefix, _, leaf = name.rpartition(".")
    kind = type(mod).__name__
    if kind == "QKVParallelLinear":
        q, kv = mod.num_heads * mod.head_size, mod.num_kv_heads * mod.head_size
        v = mod.num_kv_heads * getattr(mod, "v_head_size", mod.head_size)
        return [(f"{prefix}.q_proj.weight", q), (f"{prefix}.k_proj.weight", kv), (f"{prefix}.v_proj.weight", v)]
    if kind == "MergedColumnParallelLinear":
        if leaf != "gate_up_proj" or len(mod.output_sizes) != 2:
            return None
        return [(f"{prefix}.gate_proj.weight", mod.output_sizes[0]), (f"{prefix}.up_proj.weight", mod.output_sizes[1])]
    if hasattr(mod, "org_vocab_size"):  # embedding or LM head: the checkpoint's rows, then padding
        return [(f"{name}.weight", mod.org_vocab_size)]
    return [(f"{name}.weight", mod.output_size)]


def install(worker) -> bool:
    """collective_rpc target: build the writer on the worker's model; False when it does not apply."""
    worker._minirl_writer = Writer.build(worker.model_runner.model)
    if worker._minirl_writer is not None:
        worker._minirl_writer.widen_loaded()
    return worker._minirl_writer is not None


def write(worker, weights_iterator) -> int:
    """collective_rpc target: one sync through the worker's writer."""
    return worker._minirl_writer.write(weights_iterator)


def bind(worker, views: dict[str, torch.Tensor], key: int = 0) -> int:
    """collective_rpc target: keep `views` (HF-named tensors that follow the trainer's weights in
    place, or a snapshot slot that is written before each use) as the sources of every later
    `write_bound(key)`; checked once, here."""
    pairs = worker._minirl_writer.pairs(views.items())
    if not hasattr(worker, "_minirl_bound"):
        worker._minirl_bound = {}
    worker._minirl_bound[key] = coalesced(pairs)
    return len(pairs)


def write_bound(worker, key: int = 0) -> int:
    """collective_rpc target: one sync from the views bound under `key`: copies and the kernels'
    repack, no renaming, no intermediate tensors."""
    return worker._minirl_writer.copy(worker._minirl_bound[key])
