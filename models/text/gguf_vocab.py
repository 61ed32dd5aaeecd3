"""GGUF vocabularies (llama.cpp's ``tokenizer.ggml.*`` keys) rebuilt as ``tokenizers`` objects: byte-level BPE,
SentencePiece BPE and Unigram, and BERT's WordPiece (see :mod:`mlx_engine.models.text.tokenizer` for the rules followed
and where they differ)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from mlx_engine.errors import WeightsError

# GGUF token types (gguf.TokenType / llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: Control tokens that end generation, by text: llama.cpp's end-of-generation list (``llama_vocab::impl::load``).
EOG_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

# Pre-tokenizer splits of byte-level vocabularies by ``tokenizer.ggml.pre``. Regexes as in transformers'
# GGUF_PRE_TOKENIZER_SPLITS (themselves from the models' tokenizer.json files) and llama.cpp's llama-vocab.cpp.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
#: llama.cpp pre-types whose first regex is ``\p{N}`` followed by GPT-2's: digits split one by one.
_DIGIT_SPLIT_PRES = frozenset({"starcoder", "smollm", "refact", "codeshell", "command-r", "exaone", "minerva"})

GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n", "gemma4", "gemma-embedding"})


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``openai/gpt-2/src/encoder.py``): printable Latin-1 bytes map to
    themselves, the other 68 to ``chr(256 + n)``."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


# ---- metadata helpers --------------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """NumPy scalars and arrays to Python values (metadata may come from any reader)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def meta(md: Mapping[str, Any], key: str, default: Any = None) -> Any:
    return _plain(md[key]) if key in md and md[key] is not None else default


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary with scores: every split of a token into two vocabulary tokens, best
    token first. Reproduces ``transformers.tokenization_utils_base.generate_merges(vocab, vocab_scores)``: tokens in
    ``scores`` order, the pairs of one token ordered by the ids of their pieces, then a stable sort by
    (score, len(left), len(right)), highest first.

    Within one token the left lengths differ, so the result is: tokens by score (highest first, ties in ``scores``
    order), the pairs of a token by left length (longest first), and tokens of equal score interleaved by
    (left length, right length)."""
    items = sorted(((t, s) for t, s in scores.items() if len(t) > 1), key=lambda x: -x[1])  # stable
    out: list[tuple[str, str]] = []
    group: list[tuple[int, int, int, str, str]] = []

    def splits(token: str):
        n = len(token)
        for k in range(n - 1, 0, -1):
            left = token[:k]
            if left in vocab:
                right = token[k:]
                if right in vocab:
                    yield left, right

    i, m = 0, len(items)
    while i < m:
        j = i + 1
        score = items[i][1]
        while j < m and items[j][1] == score:
            j += 1
        if j == i + 1:
            out.extend(splits(items[i][0]))
        else:  # several tokens share a score: interleave by (len(left), len(right)), highest first
            group.clear()
            for seq in range(i, j):
                for left, right in splits(items[seq][0]):
                    group.append((-len(left), -len(right), seq, left, right))
            group.sort()
            out.extend((g[3], g[4]) for g in group)
        i = j
    return out


def _file_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) == 2:
            out.append((parts[0], parts[1]))
    return out


# ---- building from GGUF ------------------------------------------------------------------------------------------

def build_byte_level(tokens: list[str], types: list[int], md: Mapping[str, Any]
                      ) -> tuple[_HFTokenizer, dict[str, int]]:
    """Byte-level BPE (``tokenizer.ggml.model == "gpt2"``): transformers' ``byte_level_tokenizer`` + GPT2Tokenizer
    (BPE without unk, ``ByteLevel`` pre-tokenizer and decoder) + ``set_split_regex``."""
    alphabet = set(CHAR_TO_BYTE)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if types[i] in (CONTROL, USER_DEFINED) or set(t) <= alphabet:
            vocab[t] = i
        else:
            vocab["".join(BYTE_TO_CHAR[b] for b in t.encode("utf-8"))] = i
    merges = _file_merges(meta(md, "tokenizer.ggml.merges", []))
    tk = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    pre = str(meta(md, "tokenizer.ggml.pre", "default"))
    if pre in _PRE_SPLITS:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_SPLIT_PRES:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:  # "default", "gpt-2" and the rest: GPT-2's own regex
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return tk, vocab


def build_sentencepiece(tokens: list[str], types: list[int], md: Mapping[str, Any], gemma: bool
                         ) -> tuple[_HFTokenizer, dict[str, int]]:
    """SentencePiece-style BPE with byte fallback (``tokenizer.ggml.model == "llama"``, and Gemma 4's ``"gemma4"``).

    Gemma (transformers' ``gemma_tokenizer`` + ``GemmaTokenizer``): tokens made only of whitespace with a space in
    them are respelled with ``▁``; merges from the file for ``"gemma4"`` (its converter writes tokenizer.json's),
    else derived from the vocabulary ordered by file position; spaces become ``▁`` in a normalizer; nothing is
    prepended. Others (``sentencepiece_tokenizer`` + ``LlamaTokenizer``): merges from the
    file, else derived from the scores; a ``Metaspace`` pre-tokenizer prepends ``▁`` to the text's start when
    ``add_space_prefix`` (default true), and the decoder strips it again.
    """
    if gemma:
        spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        merges = (_file_merges(meta(md, "tokenizer.ggml.merges", [])) if meta(md, "tokenizer.ggml.model") == "gemma4"
                  else _merges_from_vocab(vocab, {t: -i for i, t in enumerate(spelled)}))
        unk = tokens[int(meta(md, "tokenizer.ggml.unknown_token_id", 3))] if tokens else "<unk>"
        tk = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, dropout=None,
                                     byte_fallback=True))
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tk, vocab
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in md:
        merges = _file_merges(meta(md, "tokenizer.ggml.merges", []))
    else:
        scores = meta(md, "tokenizer.ggml.scores")
        if scores is None:
            raise WeightsError("GGUF tokenizer 'llama' has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
        merges = _merges_from_vocab(vocab, dict(zip(tokens, (float(s) for s in scores))))
    tk = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = bool(meta(md, "tokenizer.ggml.add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return tk, vocab


def build_wordpiece(tokens: list[str], types: list[int], md: Mapping[str, Any]
                    ) -> tuple[_HFTokenizer, dict[str, int]]:
    """WordPiece (``tokenizer.ggml.model == "bert"``), as llama.cpp's WPM tokenizer reads it (``llama-vocab.cpp``).

    llama.cpp's converter (``conversion/bert.py``) respells the vocabulary with a phantom space: a word-initial piece
    ``w`` becomes ``\u2581w`` and a continuation ``##w`` becomes ``w``; control tokens stay. This undoes it and builds
    transformers' ``BertTokenizerFast`` pipeline: ``BertNormalizer`` (``tokenizer.ggml.normalizer.lowercase``, default
    false, and ``strip_accents``, default the lowercase flag: llama.cpp's defaults), ``BertPreTokenizer``, WordPiece
    with ``tokenizer.ggml.unknown_token_id`` (default 100), and a post-processor that puts the BOS (BERT's [CLS],
    default 101) first and the separator ([SEP], default 102) last, as llama.cpp does for every WPM vocabulary."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        word = t if types[i] == CONTROL else (t[1:] if t.startswith("\u2581") else "##" + t)
        vocab.setdefault(word, i)
    unk = int(meta(md, "tokenizer.ggml.unknown_token_id", 100))
    if not 0 <= unk < len(tokens):
        raise WeightsError(f"tokenizer.ggml.unknown_token_id {unk} is out of the vocabulary of {len(tokens)}")
    tk = _HFTokenizer(models.WordPiece(vocab=vocab, unk_token=tokens[unk], continuing_subword_prefix="##"))
    # llama.cpp lowercases when the file does not say (llama_vocab's normalizer_options: lowercase = true); older
    # files such as nomic-embed-text's carry no key
    lower = bool(meta(md, "tokenizer.ggml.normalizer.lowercase", True))
    strip = bool(meta(md, "tokenizer.ggml.normalizer.strip_accents", lower))
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=strip,
                                               lowercase=lower)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    # llama.cpp's WPM tokenizer adds both whatever the add_bos / add_sep keys say (llama_vocab::impl::tokenize)
    first = [int(meta(md, "tokenizer.ggml.bos_token_id", 101))]
    last = [int(meta(md, "tokenizer.ggml.seperator_token_id", 102))]
    if any(not 0 <= i < len(tokens) for i in first + last):
        raise WeightsError("the GGUF's BOS or separator token id is out of its vocabulary")
    tk.post_processor = processors.TemplateProcessing(
        single=[tokens[i] for i in first] + ["$A"] + [tokens[i] for i in last],
        special_tokens=[(tokens[i], i) for i in first + last])
    return tk, vocab


# ---- decoding plans ----------------------------------------------------------------------------------------------


def build_unigram(tokens: list[str], types: list[int], md: Mapping[str, Any]) -> tuple[_HFTokenizer, dict[str, int]]:
    """SentencePiece Unigram (``tokenizer.ggml.model == "t5"``: T5's and XLM-RoBERTa's vocabularies, bge-m3's), as
    llama.cpp's UGM tokenizer reads it (``llm_tokenizer_ugm_session`` in ``llama-vocab.cpp``) and transformers'
    ``SpmConverter`` builds it: the SentencePiece normalizer's precompiled character map
    (``tokenizer.ggml.precompiled_charsmap``), runs of spaces made one (``remove_extra_whitespaces``, default true),
    a ``▁`` put before every word (``add_space_prefix``, default true), then the segmentation of highest total score
    (``tokenizer.ggml.scores``: Viterbi) with ``tokenizer.ggml.unknown_token_id`` (llama.cpp's default 2) for what no
    piece covers.

    Raises:
        WeightsError: no scores, or a count that disagrees with the tokens; an unknown id outside the vocabulary.
    """
    scores = meta(md, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise WeightsError("GGUF tokenizer 't5' needs tokenizer.ggml.scores, one per token")
    unk = int(meta(md, "tokenizer.ggml.unknown_token_id", 2))
    if not 0 <= unk < len(tokens):
        raise WeightsError(f"tokenizer.ggml.unknown_token_id {unk} is out of the vocabulary of {len(tokens)}")
    tk = _HFTokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores)], unk_id=unk,
                                     byte_fallback=False))
    steps = []
    charsmap = meta(md, "tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap):  # a GGUF array of int8: the map's raw bytes
        steps.append(normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap)))
    if bool(meta(md, "tokenizer.ggml.remove_extra_whitespaces", True)):
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    tk.normalizer = normalizers.Sequence(steps)
    scheme = "always" if bool(meta(md, "tokenizer.ggml.add_space_prefix", True)) else "never"
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)])
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    return tk, {t: i for i, t in enumerate(tokens)}
