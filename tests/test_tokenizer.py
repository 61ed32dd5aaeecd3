"""Tokenizer tests: parity with transformers (the oracle) on real GGUFs, on HF folders, and on small synthetic GGUF
vocabularies; round trips; special tokens; chat templates; the streaming detokenizer.

The oracle for SmolLM2 needs a word: transformers' GGUF conversion has no entry for llama.cpp's ``smollm`` pre-type and
falls back to GPT-2's regex, while llama.cpp (and SmolLM2's own ``tokenizer.json``) split every ``\\p{N}`` character
first. The two disagree on whitespace before digits and on non-ASCII numerals (``" a  12345"``, ``"½"``). We follow
llama.cpp; the tests check exact parity with transformers on strings without numerals, and on every string with a
llama.cpp-style reference built from transformers' own BPE model (``_llama_cpp_smollm_ids``).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.models.text.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE
from mlx_engine.models.text.tokenizer import Tokenizer, bytes_to_unicode

# ---- test strings --------------------------------------------------------------------------------------------------

FRAGMENTS = [
    "", " ", "  ", "\n", "\t", "a", " a", "a ", "Hello", " Hello", "Hello world", "Hello, world!",
    "The quick brown fox jumps over the lazy dog.", "I'm sure you'll see they've done it, haven't they?",
    "   leading spaces", "trailing spaces   ", "multiple     spaces     inside", "tabs\tand\t\ttabs",
    "\n\n\nthree newlines", "windows\r\nline\r\nendings", "mixed \n \t \r\n whitespace  \n\n  ",
    "Grüße aus München, schöne Straße", "Ça va? Très bien, merci. Où est l'hôpital?", "¿Dónde está el baño? ¡Olé!",
    "Привет, как дела? Всё хорошо.", "Καλημέρα κόσμε", "مرحبا بالعالم، كيف حالك؟", "שלום עולם",
    "नमस्ते दुनिया, आप कैसे हैं?", "สวัสดีชาวโลก", "你好，世界！今天天气很好。", "日本語のテキスト、カタカナとひらがな。",
    "안녕하세요 세계", "Tiếng Việt có dấu: Xin chào thế giới", "İstanbul ılık, ĞÜŞİÖÇ", "Ærøskøbing Åland ÞÐ",
    "emoji 😀😃😄 done", "👍🏽 thumbs with skin tone", "family 👨‍👩‍👧‍👦 zwj", "rainbow flag 🏳️‍🌈 and 🇫🇷🇯🇵 flags",
    "keycap 1️⃣ #️⃣ and ❤️ heart", "🧑🏿‍💻 technologist", "🤖🦾🧠", "a😀b😃c", "😀",
    "def f(x):\n\treturn x * 2\n", "for (int i = 0; i < n; ++i) {\n    sum += a[i];\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}', "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "SELECT * FROM users WHERE id = 42;", "x = [i**2 for i in range(10) if i % 2 == 0]  # squares",
    "    indented\n        more\n    back", "#include <stdio.h>\nint main(void) { return 0; }",
    "12345", "3.14159265358979", "1,000,000.00", "2024-01-01T12:00:00Z", "x 123 4567 y", "a1b22c333", " a  12345",
    "superscripts ²³ and ½ ¾", "Arabic-Indic ٣٤٥ and Devanagari १२३", "Roman Ⅻ Ⅳ", "①②③",
    "<|im_start|>user\nHi there<|im_end|>\n", "<|im_start|>assistant\n", "<|endoftext|>", "text<|im_end|>more",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n", "<bos>", "a<eos>b", "<|im_start", "im_end|>",
    "<start_of_turn", "< |im_start| >", "<pad><unk>", "\u200b zero width", "\ufeffBOM", "combining e\u0301 a\u0308",
    "nul\x00byte", "del\x7fchar", "€ £ ¥ ₹ ₿", "math: ∀x∈ℝ, x²≥0 ⇒ √x²=|x|", "quotes “smart” ‘single’ «guillemets»",
    "ellipsis… and — em dash – en dash", "ﬁ ligature and ｆｕｌｌｗｉｄｔｈ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙", "𓀀 hieroglyph ꙮ",
]

#: Checked for id parity only: a SentencePiece vocabulary decodes its space marker "▁" as a space, and a written
#: "<0x41>" can become the byte token it spells; neither round-trips (in transformers either).
PARITY_ONLY = ["a▁b", "▁leading marker", "<0x41> byte spelled", "▁▁▁"]

_SEPARATORS = ["", " ", "  ", "\n", "\n\n", "\t", " \n", "   ", "\r\n"]
_RANGES = [(0x20, 0x7E), (0xA0, 0x17F), (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F),
           (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x1F900, 0x1F9FF)]


def make_strings(n_random: int = 300, seed: int = 1234) -> list[str]:
    """The fixed fragments plus ``n_random`` seeded mixtures: 1 to 5 fragments joined by whitespace runs, a fifth of
    them random code points from several scripts and emoji blocks."""
    rng = random.Random(seed)
    out = list(FRAGMENTS)
    for _ in range(n_random):
        parts = []
        for _ in range(rng.randint(1, 5)):
            if rng.random() < 0.2:
                lo, hi = rng.choice(_RANGES)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
            else:
                parts.append(rng.choice(FRAGMENTS))
            parts.append(rng.choice(_SEPARATORS))
        out.append("".join(parts))
    return out


STRINGS = make_strings()


def _regex():
    """The ``regex`` module (Unicode classes such as ``\\p{N}``; a transformers dependency)."""
    return pytest.importorskip("regex")

# ---- fixtures ------------------------------------------------------------------------------------------------------


def _metadata(path: Path):
    """The file's metadata as the engine reads it (``mlx_engine.weights`` ``Metadata``: NumPy arrays for numeric
    arrays), which is what ``Tokenizer.from_gguf`` gets at load time."""
    from mlx_engine.weights import open_weights

    with open_weights(path) as wf:
        return wf.metadata


@pytest.fixture(scope="session")
def smollm2_md(smollm2_gguf):
    return _metadata(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_md(gemma3_gguf):
    return _metadata(gemma3_gguf)


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_md):
    return Tokenizer.from_gguf(smollm2_md)


@pytest.fixture(scope="session")
def gemma3_tok(gemma3_md):
    return Tokenizer.from_gguf(gemma3_md)


def _transformers_from_gguf(path: Path):
    pytest.importorskip("torch")  # transformers' GGUF reader imports it
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smollm2_ref(smollm2_gguf):
    return _transformers_from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_ref(gemma3_gguf):
    return _transformers_from_gguf(gemma3_gguf)


# ---- the llama.cpp-style reference for SmolLM2 ---------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_B2U = bytes_to_unicode()


def _llama_cpp_smollm_ids(ref, md: dict, text: str) -> list[int]:
    """llama.cpp's tokenization for pre-type ``smollm`` (``llama-vocab.cpp``): control tokens matched whole, then the
    regexes ``\\p{N}`` and GPT-2's applied in turn, each piece byte-level encoded and run through transformers' BPE
    model (same vocabulary and merges as the GGUF)."""
    regex = _regex()
    tokens, types = md["tokenizer.ggml.tokens"], list(md["tokenizer.ggml.token_type"])
    control = sorted((t for t, ty in zip(tokens, types) if ty == 3), key=len, reverse=True)
    model = ref.backend_tokenizer.model
    ids: list[int] = []
    for frag in regex.split("(" + "|".join(regex.escape(c) for c in control) + ")", text):
        if not frag:
            continue
        if frag in control:
            ids.append(tokens.index(frag))
            continue
        for piece in regex.split(r"(\p{N})", frag):
            for word in regex.findall(_GPT2_SPLIT, piece):
                ids.extend(t.id for t in model.tokenize("".join(_B2U[b] for b in word.encode("utf-8"))))
    return ids


# ---- real GGUFs: structure and ids -----------------------------------------------------------------------------


def _tokenizer_json(backend) -> dict:
    return json.loads(backend.to_str())


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_gguf_tokenizer_is_built_as_transformers_builds_it(which, request):
    ours = request.getfixturevalue(f"{which}_tok")
    ref = request.getfixturevalue(f"{which}_ref")
    a, b = _tokenizer_json(ours.backend), _tokenizer_json(ref.backend_tokenizer)
    assert a["model"]["vocab"] == b["model"]["vocab"]
    assert a["model"]["merges"] == b["model"]["merges"]
    for k in ("type", "unk_token", "fuse_unk", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
        assert a["model"].get(k) == b["model"].get(k), k
    assert a["normalizer"] == b["normalizer"]
    assert a["decoder"] == b["decoder"]
    added = {(t["id"], t["content"], t["special"], t["normalized"], t["lstrip"], t["rstrip"]) for t in a["added_tokens"]}
    ref_added = {(t["id"], t["content"], t["special"], t["normalized"], t["lstrip"], t["rstrip"])
                 for t in b["added_tokens"]}
    assert added == ref_added
    if which == "gemma3":
        assert a["pre_tokenizer"] == b["pre_tokenizer"]
    else:  # llama.cpp's "smollm" pre-type: digits split one by one before GPT-2's regex (see the module docstring)
        assert a["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
        assert b["pre_tokenizer"]["type"] == "ByteLevel"


def test_gemma3_ids_match_transformers(gemma3_tok, gemma3_ref):
    assert len(STRINGS) > 300
    for s in STRINGS + PARITY_ONLY:
        ids = gemma3_tok.encode(s, add_bos=False)
        assert ids == gemma3_ref.encode(s, add_special_tokens=False), repr(s)
        if not s.startswith("<bos>"):  # we never double BOS; transformers does
            assert gemma3_tok.encode(s) == gemma3_ref.encode(s) == [2] + ids, repr(s)


def test_smollm2_ids_match_transformers(smollm2_tok, smollm2_ref, smollm2_md):
    checked = 0
    for s in STRINGS + PARITY_ONLY:
        ids = smollm2_tok.encode(s)  # SmolLM2 adds no BOS
        assert ids == smollm2_tok.encode(s, add_bos=False)
        assert ids == _llama_cpp_smollm_ids(smollm2_ref, smollm2_md, s), repr(s)
        if not _regex().search(r"\p{N}", s):
            assert ids == smollm2_ref.encode(s), repr(s)
            checked += 1
    assert checked > 200


def test_smollm2_splits_numerals_as_llama_cpp_does(smollm2_tok, smollm2_ref):
    """The known difference from transformers' GGUF conversion (which lacks the ``smollm`` pre-type)."""
    s = " a  12345"
    ours = smollm2_tok.encode(s)
    assert smollm2_tok.backend.id_to_token(ours[1]) == "ĠĠ"  # the spaces before the digits stay one piece
    assert ours[2:] == [smollm2_tok.token_to_id(d) for d in "12345"]
    # transformers: GPT-2's regex keeps " 12345" together, so the two spaces come out as "Ġ", "Ġ"
    assert smollm2_ref.convert_ids_to_tokens(smollm2_ref.encode(s))[1:3] == ["Ġ", "Ġ"]


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_decode_round_trips_and_matches_transformers(which, request):
    tok = request.getfixturevalue(f"{which}_tok")
    ref = request.getfixturevalue(f"{which}_ref")
    for s in STRINGS:
        ids = tok.encode(s, add_bos=False)
        assert tok.decode(ids) == s, repr(s)
        assert tok.decode(ids) == ref.decode(ids), repr(s)
        assert tok.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True), repr(s)


