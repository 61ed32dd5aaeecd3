"""A small random Llama 3.2 Vision checkpoint (``MllamaForConditionalGeneration``) built with transformers on PyTorch
CPU and saved in Hugging Face's folder layout, with a byte-level tokenizer holding Llama 3's header tokens and
``<|image|>`` and a chat template that writes ``<|image|>`` for an image part (as Llama 3.2 Vision's does): the
reference of the Mllama tests. A vision encoder of 3 local and 2 global layers over 16x16-pixel tiles in 4x4 patches
(17 rows per tile with the class token, padded to 24 inside the encoder), up to 4 tiles per image, and a 5-layer text
model whose layers 1 and 3 are cross-attention layers."""

from __future__ import annotations

from pathlib import Path

from tests.hybrid_small import byte_tokenizer

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|finetune_right_pad_id|>", "<|image|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
TILE = 16


def tokenizer():
    return byte_tokenizer(SPECIAL, CHAT_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                          pad_token="<|finetune_right_pad_id|>")


def build_mllama(folder: Path, seed: int = 0):
    """Save the random checkpoint and tokenizer to ``folder``; returns the transformers model (eval mode)."""
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    tk = tokenizer()
    ids = {t: tk.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(vocab_size=len(tk), hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                num_key_value_heads=2, cross_attention_layers=[1, 3], max_position_embeddings=2048,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64},
                bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|eot_id|>"],
                pad_token_id=ids["<|finetune_right_pad_id|>"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_global_layers=2, attention_heads=4,
                  image_size=TILE, patch_size=4, max_num_tiles=4, intermediate_layers_indices=[0, 2],
                  vision_output_dim=96)
    config = MllamaConfig(text_config=text, vision_config=vision, image_token_index=ids["<|image|>"])
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that every layer, and the images, matter
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif "gate" in name:
                p.copy_(0.8 + 0.3 * noise)  # tanh gates: clearly open
            else:
                p.copy_(noise * (1.0 if "embed" in name else 0.3))
    model.save_pretrained(folder)
    tk.save_pretrained(str(folder))
    return model
