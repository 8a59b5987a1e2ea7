"""The plan's advice (`minirl run --dry-run`, and a GPU run that does not fit its device): the
cheapest change that makes every phase of a plan fit, as `--set` flags with the plan they give,
and the one line a plan that does not fit is refused with. The plan itself: setup/plan.py.
"""

from __future__ import annotations

from minirl.config.precisions import PRECISIONS
from minirl.config.recipes import with_sets
from minirl.errors import UsageError
from minirl.models.shapes import ModelShape
from minirl.setup.plan import Plan, plan_for

# LoRA's learning rate against full RL's where advice turns LoRA on: the factor of the shipped
# Qwen3-30B-A3B LoRA recipe ("LoRA Without Regret"); docs/lora.md: the tiny model learned best at 1.7 ×
LORA_LR_FACTOR = 10


def _ladder(rec, plan: Plan) -> list[list[dict]]:
    """The changes `advise` tries, cheapest kind first, each kind's options mildest first: what a
    change costs in time or quality grows down the list (an engine budget the plan derives costs
    nothing; a smaller micro-batch costs a little throughput; offload, transfers; rollout TP,
    engines; FP8, a wider training-inference gap; LoRA, what the adapters cannot learn; more GPUs,
    money)."""
    t, r, p = rec.train, rec.rollout, rec.parallel
    micro = []
    ac = {} if t.activation_checkpoint == "full" else {"train.activation_checkpoint": "full"}
    if ac:
        micro.append(ac)
    m = plan.micro_batch_tokens // 2
    while m >= 1024:
        micro.append({**ac, "train.micro_batch_tokens": m})
        m //= 2
    world = p.nodes * p.gpus_per_node
    # an engine's GPUs: of one node, among the training ranks (colocated) or the rollout GPUs
    per_node, ranks = (p.rollout_gpus, p.nodes * p.rollout_gpus) if p.rollout_gpus else (p.gpus_per_node, world)
    tps = [tp for tp in (2, 4, 8) if tp > r.tensor_parallel and tp <= per_node and ranks % tp == 0]
    gpus = [(n, g) for n in (1, 2, 4, 8, 16, 32, 64) for g in (1, 2, 4, 8)
            if n * g > world and (n == 1 or g == 8) and n >= p.nodes]
    return [[{"rollout.memory_fraction": 0.0, "rollout.kv_cache_gib": 0.0}] if r.memory_fraction or r.kv_cache_gib else [],
            # FP8 decoding eagerly, where the engine must sleep at level 2 (#72; validator.py)
            [{"rollout.cuda_graphs": False}] if r.precision == "fp8" and r.cuda_graphs else [],
            micro,
            [{"train.offload": "optimizer"}] if t.offload == "none" else [],
            [{"rollout.tensor_parallel": tp} for tp in tps],
            # FP8 decodes eagerly after a level-2 sleep until a GPU confirms a fix (validator.py, #72)
            [{"rollout.precision": "fp8", **({"rollout.cuda_graphs": False} if r.sleep_level in (-1, 2) and r.cuda_graphs
                                              else {})}] if not PRECISIONS[r.precision].rounds else [],
            [{"train.lora.rank": 16, "train.lr": float(f"{t.lr * LORA_LR_FACTOR:.3g}")}] if not t.lora.rank else [],
            [{"parallel.nodes": n, "parallel.gpus_per_node": g} for n, g in sorted(gpus, key=lambda x: x[0] * x[1])]]


def advise(rec, shape: ModelShape, *, model: str, gpu_gib: float, lora: bool = True,
           fit: bool = False, keep=frozenset()) -> tuple[dict, Plan] | None:
    """The cheapest change that makes the whole plan fit (every phase, and at least one full-length
    sequence in flight), as `--set` keys and values, and the plan it gives: exactly the plan of the
    same dry run with those flags added (`rec` is the recipe before `fit_mesh`; a change of machine
    fits the mesh to the new machine, as that dry run would). Kinds of change are taken in
    `_ladder`'s order, each added to the strongest option of the kinds before it; then every
    earlier kind is eased back as far as the plan still fits. lora=False leaves LoRA off the ladder
    (what training every weight would take)."""
    def fits(sets: dict) -> Plan | None:
        try:
            plan = plan_for(with_sets(rec, sets), shape, model=model, gpu_gib=gpu_gib, keep=keep,
                            fit=fit or "parallel.gpus_per_node" in sets or "parallel.nodes" in sets)
        except UsageError:  # a combination the validator refuses is no advice
            return None
        return plan if plan.fits else None

    plan = plan_for(rec, shape, model=model, gpu_gib=gpu_gib, fit=fit, keep=keep)
    if plan.fits:
        return {}, plan
    ladder = _ladder(rec, plan)
    if not lora:
        ladder = [[o for o in level if "train.lora.rank" not in o] for level in ladder]
    merged = lambda parts: {k: v for part in parts for k, v in part.items()}  # noqa: E731
    for n, level in enumerate(ladder):
        earlier = [options[-1] if options else {} for options in ladder[:n]]  # each earlier kind at its strongest
        for option in level:
            if fits(merged([*earlier, option])) is None:
                continue
            for i in reversed(range(n)):  # ease each earlier kind back: none of it, else its mildest that fits
                earlier[i] = next(mild for mild in [{}, *ladder[i]]
                                  if fits(merged([*earlier[:i], mild, *earlier[i + 1:], option])) is not None)
            now = rec.flat()
            sets = {k: v for k, v in merged([*earlier, option]).items() if now[k] != v}  # what changes
            return sets, fits(sets)
    return None


def describe(sets: dict, plan: Plan) -> str:
    """A change as flags, and what its plan gives: '--set k=v …: training X, weight sync Y, rollout
    Z GiB per GPU; N full-length sequences in flight per engine'."""
    flags = [f"--nodes {sets['parallel.nodes']}"] if "parallel.nodes" in sets else []
    flags += [f"--gpus-per-node {sets['parallel.gpus_per_node']}"] if "parallel.gpus_per_node" in sets else []
    flags += [f"--set {k}={str(v).lower()}" if isinstance(v, bool) else f"--set {k}={v:g}" if isinstance(v, float)
              else f"--set {k}={v}"
              for k, v in sets.items() if k not in ("parallel.nodes", "parallel.gpus_per_node")]
    peaks = ", ".join(f"{k.split(' (')[0]} {v:.1f}" for k, v in plan.phases_gib.items())
    return f"{' '.join(flags)}: {peaks} GiB per GPU; {plan.in_flight} full-length sequences in flight per engine"


def refusal(plan: Plan, advice: list[str], hint: str = "") -> str:
    """The one line a plan that does not fit is refused with (the dry run's and the run's): every
    problem's first clause, then the cheapest change that fits."""
    over = "; ".join(p.split(";")[0] for p in plan.problems)
    fix = f"; the cheapest change that fits: {advice[0]}" if advice else "; no change on the ladder fits"
    return f"the plan does not fit: {over}{fix}{hint}"
