"""The example tokenizer: a byte-level BPE trained here, plus the real Qwen added tokens.

Training data is a built-in deterministic corpus (English, pseudo-words, digits, code,
whitespace runs, CJK, emoji, other scripts) so byte-level fallback and digit splitting are
exercised. The pre-tokenizer, normalizer and decoder are Qwen2's, which transformers'
``Qwen2Tokenizer`` rebuilds anyway from vocab + merges; ids therefore agree between
``tokenizers.Tokenizer.from_file`` and ``AutoTokenizer``.

Ids: 0..2999 BPE (256 byte symbols first), then ``SPECIAL_TOKENS`` in upstream order
(``<|endoftext|>`` = 3000 ... ``<|video_pad|>`` = 3013), then for Qwen3-VL ``<think>``,
``</think>`` (3014, 3015).

`gemma_tokenizer` is the Gemma 3 / Gemma 4 examples' tokenizer: a small BPE in Gemma's format
(spaces as ``▁``, byte fallback) with each family's special tokens at Gemma's ids.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer
from transformers import GemmaTokenizer

BPE_VOCAB_SIZE = 3000
# The pre-tokenizer regex of Qwen2/2.5/3 tokenizer.json (single digits, no prefix space).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Real Qwen2-VL order: ids follow the BPE vocab in exactly this order (151643.. upstream).
SPECIAL_TOKENS = tuple(
    f"<|{name}|>"
    for name in (
        "endoftext im_start im_end object_ref_start object_ref_end box_start box_end quad_start "
        "quad_end vision_start vision_end vision_pad image_pad video_pad"
    ).split()
)
QWEN3_EXTRA_TOKENS = ("<think>", "</think>")  # added, not special, as in Qwen3 tokenizers

_WORDS = (
    "the a an image video picture photo frame shows describe what where who how many is are was "
    "were cat dog bird car tree house street river mountain person people child table chair red "
    "green blue yellow black white left right top bottom center small large tall short answer "
    "question assistant user system helpful you I we they it this that there here and or but not "
    "with without on in under over between count color number text sign read write code function "
    "return value list dict string token model train data sample pack length sequence batch loss"
).split()
_MULTILINGUAL = (
    "这是一只猫。",
    "图片里有什么？",
    "请描述这个视频。",
    "你好，世界！",
    "一二三四五六七八九十",
    "これは犬です。",
    "写真を説明してください。",
    "안녕하세요 세계",
    "Привет, мир!",
    "Größe und Übermaß",
    "café déjà vu, naïve façade",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "emoji 😀🐱🚗🌳 ✨ ❤️ 👍🏽",
    "math ∑ ∫ √ π ≤ ≥ ≠ ∞",
    "ümlaut ñ ç ø å ß",
)
_CODE = (
    "def main(argv: list[str]) -> int:\n    return 0\n",
    "for i in range(10):\n\tprint(i * 2)\n",
    'if (x != null && y >= 3) { return "ok"; }',
    "SELECT id, name FROM users WHERE age > 21;",
    '{"role": "user", "content": [{"type": "image"}]}',
    "x = [1, 2, 3]; y = {'a': 1}  # comment",
    "    \n\n  trailing spaces   \r\n",
    "<b>bold</b> <br/> &amp; @user #tag $100 50% ^_^ ~/path/to/file.jpg",
)
_SYLLABLES = "ka ri to na mo le su vi de ga po lu en ar is on st th ch qu ex pl tr br".split()
_SUFFIXES = ("", "", "", "s", "ed", "ing", "ly", "er", "tion", "ness", "'s", "n't")


def _word(rng: random.Random) -> str:
    """A real word with a random suffix, or a pronounceable made-up word (vocab variety)."""
    if rng.random() < 0.6:
        word = rng.choice(_WORDS) + rng.choice(_SUFFIXES)
    else:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
    if rng.random() < 0.1:
        word = word.capitalize()
    elif rng.random() < 0.05:
        word = "".join(chr(0x4E00 + rng.randrange(800)) for _ in range(rng.randint(1, 4)))
    return word


def _corpus_lines(num_lines: int = 800, seed: int = 1234) -> list[str]:
    """A deterministic mix of English, numbers, punctuation, code and multilingual text."""
    rng = random.Random(seed)
    lines: list[str] = ["You are a helpful assistant.", "user", "assistant", "system"]
    lines += list(_MULTILINGUAL) + list(_CODE)
    while len(lines) < num_lines:
        words = [_word(rng) for _ in range(rng.randint(3, 16))]
        kind = rng.randrange(6)
        if kind == 0:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 100_000)))
        elif kind == 1:
            words.append(rng.choice(_MULTILINGUAL))
        elif kind == 2:
            words.insert(0, rng.choice(_CODE))
        text = " ".join(words)
        text = text[0].upper() + text[1:] + rng.choice((".", "?", "!", ":", ",", "...", "\n\n"))
        lines.append(text)
    return lines


def train_byte_level_bpe(
    split: str,
    corpus: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = (),
    unk_token: str | None = None,
) -> Tokenizer:
    """A byte-level BPE pre-tokenized by the ``split`` regex (as GLM-4, Tekken and Llama 3 split),
    trained on ``corpus``; ``special_tokens`` take ids 0.. Training is deterministic, so the example
    families' processor directories are the same bytes on every build."""
    tok = Tokenizer(models.BPE(unk_token=unk_token))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


