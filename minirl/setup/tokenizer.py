"""The tiny model's character-level tokenizer, saved as a standard HF fast tokenizer.

One token per character, so a response of n characters is n tokens of work; special tokens are
<pad>, <bos> (unused by Qwen3, kept for completeness) and <eos>, which ends every response.

With `chat` (a tiny-model recipe with data.chat_template = true) it speaks Qwen3's chat format: the
printable ASCII characters, Qwen3's special tokens as single symbols after them (`<|im_end|>` the EOS
that ends a turn, `<tool_call>` … `</think>` added tokens as in Qwen3's vocabulary), and a chat template
of Qwen3's shape (chat_template.jinja beside this module, written here: see its header).
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
# Qwen3's chat tokens (special: turn markers; not special: the tags, as Qwen3's tokenizer config has them)
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
CHAT_VOCAB = len(SPECIALS) + len(CHARS + MORE_CHARS) + len(CHAT_SPECIALS) + len(CHAT_TAGS)  # every id a token
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")


def vocab(vocab_size: int) -> dict[str, int]:
    chars = (CHARS + MORE_CHARS)[: vocab_size - len(SPECIALS)]
    return {tok: i for i, tok in enumerate((*SPECIALS, *chars))}


def build_tokenizer(out: Path, vocab_size: int, max_len: int, *, chat: bool = False) -> Path:
    """Write tokenizer.json (+ config files) for a char-level WordLevel tokenizer into `out`, its
    `model_max_length` the model's context (what `transformers` truncates and warns at). `chat`: Qwen3's
    chat tokens and a template of its shape (`vocab_size` CHAT_VOCAB)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    v = vocab(WIDE_VOCAB if chat else vocab_size)
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token="#"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # any character, newlines too
    tok.decoder = decoders.Fuse()
    if chat:  # after the characters, in this order: their ids are len(v), len(v) + 1, …
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TAGS])
        if tok.get_vocab_size() != vocab_size:
            raise ValueError(f"a chat tokenizer has {tok.get_vocab_size()} tokens, the model {vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<|im_end|>" if chat else "<eos>",
        unk_token="#",
    )
    fast.model_max_length = max_len
    if chat:
        fast.chat_template = CHAT_TEMPLATE.read_text()
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    ids = {"pad": v["<pad>"], "bos": v["<bos>"], "eos": fast.eos_token_id}
    (out / "minirl_special_ids.json").write_text(json.dumps(ids))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]})
    )
    return out
