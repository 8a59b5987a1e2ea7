"""#66: the staleness controller: admission bounds what is ahead, batches are trained in order,
nothing is dropped, and every trained token is at most k updates stale. Driven directly, and
by a simulated cluster of engines with random response times that keep sampling across updates."""

from __future__ import annotations

import dataclasses

import random
from collections import Counter

import pytest

from minirl.rollout.controller import Controller, StalenessError
from tests.async_sim import Cluster, simulate


def test_synchronous_admits_a_batch_only_after_the_sync_before_it():
    c = Controller(0, step=0)
    t1 = c.admit(position="p1")
    assert (t1.step, t1.admitted) == (1, 0) and not c.may_admit()  # step 2 would train θ_1, not yet synced
    c.finish(t1, "answer")
    assert c.take(1).handle == "answer" and not c.may_admit()
    c.updated(1)
    assert c.may_admit() and c.admit(position="p2").step == 2


@pytest.mark.parametrize("k", [1, 2, 4])
def test_k_batches_run_ahead_of_the_weights_and_no_more(k):
    c = Controller(k, step=0)
    while c.may_admit():
        c.admit(position=len(c))
    assert len(c) == k + 1  # steps 1..k+1 may be sampled from θ_0; step k+2 trains θ_{k+1}
    c.updated(1)  # θ_1 synced (as if step 1 had trained): one more may start
    assert c.may_admit() and c.admit(position=None).step == k + 2 and not c.may_admit()


def test_take_refuses_out_of_order_unfinished_or_too_stale_batches():
    c = Controller(1, step=0)
    t1, t2 = c.admit(position=0), c.admit(position=1)
    with pytest.raises(StalenessError, match="step 1 asked for its batch; the queue's head is step 1 \\(done: False\\)"):
        c.take(1)
    c.finish(t1)
    with pytest.raises(StalenessError, match="step 2 asked"):
        c.take(2)
    c.take(1)
    c.updated(1)
    c.finish(t2, tokens={0: 5, 1: 3})  # sampled across the update: 1 and 0 updates stale for step 2
    assert c.head().staleness() == {1: 5, 0: 3}
    c.take(2)
    c.updated(2)
    t3 = c.admit(position=2)
    c.finish(t3, tokens={0: 1})  # an engine that says θ_0 sampled a token of step 3's batch: 2 > k
    with pytest.raises(StalenessError, match="holds tokens 2 updates stale"):
        c.take(3)


def test_a_rollback_discards_everything_ahead_and_a_checkpoint_records_the_oldest_untrained_draw():
    c = Controller(2, step=10)
    assert c.position("now") == "now"
    for p in ("before 11", "before 12", "before 13"):
        c.admit(position=p)
    assert c.position("now") == "before 11"  # a resume draws the prompts of steps 11–13 again
    assert [t.step for t in c.discard()] == [11, 12, 13]
    assert len(c) == 0 and c.version == 10 and c.next_step == 11  # the restored weights are what step 11 trains
    with pytest.raises(ValueError, match="a rollback goes through"):
        c.updated(9)
    with pytest.raises(ValueError, match="max_staleness = -1"):
        Controller(-1, step=0)


def _noisy(rng: random.Random) -> int:
    """Response times with a long tail: most short, a few 30 times the median."""
    return 1 + int(rng.lognormvariate(3.0, 1.2))


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("inflight", [True, False])
def test_with_random_response_times_the_bound_holds_and_nothing_is_dropped(k, seed, inflight):
    cluster = Cluster(engines=3, slots=8, prompts=4, group=4, train_tokens_per_s=2000.0, sync_s=0.05,
                      lengths=_noisy, inflight=inflight)
    r = simulate(k, steps=40, cluster=cluster, seed=seed)
    assert max(r.staleness) <= k and r.max_in_flight <= k + 1
    if k:
        assert max(r.staleness) == k  # the engines do run ahead: the bound is reached, and held
        assert sum(n for s, n in r.staleness.items() if s > 0) > 0
    assert Counter(r.trained_lengths) == Counter(r.generated_lengths)  # every sequence generated was trained
    assert sum(r.trained_lengths) == r.tokens == sum(r.staleness.values())


@pytest.mark.parametrize("inflight", [True, False])
def test_running_ahead_is_faster_when_response_times_vary(inflight):
    cluster = Cluster(engines=3, slots=8, prompts=4, group=4, train_tokens_per_s=2000.0, sync_s=0.05,
                      lengths=_noisy, inflight=inflight)
    rate = {k: simulate(k, steps=40, cluster=cluster, seed=0).tokens_per_s for k in (0, 1, 2)}
    assert rate[0] < rate[1] <= rate[2] * 1.05


def test_with_in_flight_updates_the_batches_share_the_engines_and_run_faster_than_one_call_at_a_time():
    """#74: what the cluster figures of docs/results/async.md rest on: one call at a time, a sync waits
    for every engine to finish what was sent before it, so the slots empty behind each batch's
    longest response; with in-flight updates the next batches fill them."""
    cluster = Cluster(engines=3, slots=8, prompts=4, group=4, train_tokens_per_s=2000.0, sync_s=0.05, lengths=_noisy)
    one = simulate(2, steps=40, cluster=dataclasses.replace(cluster, inflight=False), seed=0)
    both = simulate(2, steps=40, cluster=cluster, seed=0)
    assert both.slot_use > one.slot_use and both.tokens_per_s > one.tokens_per_s
    assert both.mean_staleness < one.mean_staleness  # a sync lands mid-batch: fresher tokens
