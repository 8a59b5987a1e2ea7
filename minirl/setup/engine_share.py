"""The rollout engine's part of a plan (setup/plan.py): its KV cache and its share of the GPU, vLLM's
`gpu_memory_utilization`, beside the trainer or alone on rollout GPUs of its own, and what is refused when it
has no room for one full-length sequence or asks more than is free at its start.

The engine is its weights, its working memory and a KV cache: sized for the job (every sequence of a step at
full length, no more) within what the trainer leaves, or what the recipe's memory_fraction / kv_cache_gib make
of it. vLLM takes that budget at its start and refuses to start when less is free (its `request_memory`).
"""

from __future__ import annotations

from minirl.models import sizing
from minirl.setup.overflow import GiB, HEADROOM, largest_part, most_gib


def kv_cache(r, *, room: float, job_kv: float, fixed: float, gpu_bytes: float, short: str) -> tuple[float, str]:
    """An engine's KV cache and what decided it: rollout.kv_cache_gib; vLLM's own sizing from
    rollout.memory_fraction (the rest of its share once its weights and working memory, `fixed`,
    are in); else sized for the job (`job_kv`) within `room`, or `room` where the job needs more."""
    if r.kv_cache_gib > 0:
        return r.kv_cache_gib * GiB, "rollout.kv_cache_gib"
    if r.memory_fraction > 0:
        return max(0.0, r.memory_fraction * gpu_bytes - fixed), "rollout.memory_fraction"
    return max(0.0, min(room, job_kv)), "sized for the job" if job_kv <= room else short


