"""Every weight the engine holds written by a sync, with its shape: checked on every engine path.

vLLM's in-place `reload_weights` loads what it is given and, of what it was not given, only logs a
warning (and none at all for a quantized model such as CUDA FP8): a sync that skips a weight leaves
it at the old weights while the run goes on, which the parity check may show many steps later or
never (a weight that changes little). The engine loaded exactly its model folder's tensors when it
started, so a sync must write each of those names in the same shape: `Coverage` watches the stream
on its way in (a shape is refused before vLLM sees it) and, once the stream ends, names what it
never wrote. The CPU engine's direct writer (cpu/weights.py) checks the same against vLLM's own
parameters; both stop the run in one line (errors.EngineFault), never a traceback.

Names the folder does not hold (a tied LM head a model folder leaves out) are vLLM's to take or
skip, as it does when it loads the folder. A folder without safetensors files (none that minirl
builds or ships) has nothing to check against: no check.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from minirl.errors import EngineFault


def expected_weights(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor in the folder's safetensors files (headers only) that the
    engine holds as a weight of its own: not a tied LM head (`tie_word_embeddings`: vLLM reads the
    embeddings for it and skips the checkpoint's copy, and the trainer's state-dict adapter sends
    none), nor a RoPE table some checkpoints carry (vLLM computes its own)."""
    from safetensors import safe_open

    folder = Path(model_dir)
    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if not name.endswith("rotary_emb.inv_freq"):
                    out[name] = tuple(st.get_slice(name).get_shape())
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings"):
        out.pop("lm_head.weight", None)
    return out


class Coverage:
    """One sync's stream, watched: `watch` passes the tensors on, `done` says what was left out."""

    def __init__(self, expected: dict[str, tuple[int, ...]], *, what: str = "the weight sync"):
        self.expected, self.what = expected, what
        self.written: set[str] = set()

    def watch(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            want = self.expected.get(name)
            if want is not None and tuple(t.shape) != want:
                raise EngineFault(f"{self.what} sent {name} in shape {tuple(t.shape)}; the rollout engine holds it "
                                  f"as {want}: the trainer's model is not the engine's")
            self.written.add(name)
            yield name, t

    def whole(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A whole set of weights at once (views bound once, a snapshot slot): watched, then done."""
        for _ in self.watch(weights):
            pass
        self.done()

    def done(self) -> None:
        if not self.expected:
            return
        if missing := sorted(self.expected.keys() - self.written):
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise EngineFault(f"{self.what} left {missing[0]}{more} unwritten: the rollout engine would sample "
                              f"with stale weights there (a trainer whose names the engine does not map, or a "
                              f"sync cut short); the run stops before it samples with them")


@contextlib.contextmanager
def named_faults():
    """The CPU writer's refusals (a name the engine lacks, a shape, a weight left out: KeyError and
    ValueError from cpu/weights.py) as the same one-line stop."""
    try:
        yield
    except (KeyError, ValueError) as e:
        raise EngineFault(f"the weight sync: {e.args[0] if e.args else e}") from None
