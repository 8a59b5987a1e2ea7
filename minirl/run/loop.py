"""One step of `minirl run`, as data flows:

    prompts (datasets) ──▶ Rollouts.next ──▶ completions + log μ_θold     (rollout/: vLLM, in place
        ──▶ grader ──▶ rewards R [B, G] ──▶ group advantages A               or sampled ahead)
        ──▶ Trainer.logprobs ──▶ log π_θold, entropy          (KL(μ‖π_old) measured here; on-policy,
                                                               N = 1, the update's own forward gives them)
        ──▶ N × (forward_backward(MiniRL loss) ──▶ Guard.decide ──▶ optimizer step)
                                                              (π_θold fixed for the step)
        ──▶ Rollouts.sync (in place)                          (parity check on a fixed batch, on a schedule)
        ──▶ metrics row ──▶ checkpoint every k steps          (or rollback, when the guard says so)

By default rollouts and training alternate, so on-policy N = 1 is exactly on-policy and every
number in the log has one meaning. A recipe may have the engine sample each batch while the step
before trains (one step off-policy); only `Rollouts` knows whether it does. Under torchrun every rank runs this
same step on its share of the prompts (`World`, launch.py); what the guard decides on is reduced
over ranks first, so every rank takes the same decision. The run around the steps (its folder,
metrics file, evaluations and summary) is lifecycle.py.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from minirl import faults
from minirl.config.recipe import Recipe
from minirl.data.prompts import PromptSampler
from minirl.disk import atomic, store
from minirl.envs import outcome
from minirl.eval.evaluate import evaluate
from minirl.launch import World
from minirl.rollout import Rollouts, environments
from minirl.run import checks, dynamic
from minirl.run.groups import Group, graded, samples_mean
from minirl.run import parity as parity_check
from minirl.run.gpumem import PhasePeaks
from minirl.run.guard import Guard, Verdict
from minirl.run.state import RunState
from minirl.setup.run_inputs import RunInputs
from minirl.setup.workspace import Workspace
from minirl.stopwatch import Stopwatch
from minirl.train import objective
from minirl.train.batch import Batch, batch_of
from minirl.train.replay import diagnostics as replay_diagnostics, rollout_routes
from minirl.train.trainer import Trainer

FRESH_TOKENS = 64  # fewest tokens sampled by the trained weights whose KL the guard judges in a batch sampled behind


class RLRun:
    def __init__(self, ws: Workspace, rec: Recipe, inputs: RunInputs, *, run_dir: Path, world: World):
        self.ws, self.rec, self.world = ws, rec, world
        self.model_dir, self.shape, self.tok = inputs.model_dir, inputs.shape, inputs.tokenizer
        self.eos, self.pad = self.tok.eos_token_id, self.tok.pad_token_id
        self.train_problems, self.skipped, self.heldout = inputs.train, inputs.skipped, inputs.heldout
        self.grading = inputs.grading
        self.episodes = environments.Environments.from_recipe(rec, self.tok, inputs.tools)  # multi-turn
        self.state = RunState(run_dir=run_dir, lr=rec.train.lr)
        t0 = time.perf_counter()
        self.trainer = Trainer.from_recipe(rec, self.shape, device=world.device,
                                           micro_batch_tokens=inputs.micro_batch_tokens)  # a GPU run's: its plan's
        sampler = PromptSampler(self.train_problems, seed=rec.train.seed)
        self.guard = Guard.from_settings(rec.guard, prompts=rec.train.prompts_per_step)
        self.last_good = store.rollback_target(inputs.resume_from) if inputs.resume_from is not None else None
        self.rolled_back_to: list[str] = []
        if inputs.resume_from is None or self.trainer.lora:  # a LoRA checkpoint holds the adapters alone
            self.trainer.load_hf(self.model_dir)
        record = self.trainer.load(inputs.resume_from) if inputs.resume_from is not None else None
        if record is not None:
            self.state.restore(record)
            self.guard.restore(record)
            self.trainer.set_lr(self.state.lr)
        trainer_s = time.perf_counter() - t0
        self.gpu = PhasePeaks(world.device, resident=self.trainer.device_bytes)  # the step's memory, phase by phase
        self.clock = Stopwatch(self.state.timing, on_lap=self.gpu.lap)
        t0 = time.perf_counter()
        self.rollouts = Rollouts.from_recipe(rec, self.model_dir, trainer=self.trainer, sampler=sampler, world=world,
                                             clock=self.clock, memory_fraction=inputs.engine_fraction,
                                             kv_cache_gib=inputs.kv_cache_gib, sleep_level=inputs.sleep_level,
                                             episodes=self.episodes)
        # the start by part (the summary's `startup_s`): trainer; engine, of which vLLM's compile and graph capture
        self.startup = {"trainer": trainer_s, "engine": time.perf_counter() - t0, **self.rollouts.startup}
        if record is not None:
            self.rollouts.restore(record)
        self.tp = self.rollouts.group_ranks  # ranks that ask one engine for the same prompts
        self.first_step = self.state.step  # of this process (a resumed run checks its first sync again)
        self._parity_pairs = parity_check.fixed_pairs(self.rollouts, self.heldout, rec.rollout.max_tokens)
        faults.install(self)  # only where a test's MINIRL_INJECT_* asks for a fault

    # ----- one step -----------------------------------------------------------------------------
    def step(self) -> dict:
        r, world, clock = self.rec, self.world, self.clock
        G, N = r.train.group_size, r.train.minibatches
        step = self.state.step + 1
        clock.start()

        problems, groups = self.rollouts.next(step)
        B = len(problems)
        clock.lap("rollout")

        kept = sampled = self._graded(problems, groups)
        checks.grades(sampled, r, step, world)  # stops here, before any loss, on a broken grader or environment
        if r.train.dynamic_sampling:  # groups whose rewards are all equal left out, the batch refilled (dynamic.py)
            kept, sampled, drawn = dynamic.fill(sampled, lambda d: self._checked(step, *self.rollouts.top_up(step, d)),
                                                size=B, max_draws=r.train.dynamic_sampling_draws)
            self.rollouts.trains([g.completions for g in kept])
        problems, groups = [g.problem for g in kept], [g.completions for g in kept]
        comps = [c for g in groups for c in g]
        cut = [c.finish == "length" for c in comps]
        graded_PG, rewards_PG = torch.stack([g.graded for g in kept]), torch.stack([g.rewards for g in kept])
        shaping_PG = rewards_PG - graded_PG
        trains_PG = torch.stack([g.trains for g in kept])  # an episode the environment's fault ended: no sample
        adv_PG = self.advantages(rewards_PG, trains_PG)
        self.drawn = (sampled, kept, adv_PG)  # the step's groups, as drawn and as trained: its samples
        batch = batch_of([p.prompt_ids for p in problems for _ in range(G)], comps, adv_PG.flatten().tolist(),
                         pad_id=self.pad, trained=step - 1, temperature=r.rollout.temperature,
                         masks=[outcome.trained_mask(c) for c in comps], kept=r.loss.renormalize_kept)
        tokens = checks.engine_logp(batch, r, world, step)  # stops here, before any loss, on a broken engine
        clock.lap("grade")

        # π_θold. On-policy (N = 1) the one update's forward is at θ_old: it yields log π_θold itself
        # (`fused`), identical to a forward of its own, which would cost a whole extra forward.
        fused = N == 1 and not (r.train.replay == "r3" and r.train.replay_diagnostics)
        routes, replay_metrics, old = self._old_policy(batch, comps, fused)
        # the policy's reward: of every group sampled (dynamic sampling trains a batch chosen by it), its samples alone
        reward = world.mean({"reward": samples_mean([g.rewards for g in sampled], sampled)})["reward"]
        lr = self.state.lr * min(1.0, step / r.train.warmup_steps) if r.train.warmup_steps else self.state.lr
        self.trainer.set_lr(lr)
        if old is not None:
            batch = batch.with_old_logp(old[0])  # π_θold, fixed for every mini-batch of this step
            kl, entropy, kl_fresh = self._guard_view(batch, *old)
        clock.lap("old_logp")

        mb_metrics, losses, grad_norms, verdict = [], [], [], Verdict("step")
        for j, idx in enumerate(objective.minibatch_indices(B, G, N, seed=step)):
            mb = batch.select(idx)
            loss, m, *own = self.trainer.forward_backward(
                mb, objective.loss_for(r.loss),
                routes=routes[:, idx] if routes is not None else None, with_logp=fused)
            if fused:  # the one mini-batch is the whole batch, its forward π_θold (in the batch's order: below)
                kl, entropy, kl_fresh = self._guard_view(mb, *own)
                logp = own[0].detach()
                batch = batch.with_old_logp(torch.empty_like(logp).index_copy_(0, idx.to(logp.device), logp))
            norm = self.trainer.clip_grads()
            # The guard's one decision point: after the loss, before the optimizer step.
            v = self.guard.decide(kl=kl, entropy=entropy, reward=reward, loss=loss, grad_norm=norm, new_step=j == 0,
                                  lag=self.rollouts.lag(), kl_fresh=kl_fresh)
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
        clock.lap("update")
        self.trained = (batch, comps)  # what the update took, token by token, and what the engine returned

        rollback_to = {}
        if verdict.action in ("rollback", "stop"):  # a stopped run also ends on its last good weights
            self.rollback()
            # the stretch after that checkpoint up to this step was undone (`export --best` skips it)
            rollback_to = {"guard/rollback_to_step": store.record_step(self.last_good)}
        else:
            self.rollouts.sync(self.trainer)
        clock.lap("sync")
        every = r.rollout.parity_every  # after the run's first sync, every k-th, every rollback, and after a bad one
        due = every and (step == self.first_step + 1 or step % every == 0 or rollback_to or self.guard.parity_due)
        parity = self.parity() if due else None  # None: not due, no value
        if parity is not None and math.isfinite(parity):
            self.guard.observe_parity(parity)  # the next step's decision judges it
        clock.lap("parity")

        self.state.step = step
        mask = batch.mask_BT
        rollout_metrics = world.mean({  # this rank's share, then over ranks (the others already are)
            # the grader's, before any shaping, of every group sampled
            "rollout/acc": samples_mean([(g.graded >= 1.0).float() for g in sampled], sampled),
            "rollout/resp_len": float(mask.sum(-1).mean()),
            "rollout/truncated_frac": sum(cut) / (B * G),
            "rollout/grader_errors": sum("error" in s.info for g in sampled for s in g.scores),
            "rollout/grader_timeouts": sum(bool(s.info.get("timeout")) for g in sampled for s in g.scores),
            "rollout/zero_adv_groups": float((adv_PG.abs().sum(-1) == 0).float().mean()),
            **({"rollout/graded_mean": float(graded_PG.mean()),  # the reward before the shaping below
                "rollout/overlong_frac": float((shaping_PG < 0).float().mean()),  # in the buffer: punished
                "rollout/overlong_penalty": float(shaping_PG.mean())} if r.loss.overlong_buffer else {}),
            **replay_metrics, **environments.rows(comps),
            **(drawn if r.train.dynamic_sampling else {}),
        }, sums=("rollout/grader_errors", "rollout/grader_timeouts", *environments.SUMS))
        row = {
            "step": step,
            "rollout/reward_mean": reward,
            **rollout_metrics,
            **tokens,
            "train/entropy": entropy,
            "train/kl_mu_pi_old": kl,
            **({"train/kl_mu_pi_old_fresh": kl_fresh} if kl_fresh is not None else {}),
            **self.trainer.take_cut_stats(),  # top-k / top-p / min-p: the kept mass, tokens outside it (cuts.py)
            "train/loss": sum(losses) / len(losses),
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            **({"sync/parity_abs_dlogp": parity} if parity is not None else {}),
            **self.rollouts.metrics(),  # k ≥ 1: how stale the step's batch was, what is ahead
            # means over the mini-batches, but the tokens the loss saw are the step's: summed
            **{k: sum(m[k] for m in mb_metrics) / (1 if k == "loss/tokens" else len(mb_metrics)) for k in mb_metrics[0]},
            "loss/is_weight_max": max(m["loss/is_weight_max"] for m in mb_metrics),
            "loss/clip_frac_per_mb": [m["loss/clip_frac"] for m in mb_metrics],
            **{f"timing/{k}_s": round(v, 4) for k, v in self.state.timing.items()},
            "timing/elapsed_s": round(time.time() - self.state.started, 2),
            "guard/rollbacks": self.guard.rollbacks,
            "guard/skipped_updates": self.guard.skipped,
            "train/lr": lr,  # the rate this step's updates used (a rollback lowers the next one)
            **self.gpu.row(),  # on a GPU: the step's peak, the trainer's own, what the device holds after the sync
            **({"guard/action": verdict.action, "guard/reason": verdict.reason} if verdict.action != "step" or verdict.reason
               else {}),
            **rollback_to,
        }
        if parity is not None and not math.isfinite(parity):  # the step trained: its row stays, the run stops
            raise parity_check.broken(step, parity, r, world.device, row)
        return row

    # ----- pieces of a step ---------------------------------------------------------------------
    def _graded(self, problems: list, groups: list) -> list[Group]:
        return graded(problems, groups, self.rec, self.grading, self.decode, self.eos)

    def _checked(self, step: int, problems: list, groups: list) -> list[Group]:
        """A dynamic-sampling draw, graded and checked as the step's first draw is (a broken grader or
        environment stops the run here too)."""
        graded = self._graded(problems, groups)
        checks.grades(graded, self.rec, step, self.world)
        return graded

    def advantages(self, rewards_PG: torch.Tensor, trains_PG: torch.Tensor | None = None) -> torch.Tensor:
        """A [B, G] of each response's reward against its group's samples of the model (faults.py may
        invert the rewards)."""
        return objective.group_advantages(rewards_PG, std_scale=self.rec.loss.adv_std, trains_PG=trains_PG)

    def _old_policy(self, batch: Batch, comps: list, fused: bool):
        """(routes to replay or None, replay metrics, (log π_θold, entropy) or None when `fused`)."""
        r = self.rec
        if r.train.replay != "r3":  # R2 records the trainer's own routes under π_old and replays them in every mini-batch
            if fused:
                return None, {}, None
            logp, ent, routes = self.trainer.logprobs(batch, record_routes=r.train.replay == "r2")
            return routes, {}, (logp, ent)
        # R3: π_old under the rollout engine's routes; the trainer's own for metrics
        routes = rollout_routes(comps, batch, self.trainer.replay.num_layers, self.shape.top_k, self.shape.num_experts)
        metrics = {"replay/coverage": 1.0}  # every fed position has a captured route (checked when built)
        old = None if fused else self.trainer.logprobs(batch, routes=routes)[:2]
        if r.train.replay_diagnostics:
            metrics.update(replay_diagnostics(self.trainer, batch, routes, total=self.world.total))
        return routes, metrics, old

    def _guard_view(self, batch: Batch, old_logp: torch.Tensor, ent: torch.Tensor) -> tuple[float, float, float | None]:
        """KL(μ_old ‖ π_old) and the entropy of π_old, over all ranks (token-weighted; every rank has
        B·G rows): what the guard decides on; and, of a batch with tokens sampled behind, the KL over
        those the trained weights sampled themselves where there are FRESH_TOKENS of them (else None)."""
        kl = objective.train_inference_kl(batch.rollout_logp_BT, old_logp, batch.mask_BT)
        entropy = objective.masked_mean(ent, batch.mask_BT)
        kl, entropy = self.world.mean({"kl": kl, "entropy": entropy}, weight=float(batch.mask_BT.sum())).values()
        behind = batch.behind_BT
        if behind is None or not self.world.any(bool((behind * batch.mask_BT).sum() > 0)):
            return kl, entropy, None  # nothing behind anywhere: `kl` is the fresh tokens' own
        fresh = batch.mask_BT * (1 - behind)
        n = float(fresh.sum())
        got = self.world.mean({"kl": objective.train_inference_kl(batch.rollout_logp_BT, old_logp, fresh) if n else 0.0,
                               "n": n}, weight=n, sums=("n",))
        return kl, entropy, (got["kl"] if got["n"] >= FRESH_TOKENS else None)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def parity(self) -> float:
        """mean |log μ − log π| over the run's fixed batch of tokens, right after a sync (parity.py)."""
        return parity_check.measure(self._parity_pairs, self.rollouts, self.trainer, self.world, self.tp, self.pad)

    def heldout_eval(self) -> dict:
        e, world, tp = self.rec.eval, self.world, self.tp  # a TP group evaluates its share; each member gathers its part
        return evaluate(self.rollouts, world.group_share(self.heldout, tp), self.grading, k=e.k, episodes=self.episodes,
                        sampler=e, max_tokens=self.rec.rollout.max_tokens, decode=self.decode,
                        eos_id=self.eos, gather=lambda rows: world.gather(world.member_share(rows, tp)))

    # ----- checkpoints --------------------------------------------------------------------------
    def save(self, name: str) -> Path:
        """A checkpoint (each part records its own); the rollback target if the guard sees nothing pending."""
        path = self.state.run_dir / "checkpoints" / name
        self.trainer.save(path, {"recipe": self.rec.to_dict(), **self.state.record(), **self.rollouts.record(),
                                 **self.guard.record()})
        if self.guard.healthy:
            self.last_good = path
        return path

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` step checkpoints (0: all), always the rollback target, and the
        good one with the best held-out score (`export --best`'s pick among those that have one)."""
        ckpts = store.complete_checkpoints(self.state.run_dir) if self.world.main else []
        best = store.best_scored(ckpts, f"avg@{self.rec.eval.k}")
        for old in ckpts[:-keep] if keep > 0 else []:
            if old not in (self.last_good, best):
                atomic.remove_dir(old)

    def record_heldout(self, path: Path, heldout: dict) -> None:
        """The held-out result of the weights a checkpoint holds (the periodic eval of its step),
        beside it: `prune` keeps the best good one and `export --best` reads it."""
        if self.world.main and self.guard.healthy:
            store.write_scores(path, {**{k: v for k, v in heldout.items() if "@" in k},
                                      "measured_by": f"the run's held-out evaluation at step {self.state.step}"})

    def rollback(self) -> None:
        """Back to the last good weights and optimizer state, at a lower learning rate. The data
        position and the sampling seeds keep moving, so the same collapse is not replayed."""
        self.rollouts.discard()  # nothing sampled from, or reading, the weights being undone
        back_to = self.last_good.name
        for undone in store.complete_checkpoints(self.state.run_dir) if self.world.main else []:
            if undone.name > back_to:  # what the rollback undoes is no candidate for the best
                store.drop_scores(undone)
        self.trainer.load(self.last_good)
        self.rolled_back_to.append(str(self.last_good))
        self.state.lr *= self.rec.guard.lr_factor
        self.trainer.set_lr(self.state.lr)
        self.rollouts.sync(self.trainer)

    def close(self) -> None:
        self.rollouts.close()