def beside_trainer(r, *, vllm_w: float, working: float, job_kv: float, gpu_gib: float, kept: dict[str, float],
                   trainer_peak: float, seq: int, kv_per_token: float) -> dict:
    """An engine on the trainer's GPUs (colocated): its KV cache within what the trainer's larger phase
    leaves (`trainer_peak`; with the engine asleep, what it keeps between updates, `kept`), the share it
    takes at its start beside `kept`, the full-length sequences it holds at once, and what is refused."""
    gpu_bytes, budget, tp = gpu_gib * GiB, HEADROOM * gpu_gib * GiB, r.tensor_parallel
    fixed = vllm_w + working
    kv, kv_sizing = kv_cache(r, room=budget - trainer_peak - fixed, job_kv=job_kv, fixed=fixed, gpu_bytes=gpu_bytes,
                             short="what the trainer leaves")
    engine_bytes = fixed + kv
    resident = sum(kept.values())
    start_free = budget - resident  # free when the engine starts: the trainer's weights (and moments) are in
    limit = min(start_free, budget - trainer_peak)  # the most the engine may take
    if r.memory_fraction > 0:
        fraction = r.memory_fraction
    else:  # what the engine needs, rounded up to vLLM's thousandths, never past what is free then
        fraction = sizing.fraction(engine_bytes, gpu_bytes, limit=max(0.0, limit))
    asked = fraction * gpu_bytes
    in_flight = int(kv * tp // (seq * kv_per_token))
    problems = []
    if asked > limit >= fixed and (r.memory_fraction > 0 or r.kv_cache_gib > 0):
        problems.append(_start_refusal(r, asked=asked, free=start_free, room=budget - trainer_peak, resident=resident,
                                       gpu_gib=gpu_gib, awake=r.sleep_level == 0, fixed=fixed))
    elif (in_flight < 1 and r.memory_fraction > 0 and r.kv_cache_gib <= 0
          and limit - fixed >= seq * kv_per_token / tp):
        problems.append(f"rollouts: rollout.memory_fraction = {r.memory_fraction:g} gives the engine "
                        f"{asked / GiB:.1f} GiB, and its weights and working memory take {fixed / GiB:.1f} GiB of it, "
                        f"leaving no KV cache for one {seq}-token sequence: raise it (at most "
                        f"{int(limit / gpu_bytes * 1000) / 1000:g}), or 0 (the plan's: what the trainer leaves, sized "
                        "for the job)")
    elif in_flight < 1 or asked > limit:
        engine = {f"vLLM weights ({r.precision}, TP {tp})": vllm_w, "vLLM working memory (estimate)": working}
        problems.append(f"rollouts: after the trainer's state between updates, vLLM's weights and its working memory "
                        f"({(resident + fixed) / GiB:.1f} GiB) no KV cache is left for one {seq}-token sequence; "
                        f"{largest_part({**kept, **engine}, r)}")
    elif resident + engine_bytes > budget:  # #75: a KV cache set by hand past the GPU: "fits" at 230.9 GiB on 80
        problems.append(f"rollouts need {(resident + engine_bytes) / GiB:.1f} GiB per GPU, over {HEADROOM:.0%} of "
                        f"{gpu_gib:g} GiB, the largest part vLLM's KV cache ({kv / GiB:.1f} GiB): set "
                        f"rollout.kv_cache_gib at most {most_gib(budget - resident - fixed)}, or 0 (the plan's: sized "
                        "for the job within what the trainer leaves)")
    return {"kv": kv, "kv_sizing": kv_sizing, "fraction": fraction, "in_flight": in_flight, "start_free": start_free,
            "engine_bytes": engine_bytes, "problems": problems}


def _start_refusal(r, *, asked: float, free: float, room: float, resident: float, gpu_gib: float, awake: bool,
                   fixed: float) -> str:
    """The engine's budget is more than the GPU has free when it starts (vLLM would refuse), or, awake,
    more than the trainer's larger phase leaves it: which setting asks it, and the most that fits."""
    limit = min(free, room)
    key = "rollout.kv_cache_gib" if r.kv_cache_gib > 0 else "rollout.memory_fraction"
    value = r.kv_cache_gib if r.kv_cache_gib > 0 else r.memory_fraction
    most = (f"at most {most_gib(limit - fixed)}" if key == "rollout.kv_cache_gib"
            else f"at most {int(limit / (gpu_gib * GiB) * 1000) / 1000:g}")
    beside = ("the trainer's larger phase (training or the weight sync) leaves it" if awake and room < free
              else f"are free when it starts (the trainer's state between updates holds {resident / GiB:.1f} GiB, "
                   f"within {HEADROOM:.0%} of {gpu_gib:g} GiB)")
    return (f"vLLM's start: {key} = {value:g} gives the engine {asked / GiB:.1f} GiB of each GPU, and "
            f"{max(0.0, limit) / GiB:.1f} GiB {beside}: set {key} {most}, or 0 (the plan's: what the trainer leaves, "
            "sized for the job)")


def on_rollout_gpus(r, *, vllm_w: float, working: float, job_kv: float, bucket: float, budget: float, gpu_gib: float,
                 seq: int, kv_per_token: float) -> dict:
    """An engine alone on rollout GPUs of its own (parallel.rollout_gpus): its weights, working
    memory, a KV cache (sized for the job within the GPU, or the recipe's memory_fraction /
    kv_cache_gib), and the bucket the trainer's weights arrive in at each sync (broadcast). What
    it holds by part, its KV cache and what decided it, vLLM's gpu_memory_utilization, the
    full-length sequences it holds at once, and what does not fit."""
    gpu_bytes, tp = gpu_gib * GiB, r.tensor_parallel
    kv, kv_sizing = kv_cache(r, room=budget - vllm_w - working - bucket, job_kv=job_kv, fixed=vllm_w + working,
                             gpu_bytes=gpu_bytes, short="what its GPU holds")
    engine_bytes = vllm_w + working + kv
    fraction = r.memory_fraction or sizing.fraction(engine_bytes, gpu_bytes, limit=max(0.0, budget - bucket))
    in_flight = int(kv * tp // (seq * kv_per_token))
    parts = {f"vLLM weights ({r.precision}, TP {tp})": vllm_w, "vLLM working memory (estimate)": working,
             "vLLM KV cache": kv, "weight broadcast bucket": bucket}
    problems = []
    room = max(0.0, budget - bucket)  # what the engine may take beside the bucket the weights arrive in
    if r.kv_cache_gib > 0 and vllm_w + working + kv > room:  # #75: "fits" at a sampling peak of 532 GiB on 141
        problems.append(f"sampling on a rollout GPU needs {(vllm_w + working + kv + bucket) / GiB:.1f} GiB, over "
                        f"{HEADROOM:.0%} of {gpu_gib:g} GiB: rollout.kv_cache_gib = {r.kv_cache_gib:g} is more than is "
                        f"left beside its weights, working memory and the bucket: set it at most "
                        f"{most_gib(room - vllm_w - working)}, or 0 (the plan's: sized for the job)")
    elif fraction * gpu_bytes > room:
        key = "rollout.kv_cache_gib" if r.kv_cache_gib > 0 else "rollout.memory_fraction"
        most = f"at most {int(room / gpu_bytes * 1000) / 1000:g}" if key == "rollout.memory_fraction" else \
            f"at most {most_gib(room - vllm_w - working)}"
        problems.append(f"vLLM's start on a rollout GPU: {key} gives the engine {fraction * gpu_bytes / GiB:.1f} GiB, "
                        f"and {room / GiB:.1f} GiB are left beside the weight broadcast's bucket within "
                        f"{HEADROOM:.0%} of {gpu_gib:g} GiB: set it {most}, or 0 (the plan's: sized for the job)")
    elif in_flight < 1:
        problems.append(f"rollouts: on a rollout GPU, vLLM's weights and working memory "
                        f"({(vllm_w + working) / GiB:.1f} GiB) leave no KV cache for one {seq}-token sequence; "
                        f"{largest_part({k: v for k, v in parts.items() if k != 'vLLM KV cache'}, r)}")
    return {"parts": parts, "kv": kv, "kv_sizing": kv_sizing, "fraction": fraction, "in_flight": in_flight,
            "problems": problems}
