"""log μ of every sampled token, taken from vLLM's sampler in one tensor op per engine step.

Asked for `logprobs=0`, vLLM returns the sampled token's log-prob through per-request Python at
every engine step: the worker turns the step's tensors into lists, the scheduler slices them per
request, and the output processor appends them to each request's `FlatLogprobs`: a visible share
of a short rollout (docs/results/cpu-path.md). The log-probs themselves are one `log_softmax` and
one `gather` over the step's logits.

So the engine asks for none, and this recorder, inside the worker, wraps the model runner's
`_sample`:
- before the sampler runs (an fp32 engine's sampler scales the logits in place by temperature),
  the log-probs of the distribution each row's token is drawn from: log softmax(z / T) in float32
  with the row's own temperature, as the sampler divides it (`Sampler.apply_temperature`: a
  greedy row's T taken as 1), with vLLM's own `Sampler.compute_logprobs`: what `logprobs=0`
  returns in vLLM's `processed_logprobs` mode, which the CUDA engine asks for (#79: the default
  `raw_logprobs` is the T = 1 policy, not what sampled the token), then cut as the sampler cuts
  it (min-p, top-k, top-p: an evaluation's settings), renormalized over what it keeps; penalties
  would change it again from each request's history: minirl sets none, and a step with one is refused;
- after it, the log-prob of each row's sampled token, kept with the step's request ids (the rows
  are the runner's batch, in order).
`stop` cuts them per request. Each request must have exactly one per token it sampled
(`rollout.VLLMEngine.generate` checks the counts), so a step the recorder missed, or one whose
samples vLLM threw away, is an error, never a shifted log-prob.

Runs inside the engine's worker (installed through `collective_rpc`); the CPU engine only
(`VLLMEngine`): on CUDA vLLM's own path is kept, unmeasured against this one.
"""

from __future__ import annotations

import torch

from minirl.rollout import vllm_internals


class LogprobRecorder:
    def __init__(self, worker):
        runner = worker.model_runner
        self.enabled = False
        self.version = 0  # the policy version of the weights: each step's samples are stamped with it
        self._reset()

        def sample(original, logits, spec_decode_metadata):
            if not self.enabled or logits is None:
                return original(logits, spec_decode_metadata)
            if spec_decode_metadata is not None:
                raise RuntimeError("log-prob capture: speculative decoding is not supported")
            # before the sampler: fp32 logits are scaled in place
            md = runner.input_batch.sampling_metadata
            cut = drawn_from(logits, md)
            drawn = vllm_internals.compute_logprobs(cut)
            out = original(logits, spec_decode_metadata)
            n = out.sampled_token_ids.shape[0]
            # what each row's cut kept, where the step cuts (0: nothing cut): the trainer renormalizes over as many
            kept = torch.isfinite(cut[:n]).sum(-1) if cuts(md) else None
            self.steps.append((runner.input_batch.req_ids[:n],
                               drawn.gather(-1, out.sampled_token_ids[:, :1].long()).view(-1), self.version, kept))
            return out

        vllm_internals.around_sample(runner, sample)

    def _reset(self) -> None:
        self.steps: list[tuple[list[str], torch.Tensor, int, torch.Tensor | None]] = []
        # steps already cut per request (`take`): key → ([log μ], [version], [tokens the sampler's cut kept])
        self.per_request: dict[tuple[str, int], tuple[list[float], list[int], list[int]]] = {}

    def start(self) -> None:
        self.enabled = True
        self._reset()

    def discard(self) -> None:
        """Stop, keeping nothing: what a forward cut short left is torn."""
        self.enabled = False
        self._reset()

    def stop(self) -> tuple[dict, dict, dict]:
        """({(external request id, completion index): log μ of its sampled tokens, in order}, the same
        keys → the policy version that sampled each, and → how many tokens the sampler's cut kept at each
        (0: nothing cut))."""
        self.enabled = False
        self._split()
        out = tuple({k: v[i] for k, v in self.per_request.items()} for i in range(3))
        self._reset()
        return out

    def take(self, external_ids) -> tuple[dict, dict, dict]:
        """The same for the requests of these external ids only (they have finished); capturing goes on."""
        self._split()
        wanted = set(external_ids)
        mine = [k for k in self.per_request if k[0] in wanted]
        taken = [self.per_request.pop(k) for k in mine]
        return tuple(dict(zip(mine, (t[i] for t in taken))) for i in range(3))

    def _split(self) -> None:
        """The steps recorded so far, cut per request (one tensor op for all of them)."""
        if not self.steps:
            return
        rids = [r for ids, _, _, _ in self.steps for r in ids]
        values = torch.cat([v for _, v, _, _ in self.steps]).tolist()
        versions = [version for ids, _, version, _ in self.steps for _ in ids]
        kept = [c for ids, _, _, k in self.steps for c in (k.tolist() if k is not None else [0] * len(ids))]
        self.steps = []
        for rid, v, version, k in zip(rids, values, versions, kept):
            lps, stamps, counts = self.per_request.setdefault(vllm_internals.split_request_id(rid), ([], [], []))
            lps.append(v)
            stamps.append(version)
            counts.append(k)


def cuts(md) -> bool:
    """The step's sampler cuts some row's distribution (top-k, top-p, or an argmax-invariant processor: min-p)."""
    return md.top_k is not None or md.top_p is not None or any(
        getattr(p, "min_p_count", 1) for p in md.logitsprocs.argmax_invariant)


def drawn_from(logits: torch.Tensor, md) -> torch.Tensor:
    """The step's logits as its sampler draws from them: float32, each row divided by its request's
    temperature, then cut as the sampler cuts them (min-p, top-k, top-p: -inf outside what each row
    keeps, with vLLM's own functions), in a new tensor: the sampler's own input is left as it is.
    vLLM's temperature rule (`Sampler.apply_temperature`): no division where every row is greedy, and
    a greedy row beside sampled ones divided by 1. A penalty, which reshapes the distribution from the
    request's history, is refused (minirl sets none)."""
    if not md.no_penalties:
        raise RuntimeError("log-prob capture: a penalty is set on a rollout request; log μ would not be the "
                           "distribution the token was drawn from (minirl sets none)")
    x = logits.float()
    if md.all_greedy or md.temperature is None:  # the sampler takes the argmax, and cuts nothing
        return x
    t = md.temperature[: x.shape[0]].to(x.device, torch.float32)
    if not md.all_random:
        t = torch.where(t < vllm_internals.greedy_below(), 1.0, t)
    return vllm_internals.cut(x / t[:, None], md)  # a new tensor: the cuts write in place


def install(worker) -> bool:
    """Attach one recorder to this worker (idempotent)."""
    if getattr(worker, "_minirl_logprobs", None) is None:
        worker._minirl_logprobs = LogprobRecorder(worker)
    return True


def start(worker) -> None:
    worker._minirl_logprobs.start()


def stop(worker) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], list[int]]]:
    return worker._minirl_logprobs.stop()


def take(worker, external_ids):
    return worker._minirl_logprobs.take(external_ids)


def set_version(worker, version: int) -> None:
    worker._minirl_logprobs.version = version


def discard(worker) -> None:
    worker._minirl_logprobs.discard()
