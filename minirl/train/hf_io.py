"""HF <-> TorchTitan weights: HF model folders (safetensors + config + tokenizer) in and out.

All conversion goes through TorchTitan's `Qwen3StateDictAdapter`, the same one a 30B-A3B run uses
to load `Qwen/Qwen3-30B-A3B-Base`, so the tiny model exercises the real mapping (per-expert HF
tensors <-> TorchTitan's grouped `w1_EFD / w2_EDF / w3_EFD`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from minirl.disk import atomic
from minirl.errors import UsageError
from minirl.models.shapes import ModelShape, hf_config_dict
from minirl.models.titan import titan_config
from minirl.train.lora import adapted

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def adapter(shape: ModelShape):
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(titan_config(shape), None)


def titan_to_hf(shape: ModelShape, titan_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TorchTitan state dict -> HF names (experts split per expert). Tensors are not copied."""
    return adapter(shape).to_hf(titan_sd)


def hf_to_titan(shape: ModelShape, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return adapter(shape).from_hf(dict(hf_sd))


def save_hf_folder(
    out: Path,
    shape: ModelShape,
    titan_sd: dict[str, torch.Tensor],
    *,
    tokenizer_dir: Path,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write a self-contained HF folder (loadable by transformers and vLLM) from TorchTitan weights:
    safetensors (sharded with an index above `max_shard_size`, by huggingface_hub), config,
    generation config and the tokenizer files. Written beside `out` and renamed into place: a
    crash never leaves a half folder that looks whole."""
    from huggingface_hub import save_torch_state_dict

    final, out = Path(out), _fresh(out)
    # per-expert tensors are views into the grouped ones: each gets storage of its own
    hf_sd = {k: v.detach().to(dtype).cpu().clone() for k, v in titan_to_hf(shape, titan_sd).items()}
    save_torch_state_dict(hf_sd, out, max_shard_size=max_shard_size)
    for f in out.glob("*.safetensors"):  # written through a private temporary file (0600): as the folder's others
        f.chmod(0o666 & ~atomic.umask())
    return _finish(out, final, shape, tokenizer_dir=tokenizer_dir, dtype=dtype)


def write_hf_folder(out: Path, shape: ModelShape, buckets, *, tokenizer_dir: Path, dtype: torch.dtype) -> Path:
    """The same folder from a stream of HF-named buckets (rollout/sync.py's `hf_buckets`: whole decoder
    layers in `dtype`), each written as a safetensors shard as it comes and let go before the next is
    asked for: what is held at once is one bucket (and its copy in host memory), never the model (#80:
    the end of a 30B run gathered every weight on every GPU). One bucket: `model.safetensors`; more:
    `model-0000i-of-0000n.safetensors` with huggingface_hub's index."""
    from safetensors.torch import save_file

    final, out = Path(out), _fresh(out)
    weight_map, total, n = {}, 0, 0
    it = iter(buckets)
    while (bucket := next(it, None)) is not None:
        n += 1
        # host copies with storage of their own (per-expert tensors are views into the grouped ones)
        tensors = {k: v.detach().to("cpu", dtype, copy=True).contiguous() for k, v in bucket}
        del bucket  # the gathered tensors go before the next layer is gathered
        save_file(tensors, out / f"part-{n:05d}.safetensors", metadata={"format": "pt"})
        weight_map.update({k: n for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    names = {i: "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
    for i, name in names.items():
        (out / f"part-{i:05d}.safetensors").rename(out / name)
        (out / name).chmod(0o666 & ~atomic.umask())
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return _finish(out, final, shape, tokenizer_dir=tokenizer_dir, dtype=dtype)


def _fresh(final: Path) -> Path:
    """The empty folder beside `final` a folder is written in before it is renamed into place."""
    out = Path(final).with_name(Path(final).name + ".tmp")
    atomic.remove_dir(out)
    out.mkdir(parents=True)
    return out


def _finish(out: Path, final: Path, shape: ModelShape, *, tokenizer_dir: Path, dtype: torch.dtype) -> Path:
    """Config, generation config and tokenizer beside the weights, then the folder renamed into place."""
    ids = _special_ids(tokenizer_dir)
    cfg = hf_config_dict(shape, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"])
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in Path(tokenizer_dir).iterdir():  # tokenizer, chat template, generation config
        if f.is_file() and (f.name in TOKENIZER_FILES or f.suffix in (".jinja", ".txt", ".model", ".tiktoken")
                            or f.name in ("minirl_special_ids.json", "vocab.json", "merges.txt")):
            shutil.copy(f, out / f.name)
    if not (out / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(out)
    atomic.remove_dir(final)
    out.rename(final)
    return final


def _special_ids(folder: Path) -> dict[str, int | None]:
    """BOS/EOS/pad ids: the embedded tokenizer's own file, else the source model's config.json."""
    folder = Path(folder)
    if (folder / "minirl_special_ids.json").exists():
        return json.loads((folder / "minirl_special_ids.json").read_text())
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    return {"bos": cfg.get("bos_token_id"), "eos": cfg.get("eos_token_id"), "pad": cfg.get("pad_token_id")}


def load_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All safetensors shards of an HF folder, by HF name."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UsageError(f"no *.safetensors in {folder}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def peft_state(shape: ModelShape, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LoRA adapters by TorchTitan name (train/lora.py) under PEFT's names and layout: each adapted
    HF linear layer's `lora_A.weight` [r, in] and `lora_B.weight` [out, r], the grouped experts'
    split per expert (`mlp.experts.<e>.gate_proj`, ...), as the state-dict adapter splits the
    weights they adapt; prefixed `base_model.model.` as PEFT saves them."""
    to_hf = adapter(shape).to_hf
    out = {}
    for weight, pair in adapted(adapters).items():
        for part, name in zip(("lora_A", "lora_B"), pair):
            t = adapters[name]
            for hf_name, v in to_hf({weight: t}).items():
                key = f"base_model.model.{hf_name.removesuffix('.weight')}.{part}.weight"
                out[key] = v.reshape(t.shape[-2:]).contiguous()  # the adapter splits experts with a squeeze: rank 1 too
    return out


def save_peft_folder(out: Path, shape: ModelShape, adapters: dict[str, torch.Tensor], *, rank: int, alpha: float,
                     base_model: str) -> Path:
    """A PEFT LoRA adapter folder: adapter_model.safetensors and adapter_config.json, which
    `peft.PeftModel.from_pretrained(<base_model loaded by transformers>, out)` reads (and vLLM's
    LoRA serving)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.float32).cpu() for k, v in peft_state(shape, adapters).items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_model.safetensors").chmod(0o666 & ~atomic.umask())  # as save_hf_folder's: the folder's others
    modules = sorted({k.removesuffix(".lora_A.weight").rsplit(".", 1)[1] for k in state if k.endswith(".lora_A.weight")})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
              "lora_alpha": alpha, "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "init_lora_weights": True, "inference_mode": True}
    atomic.write_text(out / "adapter_config.json", json.dumps(config, indent=2))
    return out


def merge_peft_folder(adapter: Path, base: Path, out: Path) -> Path:
    """A PEFT LoRA adapter folder (`save_peft_folder`'s, or any with the same layout) merged onto
    its base HF folder: each adapted weight W + (lora_alpha / r) · B · A, computed in float32 and
    stored in the base's dtype, beside the base's config and tokenizer. Written aside and renamed:
    what `minirl eval` serves for an adapter (vLLM's own LoRA serving is not used)."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    adapter, base, final = Path(adapter), Path(base), Path(out)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("peft_type", "LORA") != "LORA":
        raise UsageError(f"{adapter}: only plain LoRA adapters are merged here (use_rslora and use_dora false)")
    scale = float(cfg["lora_alpha"]) / int(cfg["r"])
    weights = load_hf_weights(base)
    delta = load_file(str(adapter / "adapter_model.safetensors"))
    for key, a in delta.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
        if name not in weights:
            raise UsageError(f"{adapter} adapts {name}, which the base model {base} does not have")
        b = delta[key.replace(".lora_A.", ".lora_B.")]
        w = weights[name]
        weights[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    tmp = final.with_name(final.name + ".tmp")
    atomic.remove_dir(tmp)
    tmp.mkdir(parents=True)
    save_torch_state_dict({k: v.contiguous() for k, v in weights.items()}, tmp)
    for f in base.iterdir():  # config, generation config, tokenizer: the base's
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, tmp / f.name)
    atomic.remove_dir(final)
    os.replace(tmp, final)
    return final
