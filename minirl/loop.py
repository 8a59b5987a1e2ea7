"""The RL loop of `minirl run`. One step, as data flows:

    prompts (datasets) ──▶ VLLMEngine.generate ──▶ completions + log μ_θold
        ──▶ grader ──▶ rewards R [B, G] ──▶ group advantages A
        ──▶ Trainer.logprobs ──▶ log π_θold, entropy          (KL(μ‖π_old) measured here; on-policy,
                                                               N = 1, the update's own forward gives them)
        ──▶ N × (forward_backward(MiniRL loss) ──▶ Guard.decide ──▶ optimizer step)
                                                              (π_θold fixed for the step)
        ──▶ VLLMEngine.load_weights (in place)                (parity check on a fixed batch, on a schedule)
        ──▶ metrics.jsonl ──▶ checkpoint every k steps       (or rollback, when the guard says so)
                          ──▶ held-out avg@k every eval.every steps (off the RL clock)

Deliberately simple: rollouts and training alternate (no async, no overlap), so on-policy N = 1
is exactly on-policy and every number in the log has one meaning. Under torchrun every rank runs
this same step on its share of the prompts (`World`, launch.py); what the guard decides on is
reduced over ranks first, so every rank takes the same decision.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minirl import atomic, objective, weight_sync
from minirl import status as status_mod
from minirl.data import PromptSampler
from minirl.engine_process import start_overlapped
from minirl.errors import RunIOError, UsageError
from minirl.evaluate import evaluate, response_text
from minirl.guard import Guard, Verdict
from minirl.launch import World
from minirl.preflight import RunInputs, complete_checkpoints, prepare_run
from minirl.recipe import Recipe
from minirl.replay import rollout_routes, route_agreement
from minirl.runlock import RunLock
from minirl.rollout import VLLMEngine
from minirl.sinks import Sinks
from minirl.summary import write_summary
from minirl.train import Batch, Trainer, build_batch
from minirl.workspace import Workspace

PARITY_BATCH = 16  # fixed (prompt, response) pairs re-scored by both engines after every sync


@dataclass
class RunState:
    """Everything a resumed run needs besides model/optimizer weights."""

    run_dir: Path
    step: int = 0
    heldout_start: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)


class Stop:
    """Set by the CLI's SIGINT/SIGTERM handler; the loop checks it between steps."""

    requested = False
    signal = 2  # which signal asked (the exit code is 128 + it)


def _timed(timing: dict, key: str, t0: float) -> float:
    now = time.perf_counter()
    timing[key] = timing.get(key, 0.0) + (now - t0)
    return now


