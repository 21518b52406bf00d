"""A small byte-level BPE tokenizer built in code, in which every word of a task's vocabulary is one token.

Tasks built in code write their texts as words separated by single spaces. The tokenizer is trained on those
words so that each `` word`` (with its leading space, as it appears after the first word of a text) is a
single token, and it pre-tokenizes exactly like Qwen2's tokenizer (same split regex, then byte level).
That matters: ``AutoTokenizer`` loads any tokenizer next to a ``qwen2`` config as ``Qwen2Tokenizer``, which
keeps the vocabulary and merges of ``tokenizer.json`` but rebuilds the Qwen2 pre-tokenizer; a tokenizer with
any other pre-tokenizer (word level, whitespace split) would silently encode differently once saved. Under
Qwen2's regex a token cannot mix letters and digits (digits are split one by one), so vocabulary words that
must be one token are made of letters (a tag ``a = 7`` is the word ``aSeven``), optionally after one
punctuation character.

EOS is ``<|im_end|>`` and PAD ``<|endoftext|>`` (the Qwen2.5 chat convention); all 256 byte symbols are in the
vocabulary, so any text encodes and ``decode(encode(text)) == text``.
"""
from __future__ import annotations

from typing import Iterable

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)
"""The first ids: pad 0, eos 1."""
_ENOUGH_MERGES = 1 << 16
"""BPE training stops when every training word is one token, long before this vocabulary size."""


def build_word_tokenizer(words: Iterable[str], extra_texts: Iterable[str] = ()):
    """A ``PreTrainedTokenizerFast`` in which `` word`` is one token for every ``word`` of ``words``.

    ``extra_texts`` are also trained on (their pre-tokens, e.g. ``\\boxed``, become tokens too). Raises
    ``ValueError`` if some word cannot be a single token under Qwen2's pre-tokenizer (letters mixed with digits
    or spaces). Deterministic: the same words give the same ids.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    words = list(dict.fromkeys(words))
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_ENOUGH_MERGES, min_frequency=1, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" " + w for w in words] + list(extra_texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   clean_up_tokenization_spaces=False, model_max_length=1 << 20)
    split = [w for w in words if len(fast(" " + w, add_special_tokens=False)["input_ids"]) != 1]
    if split:
        raise ValueError(f"build_word_tokenizer: these words cannot be single tokens under Qwen2's pre-tokenizer "
                         f"(use letters, optionally after one punctuation character): {split[:5]}")
    return fast