def test_special_tokens_and_end_ids(smollm2_tok, gemma3_tok):
    t = smollm2_tok
    assert t.vocab_size == 49152 and t.bos_id == 1 and not t.add_bos
    assert t.eos_ids == {0, 2}  # <|im_end|> (eos_token_id) and <|endoftext|> (llama.cpp's end-of-generation list)
    assert t.bos_token == "<|im_start|>" and t.eos_token == "<|im_end|>"
    assert t.encode("<|im_start|>user\nhi<|im_end|>")[:1] == [1] and t.encode("x<|im_end|>")[-1] == 2
    assert t.is_special(1) and t.is_special(2) and not t.is_special(t.encode("hi")[0])
    assert t.decode(t.encode("<|im_start|>user\nhi<|im_end|>"), skip_special=True) == "user\nhi"
    g = gemma3_tok
    assert g.vocab_size == 262144 and g.bos_id == 2 and g.add_bos
    assert g.eos_ids == {1, 106}  # <eos> and <end_of_turn>
    assert g.encode("<start_of_turn>user\n", add_bos=False) == [105, 2364, 107]
    assert g.encode("hi")[0] == 2 and g.encode("<bos>hi") == g.encode("hi")  # BOS once
    assert g.encode("hi", add_bos=False)[0] != 2 and g.encode("hi", add_bos=True)[0] == 2
    assert g.is_special(105) and g.is_special(2) and not g.is_special(107)  # "\n" is a user-defined token


