"""A running request's KV slots for its next tokens, answered at once where its blocks already hold them.

vLLM's scheduler asks its KV manager for slots (`allocate_slots`) for every request it schedules, at
every step: a rollout of 256 requests asks 256 times a step, and each answer walks the KV coordinator.
For a request that is running (decoding), in an engine without prefix caching whose one KV group is
full attention, asked with nothing else to place (no lookahead, no prefix hit, no external or
encoder tokens, no admission gate or reserve), vLLM's own path frees no block (full attention skips
none), allocates none where the request's blocks already cover its tokens so far and the new ones,
caches none, and returns its empty blocks. This returns those empty blocks at once in that case, the
same answer; every other call (an admission, a request that needs a new block, a resumed one) is
vLLM's own. Installed on a CPU engine's scheduler (rollout/vllm.py); `active` turns it off for a
comparison (tests/test_rollout.py holds a rollout with it to one without, bit for bit).
"""

from __future__ import annotations

from minirl.rollout import vllm_internals

active = True  # tests compare an engine's rollout with this on and off


def install(scheduler) -> bool:
    """Answer the running requests' slot calls of `scheduler`'s KV manager at once where they need no
    block; False (nothing installed) where the engine caches prefixes or holds another KV group."""
    manager = scheduler.kv_cache_manager
    groups = manager.coordinator.single_type_managers
    if manager.enable_caching or len(groups) != 1 or not vllm_internals.full_attention(groups[0]):
        return False

    def answered(allocate_slots):
        def allocate(request, num_new_tokens, *args, **kwargs):
            if active and needs_nothing(manager, groups[0], request, num_new_tokens, args, kwargs):
                return manager.empty_kv_cache_blocks
            return allocate_slots(request, num_new_tokens, *args, **kwargs)

        return allocate

    vllm_internals.around_allocate_slots(manager, answered)
    return True


def needs_nothing(manager, group, request, num_new_tokens: int, args: tuple, kwargs: dict) -> bool:
    """Whether vLLM's `manager.allocate_slots(request, num_new_tokens, *args, **kwargs)` would free, allocate
    and cache nothing and return the manager's empty blocks: a running request asked with nothing else to
    place, whose blocks in the one full-attention `group` already cover its tokens and the new ones."""
    if args or kwargs.keys() - {"num_lookahead_tokens"} or kwargs.get("num_lookahead_tokens", 0):
        return False
    if not vllm_internals.running(request):
        return False
    blocks = group.req_to_blocks.get(request.request_id)  # a defaultdict: `[...]` would add the request
    need = min(request.num_computed_tokens + num_new_tokens, manager.max_model_len)
    return bool(blocks) and len(blocks) * group.block_size >= need
