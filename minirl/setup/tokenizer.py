"""The tiny model's character-level tokenizer, saved as a standard HF fast tokenizer.

One token per character, so a response of n characters is n tokens of work; special tokens are
<pad>, <bos> (unused by Qwen3, kept for completeness) and <eos>, which ends every response.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789+-*=,;:()?# abcdefg"  # 29 chars + 3 specials = the tiny vocab of 32
# the rest of printable ASCII, after the embedded tasks' 29 so that their ids never move: a vocab of
# 128 reads any English task text (reasoning-gym's questions: minirl/data/gym.py); any other
# character is the unknown token "#"
MORE_CHARS = "".join(c for c in map(chr, range(32, 127)) if c not in CHARS) + "\n"
WIDE_VOCAB = 128


def vocab(vocab_size: int) -> dict[str, int]:
    chars = (CHARS + MORE_CHARS)[: vocab_size - len(SPECIALS)]
    return {tok: i for i, tok in enumerate((*SPECIALS, *chars))}


def build_tokenizer(out: Path, vocab_size: int, max_len: int) -> Path:
    """Write tokenizer.json (+ config files) for a char-level WordLevel tokenizer into `out`, its
    `model_max_length` the model's context (what `transformers` truncates and warns at)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    v = vocab(vocab_size)
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token="#"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # any character, newlines too
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="#",
    )
    fast.model_max_length = max_len
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    ids = {"pad": v["<pad>"], "bos": v["<bos>"], "eos": v["<eos>"]}
    (out / "minirl_special_ids.json").write_text(json.dumps(ids))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]})
    )
    return out