def test_from_folder_matches_transformers(smollm2_ref, gemma3_ref, smollm2_tok, gemma3_tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    for name, ref, gguf_tok in (("smollm2", smollm2_ref, smollm2_tok), ("gemma3", gemma3_ref, gemma3_tok)):
        folder = tmp_path / name
        ref.save_pretrained(str(folder))
        assert (folder / "tokenizer.json").is_file()
        ours = Tokenizer.from_folder(folder)
        # transformers reading the folder back; for Gemma (4 s to reload 262k tokens) the tokenizer that wrote it
        oracle = transformers.AutoTokenizer.from_pretrained(str(folder)) if name == "smollm2" else ref
        assert ours.bos_id == gguf_tok.bos_id and ours.add_bos == gguf_tok.add_bos
        assert ours.eos_ids == gguf_tok.eos_ids
        assert ours.chat_template == gguf_tok.chat_template
        assert ours.vocab_size == gguf_tok.vocab_size
        for s in STRINGS:
            ids = ours.encode(s, add_bos=False)
            assert ids == oracle.encode(s, add_special_tokens=False), (name, s)
            assert ours.decode(ids) == oracle.decode(ids), (name, s)
            if not s.startswith(str(oracle.bos_token)):
                assert ours.encode(s) == oracle.encode(s), (name, s)


def test_from_folder_reads_generation_config_and_template_file(smollm2_ref, tmp_path):
    smollm2_ref.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 5}))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    t = Tokenizer.from_folder(tmp_path)
    assert t.eos_ids == {0, 2, 5, 7} and t.architecture == "llama"
    assert t.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    assert t.encode("hi")[0] == t.bos_id == 1


