"""Small random FLUX.2 pipelines (dev and klein) built with diffusers and transformers on PyTorch CPU, saved in
diffusers' folder layout, and diffusers' own results on them (the references of ``tests/test_imagegen_flux2.py``).

The components follow diffusers' ``tests/pipelines/flux2/test_pipeline_flux2.py`` and ``test_pipeline_flux2_klein.py``
at a small size: a ``Flux2Transformer2DModel`` (2 heads of 16, one double-stream and two single-stream blocks, RoPE
axes (4, 4, 4, 4); dev embeds guidance, klein does not), an ``AutoencoderKLFlux2`` (4 blocks, so 8 pixels per latent
as the real one, 4 latent channels, quant convs, a wider decoder than encoder, random BatchNorm statistics), and the
text encoders: a transformers ``Mistral3ForConditionalGeneration`` (FLUX.2 dev: a 4-layer Mistral text model of width
32 and a 1-layer Pixtral vision tower, never run) and a ``Qwen3ForCausalLM`` (klein: 4 layers, width 32). The stacked
hidden states are ``(1, 2, 4)``: the last is the final-normed output, ``hidden_states[num_layers]``, so
``joint_attention_dim`` is 96.

Tokenizers: small byte-level BPEs trained here. The Mistral one has Mistral's special tokens and a Mistral-style chat
template (``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``, list contents) and pads on the left, as
transformers' ``LlamaTokenizer`` does; the real folder's ``PixtralProcessor`` cannot be made here (its image processor
needs torchvision), and a tokenizer's ``apply_chat_template`` tokenizes the same way when the template writes the
BOS token, as this one does. The Qwen one has Qwen3's turn format (``enable_thinking``) and pads on the right.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | map(attribute='text') | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CORPUS = ["a red circle on a blue background", "a small green square in the top left corner",
          "a yellow triangle at the bottom right", "make the circle green", "user assistant"]
TEXT_LAYERS = (1, 2, 4)
TEXT_WIDTH = 32


def _tokenizer(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "dev":
        special = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]
    else:
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tok.train_from_iterator((CORPUS + [SYSTEM_MESSAGE]) * 10, trainer)
    if kind == "dev":
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                       unk_token="<unk>", padding_side="left", chat_template=MISTRAL_TEMPLATE)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="right", chat_template=QWEN_TEMPLATE)


def _text_encoder(kind: str, tokenizer):
    import torch

    torch.manual_seed(3)
    if kind == "dev":
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        config = Mistral3Config(
            text_config={"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": TEXT_WIDTH,
                         "intermediate_size": 64, "max_position_embeddings": 512, "num_attention_heads": 4,
                         "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5,
                         "rope_theta": 1000000000.0, "sliding_window": None,
                         "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                         "pad_token_id": tokenizer.pad_token_id},
            vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1,
                           "num_attention_heads": 4, "intermediate_size": 37, "image_size": 30, "patch_size": 6,
                           "num_channels": 3},
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), vision_feature_layer=-1,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        model = Mistral3ForConditionalGeneration(config)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=512,
                             rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
        model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # peaked activations: default init leaves the layers close to the identity
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model.eval()


def build_pipeline(kind: str):
    """The diffusers ``Flux2Pipeline`` (``kind="dev"``) or ``Flux2KleinPipeline`` (``"klein"``) of random small
    components (float32, CPU, seeded)."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    tokenizer = _tokenizer(kind)
    text_encoder = _text_encoder(kind, tokenizer)
    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=len(TEXT_LAYERS) * TEXT_WIDTH, timestep_guidance_channels=256,
        mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, guidance_embeds=kind == "dev")
    torch.manual_seed(1)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16),
        decoder_block_out_channels=(8, 16, 16, 24), layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=64, use_quant_conv=True, use_post_quant_conv=True, mid_block_add_attention=True)
    with torch.no_grad():  # the statistics start as 0 and 1: give them values the pipeline must undo
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean) * 0.3)
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) * 2.0 + 0.5)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    parts = dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler)
    if kind == "dev":
        from diffusers import Flux2Pipeline

        return Flux2Pipeline(**parts)
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline(**parts, is_distilled=False)


def build_folder(path: Path, kind: str) -> Path:
    """Save the small pipeline of ``kind`` in diffusers' layout at ``path`` (the transformer sharded)."""
    pipe = build_pipeline(kind)
    pipe.save_pretrained(str(path), max_shard_size="200KB")
    return path


def load(folder: Path):
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def noise(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def reference_generate(pipe, prompt, init_noise: np.ndarray, *, steps: int, guidance: float, width: int,
                       height: int, images=None, max_sequence_length: int):
    """diffusers' pipeline from ``init_noise`` ``[B, 128, h, w]`` (its ``latents`` argument): ``(final latents
    [B, 128, h, w] float32, pixels [B, H, W, 3] float in [0, 1])``. The final latents are read by the step callback
    (diffusers returns them packed, ``[B, h w, 128]``)."""
    import torch

    seen = {}

    def grab(_pipe, i, t, kwargs):
        seen["latents"] = kwargs["latents"]
        return {}

    with torch.no_grad():
        out = pipe(prompt=prompt, image=images, height=height, width=width, num_inference_steps=steps,
                   guidance_scale=guidance, latents=torch.from_numpy(init_noise), output_type="np",
                   max_sequence_length=max_sequence_length, text_encoder_out_layers=TEXT_LAYERS,
                   callback_on_step_end=grab)
    b, c, h, w = init_noise.shape
    packed = seen["latents"].float().numpy()
    return packed.transpose(0, 2, 1).reshape(b, c, h, w), np.asarray(out.images, dtype=np.float32)
