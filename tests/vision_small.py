"""A small random Gemma 3 vision checkpoint (``Gemma3ForConditionalGeneration``) built with transformers on PyTorch
CPU and saved in Hugging Face's folder layout, with a byte-level tokenizer holding Gemma's image and turn tokens and
a chat template that writes ``<start_of_image>`` for an image part (as Gemma 3's does): the reference of the vision
tests. A SigLIP tower of 2 layers over 32x32 pixels in 4x4 patches (64 patches, pooled to 16 tokens per image), and
a 4-layer Gemma 3 text model with a sliding window of 8 on every other layer (an image's 16 tokens span it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.hybrid_small import byte_tokenizer, write_gguf

SPECIAL = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
           "<image_soft_token>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<start_of_image>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
IMAGE_SIZE = 32


def tokenizer():
    return byte_tokenizer(SPECIAL, CHAT_TEMPLATE, bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>")


def build_gemma3_vision(folder: Path, seed: int = 0):
    """Save the random checkpoint and tokenizer to ``folder``; returns the transformers model (eval mode)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tk = tokenizer()
    ids = {t: tk.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(vocab_size=len(tk), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=2,
                query_pre_attn_scalar=16, max_position_embeddings=2048, bos_token_id=ids["<bos>"],
                eos_token_id=ids["<end_of_turn>"], pad_token_id=ids["<pad>"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=4, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                          eoi_token_index=ids["<end_of_image>"])
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # small embeddings (Gemma scales them by sqrt(D)), large projections: images matter
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                gemma = ("language_model" in name and "norm" in name) or "mm_soft_emb_norm" in name
                p.copy_(0.1 * noise + (0.0 if gemma else 1.0))  # Gemma's norms store w for 1 + w
            else:
                p.copy_(noise * (0.1 if "embed_tokens" in name else 0.7))
    model.save_pretrained(folder)
    tk.save_pretrained(str(folder))
    return model


def photo(seed: int, size: tuple[int, int] = (48, 40), mode: str = "RGB"):
    """A PIL image of smooth random colours (so resizing matters), in ``mode``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    base = rng.integers(0, 256, (4, 4, 4), np.uint8)
    img = Image.fromarray(base, "RGBA").resize((w, h), Image.Resampling.BICUBIC)
    return img.convert(mode) if mode != "RGBA" else img


def reference_pixels(images) -> "np.ndarray":
    """transformers' Gemma 3 image processor (the PIL one) on ``images``: ``[B, 3, S, S]`` float32."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    proc = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return np.asarray(proc(images=list(images), return_tensors="np")["pixel_values"], np.float32)


def mmproj_gguf(model, path: Path) -> Path:
    """The vision part of ``model`` as llama.cpp's ``convert_hf_to_gguf.py --mmproj`` writes it
    (``Gemma3VisionModel``): ``clip.*`` keys, gguf-py's MMPROJ tensor names, ``soft_emb_norm`` with the one added."""
    import gguf

    v = model.config.vision_config
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.hidden_size)
    w.add_uint32("clip.vision.feed_forward_length", v.intermediate_size)
    w.add_uint32("clip.vision.block_count", v.num_hidden_layers)
    w.add_uint32("clip.vision.attention.head_count", v.num_attention_heads)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v.layer_norm_eps)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    scale = (v.image_size // v.patch_size) // int(model.config.mm_tokens_per_image ** 0.5)
    if scale != 4:
        w.add_uint32("clip.vision.projector.scale_factor", scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v.num_hidden_layers)
    for name, t in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) or ".head." in name:
            continue
        hf = name.replace("model.", "", 1).replace("vision_tower.", "vision_tower.vision_model.", 1)
        hf = hf.replace("_weight", ".weight")
        a = t.detach().float()
        if "soft_emb_norm.weight" in hf:
            a = a + 1
        w.add_tensor(names.get_name(hf, try_suffixes=(".weight", ".bias")), a.numpy())
    write_gguf(w)
    return path


def text_only_folder(folder: Path, out: Path) -> Path:
    """The text model of a saved vision checkpoint, alone (the language model's tensors, its text config, the
    tokenizer): what an mmproj file is paired with."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    out.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({n.replace("language_model.", "", 1): a for n, a in tensors.items()
               if n.startswith("language_model.")}, str(out / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config["text_config"], "architectures": ["Gemma3ForCausalLM"]}))
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def ollama_vision_gguf(model, path: Path) -> Path:
    """The vision part of ``model`` as ollama's converter names it inside a Gemma 3 model file
    (``convert/convert_gemma3.go``'s replacements: ``v.`` + SigLIP names with ``blk`` and ``attn_q/k/v/output``,
    ``mm.mm_*``, the one added to ``*_norm.weight``; ``gemma3.vision.*`` keys). Only the vision tensors: the text
    model's are written as every Gemma 3 GGUF's."""
    import gguf

    v = model.config.vision_config
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in (("block_count", v.num_hidden_layers), ("embedding_length", v.hidden_size),
                       ("feed_forward_length", v.intermediate_size), ("image_size", v.image_size),
                       ("patch_size", v.patch_size), ("num_channels", 3), ("attention.head_count",
                                                                            v.num_attention_heads)):
        w.add_uint32(f"gemma3.vision.{key}", value)
    w.add_float32("gemma3.vision.attention.layer_norm_epsilon", v.layer_norm_eps)
    w.add_uint32("gemma3.mm.tokens_per_image", model.config.mm_tokens_per_image)
    swaps = [("vision_tower.vision_model.embeddings", "v"), ("vision_tower.vision_model", "v"),
             ("encoder.layers", "blk"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
             ("self_attn.v_proj", "attn_v"), ("self_attn.out_proj", "attn_output"),
             ("input_projection_weight", "input_projection.weight"), ("multi_modal_projector", "mm")]
    for name, t in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) or ".head." in name:
            continue
        name = name.replace("model.", "", 1).replace("vision_tower.", "vision_tower.vision_model.", 1)
        for a, b in swaps:
            name = name.replace(a, b)
        a = t.detach().float()
        if name.endswith("_norm.weight"):
            a = a + 1
        w.add_tensor(name, a.numpy())
    write_gguf(w)
    return path


def engine_logits_and_tokens(model, tokens, placed, n):
    """Our first-step logits (a fresh prefill of sequence 0) and ``n`` greedy tokens for ``tokens`` with the images
    ``placed`` (``PromptImage``), through the model's runner: what the parity tests compare with transformers."""
    from mlx_engine.models.generation.runner import GenerationStats, Request
    from mlx_engine.models.generation.sampler import SamplerOptions

    runner = model.runner
    runner.reset()
    with model.text_model.backend.new_context() as ctx:
        logits, _ = runner.prefill(ctx, 0, tokens, placed)
        first = logits.numpy()[0]
    runner.reset()
    req = Request(tokens, SamplerOptions(temperature=0.0), max_tokens=n, images=placed)
    return first, list(runner.generate_tokens(req, GenerationStats()))