def test_from_folder_errors(tmp_path):
    with pytest.raises(WeightsError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(WeightsError):
        Tokenizer.from_folder(tmp_path)


# ---- synthetic GGUF vocabularies (every code path, against transformers' own GGUF builders) ------------------------

_BPE_MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r", "Ġ Ġ", "o n", "Ġt he", "ĠĠ ĠĠ", "Ġ 1", "1 2", "l l", "e ll",
               "h ell", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ċ Ċ", "Ġ Ċ", "' s", "Ġ i", "Ġi n", "Ã ©"]


def _byte_level_md(pre: str) -> dict:
    chars = [bytes_to_unicode()[b] for b in range(256)]
    merged = []
    for m in _BPE_MERGES:
        t = m.replace(" ", "")
        if t not in merged:
            merged.append(t)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokens = specials + chars + merged + ["<think>"]
    types = [3] * len(specials) + [1] * (len(chars) + len(merged)) + [4]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": _BPE_MERGES,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 4, "tokenizer.ggml.add_bos_token": True}


def _sentencepiece_md(add_space_prefix: bool | None = None, arch: str = "llama") -> dict:
    pieces = ["▁", "a", "b", "c", "h", "e", "l", "o", "w", "r", "d", "▁a", "ab", "▁ab", "bc", "▁abc", "he", "ll",
              "llo", "hello", "▁hello", "▁w", "or", "▁wor", "▁world", "▁▁", "▁▁▁▁", "ca", "cab"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<tool>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))] + [0.0]
    md = {"general.architecture": arch, "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
          "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    if add_space_prefix is not None:
        md["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return md


def _transformers_builder(md: dict):
    pytest.importorskip("torch")
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    d = {"tokenizer_type": md["tokenizer.ggml.model"], "pre_tokenizer_type": md.get("tokenizer.ggml.pre"),
         "tokens": md["tokenizer.ggml.tokens"], "token_type": md["tokenizer.ggml.token_type"]}
    for k in ("scores", "merges"):
        if f"tokenizer.ggml.{k}" in md:
            d[k] = md[f"tokenizer.ggml.{k}"]
    backend, _ = mapping.convert_gguf_tokenizer(md["general.architecture"], d)
    # transformers' tokenizer classes add their default special tokens (GPT-2's <|endoftext|>, Gemma's <bos>...) when
    # the vocabulary lacks them, as new ids: strings that spell those are not comparable.
    n = len(md["tokenizer.ggml.tokens"])
    extra = [t.content for i, t in backend.get_added_tokens_decoder().items() if i >= n]
    return backend, extra


_SYNTH = ["hello world", "the thing in the world's", "  two  spaces", "\n\n x \n", "12 123 1234", "é café",
          "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "<think>why</think>", "ab abc cab bca",
          " hello", "helloworld", "x😀y", "\tabc  ", "<s>a</s>", "<tool>", "abc<tool>abc"]


@pytest.mark.parametrize("pre", ["default", "gpt-2", "llama-bpe", "qwen2", "gpt-4o", "tekken", "qwen35"])
def test_byte_level_pre_types_match_transformers(pre):
    md = _byte_level_md(pre)
    ours = Tokenizer.from_gguf(md)
    ref, extra = _transformers_builder(md)
    for s in _SYNTH + STRINGS[:120]:
        if any(e in s for e in extra):
            continue
        ids = ours.encode(s, add_bos=False)
        assert ids == ref.encode(s, add_special_tokens=False).ids, (pre, s)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False) == s, (pre, s)
    assert ours.bos_id == 0 and ours.add_bos and ours.encode("hi")[0] == 0
    assert ours.eos_ids == {1, 4}  # eos_token_id and <|end_of_text|>
    assert not ours.has_chat_template
    assert ours.apply_chat_template([{"role": "user", "content": " hi "}]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ours.encode("<think>", add_bos=False) == [len(md["tokenizer.ggml.tokens"]) - 1]
    assert not ours.is_special(len(md["tokenizer.ggml.tokens"]) - 1) and ours.is_special(2)


def test_starcoder_family_splits_digits():
    ours = Tokenizer.from_gguf(_byte_level_md("starcoder"))
    one, two = ours.token_to_id("1"), ours.token_to_id("2")
    assert ours.encode("12", add_bos=False) == [one, two]  # the "1 2" merge never applies
    assert Tokenizer.from_gguf(_byte_level_md("gpt-2")).encode("12", add_bos=False) == [ours.token_to_id("12")]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sentencepiece_matches_transformers(arch):
    md = _sentencepiece_md(arch=arch)
    ours = Tokenizer.from_gguf(md)
    ref, extra = _transformers_builder(md)
    for s in _SYNTH + STRINGS:
        if any(e in s for e in extra):
            continue
        ids = ours.encode(s, add_bos=False)
        assert ids == ref.encode(s, add_special_tokens=False).ids, (arch, s)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False), (arch, s)
        assert ours.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True), (arch, s)
    assert ours.add_bos and ours.encode("abc")[0] == 1