@lru_cache(maxsize=1)
def _trained_bpe_json() -> str:
    """Train the byte-level BPE once per process; training is deterministic."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tokenizer.to_str()


def build_tokenizer(family: str) -> Tokenizer:
    """Trained BPE plus the Qwen added tokens, whose ids follow the BPE vocab."""
    tokenizer = Tokenizer.from_str(_trained_bpe_json())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if family == "qwen3_vl":
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_EXTRA_TOKENS])
    return tokenizer


def _added_token_entry(content: str, special: bool) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def tokenizer_config(family: str, first_added_id: int) -> dict[str, Any]:
    """Mirror of the real tokenizer_config.json (template lives in chat_template.jinja)."""
    added = [(t, True) for t in SPECIAL_TOKENS]
    if family == "qwen3_vl":
        added += [(t, False) for t in QWEN3_EXTRA_TOKENS]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(first_added_id + i): _added_token_entry(t, s) for i, (t, s) in enumerate(added)},
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        # Named model tokens: transformers 5 exposes them as tokenizer.image_token(_id) etc.
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
        "model_max_length": 262144 if family == "qwen3_vl" else 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _gemma_pipeline(tok: Tokenizer) -> None:
    """``GemmaTokenizer.__init__``'s normalizer and (no-op) pre-tokenizer."""
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)


def _gemma_vocab_and_merges(
    leading: Sequence[str], trailing: Sequence[str], corpus: Sequence[str], vocab_size: int
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train the small BPE, then lay ids out as Gemma does: ``leading`` specials, the byte-fallback
    tokens, the BPE, ``trailing`` (media) specials last."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    _gemma_pipeline(tok)
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=list(leading), show_progress=False)
    tok.train_from_iterator(list(corpus) * 10, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = {}
    for token in (*leading, *(f"<0x{b:02X}>" for b in range(256))):
        vocab.setdefault(token, len(vocab))
    for token, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    for token in trailing:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return vocab, [(a, b) for a, b in merges]


def gemma_tokenizer(
    *,
    leading: Sequence[str],
    media: Sequence[str],
    corpus: Sequence[str],
    named: dict[str, str],
    vocab_size: int = 900,
) -> GemmaTokenizer:
    """transformers' ``GemmaTokenizer`` over a BPE trained on ``corpus``: ``leading`` specials
    first, ``media`` specials last, all matched whole (never split by BPE); ``named`` are its
    ``extra_special_tokens`` (``image_token`` ...)."""
    vocab, merges = _gemma_vocab_and_merges(leading, media, corpus, vocab_size)
    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # pairs, as the tokenizers BPE model takes them
        add_bos_token=True,
        extra_special_tokens=named,
    )
    specials = (*leading, *media)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    return tokenizer
