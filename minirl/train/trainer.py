"""Trainer: the TorchTitan Qwen3(-MoE) model, its log-probs/entropy, updates and checkpoints.

Interface: `logprobs`, `forward_backward`, `optim_step`, `hf_state_dict` / `hf_views` (what the weight
sync reads: rollout/sync.py), `save`, `load`.
TorchTitan is imported only on this side: here, `models`, `parallel`, `replay` and `hf_io`
(tests/test_imports.py).

Precision (`train.param_dtype`; "auto": bfloat16 on CUDA, float32 on CPU). float32 computes
everything in fp32, the routed experts included (models/titan.py). bfloat16 computes under autocast in
one process, or under FSDP2's mixed-precision policy when sharded, with TorchTitan's own bf16
grouped-GEMM experts, while weights, gradients and Adam state stay float32 (master weights).
Forced on a CPU, bfloat16 runs the same dtype code as CUDA (tests/test_train.py, test_parallel.py).
vLLM rolls out in bf16 (or FP8 weights).

Checkpoints are torch.distributed.checkpoint (DCP) folders, the format TorchTitan itself writes,
with model and optimizer state; they load under any later parallel layout (checkpoint.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from minirl.models.hub import check_base, fingerprint
from minirl.models.shapes import ModelShape, attention_pair_cost
from minirl.models.titan import titan_config
from minirl.train import checkpoint, cuts
from minirl.train import lora as lora_mod
from minirl.train import offload as offload_mod
from minirl.train.batch import Batch
from minirl.train.head import head_chunk, head_logprobs, target_logprobs, token_logprobs
from minirl.train.hf_io import hf_to_titan, load_hf_weights, titan_to_hf
from minirl.train.objective import entropy_from_logits, merge_metrics
from minirl.train.packing import pack_shared_prompts
from minirl.train.parallel import full_ac, full_state_dict, global_count, global_max, parallelize, whole
from minirl.train.replay import RoutingReplay


LOGPROB_TOKENS = 2**16  # tokens of one no-grad forward of `logprobs` where no micro-batch is set


class Trainer:
    def __init__(
        self,
        shape: ModelShape,
        *,
        lr: float,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        seed: int = 0,
        device: str | torch.device = "cpu",
        ep: int = 1,
        param_dtype: str = "auto",
        pack_prompts: bool = True,
        shard: bool | None = None,
        activation_checkpoint: str = "none",
        lora: dict | None = None,
        head_chunk: int | None = None,
        offload: str = "none",
        micro_batch_tokens: int = 0,
    ):
        """Under torchrun (an initialised process group of more than one rank) the model is
        sharded with TorchTitan's FSDP2 over all ranks and its experts over `ep` of them; each
        rank then passes its own share of the batch, and results equal one process's.

        param_dtype: what the parameters compute in ("auto": bfloat16 on CUDA, float32 on CPU).
        Weights, gradients and Adam state stay float32 (master weights): FSDP2 gathers the
        shards in bfloat16 under torchrun; one process computes under bfloat16 autocast, as
        TorchTitan does without FSDP.

        pack_prompts: forward each prompt once for all the rows that share it (packing.py).

        shard: build through TorchTitan's `parallelize` (FSDP2) over the initialised process group
        whatever its size; None does so under torchrun of more than one rank. True at one rank is
        the cluster's code path on a single GPU (tests/gpu).

        activation_checkpoint "full": TorchTitan's FullAC around every decoder layer (its
        activations recomputed in backward; state-dict names are unchanged).

        lora {"rank", "alpha", "targets"}: adapters on the targeted weights (lora.py) are what
        trains, every other parameter frozen; the weights synced, exported and scored are W + s·B·A.

        head_chunk: positions of the output head at a time (head.py: no whole [positions, vocab]
        logits, forward or backward); None chooses by the logits' size (`_head_chunk`), 0 never.

        offload "optimizer": Adam's moments live in host memory between updates (offload.py), so
        the rollout engine gets their GPU memory; each update brings them back for its step.

        micro_batch_tokens: the most tokens one forward takes (`forward_backward`'s gradient
        accumulation, `logprobs`'s chunks; 0: a whole mini-batch, and LOGPROB_TOKENS a `logprobs`
        chunk); a GPU run's comes from its plan (setup/plan.py)."""
        import torch.distributed as dist

        torch.manual_seed(seed)
        self.shape, self.grad_clip, self.device, self.ep = shape, grad_clip, torch.device(device), ep
        self.pack_prompts, self.head_chunk, self.offload = pack_prompts, head_chunk, offload
        self.micro_batch_tokens = micro_batch_tokens
        self._pair_cost = attention_pair_cost(shape)  # what packing weighs its dense attention by
        if param_dtype == "auto":
            param_dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.param_dtype = param_dtype
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.sharded = self.world > 1 if shard is None else shard
        if self.sharded and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Trainer(shard=True) needs an initialised process group")
        self.rank = dist.get_rank() if self.sharded else 0
        # bf16 compute runs TorchTitan's own grouped experts (its bf16 grouped GEMM, CUDA's only
        # kernel); fp32 compute keeps the experts in fp32 (models/titan.py)
        cfg = titan_config(shape, expert_dtype="bfloat16" if param_dtype == "bfloat16" else "float32")
        self.lora = dict(lora) if lora and lora.get("rank") else None
        self.model = self._build(cfg, seed=seed, activation_checkpoint=activation_checkpoint)
        self.base: dict | None = None  # the frozen base's folder and fingerprint, once `load_hf` read it (LoRA)
        self._views = None  # (parameter storages, HF-named views of them): `hf_views`
        self._params = list(self.model.parameters())  # kept: a sync must not walk the module tree again

        self.replay = RoutingReplay(self.model)
        self.cut_stats: dict = {}  # what forwards read of the sampler's cuts (head.py), until `take_cut_stats`
        # one fused kernel for all parameters (one process; much faster than the per-parameter loop
        # on CPU); sharded DTensor parameters keep the default implementation
        trained = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA, the adapters alone
        self.optim = torch.optim.AdamW(
            trained, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, eps=1e-8,
            fused=not self.sharded or None,
        )

    @classmethod
    def from_recipe(cls, rec, shape: ModelShape, *, device: str | torch.device,
                    micro_batch_tokens: int | None = None) -> "Trainer":
        """The trainer a recipe's [train] and [parallel] sections ask for; `micro_batch_tokens`, where
        given, instead of train.micro_batch_tokens (a GPU run's plan chooses it when that is 0)."""
        t = rec.train
        micro = t.micro_batch_tokens if micro_batch_tokens is None else micro_batch_tokens
        return cls(shape, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, seed=t.seed, device=device,
                   ep=rec.parallel.ep, param_dtype=t.param_dtype, activation_checkpoint=t.activation_checkpoint,
                   pack_prompts=t.pack_prompts, lora=lora_mod.settings(rec, shape), offload=t.offload,
                   micro_batch_tokens=micro)

    @classmethod
    def for_checkpoint(cls, rec, shape: ModelShape, base: Path, *, device: str | torch.device = "cpu") -> "Trainer":
        """A trainer to read one of a run's checkpoints into (export, evaluation): the model the
        run's recipe trained, its LoRA adapters included, with no optimizer worth keeping. With
        LoRA it holds the base (the model folder `base`) the checkpoint's adapters apply to."""
        trainer = cls(shape, lr=0.0, device=device, lora=lora_mod.settings(rec, shape))
        if trainer.lora:
            trainer.load_hf(base)
        return trainer

    def _adapt(self, model, *, base_dtype: torch.dtype) -> None:
        """LoRA (lora.py): the base frozen in the compute dtype (bfloat16 on a GPU: no float32 copy,
        gradient or optimizer state of it), float32 adapters on the targeted weights."""
        for p in model.parameters():
            p.data = p.data.to(base_dtype)
        lora_mod.attach(model, rank=self.lora["rank"], alpha=self.lora["alpha"], targets=tuple(self.lora["targets"]))

    def _build(self, cfg, *, seed: int, activation_checkpoint: str) -> torch.nn.Module:
        """The TorchTitan model, its weights initialised by the config's per-parameter init functions. Under a
        process group, through TorchTitan's `parallelize` (FSDP2, the experts over `ep` ranks). LoRA's adapters
        go on before TorchTitan's sharding and activation checkpointing see the model."""
        adapt = functools.partial(self._adapt, base_dtype=getattr(torch, self.param_dtype)) if self.lora else None
        if self.sharded:
            return parallelize(cfg, ep=self.ep if self.shape.is_moe else 1, device=self.device, seed=seed,
                               param_dtype=self.param_dtype, activation_checkpoint=activation_checkpoint, adapt=adapt)
        if adapt is not None:  # built on the meta device and allocated in the base's dtype: no float32 copy, ever
            with torch.device("meta"):
                model = cfg.build()
            adapt(model)
            model.to_empty(device=self.device)
            with torch.no_grad():
                model.init_states()
                lora_mod.init_adapters(model)
        else:
            model = cfg.build().to(self.device)
            model.init_states()
        if activation_checkpoint == "full":
            full_ac(model)
        return model

    # ----- weights in / out --------------------------------------------------------------------
    def load_hf(self, folder: Path) -> None:
        """An HF folder's weights in. Sharded over several ranks, rank 0 alone reads the folder and
        the others receive each tensor from it in turn: a node's host memory holds one copy of the
        checkpoint, not one a rank (the plan's host row counts it)."""
        rank0 = self.sharded and self.world > 1
        self.load_weights(hf_to_titan(self.shape, load_hf_weights(folder)) if self.rank == 0 else {}, from_rank0=rank0)
        if self.lora:  # what this trainer's checkpoints name as their base
            self.base = {"path": str(folder), "fingerprint": fingerprint(folder)}

    def load_weights(self, sd: dict[str, torch.Tensor], *, from_rank0: bool = False) -> None:
        """Whole TorchTitan-named tensors in (any device); sharded, each rank keeps its shard.
        `from_rank0`: only rank 0 holds `sd`, and sends every other rank its tensors one by one."""
        if self.sharded:
            import torch.distributed as dist
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            own = self.model.state_dict()
            missing, unexpected = [k for k in own if k not in sd], [k for k in sd if k not in own]
            if from_rank0:  # rank 0's names decide for all (the others hold none)
                box = [(missing, unexpected)]
                dist.broadcast_object_list(box, src=0)
                missing, unexpected = box[0]
            set_model_state_dict(self.model, sd, options=StateDictOptions(full_state_dict=True, strict=False,
                                                                          broadcast_from_rank0=from_rank0))
        else:
            missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if "expert_bias" not in k and "tokens_per_expert" not in k
                   and not lora_mod.is_adapter(k)]  # adapters start where attach put them
        if missing or unexpected:
            raise RuntimeError(f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return titan_to_hf(self.shape, self.full_state_dict())

    def hf_views(self) -> dict[str, torch.Tensor] | None:
        """The weights under HF names as views of the live parameters (one process): they follow
        every in-place update (optimizer steps, checkpoint loads), so a rollout engine may keep
        them and re-read them at each sync. The same dict until a parameter's storage changes.
        None when sharded (whole tensors exist only after a gather), with LoRA (the synced weights
        are W + s·B·A, made at each sync) or where the adapter would copy a tensor instead of viewing it."""
        if self.sharded or self.lora:
            return None
        # the weights are parameters (buffers are RoPE tables and MoE counters, never synced);
        # their pointers cost half a state_dict()
        key = tuple(p.data_ptr() for p in self._params)
        if self._views is None or self._views[0] != key:
            state = {k: v.detach() for k, v in self.model.state_dict().items()}
            views = titan_to_hf(self.shape, state)
            live = {t.untyped_storage().data_ptr() for t in state.values()}
            ok = all(t.untyped_storage().data_ptr() in live for t in views.values())
            self._views = (key, views if ok else None)
        return self._views[1]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """TorchTitan names to whole tensors (shards gathered: a collective when sharded); with
        LoRA, the merged weights W + s·B·A."""
        if self.sharded and not self.lora:
            return full_state_dict(self.model)
        return dict(self.weights())

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The model's weights by TorchTitan name as a rollout engine should have them (sharded:
        this rank's shards); with LoRA, merged as each is read (lora.Merged)."""
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        if not self.lora:
            return state
        return lora_mod.Merged(state, self.lora_scale, whole=whole if self.sharded else None)

    @property
    def lora_scale(self) -> float:
        return self.lora["alpha"] / self.lora["rank"]

    # ----- compute -----------------------------------------------------------------------------
    def _forward_logp(self, batch: Batch, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log π(y_t) [B, L-1] (and H_t) of softmax(logits / T) at the batch's sampling temperature:
        at every position, or, packed, at response positions only (0 elsewhere; every consumer masks
        to the response)."""
        autocast = not self.sharded and self.param_dtype == "bfloat16"  # under FSDP2 its policy casts
        packed = self._packed(batch)
        if packed is not None:
            tokens, kw = packed.tokens_CS, {"positions": packed.positions_CS, "attention_masks": packed.attend_C1SS}
        else:
            full = batch.tokens_BL.to(self.device)
            tokens, kw = full[:, :-1], {}
        chunk = self._head_chunk(tokens.numel())
        T = batch.temperature
        # the sampler's kept counts (top-k, top-p, min-p): π and H renormalized over as many of the most likely
        kept, kept_K, kept_M = cuts.kept_of(batch, packed, self.device)
        cut = {"stats": self.cut_stats} if kept is not None else {}
        self.model._skip_lm_head = bool(chunk)  # TorchTitan's decoder then returns the final hidden states
        try:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
                out = self.model(tokens, **kw)
                if chunk:  # no [positions, vocab] logits: the head a chunk of positions at a time (head.py)
                    h = out.flatten(0, 1)
                    h, targets = (h[packed.src_N], packed.target_N) if packed is not None else (h, full[:, 1:].flatten())
                    logp, ent = head_logprobs(h, targets, self.model.lm_head, chunk=chunk, with_entropy=with_entropy,
                                              temperature=T, kept_K=kept_K, **cut)
                    ent = ent.detach() if ent is not None else None
                    if packed is not None:
                        return packed.unpack(logp), (packed.unpack(ent) if ent is not None else None)
                    return logp.view(tokens.shape), (ent.view(tokens.shape) if ent is not None else None)
        finally:
            self.model._skip_lm_head = False
        if packed is not None:
            # per packed position, then picked per target: no [targets, vocab] copy of the logits
            x_MV = out.flatten(0, 1)
            logp = packed.unpack(target_logprobs(x_MV, packed.src_N, packed.target_N, temperature=T, kept_N=kept_M,
                                                 **cut))
            ent = None
            if with_entropy:
                ent = entropy_from_logits(out.detach(), temperature=T,
                                          kept_BT=None if kept_M is None else kept_M.view(out.shape[:2]))
                ent = packed.unpack(ent.flatten()[packed.src_N])
            return logp, ent
        logp = token_logprobs(out, full[:, 1:], temperature=T, kept_BT=kept, **cut)
        ent = entropy_from_logits(out.detach(), temperature=T, kept_BT=kept) if with_entropy else None
        return logp, ent

    def take_cut_stats(self) -> dict:
        """What the forwards since the last call read of the sampler's cuts, as a step's row (cuts.row)."""
        got, self.cut_stats = self.cut_stats, {}
        return cuts.row(got)

    def _head_chunk(self, positions: int) -> int:
        """Positions per chunk of the output head (head.py), or 0 for whole logits (head.head_chunk)."""
        return self.head_chunk if self.head_chunk is not None else head_chunk(positions, self.shape.vocab_size)

    def _packed(self, batch: Batch):
        """The batch with each prompt forwarded once for all its responses (packing.py), or None:
        packing off, a batch without lengths, or routes replayed or recorded (their [B, L-1]
        layout is the unpacked one)."""
        if not self.pack_prompts or batch.prompt_len_B is None or self.replay.active:
            return None

        packed = pack_shared_prompts(batch.tokens_BL, batch.prompt_len_B, batch.seq_len_B, pair_cost=self._pair_cost,
                                     kept_BT=batch.kept_BT)
        return packed.to(self.device) if packed is not None else None

    @torch.no_grad()
    def logprobs(
        self, batch: Batch, *, routes: torch.Tensor | None = None, record_routes: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """log π(y_t) and full-vocabulary entropy H_t at every position, [B, L-1] each, on the CPU.
        Forwarded a chunk of rows at a time, each of at most `micro_batch_tokens` tokens (one row
        at least; LOGPROB_TOKENS where that is 0): an off-policy step's whole mini-batch, or a
        batch of 32k-token responses, never at once.

        routes [n_layers, B, L-1, K]: replay these expert choices (R3). record_routes: also return
        the experts this forward used (R2 records them while computing π_old)."""
        chunk = max(1, (self.micro_batch_tokens or LOGPROB_TOKENS) // batch.tokens_BL.shape[1])
        self.model.eval()
        lps, ents = [], []
        if record_routes:
            self.replay.start_recording()
        try:
            for s in range(0, len(batch), chunk):
                self.replay.set_replay(routes[:, s : s + chunk] if routes is not None else None)
                lp, ent = self._forward_logp(batch.select(slice(s, s + chunk)), with_entropy=True)
                lps.append(lp.cpu())
                ents.append(ent.cpu())
        finally:
            self.replay.set_replay(None)
            recorded = self.replay.stop_recording() if record_routes else None
        return torch.cat(lps), torch.cat(ents), recorded

    def forward_backward(
        self,
        batch: Batch,
        loss_fn: Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict]],
        *,
        scale: float = 1.0,
        routes: torch.Tensor | None = None,
        micro_batch_tokens: int | None = None,
        with_logp: bool = False,
    ) -> tuple[float, dict] | tuple[float, dict, torch.Tensor, torch.Tensor]:
        """Accumulate grads of `scale * loss_fn(logp_BT, batch)`, replaying `routes` if given.

        with_logp: also return this forward's log π(y_t) (detached) and entropy H_t, [B, L-1] each
        on the CPU, as `logprobs` would before any update: the one forward of an on-policy step
        (N = 1) is at θ_old, so its log-probs are π_θold and need no forward of their own.

        micro_batch_tokens > 0 (None: the trainer's own) splits the rows into micro-batches of at most that many tokens
        (gradient accumulation). The losses average over the responses with a token to train, so
        micro-batch j with n_j of the batch's B such rows is weighted n_j / B and the gradient equals
        the whole batch's; metrics are combined weighted by their token counts (maxima by max)."""
        rows, length = batch.tokens_BL.shape
        live = batch.live_rows
        if micro_batch_tokens is None:
            micro_batch_tokens = self.micro_batch_tokens
        n_micro = -(-rows // max(1, micro_batch_tokens // length)) if micro_batch_tokens else 1
        if self.sharded:  # gradients are summed over ranks: weigh this rank's mean by its share

            share = live / max(1, global_count(live))
            scale *= share
            n_micro = global_max(n_micro)  # every rank runs as many forwards (FSDP and EP are collectives)
        step = -(-rows // n_micro)
        total, parts, lps, ents = 0.0, [], [], []
        for s in range(0, rows, step):
            part = batch.select(slice(s, s + step))
            w = part.live_rows / max(1, live)
            loss, m, lp, ent = self._forward_backward_one(part, loss_fn, scale * w,
                                                          routes[:, s : s + step] if routes is not None else None,
                                                          with_entropy=with_logp)
            total += w * loss
            parts.append(m)
            lps.append(lp)
            ents.append(ent)
        if self.sharded:  # the loss of the global batch, on every rank
            import torch.distributed as dist

            t = torch.tensor([total * share])
            dist.all_reduce(t)
            total = float(t.item())
        metrics = parts[0] if len(parts) == 1 else merge_metrics(parts)
        if with_logp:
            return total, metrics, torch.cat(lps), torch.cat(ents)
        return total, metrics

    def _forward_backward_one(self, batch: Batch, loss_fn, scale: float, routes, *, with_entropy: bool):
        self.model.train()
        self.replay.set_replay(routes)
        try:
            # the forward reads the batch where it is (packing works on the host); the loss on the device
            logp, ent = self._forward_logp(batch, with_entropy=with_entropy)
            loss, metrics = loss_fn(logp, batch.to(self.device))
            (loss * scale).backward()
        finally:
            self.replay.set_replay(None)
        if not with_entropy:  # no device-to-host copy unless the caller keeps π_old from this forward
            return float(loss.detach()), metrics, None, None
        return float(loss.detach()), metrics, logp.detach().cpu(), ent.cpu()

    def device_bytes(self) -> int:
        """What this trainer holds on its device now: weights (this rank's shards), gradients,
        the optimizer's state and buffers (run/gpumem.py: its peak apart from the engine's)."""
        seen, total = set(), 0
        tensors = [*self.model.parameters(), *self.model.buffers(),
                   *(p.grad for p in self.model.parameters() if p.grad is not None),
                   *(v for state in self.optim.state.values() for v in state.values() if torch.is_tensor(v))]
        for t in tensors:
            local = getattr(t, "_local_tensor", t)
            if local.device.type != self.device.type:
                continue
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def clip_grads(self) -> float:
        """Clip accumulated gradients in place; returns their norm before clipping (of the whole
        model: under EP, TorchTitan's clip reduces over the expert and the dense meshes)."""
        if not self.sharded:
            return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        from torch.distributed.tensor import DTensor
        from torchtitan.distributed.utils import clip_grad_norm_

        norm = clip_grad_norm_(list(self.model.parameters()), self.grad_clip, ep_enabled=self.ep > 1)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def fill_grads(self, value: float) -> None:
        """Overwrite the accumulated gradients (fault injection in tests: MINIRL_INJECT_NAN)."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.fill_(value)

    def apply_update(self) -> None:
        if self.offload == "optimizer":  # the moments back for this step, and off again after it
            offload_mod.to_device(self.optim)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if self.offload == "optimizer":
            offload_mod.to_host(self.optim)

    def drop_update(self) -> None:
        self.optim.zero_grad(set_to_none=True)

    def optim_step(self) -> float:
        """Clip, step, zero; returns the pre-clip grad norm."""
        norm = self.clip_grads()
        self.apply_update()
        return norm

    def set_lr(self, lr: float) -> None:
        for g in self.optim.param_groups:
            g["lr"] = lr

    # ----- checkpoints -------------------------------------------------------------------------
    def save(self, path: Path, extra: dict | None = None) -> Path:
        """A DCP checkpoint of model and optimizer, plus `extra` (step, sampler, ...) as JSON,
        written aside and renamed into place (checkpoint.py). With LoRA, of the model only the
        adapters, and the base's folder and fingerprint: the checkpoint is small, and loads only
        onto that base."""
        if self.lora:
            if self.base is None:
                raise RuntimeError("a LoRA checkpoint names its base: load_hf(folder) before save")
            extra = {**(extra or {}), "lora": lora_mod.record(self.lora), "base": self.base}
        return checkpoint.save(self.model, self.optim, Path(path), extra, sharded=self.sharded, main=self.rank == 0,
                               adapters_only=bool(self.lora))

    def load(self, path: Path, *, with_optim: bool = True) -> dict:
        """Restore a checkpoint; one saved before the first optimizer step restores a fresh optimizer.
        A LoRA checkpoint holds the adapters only: this trainer must hold its base (`load_hf`)."""
        base = checkpoint.read_extra(path).get("base")
        if base and self.lora:
            if self.base is None:
                raise RuntimeError("a LoRA checkpoint holds adapters only: load_hf(its base) first")
            check_base(path, base, Path(self.base["path"]), here=self.base["fingerprint"])
        offload_mod.to_device(self.optim)  # DCP fills the optimizer's state where it is used
        extra = checkpoint.load(self.model, self.optim, Path(path), with_optim=with_optim, sharded=self.sharded)
        if self.offload == "optimizer":
            offload_mod.to_host(self.optim)
        return extra