def test_sentencepiece_add_space_prefix_false_is_honoured():
    prefixed = Tokenizer.from_gguf(_sentencepiece_md(True))
    bare = Tokenizer.from_gguf(_sentencepiece_md(False))
    assert prefixed.backend.id_to_token(prefixed.encode("abc", add_bos=False)[0]) == "▁abc"
    assert bare.backend.id_to_token(bare.encode("abc", add_bos=False)[0]) == "ab"
    for t in (prefixed, bare):
        for s in ("abc", "hello world", "x😀 y"):
            assert t.decode(t.encode(s)[1:]) == s
    assert prefixed.decode(prefixed.encode(" x")[1:]) == "x"  # SentencePiece drops the leading space, as transformers


def test_from_gguf_errors():
    with pytest.raises(WeightsError):
        Tokenizer.from_gguf({"general.architecture": "llama"})
    md = _byte_level_md("default")
    md["tokenizer.ggml.model"] = "rwkv"  # (bert's WordPiece is read: tests/test_embeddings.py)
    with pytest.raises(UnsupportedError, match="rwkv"):
        Tokenizer.from_gguf(md)
    md = _byte_level_md("default")
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:-3]
    with pytest.raises(WeightsError):
        Tokenizer.from_gguf(md)
    with pytest.raises(InvalidRequestError):
        Tokenizer.from_gguf(_byte_level_md("default")).encode(b"bytes")  # type: ignore[arg-type]