class RLRun:
    def __init__(self, ws: Workspace, rec: Recipe, inputs: RunInputs, *, run_dir: Path, world: World):
        self.ws, self.rec, self.world = ws, rec, world
        model_dir, self.shape = inputs.model_dir, inputs.shape
        resume_from = inputs.resume_from
        self.tok = inputs.tokenizer
        self.eos, self.pad = self.tok.eos_token_id, self.tok.pad_token_id
        self.train_problems, self.skipped, self.heldout = inputs.train, inputs.skipped, inputs.heldout
        self.grading = inputs.grading
        self.model_dir = model_dir

        self.trainer = Trainer(self.shape, lr=rec.train.lr, weight_decay=rec.train.weight_decay,
                               grad_clip=rec.train.grad_clip, seed=rec.train.seed, device=world.device,
                               ep=rec.parallel.ep, param_dtype=rec.train.param_dtype,
                               activation_checkpoint=rec.train.activation_checkpoint,
                               pack_prompts=rec.train.pack_prompts)
        self.state = RunState(run_dir=run_dir)
        self.sampler = PromptSampler(self.train_problems, seed=rec.train.seed)
        self.guard = Guard.from_settings(rec.guard)
        self.lr = rec.train.lr
        self.last_good: Path | None = resume_from
        self.rolled_back_to: list[str] = []
        if resume_from is not None:
            extra = self.trainer.load(resume_from)
            self.state.step = extra["step"]
            self.state.heldout_start = extra.get("heldout_start", {})
            self.state.timing = extra.get("timing", {})
            self.sampler.restore(extra["sampler"])
            self.guard.load_state_dict(extra.get("guard", {}))
            self.lr = extra.get("lr", self.lr)
            self.trainer.set_lr(self.lr)
        else:
            self.trainer.load_hf(model_dir)
        max_len = rec.data.max_prompt_tokens + rec.rollout.max_tokens + 1
        engine_kw = dict(seed=rec.train.seed, max_model_len=max_len, capture_routes=rec.train.replay == "r3",
                         max_num_seqs=max(256, rec.train.prompts_per_step * rec.train.group_size))
        self.overlap = rec.rollout.overlap
        self._pending = None  # overlapped: (prompts, answer handle) of the next step's rollout, under way
        if self.overlap:
            if world.size > 1 or world.device.type != "cpu":
                raise UsageError("rollout.overlap runs one process on CPU (an engine process beside the trainer); "
                                 "set rollout.overlap = false under torchrun or on GPUs")
            self.engine = start_overlapped(model_dir, rec.rollout, **engine_kw)
            self.trainer.share_memory()  # the engine's process copies the weights from here at each sync
        else:
            self.engine = VLLMEngine.from_config(model_dir, rec.rollout, **engine_kw)
        self.tp = rec.rollout.tensor_parallel  # ranks per vLLM engine
        self.first_step = self.state.step  # of this process (a resumed run checks its first sync again)
        self.sync()  # resumed weights, or FP8-emulated ones; a no-op in effect otherwise (~30 ms)
        self._parity_pairs = self._fixed_parity_pairs()

    # ----- pieces -------------------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def sync(self) -> None:
        """Trainer weights -> vLLM, in place, a bounded bucket at a time (weight_sync.py)."""
        weight_sync.sync(self.trainer, self.engine, bucket_bytes=self.rec.rollout.sync_bucket_mib * 2**20)

    def _fixed_parity_pairs(self) -> list[tuple[list[int], list[int]]]:
        probs = self.heldout[:PARITY_BATCH]
        groups = self.engine.generate([p.prompt_ids for p in probs], n=1, temperature=1.0,
                                      max_tokens=self.rec.rollout.max_tokens, seed=4321)
        return [(list(p.prompt_ids), list(g[0].token_ids)) for p, g in zip(probs, groups)]

    def parity(self) -> float:
        """mean |log μ − log π| over a fixed batch of tokens, right after a sync."""
        pairs = self.world.group_share(self._parity_pairs, self.tp)
        mu = self.world.member_share(self.engine.score([p for p, _ in pairs], [r for _, r in pairs]), self.tp)
        pairs = self.world.member_share(pairs, self.tp)
        prompts, resps = [p for p, _ in pairs], [r for _, r in pairs]
        batch = build_batch(prompts, resps, mu, None, pad_id=self.pad)
        pi, _, _ = self.trainer.logprobs(batch)
        m = batch.mask_BT
        local = float(((batch.rollout_logp_BT - pi).abs() * m).sum() / m.sum())
        return self.world.mean({"parity": local}, weight=float(m.sum()))["parity"]

    def heldout_eval(self) -> dict:
        e = self.rec.eval
        world, tp = self.world, self.tp  # a TP group evaluates its share once; each member gathers its part
        return evaluate(self.engine, world.group_share(self.heldout, tp), self.grading, k=e.k, temperature=e.temperature,
                        max_tokens=self.rec.rollout.max_tokens, decode=self.decode, eos_id=self.eos,
                        gather=lambda rows: world.gather(world.member_share(rows, tp)))

    def _guard_view(self, batch: Batch, old_logp: torch.Tensor, ent: torch.Tensor) -> tuple[float, float]:
        """KL(μ_old ‖ π_old) and the entropy of π_old, over all ranks (token-weighted; every rank has
        B·G rows): what the guard decides on."""
        kl = objective.train_inference_kl(batch.rollout_logp_BT, old_logp, batch.mask_BT)
        entropy = objective.masked_mean(ent, batch.mask_BT)
        return tuple(self.world.mean({"kl": kl, "entropy": entropy}, weight=float(batch.mask_BT.sum())).values())

    def _rollout(self, step: int) -> tuple[list, list]:
        """This step's problems and their G completions each. Overlapped (`rollout.overlap`), they
        were sampled while the step before trained, from the weights before its update (one step
        off-policy), and the next step's rollout starts here, before this step trains."""
        (asked, answer), self._pending = self._pending or self._sample(step), None
        if not self.overlap:
            return asked, answer
        groups = self.engine.result(answer)
        self._sampler_at_step = self.sampler.state()  # what a checkpoint of this step records
        self._pending = self._sample(step + 1)
        return asked, groups

    def _sample(self, step: int) -> tuple[list, list]:
        """Draw a step's prompts and sample G responses to each: the same draw on every rank; each
        rollout (TP) group generates its share, each rank keeps its part. Overlapped, the answer is
        a handle the engine's process fills in while this process goes on."""
        r = self.rec
        asked = self.world.group_share(self.sampler.next_batch(r.train.prompts_per_step), self.tp)
        call = ([p.prompt_ids for p in asked],)
        kw = dict(n=r.train.group_size, temperature=r.rollout.temperature, max_tokens=r.rollout.max_tokens,
                  seed=r.train.seed * 1_000_003 + step)
        return asked, self.engine.submit("generate", *call, **kw) if self.overlap else self.engine.generate(*call, **kw)

    # ----- one step -----------------------------------------------------------------------------
    def step(self) -> dict:
        r, t, world = self.rec, self.state.timing, self.world
        G, N = r.train.group_size, r.train.minibatches
        step = self.state.step + 1
        injected_kill(step, world.rank)
        t0 = time.perf_counter()
        self.engine.settle()  # overlapped: the engine's share of the last sync, written while the step before ended
        t0 = _timed(t, "sync", t0)

        asked, groups = self._rollout(step)
        self.engine.sleep()  # frees its memory for training (CUDA); the sync wakes it
        problems, groups = world.member_share(asked, self.tp), world.member_share(groups, self.tp)
        B = len(problems)
        t0 = _timed(t, "rollout", t0)

        comps = [c for g in groups for c in g]
        scores = self.grading.grade([(prob.record, response_text(c.token_ids, self.decode, self.eos))
                                     for prob, g in zip(problems, groups) for c in g])
        cut = [c.finish == "length" for c in comps]
        rewards_PG = sequence_rewards([s.score for s in scores], cut, r.loss.truncated_reward).view(B, G)
        adv_PG = objective.group_advantages(rewards_PG, std_scale=r.loss.adv_std)
        batch = build_batch([p.prompt_ids for p in problems for _ in range(G)], [c.token_ids for c in comps],
                            [c.logprobs for c in comps], adv_PG.flatten().tolist(), pad_id=self.pad)
        t0 = _timed(t, "grade", t0)

        # π_θold. On-policy (N = 1) the one update's forward is at θ_old: it yields log π_θold itself
        # (`fused`), identical to a forward of its own, which would cost 10-15% of a step.
        fused = N == 1 and not (r.train.replay == "r3" and r.train.replay_diagnostics)
        replay_metrics, routes, old_logp = {}, None, None
        if r.train.replay == "r3":  # π_old under the rollout engine's routes; the trainer's own for metrics
            routes = rollout_routes(comps, batch, self.trainer.replay.num_layers, self.shape.top_k,
                                    self.shape.num_experts)
            replay_metrics = {"replay/coverage": 1.0}  # every fed position has a captured route (checked when built)
            if not fused:
                old_logp, ent, _ = self.trainer.logprobs(batch, routes=routes)
            if r.train.replay_diagnostics:
                own_logp, _, own_routes = self.trainer.logprobs(batch, record_routes=True)
                agree = route_agreement(routes, own_routes, batch.mask_BT)
                replay_metrics.update({
                    "replay/route_agreement": float(agree.mean()),
                    **{f"replay/route_agreement_l{i}": float(a) for i, a in enumerate(agree)},
                    "train/kl_mu_pi_old_noreplay": objective.train_inference_kl(
                        batch.rollout_logp_BT, own_logp, batch.mask_BT),
                })
        elif not fused:  # R2 records the trainer's own routes under π_old and replays them in every mini-batch
            old_logp, ent, routes = self.trainer.logprobs(batch, record_routes=r.train.replay == "r2")
        reward, lr = world.mean({"reward": float(rewards_PG.mean())})["reward"], self.lr
        if not fused:
            batch = batch.with_old_logp(old_logp)  # π_θold, fixed for every mini-batch of this step
            kl, entropy = self._guard_view(batch, old_logp, ent)
        t0 = _timed(t, "old_logp", t0)

        mb_metrics, losses, grad_norms, verdict = [], [], [], Verdict("step")
        inject = injected_nan(step)
        for j, idx in enumerate(minibatch_indices(B, G, N, seed=step)):
            mb = batch.select(idx)
            loss_fn = loss_for(r, poison=inject == "loss")
            loss, m, *own = self.trainer.forward_backward(
                mb, loss_fn, routes=routes[:, idx] if routes is not None else None,
                micro_batch_tokens=r.train.micro_batch_tokens, with_logp=fused)
            if fused:  # the one mini-batch is the whole batch, its forward π_θold
                kl, entropy = self._guard_view(mb, *own)
            if inject == "grad":
                self.trainer.fill_grads(math.nan)
            norm = self.trainer.clip_grads()
            # The guard's one decision point: after the loss, before the optimizer step.
            v = self.guard.decide(kl=kl, entropy=entropy, reward=reward, loss=loss, grad_norm=norm, new_step=j == 0)
            if v.action == "step":
                self.trainer.apply_update()
            else:
                self.trainer.drop_update()
            losses.append(loss)
            grad_norms.append(norm)
            # over ranks, token-weighted (the IS-weight quantiles become token-weighted means of the ranks' quantiles)
            mb_metrics.append(world.mean(m, weight=m["loss/tokens"], sums=("loss/tokens",)))
            if v.action in ("rollback", "stop"):
                verdict = v
                break
            if v.action == "skip" or v.reason:
                verdict = v
        t0 = _timed(t, "update", t0)

        if self._pending is not None:  # overlapped: what of the next rollout this step's update did not hide
            self.engine.result(self._pending[1])
            t0 = _timed(t, "rollout", t0)
        rollback_to = {}
        if verdict.action in ("rollback", "stop"):  # a stopped run also ends on its last good weights
            self.rollback()
            # the stretch after that checkpoint up to this step was undone (`export --best` skips it)
            rollback_to = {"guard/rollback_to_step": json.loads((self.last_good / "minirl.json").read_text())["step"]}
        else:
            self.sync()
        every = r.rollout.parity_every  # after the run's first sync, every k-th, and every rollback
        due = every and (step == self.first_step + 1 or step % every == 0 or rollback_to)
        if due:
            self.engine.settle()  # the parity check scores the weights just synced
        t0 = _timed(t, "sync", t0)
        parity = self.parity() if due else float("nan")
        _timed(t, "parity", t0)

        self.state.step = step
        mask = batch.mask_BT
        rollout_metrics = world.mean({  # this rank's share, then over ranks (the others already are)
            "rollout/acc": float((rewards_PG >= 1.0).float().mean()),
            "rollout/resp_len": float(mask.sum(-1).mean()),
            "rollout/truncated_frac": sum(cut) / (B * G),
            "rollout/grader_errors": sum("error" in s.info for s in scores),
            "rollout/grader_timeouts": sum(bool(s.info.get("timeout")) for s in scores),
            "rollout/zero_adv_groups": float((adv_PG.abs().sum(-1) == 0).float().mean()),
            **replay_metrics,
        }, sums=("rollout/grader_errors", "rollout/grader_timeouts"))
        metrics = {
            "step": step,
            "rollout/reward_mean": reward,
            **rollout_metrics,
            "train/entropy": entropy,
            "train/kl_mu_pi_old": kl,
            "train/loss": sum(losses) / len(losses),
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "sync/parity_abs_dlogp": parity,
            **{k: sum(m[k] for m in mb_metrics) / len(mb_metrics) for k in mb_metrics[0]},
            "loss/is_weight_max": max(m["loss/is_weight_max"] for m in mb_metrics),
            "loss/clip_frac_per_mb": [m["loss/clip_frac"] for m in mb_metrics],
            **{f"timing/{k}_s": round(v, 4) for k, v in t.items()},
            "timing/elapsed_s": round(time.time() - self.state.started, 2),
            "guard/rollbacks": self.guard.rollbacks,
            "guard/skipped_updates": self.guard.skipped,
            "train/lr": lr,  # the rate this step's updates used (a rollback lowers the next one)
            **({"guard/action": verdict.action, "guard/reason": verdict.reason} if verdict.action != "step" or verdict.reason
               else {}),
            **rollback_to,
        }
        return metrics

    # ----- checkpoints --------------------------------------------------------------------------
    def save(self, name: str) -> Path:
        """A checkpoint; it becomes the rollback target if the guard sees nothing pending."""
        path = self.state.run_dir / "checkpoints" / name
        self.trainer.save(path, {
            # overlapped, the next step's prompts are drawn already: a resumed run draws them again
            "step": self.state.step, "heldout_start": self.state.heldout_start,
            "sampler": self._sampler_at_step if self._pending is not None else self.sampler.state(),
            "timing": self.state.timing, "recipe": self.rec.to_dict(), "guard": self.guard.state_dict(),
            "lr": self.lr, "good": self.guard.healthy,  # `export --best` picks only among good ones
        })
        if self.guard.healthy:
            self.last_good = path
        return path

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` step checkpoints (0: all), and always the rollback target."""
        ckpts = complete_checkpoints(self.state.run_dir) if self.world.main else []
        for old in ckpts[:-keep] if keep > 0 else []:
            if old != self.last_good:
                atomic.remove_dir(old)

    def close(self) -> None:
        """Stop the engine's process (overlapped; an in-process engine ends with this process)."""
        if self.overlap:
            self.engine.close()

    def rollback(self) -> None:
        """Back to the last good weights and optimizer state, at a lower learning rate. The data
        position and the sampling seeds keep moving, so the same collapse is not replayed."""
        if self._pending is not None:  # sampled from the weights being undone: dropped, the data moves on
            self.engine.result(self._pending[1])
            self._pending = None
        self.engine.settle()  # overlapped: nothing of the last sync still reads the parameters loaded over
        self.trainer.load(self.last_good)
        self.rolled_back_to.append(str(self.last_good))
        self.lr *= self.rec.guard.lr_factor
        self.trainer.set_lr(self.lr)
        self.sync()


def sequence_rewards(scores: list[float], truncated: list[bool], truncated_reward: str) -> torch.Tensor:
    """R(x, y) per response. A response cut at the length limit is graded as written ("grade") or
    scores 0 whatever it says ("zero"); the recipe declares which (`loss.truncated_reward`)."""
    if truncated_reward == "zero":
        return torch.tensor([0.0 if cut else s for s, cut in zip(scores, truncated)])
    return torch.tensor(scores, dtype=torch.float32)


def minibatch_indices(B: int, G: int, N: int, *, seed: int) -> list[torch.Tensor]:
    """Split B prompts × G responses (rows grouped by prompt) into N mini-batches of whole groups,
    in a seeded random order. Every row lands in exactly one mini-batch."""
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).view(N, B // N)
    return [(prompts[:, None] * G + torch.arange(G)[None, :]).flatten() for prompts in order]


def loss_for(r: Recipe, *, poison: bool = False) -> Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict]]:
    kw = dict(eps_low=r.loss.eps_low, eps_high=r.loss.eps_high, tis_cap=r.loss.tis_cap, is_mode=r.loss.is_mode,
              length_norm=r.loss.length_norm)

    def fn(logp_BT: torch.Tensor, b: Batch):
        # on-policy (N = 1) the batch has no π_θold yet: it is this forward's π_θ, held fixed
        old = b.old_logp_BT if b.old_logp_BT is not None else logp_BT.detach()
        loss, m = objective.policy_loss(r.loss.name, logp_BT, old, b.rollout_logp_BT, b.adv_B, b.mask_BT, **kw)
        return (loss * math.nan, m) if poison else (loss, m)

    return fn


def injected_kill(step: int, rank: int) -> None:
    """Fault-injection hook for tests: MINIRL_INJECT_KILL="1@3" SIGKILLs rank 1 as step 3 begins
    (as an OOM killer or a lost node would), on a job's first attempt only (torchrun's
    TORCHELASTIC_RESTART_COUNT), so that `torchrun --max-restarts` has something to restart."""
    spec = os.environ.get("MINIRL_INJECT_KILL", "")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and spec == f"{rank}@{step}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def injected_nan(step: int) -> str | None:
    """Fault-injection hook for tests, read here and nowhere else: MINIRL_INJECT_NAN="loss@3,grad@5"
    makes step 3's loss and step 5's gradients NaN, to show that the guard keeps them out of the weights."""
    for item in os.environ.get("MINIRL_INJECT_NAN", "").split(","):
        what, _, at = item.strip().partition("@")
        if what in ("loss", "grad") and at.isdigit() and int(at) == step:
            return what
    return None


def run(
    ws: Workspace,
    rec: Recipe,
    *,
    resume: str | None = None,
    on_event: Callable[[str, dict], None] = lambda kind, data: None,
    world: World | None = None,
) -> dict:
    """Run (or resume) RL in `ws`; returns the summary dict (also written to summary.json).

    resume: None (a new run), "latest" (the newest checkpoint of the newest run; an error when
    there is none) or "auto" (that, when the newest run has not ended; else a new run: the form a
    job that restarts itself uses).

    on_event(kind, data) with kind in: "start", "eval", "step", "checkpoint", "done"; called on
    the main rank only. world: this process's place in a torchrun job (default: the whole job).
    """
    t_start = time.time()
    world = world or World()
    inputs = prepare_run(ws, rec, resume=resume, world_size=world.size)  # every check that can fail on input
    try:
        return _start_and_train(ws, rec, inputs, on_event if world.main else _quiet, t_start=t_start, world=world)
    except OSError as e:
        if e.errno not in _DISK_ERRORS:
            raise
        # A full disk or a read-only folder: one line. Checkpoints are written aside and renamed
        # into place, so every complete one on disk is still whole.
        where = e.filename or ws.runs
        raise RunIOError(f"cannot write {where}: {e.strerror}; every complete checkpoint is intact (free space, "
                         f"then `minirl run {ws.root} --resume`)") from None


_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def _quiet(kind: str, data: dict) -> None:
    """on_event of the ranks that do not print."""


def _start_and_train(ws: Workspace, rec: Recipe, inputs: RunInputs, on_event, *, t_start: float,
                     world: World) -> dict:
    resume_from = inputs.resume_from
    if resume_from:
        run_dir = resume_from.parent.parent
    else:  # rank 0 names the folder, every rank uses it
        run_dir = world.broadcast(_new_run_dir(ws.runs) if world.main else None)
    lock = _writer_lock(run_dir, world)  # before anything in the folder changes; refused: nothing did
    try:
        return _locked_start_and_train(ws, rec, inputs, on_event, t_start=t_start, world=world, run_dir=run_dir)
    finally:
        if lock is not None:
            lock.release()


def _writer_lock(run_dir: Path, world: World) -> RunLock | None:
    """Rank 0 locks the run folder for the job (runlock.py); every rank gets its answer."""
    lock, refused = None, None
    if world.main:
        try:
            lock = RunLock(run_dir)
        except UsageError as e:
            refused = str(e)
    refused = world.broadcast(refused)
    if refused:
        raise UsageError(refused)
    return lock


def _locked_start_and_train(ws: Workspace, rec: Recipe, inputs: RunInputs, on_event, *, t_start: float,
                            world: World, run_dir: Path) -> dict:
    resume_from = inputs.resume_from
    try:
        if world.main:
            atomic.sweep(run_dir / "checkpoints")  # what a killed writer or deleter left behind
            atomic.write_text(run_dir / "recipe.toml", rec.to_toml())
            atomic.write_text(run_dir / status_mod.PROCESS_FILE,  # who runs it, for `minirl status`
                              json.dumps(status_mod.process_record(str(resume_from) if resume_from else None)))
        rl = RLRun(ws, rec, inputs, run_dir=run_dir, world=world)
    except BaseException:
        if resume_from is None and world.main:  # a run that never started leaves no folder for --resume to pick
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    startup_s = time.time() - t_start  # input checks, data, trainer and vLLM
    if rec.loss.is_mode == "off":  # allowed explicitly (recipe.validate); said once, recorded in the summary
        on_event("warning", {"text": f"IS correction is off: the gap between vLLM ({rec.rollout.precision}) and the "
                                     "trainer is left uncorrected (loss.allow_uncorrected = true)"})
    on_event("start", {"run_dir": str(run_dir), "step": rl.state.step, "startup_s": round(startup_s, 1),
                       "skipped_rows": rl.skipped, "train_rows": len(rl.train_problems),
                       "resumed_from": str(resume_from) if resume_from else None})

    try:
        t0 = time.time()
        if not rl.state.heldout_start:
            rl.state.heldout_start = rl.heldout_eval()
            on_event("eval", {"which": "start", **rl.state.heldout_start})
        eval_s = time.time() - t0
        return _train(rl, on_event, t_start=t_start, startup_s=startup_s, eval_s=eval_s)
    finally:
        rl.close()


def _train(rl: RLRun, on_event, *, t_start: float, startup_s: float, eval_s: float) -> dict:
    """The steps, the checkpoints and the end of a run (final checkpoint, held-out eval, summary)."""
    rec, run_dir, world = rl.rec, rl.state.run_dir, rl.world
    if rl.last_good is None:  # a fresh run: its starting point is the first rollback target
        rl.save("step_000000")
    metrics_path = run_dir / "metrics.jsonl"
    if world.main:
        _truncate_metrics(metrics_path, rl.state.step)  # rows past the checkpoint are redone; a torn last line goes
    status = "finished"
    last_eval = (None, {})  # (step, held-out result) of the newest periodic eval (eval.every)
    t_rl = time.time()
    sinks = Sinks(rec.metrics, run_dir=run_dir, recipe=rec.to_dict(),
                  resumed_at=rl.state.step if rl.state.step else None) if world.main else None
    with metrics_path.open("a") if world.main else open(os.devnull, "w") as mf:
        while rl.state.step < rec.train.steps:
            if world.any(Stop.requested):  # every rank stops after the same step
                status = "interrupted"
                break
            if world.any(rec.train.time_limit_s and time.time() - t_rl > rec.train.time_limit_s):
                status = "time_limit"
                break
            t_iter = time.perf_counter()
            m = rl.step()
            timing = rl.state.timing  # "loop": the RL clock, every step's wall, held-out evals left out
            _timed(timing, "loop", t_iter)
            m["timing/loop_s"] = round(timing["loop"], 4)
            if rec.eval.every and rl.state.step % rec.eval.every == 0:
                t0 = time.time()
                heldout = rl.heldout_eval()  # of this step's weights, off the RL clock
                last_eval = (rl.state.step, heldout)
                m.update({f"heldout/{k}": v for k, v in heldout.items() if "@" in k})
                on_event("eval", {"which": f"step {rl.state.step}", **heldout})
                eval_s += time.time() - t0
                timing["heldout"] = timing.get("heldout", 0.0) + time.time() - t0
            t_iter = time.perf_counter()
            mf.write(json.dumps(m) + "\n")  # one write per row; a kill can tear only the last line
            mf.flush()
            if sinks:
                sinks.log(m)  # TensorBoard / W&B, as enabled in [metrics]
            on_event("step", m)
            if m.get("guard/action") in ("rollback", "stop", "skip"):
                on_event("guard", {"step": m["step"], "action": m["guard/action"], "reason": m["guard/reason"],
                                   "to": str(rl.last_good), "lr": rl.lr})
            if m.get("guard/action") == "stop":
                status = "collapsed"
                break
            if rl.state.step % rec.checkpoint.every == 0 and rl.state.step < rec.train.steps:
                t0 = time.perf_counter()
                path = rl.save(f"step_{rl.state.step:06d}")
                rl.prune(rec.checkpoint.keep)
                _timed(timing, "checkpoint", t0)
                on_event("checkpoint", {"path": str(path), "step": rl.state.step})
            _timed(timing, "loop", t_iter)  # writing the row, the sinks and the checkpoint are RL time too
    rl_s = time.time() - t_rl

    final = rl.save(f"step_{rl.state.step:06d}")
    rl.prune(rec.checkpoint.keep)
    on_event("checkpoint", {"path": str(final), "step": rl.state.step})
    t0 = time.time()
    heldout_end = last_eval[1] if last_eval[0] == rl.state.step else rl.heldout_eval()  # the same weights: once
    on_event("eval", {"which": "end", **heldout_end})
    eval_s += time.time() - t0

    from minirl.hf_io import save_hf_folder

    weights = rl.trainer.full_state_dict()  # a collective: every rank takes part, rank 0 writes
    if not world.main:
        return {"status": status}
    hf_dir = save_hf_folder(final / "hf", rl.shape, weights, tokenizer_dir=rl.model_dir)
    phases = {"startup": startup_s, "eval": eval_s, "rl": rl_s, **rl.state.timing}
    summary = write_summary(rl, status=status, stop_signal=Stop.signal, wall_s=time.time() - t_start, phases=phases,
                            heldout_end=heldout_end, checkpoint=final, hf_dir=hf_dir, metrics_path=metrics_path)
    sinks.close(summary)
    on_event("done", summary)
    return summary


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows of steps ≤ `step` (the checkpoint a run resumes from), in one atomic rewrite.
    A line a kill cut short is not JSON and goes too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    atomic.write_text(path, "".join(x + "\n" for x in kept))


def _new_run_dir(runs: Path) -> Path:
    """runs/<YYYYmmdd-HHMMSS>, with a suffix if another run started in the same second."""
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = runs / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run folder in {runs}")