# ---- chat templates ------------------------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke 😀\n\twith tabs"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Ahoy"},
     {"role": "assistant", "content": "Arr!"}, {"role": "user", "content": "<|im_start|> inside text"}],
]


def test_smollm2_chat_template_matches_transformers(smollm2_tok, smollm2_ref):
    assert smollm2_tok.has_chat_template and "<|im_start|>" in smollm2_tok.chat_template
    for conv in CONVERSATIONS:
        for agp in (True, False):
            ours = smollm2_tok.apply_chat_template(conv, add_generation_prompt=agp)
            ref = smollm2_ref.apply_chat_template(conv, add_generation_prompt=agp, tokenize=False)
            assert ours == ref
            assert smollm2_tok.encode(ours) == smollm2_ref.encode(ref, add_special_tokens=False)
    assert smollm2_tok.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_gemma3_default_turn_format(gemma3_tok):
    assert not gemma3_tok.has_chat_template and gemma3_tok.chat_template is None
    prompt = gemma3_tok.apply_chat_template(CONVERSATIONS[1])
    assert prompt == "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma3_tok.encode(prompt)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1
    prompt = gemma3_tok.apply_chat_template(CONVERSATIONS[2], add_generation_prompt=False)
    assert prompt == ("<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi! How can I help?"
                      "<end_of_turn>\n<start_of_turn>user\nTell me a joke 😀\n\twith tabs<end_of_turn>\n")


def test_default_template_choice_and_template_features():
    from mlx_engine.models.text.chat_template import default_template, render_chat_template

    assert default_template("gemma3", {}) is GEMMA_TEMPLATE
    assert default_template("llama", {"<|start_header_id|>": 1}) is LLAMA3_TEMPLATE
    assert default_template("qwen3", {"<|im_start|>": 1}) is CHATML_TEMPLATE
    assert render_chat_template(CHATML_TEMPLATE, [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                              {"type": "image"}]}]) == \
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
    t = ("{% for m in messages %}{{ m | tojson }}{% generation %}[{{ m.role }}]{% endgeneration %}"
         "{% if loop.last %}{% break %}{% endif %}{% endfor %}{{ bos_token }}{{ extra }}")
    out = render_chat_template(t, [{"role": "user", "content": "é<>", "name": None}], special_tokens={"bos_token": "B"},
                               extra="X")
    assert out == '{"role": "user", "content": "é<>"}[user]BX'  # None keys dropped, no HTML escaping
    ns = "{% set ns = namespace(x=1) %}{% set ns.x = ns.x + 1 %}{{ ns.x }}{{ strftime_now('%Y')|length }}"
    assert render_chat_template(ns, [{"role": "user", "content": ""}]) == "24"


def test_chat_template_errors(smollm2_tok):
    with pytest.raises(InvalidRequestError, match="empty"):
        smollm2_tok.apply_chat_template([])
    from mlx_engine.models.text.chat_template import render_chat_template

    with pytest.raises(InvalidRequestError, match="alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="compile"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError):  # the sandbox refuses attribute hacks
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError):
        render_chat_template("{% set ns = namespace() %}{% set ns._x = 1 %}", [{"role": "user", "content": "x"}])


# ---- streaming detokenizer -----------------------------------------------------------------------------------------

_EMOJI_HEAVY = ("😀😃😄 👍🏽👨‍👩‍👧‍👦🏳️‍🌈🇫🇷🇯🇵 1️⃣❤️ 🧑🏿‍💻 你好，世界 日本語 한국어 Ελληνικά Привет "
                "𓀀𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ é à ü ñ ∀∈ℝ ½ — “quotes” <|im_start|><start_of_turn>\n\t ")


def _stream(tok, ids, skip_special=False):
    det = tok.detokenizer(skip_special=skip_special)
    chunks = [det.add(i) for i in ids]
    chunks.append(det.flush())
    return chunks


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_streaming_detokenizer_never_splits_characters(which, request):
    tok = request.getfixturevalue(f"{which}_tok")
    text = "".join(_EMOJI_HEAVY[i:] + _EMOJI_HEAVY[:i] for i in range(0, len(_EMOJI_HEAVY), 7))
    ids = tok.encode(text, add_bos=False)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)
    for c in chunks:
        c.encode("utf-8")  # no lone surrogates
    assert sum(1 for c in chunks if c == "") > 10  # characters split across tokens were held back
    if which == "gemma3":  # byte-fallback tokens <0x..> (ids 238-493) are exercised
        assert any(238 <= i <= 493 for i in ids)
    skipped = _stream(tok, ids, skip_special=True)
    assert "".join(skipped) == tok.decode(ids, skip_special=True)
    assert ("<|im_start|>" if which == "smollm2" else "<start_of_turn>") not in "".join(skipped)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_streaming_equals_decode_on_random_ids(which, request):
    tok = request.getfixturevalue(f"{which}_tok")
    rng = random.Random(5)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 16))]
        if rng.random() < 0.5:  # byte-heavy: byte-level pieces / byte-fallback tokens, often invalid UTF-8
            ids = [rng.randrange(238, 494) if which == "gemma3" else rng.randrange(0, 600) for _ in ids]
        for skip in (False, True):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip)


def test_streaming_is_linear(smollm2_tok):
    ids = smollm2_tok.encode(_EMOJI_HEAVY * 6 + "plain text " * 500, add_bos=False) * 10
    assert len(ids) > 20000
    det = smollm2_tok.detokenizer()
    start = time.perf_counter()
    out = [det.add(i) for i in ids]
    out.append(det.flush())
    elapsed = time.perf_counter() - start
    assert "".join(out) == smollm2_tok.decode(ids)
    assert elapsed < 2.0  # about 2 microseconds a token; re-decoding the history would take minutes


def test_window_detokenizer_for_other_decoders(tmp_path):
    """A decoder we do not reproduce byte by byte (WordPiece) falls back to windowed decoding by ``tokenizers``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[CLS]": 1, "hello": 2, "wor": 3, "##ld": 4, "!": 5, "é": 6, "##llo": 7, "he": 8}
    hf = HFTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(["[CLS]"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[CLS]"}))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.bos_id == 1 and not tok.add_bos  # no add_bos_token and no post-processor putting it first
    ids = tok.encode("[CLS] hello world! é hello")
    assert ids[0] == 1 and 0 not in ids
    for skip in (False, True):
        assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip) == hf.decode(
            ids, skip_special_tokens=skip)
