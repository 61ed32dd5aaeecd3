"""Train the default image model (``shapes:64``) on MLX: the autoencoder, then the diffusion transformer.

    python -m training.train_image vae --out runs/shapes --minutes 12
    python -m training.train_image text --out runs/shapes          # smollm2 features of every caption (once)
    python -m training.train_image dit --out runs/shapes --minutes 25
    python -m training.train_image export --out runs/shapes --to mlx_engine/assets/shapes-64

The forward passes are the project's inference classes: :class:`mlx_engine.imagegen.vae.AutoencoderKL` and
:class:`mlx_engine.imagegen.transformer.ZImageTransformer` are built once from a backend holding ``MLXTensor``\\ s, and the loss
function puts the traced parameter arrays into those very tensors (:class:`Binder`) before running the model, so
``mx.value_and_grad`` differentiates the inference code itself. Parameters are kept under their diffusers names and
layouts (PyTorch convolutions ``[O, I, kH, kW]``), so the export is the parameter dict as it is.

Objectives:

- autoencoder (Rombach et al. 2022, latent diffusion): ``L1 + MSE`` of the reconstruction of a posterior sample plus
  ``kl_weight`` times the mean KL divergence to ``N(0, 1)``; after training ``shift_factor`` and ``scaling_factor``
  are set to the mean and ``1 / std`` of the latent means over training images (the pipeline's
  ``z = (x - shift) * scale``);
- transformer (rectified flow, Liu et al. 2022 / Esser et al. 2024): ``x_s = (1 - s) z + s e`` with ``s ~ U(0, 1)``,
  the model's output is ``-(e - z)`` (the Z-Image convention: the pipeline steps with ``noise_pred = -output``),
  MSE; timestep input ``1 - s``; captions dropped to ``""`` with probability ``caption_dropout``.

Everything is seeded: the batch of step ``k`` is drawn from ``default_rng([seed, k])``, so a run resumed from its
checkpoint (``<out>/<stage>.ckpt.safetensors`` + ``.json``, written every ``--ckpt-every`` steps and at the end)
continues exactly as if it had not stopped. Loss is logged to ``<out>/<stage>.log`` (one JSON line per log step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from mlx_engine.mlx.runtime import mx  # loads OpenBLAS before mlx (see the runtime module)
import mlx.optimizers as optim  # noqa: E402

from mlx_engine.imagegen import shapes_data  # noqa: E402
from mlx_engine.mlx.backend import MLXBackend  # noqa: E402
from mlx_engine.mlx.tensor import MLXTensor  # noqa: E402

__all__ = ["VAE_CONFIG", "DIT_CONFIG", "SCHEDULER_CONFIG", "VAE_SCALE", "vae_param_shapes", "dit_param_shapes",
           "init_params", "Binder", "build_vae", "build_transformer", "vae_loss_fn", "dit_loss_fn", "train",
           "export_folder", "shape_masks", "latent_masks", "vae_batches", "dit_batches"]

SIDE = 64
TEXT_MODEL = "smollm2:135m"

#: the tiny FLUX-style autoencoder (16 latent channels and no quant convs, as FLUX): 3 blocks, so a 4x downscale to
#: 16 x 16 latents. The real VAE's 8x downscale, at this width, did not learn the flat colours within the training
#: budget (reconstruction stalled near the dataset mean); 4 latent channels learned backgrounds but not shape colours.
VAE_CONFIG = {
    "_class_name": "AutoencoderKL", "_diffusers_version": "0.36.0", "in_channels": 3, "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 3, "up_block_types": ["UpDecoderBlock2D"] * 3,
    "block_out_channels": [16, 16, 32], "layers_per_block": 1, "act_fn": "silu", "latent_channels": 16,
    "norm_num_groups": 8, "sample_size": SIDE, "scaling_factor": 1.0, "shift_factor": 0.0,
    "use_quant_conv": False, "use_post_quant_conv": False, "mid_block_add_attention": True, "force_upcast": True,
}
#: pixels per latent (diffusers: ``2 ** (len(block_out_channels) - 1)``)
VAE_SCALE = 2 ** (len(VAE_CONFIG["block_out_channels"]) - 1)
#: the tiny Z-Image transformer (cap_feat_dim: smollm2-135m's hidden size)
DIT_CONFIG = {
    "_class_name": "ZImageTransformer2DModel", "_diffusers_version": "0.36.0", "all_patch_size": [2],
    "all_f_patch_size": [1], "in_channels": 16, "dim": 128, "n_layers": 3, "n_refiner_layers": 1, "n_heads": 4,
    "n_kv_heads": 4, "norm_eps": 1e-5, "qk_norm": True, "cap_feat_dim": 576, "rope_theta": 256.0, "t_scale": 1000.0,
    "axes_dims": [8, 12, 12], "axes_lens": [256, 32, 32],
}
#: Euler flow matching, plain linear sigmas (shift 1: trained with s ~ U(0, 1))
SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.36.0",
                    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}
T_EMBED_MID = 1024  # diffusers ZImageTransformer2DModel: TimestepEmbedder(min(dim, 256), mid_size=1024)


# ---- parameter names and shapes (diffusers' state-dict layout) -------------------------------------------------------
def vae_param_shapes(cfg: dict = VAE_CONFIG) -> dict[str, tuple[int, ...]]:
    """Names and shapes of diffusers' ``AutoencoderKL(**cfg).state_dict()`` (convolutions ``[O, I, kH, kW]``)."""
    s: dict[str, tuple[int, ...]] = {}
    ch, n, lpb, lat = cfg["block_out_channels"], len(cfg["block_out_channels"]), cfg["layers_per_block"], \
        cfg["latent_channels"]

    def conv(p, i, o, k):
        s[p + ".weight"], s[p + ".bias"] = (o, i, k, k), (o,)

    def norm(p, c):
        s[p + ".weight"], s[p + ".bias"] = (c,), (c,)

    def resnet(p, i, o):
        norm(p + ".norm1", i), conv(p + ".conv1", i, o, 3), norm(p + ".norm2", o), conv(p + ".conv2", o, o, 3)
        if i != o:
            conv(p + ".conv_shortcut", i, o, 1)

    def mid(p, c):
        resnet(p + ".resnets.0", c, c)
        if cfg.get("mid_block_add_attention", True):
            a = p + ".attentions.0"
            norm(a + ".group_norm", c)
            for q in ("to_q", "to_k", "to_v", "to_out.0"):
                s[f"{a}.{q}.weight"], s[f"{a}.{q}.bias"] = (c, c), (c,)
        resnet(p + ".resnets.1", c, c)

    conv("encoder.conv_in", cfg["in_channels"], ch[0], 3)
    cout = ch[0]
    for i in range(n):
        cin, cout = cout, ch[i]
        for j in range(lpb):
            resnet(f"encoder.down_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout)
        if i < n - 1:
            conv(f"encoder.down_blocks.{i}.downsamplers.0.conv", cout, cout, 3)
    mid("encoder.mid_block", ch[-1])
    norm("encoder.conv_norm_out", ch[-1])
    conv("encoder.conv_out", ch[-1], 2 * lat, 3)
    conv("decoder.conv_in", lat, ch[-1], 3)
    mid("decoder.mid_block", ch[-1])
    rch = list(reversed(ch))
    cout = rch[0]
    for i in range(n):
        cin, cout = cout, rch[i]
        for j in range(lpb + 1):
            resnet(f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout)
        if i < n - 1:
            conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", cout, cout, 3)
    norm("decoder.conv_norm_out", ch[0])
    conv("decoder.conv_out", ch[0], cfg["out_channels"], 3)
    if cfg.get("use_quant_conv", True):
        conv("quant_conv", 2 * lat, 2 * lat, 1)
    if cfg.get("use_post_quant_conv", True):
        conv("post_quant_conv", lat, lat, 1)
    return s


def dit_param_shapes(cfg: dict = DIT_CONFIG) -> dict[str, tuple[int, ...]]:
    """Names and shapes of diffusers' ``ZImageTransformer2DModel(**cfg).state_dict()``."""
    d, hd, ada = cfg["dim"], cfg["dim"] // cfg["n_heads"], min(cfg["dim"], 256)
    ffn = int(d / 3 * 8)
    s: dict[str, tuple[int, ...]] = {
        "t_embedder.mlp.0.weight": (T_EMBED_MID, 256), "t_embedder.mlp.0.bias": (T_EMBED_MID,),
        "t_embedder.mlp.2.weight": (ada, T_EMBED_MID), "t_embedder.mlp.2.bias": (ada,),
        "cap_embedder.0.weight": (cfg["cap_feat_dim"],), "cap_embedder.1.weight": (d, cfg["cap_feat_dim"]),
        "cap_embedder.1.bias": (d,), "x_pad_token": (1, d), "cap_pad_token": (1, d),
    }
    for p, f in zip(cfg["all_patch_size"], cfg["all_f_patch_size"]):
        k, feat = f"{p}-{f}", p * p * f * cfg["in_channels"]
        s[f"all_x_embedder.{k}.weight"], s[f"all_x_embedder.{k}.bias"] = (d, feat), (d,)
        s[f"all_final_layer.{k}.linear.weight"], s[f"all_final_layer.{k}.linear.bias"] = (feat, d), (feat,)
        s[f"all_final_layer.{k}.adaLN_modulation.1.weight"] = (d, ada)
        s[f"all_final_layer.{k}.adaLN_modulation.1.bias"] = (d,)

    def block(pre, mod):
        for q in ("to_q", "to_k", "to_v"):
            s[f"{pre}attention.{q}.weight"] = (d, d)
        s[f"{pre}attention.to_out.0.weight"] = (d, d)
        if cfg.get("qk_norm", True):
            s[f"{pre}attention.norm_q.weight"] = s[f"{pre}attention.norm_k.weight"] = (hd,)
        for nm in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            s[f"{pre}{nm}.weight"] = (d,)
        s[f"{pre}feed_forward.w1.weight"] = s[f"{pre}feed_forward.w3.weight"] = (ffn, d)
        s[f"{pre}feed_forward.w2.weight"] = (d, ffn)
        if mod:
            s[f"{pre}adaLN_modulation.0.weight"], s[f"{pre}adaLN_modulation.0.bias"] = (4 * d, ada), (4 * d,)

    for i in range(cfg["n_refiner_layers"]):
        block(f"noise_refiner.{i}.", True)
        block(f"context_refiner.{i}.", False)
    for i in range(cfg["n_layers"]):
        block(f"layers.{i}.", True)
    return s


def init_params(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, "mx.array"]:
    """PyTorch-style initialisation: weights and biases of linear and conv layers ``U(-1/sqrt(fan_in), ...)``, norm
    weights 1 and biases 0, pad tokens ``N(0, 0.02)``; adaLN modulations and the transformer's final linear layer are
    zero (DiT's adaLN-Zero, Peebles & Xie 2023: every block starts as the identity)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if "adaLN_modulation" in name or name.startswith("all_final_layer") and ".linear." in name:
            a = np.zeros(shape, np.float32)
        elif "pad_token" in name:
            a = rng.normal(0, 0.02, shape).astype(np.float32)
        elif len(shape) == 1 and ("norm" in name or name.startswith("cap_embedder.0")):
            a = (np.zeros if name.endswith(".bias") else np.ones)(shape, np.float32)
        else:
            wname = name[:-5] + ".weight" if name.endswith(".bias") else name
            fan_in = int(np.prod(shapes[wname][1:]))
            bound = 1.0 / math.sqrt(fan_in)
            a = rng.uniform(-bound, bound, shape).astype(np.float32)
        if name == "encoder.conv_out.bias" and len(shape) == 1:
            a[shape[0] // 2:] = -6.0  # the posterior's log-variance starts small: reconstructions learn from the start
        out[name] = mx.array(a)
    return out


# ---- running the inference classes on trainable arrays -----------------------------------------------------------------
def _backend(config: dict, params: dict[str, "mx.array"]) -> MLXBackend:
    b = MLXBackend(None, dtype="float32")
    b._metadata = dict(config)
    b._weights = {k: MLXTensor(v) for k, v in params.items()}
    return b


class Binder:
    """Puts parameter arrays into a model's tensors: ``bind(params)`` before each forward.

    ``shared``: the backend's tensors (the model holds the same objects); ``convs``: ``(conv, name)`` pairs of the
    VAE's channels-last copies, fed ``params[name]`` transposed ``[O, I, kH, kW] -> [O, kH, kW, I]``."""

    def __init__(self, backend: MLXBackend, model) -> None:
        self.shared = dict(backend.weights)
        by_id = {id(t): n for n, t in self.shared.items()}
        self.convs = []
        for conv in _find(model, "_Conv"):
            bias_name = by_id.get(id(conv.bias))
            if bias_name is None:
                raise RuntimeError("a VAE convolution without a known bias")
            self.convs.append((conv, bias_name[: -len(".bias")] + ".weight"))

    def bind(self, params: dict[str, "mx.array"]) -> None:
        for name, t in self.shared.items():
            t.a = params[name]
        for conv, name in self.convs:
            conv.weight = MLXTensor(mx.transpose(params[name], (0, 2, 3, 1)))


def _find(obj, cls_name: str, seen=None) -> list:
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool, MLXTensor, np.ndarray)):
        return []
    seen.add(id(obj))
    if type(obj).__name__ == cls_name:
        return [obj]
    out = []
    if isinstance(obj, (list, tuple)):
        for x in obj:
            out += _find(x, cls_name, seen)
        return out
    if isinstance(obj, dict):
        return out
    slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
    fields = list(getattr(obj, "__dict__", {}).values()) + [getattr(obj, s, None) for s in slots]
    if type(obj).__module__.startswith("imagegen"):
        for x in fields:
            out += _find(x, cls_name, seen)
    return out


def build_vae(params: dict[str, "mx.array"], config: dict = VAE_CONFIG):
    """``(AutoencoderKL, Binder)`` on these parameters (diffusers names and layout)."""
    from mlx_engine.imagegen.vae import AutoencoderKL

    b = _backend(config, params)
    vae = AutoencoderKL.from_backend(b)
    return vae, Binder(b, vae)


def build_transformer(params: dict[str, "mx.array"], config: dict = DIT_CONFIG):
    """``(ZImageTransformer, Binder)`` on these parameters."""
    from mlx_engine.imagegen.transformer import ZImageTransformer

    b = _backend(config, params)
    tr = ZImageTransformer.from_backend(b)
    return tr, Binder(b, tr)


def _weighted_mean(x: "mx.array", w: "mx.array | None") -> "mx.array":
    """``mean(x)``, or with weights ``w`` (broadcast against ``x``) ``mean(x * w) / mean(w)``."""
    return mx.mean(x) if w is None else mx.mean(x * w) / mx.mean(w)


def vae_loss_fn(vae, binder: Binder, kl_weight: float):
    """``loss(params, x, eps, w=None) -> (loss, (rec, kl))`` with ``x`` float32 ``[B, H, W, 3]`` in ``[-1, 1]``,
    ``eps`` ``[B, H/s, W/s, C]`` standard normal (the posterior sample's noise) and ``w`` optional per-pixel weights
    ``[B, H, W, 1]`` of the reconstruction terms (a weighted mean)."""
    ctx = MLXBackend(None).new_context()
    c = vae.latent_channels

    def loss(params, x, eps, w=None):
        binder.bind(params)
        m = vae.encoder(ctx, MLXTensor(x))
        if vae.quant_conv is not None:
            m = vae.quant_conv(m)
        mean, logvar = m.a[..., :c], mx.clip(m.a[..., c:], -30.0, 20.0)
        z = mean + mx.exp(0.5 * logvar) * eps
        rec = vae.decode(ctx, MLXTensor(z)).a
        err = rec - x
        rec_loss = _weighted_mean(mx.abs(err) + err * err, w)
        kl = 0.5 * mx.mean(mean * mean + mx.exp(logvar) - 1.0 - logvar)
        return rec_loss + kl_weight * kl, (rec_loss, kl)

    return loss


def dit_loss_fn(transformer, binder: Binder):
    """``loss(params, z0, noise, sigma, caps, w=None) -> (loss, ())``: ``z0``, ``noise`` float32 ``[B, C, h, w]``
    (scaled latents), ``sigma`` NumPy float32 ``[B]`` in [0, 1], ``caps`` B arrays ``[L_i, cap_feat_dim]``, ``w``
    optional per-latent-pixel weights ``[B, 1, h, w]`` of the squared error (a weighted mean)."""
    ctx = MLXBackend(None).new_context()

    def loss(params, z0, noise, sigma, caps, w=None):
        binder.bind(params)
        b, ch, height, width = z0.shape
        s = mx.array(sigma)[:, None, None, None]
        xt = (1.0 - s) * z0 + s * noise
        xs = [MLXTensor(xt[i].reshape(ch, 1, height, width)) for i in range(b)]
        outs = transformer(ctx, xs, (1.0 - sigma).astype(np.float32), [MLXTensor(c) for c in caps])
        pred = mx.stack([o.a.reshape(ch, height, width) for o in outs])
        target = z0 - noise  # = -(velocity d x_s / d s): the Z-Image output convention
        return _weighted_mean((pred - target) ** 2, w), ()

    return loss


# ---- the training loop ---------------------------------------------------------------------------------------------
def _save_ckpt(out: Path, stage: str, params, opt, step: int, extra: dict) -> None:
    flat = {f"p.{k}": v for k, v in params.items()}
    for k, v in opt.state.items():  # parameter names hold dots: keep the optimizer state one level deep, "|"-joined
        if isinstance(v, dict):
            flat.update({f"o|{k}|{sk}": sv for sk, sv in v.items()})
        else:
            flat[f"s|{k}"] = v
    tmp = out / f"{stage}.ckpt.tmp.safetensors"
    mx.save_safetensors(str(tmp), flat)
    os.replace(tmp, out / f"{stage}.ckpt.safetensors")
    (out / f"{stage}.ckpt.json").write_text(json.dumps(dict(extra, step=step)))


def _load_ckpt(out: Path, stage: str, opt):
    f = out / f"{stage}.ckpt.safetensors"
    if not f.is_file():
        return None, 0
    flat = mx.load(str(f))
    params = {k[2:]: v for k, v in flat.items() if k.startswith("p.")}
    state: dict = {}
    for k, v in flat.items():
        if k.startswith("o|"):
            _, name, sk = k.split("|")
            state.setdefault(name, {})[sk] = v
        elif k.startswith("s|"):
            state[k[2:]] = v
    opt.state = state
    step = json.loads((out / f"{stage}.ckpt.json").read_text())["step"]
    return params, step


def train(stage: str, out: Path, params, loss, make_batch, *, steps: int, lr: float, minutes: float | None = None,
          log_every: int = 10, ckpt_every: int = 100, warmup: int = 50, log=print,
          stop_at: int | None = None) -> tuple[dict, list[float]]:
    """AdamW (cosine decay after a linear warm-up) on ``loss(params, *make_batch(step))``. Resumes from the stage's
    checkpoint in ``out`` when there is one; stops after ``steps`` steps, or once ``minutes`` have passed (then the
    checkpoint lets a later call go on; ``stop_at`` stops at that step the same way). Returns the parameters and the
    losses of the steps run."""
    out.mkdir(parents=True, exist_ok=True)
    sched = optim.join_schedules([optim.linear_schedule(lr * 0.01, lr, warmup),
                                  optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.05)], [warmup])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    opt.init(params)
    resumed, start = _load_ckpt(out, stage, opt)
    if resumed is not None:
        params = resumed
        log(f"[{stage}] resumed at step {start}")
    vg = mx.value_and_grad(loss, argnums=0)
    t0 = time.time()
    losses, window = [], []
    logf = open(out / f"{stage}.log", "a")
    step = start
    try:
        while step < steps:
            (l, aux), grads = vg(params, *make_batch(step))
            opt.update(params, grads)
            mx.eval(params, opt.state, l)
            step += 1
            losses.append(float(l))
            window.append(float(l))
            if step % log_every == 0 or step == steps:
                rec = {"step": step, "loss": float(np.mean(window)), "lr": float(opt.learning_rate),
                       "seconds": round(time.time() - t0, 1)}
                if aux:
                    rec.update({f"aux{i}": float(a) for i, a in enumerate(aux)})
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                log(f"[{stage}] {json.dumps(rec)}")
                window = []
            if step % ckpt_every == 0:
                _save_ckpt(out, stage, params, opt, step, {"stage": stage})
            if stop_at is not None and step >= stop_at:
                break
            if minutes is not None and time.time() - t0 > minutes * 60:
                log(f"[{stage}] time budget reached at step {step}")
                break
    finally:
        _save_ckpt(out, stage, params, opt, step, {"stage": stage})
        logf.close()
    return params, losses


# ---- data ------------------------------------------------------------------------------------------------------------
def _unit(images: np.ndarray) -> np.ndarray:
    """uint8 pixels to float32 in ``[-1, 1]`` (the autoencoder's input range)."""
    return images.astype(np.float32) / 127.5 - 1.0


def _pixels(seed_list) -> np.ndarray:
    return _unit(shapes_data.batch(seed_list, SIDE)[0])


def shape_masks(seed_list, images: np.ndarray | None = None) -> np.ndarray:
    """float32 ``[N, SIDE, SIDE, 1]``: 1 where a drawing differs from its plain background (the shape and its
    anti-aliased edge), else 0. ``images``: the seeds' uint8 drawings when already drawn."""
    if images is None:
        images, _ = shapes_data.batch(seed_list, SIDE)
    bg = np.array([shapes_data.COLOURS[shapes_data.sample(int(s)).background] for s in seed_list], np.int16)
    return (np.abs(images.astype(np.int16) - bg[:, None, None]).max(-1, keepdims=True) > 0).astype(np.float32)


def vae_batches(seed: int, batch: int, pool: int = 200_000, fg_weight: float = 0.0):
    """``make_batch(step) -> (x, eps)`` over training-split seeds (drawn from ``[0, pool)``); with ``fg_weight`` > 0
    ``(x, eps, w)``, ``w = 1 + fg_weight * shape_mask``: the shape is a few percent of the pixels, and without the
    weight its colour is the last thing the autoencoder learns."""
    c, lat = VAE_CONFIG["latent_channels"], SIDE // VAE_SCALE

    def make(step: int):
        rng = np.random.default_rng([seed, step])
        cand = rng.integers(0, pool, size=batch * 2)
        picked = [int(s) for s in cand if not shapes_data.is_held_out(int(s))][:batch]
        images, _ = shapes_data.batch(picked, SIDE)
        x = mx.array(_unit(images))
        eps = mx.array(rng.standard_normal((len(picked), lat, lat, c)).astype(np.float32))
        if fg_weight <= 0:
            return x, eps
        return x, eps, mx.array(1.0 + fg_weight * shape_masks(picked, images))

    return make


def text_encoder():
    """The project's TextEncoder over the store's ``smollm2:135m`` (pulled when missing)."""
    from mlx_engine.imagegen.text_encoder import TextEncoder
    from mlx_engine.models.registry import load_text_checkpoint
    from mlx_engine.store import Store

    text = load_text_checkpoint(Store().resolve(TEXT_MODEL, pull=True).path, MLXBackend)
    return TextEncoder(text.model, text.tokenizer, text.backend)


def caption_in_subset(cap: str, every: int) -> bool:
    """Whether a caption is in the trained subset: every short caption and ``""``, and about one long caption in
    ``every`` (by a hash), so that encoding the captions (about 1 s each on a busy 2-core CPU) stays short."""
    import hashlib

    if every <= 1 or " in the " not in cap and " at the " not in cap and " on the " not in cap:
        return True
    return int(hashlib.sha256(cap.encode()).hexdigest()[:8], 16) % every == 0


def all_captions(every: int = 1) -> list[str]:
    """Every caption the generator can write (long ones: those of :func:`caption_in_subset`), and ``""``."""
    d = shapes_data
    caps = {""}
    for sh in d.SHAPES:
        for c in d.COLOURS:
            for bg in d.COLOURS:
                if c == bg:
                    continue
                caps.add(d.caption(sh, c, bg))
                for sz in d.SIZES:
                    for pos in d.POSITIONS:
                        caps.add(d.caption(sh, c, bg, sz, pos))
    return sorted(c for c in caps if caption_in_subset(c, every))


def encode_captions(captions: list[str], chunk: int = 64, log=print) -> dict[str, np.ndarray]:
    """float16 ``[L, 576]`` features of each caption (the text encoder's, as the pipeline computes them)."""
    te = text_encoder()
    out = {}
    ctx = te.backend.new_context()
    t0 = time.time()
    for i in range(0, len(captions), chunk):
        part = captions[i:i + chunk]
        for cap, h in zip(part, te.encode(ctx, part)):
            out[cap] = h.numpy().astype(np.float16)
        log(f"[text] {i + len(part)}/{len(captions)} captions, {time.time() - t0:.0f} s")
    te.close()
    return out


def load_vae_export(folder: Path):
    """The exported autoencoder as the pipeline loads it."""
    from mlx_engine.imagegen.vae import AutoencoderKL

    return AutoencoderKL.from_backend(MLXBackend(folder, dtype="float32"))


def encode_latents(vae, seed_list, chunk: int = 128) -> np.ndarray:
    """Scaled latents ``(mean - shift) * scale``, float32 ``[N, C, h, w]`` (the posterior means)."""
    ctx = MLXBackend(None).new_context()
    out = []
    for i in range(0, len(seed_list), chunk):
        x = MLXTensor(mx.array(_pixels(seed_list[i:i + chunk])))
        m = vae.encode(ctx, x).a
        m = (m - vae.shift_factor) * vae.scaling_factor
        mx.eval(m)
        out.append(np.array(m).transpose(0, 3, 1, 2))
    return np.concatenate(out)


def latent_masks(seed_list) -> np.ndarray:
    """float32 ``[N, 1, SIDE / VAE_SCALE, SIDE / VAE_SCALE]``: 1 on the latent pixels that hold part of the shape
    (:func:`shape_masks`, max-pooled over each ``VAE_SCALE`` square)."""
    m = shape_masks(seed_list)[..., 0]
    n, k = len(m), SIDE // VAE_SCALE
    return m.reshape(n, k, VAE_SCALE, k, VAE_SCALE).max(axis=(2, 4))[:, None]


def dit_batches(seed: int, batch: int, latents: np.ndarray, captions: list[str], feats: dict[str, np.ndarray],
                caption_dropout: float = 0.1, masks: np.ndarray | None = None, fg_weight: float = 0.0):
    """``make_batch(step) -> (z0, noise, sigma, caps)``; with ``masks`` (:func:`latent_masks` of the latents) and
    ``fg_weight`` > 0 also ``w = 1 + fg_weight * mask``: the shape covers a few of the 256 latent pixels, and without
    the weight the background (one colour over the whole picture) is nearly all of the loss."""
    n = len(latents)
    cache: dict[str, "mx.array"] = {}

    def feat(c):
        if c not in cache:
            cache[c] = mx.array(feats[c].astype(np.float32))
        return cache[c]

    def make(step: int):
        rng = np.random.default_rng([seed, step])
        idx = rng.integers(0, n, size=batch)
        z0 = latents[idx]
        noise = rng.standard_normal(z0.shape).astype(np.float32)
        sigma = rng.random(batch).astype(np.float32)
        drop = rng.random(batch) < caption_dropout
        caps = [feat("" if d else captions[i]) for i, d in zip(idx, drop)]
        if masks is None or fg_weight <= 0:
            return mx.array(z0), mx.array(noise), sigma, caps
        return mx.array(z0), mx.array(noise), sigma, caps, mx.array(1.0 + fg_weight * masks[idx])

    return make


# ---- export ----------------------------------------------------------------------------------------------------------
def _save_component(folder: Path, config: dict, params: dict, dtype=mx.float16) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(folder / "diffusion_pytorch_model.safetensors"),
                        {k: v.astype(dtype) for k, v in sorted(params.items())}, metadata={"format": "pt"})


def export_folder(to: Path, vae_params: dict, vae_config: dict, dit_params: dict | None, defaults: dict) -> None:
    """Write the diffusers-style folder: ``model_index.json``, ``vae/``, ``transformer/``, ``scheduler/``, and this
    engine's ``mlx_engine.json`` (defaults, and the store model that is the text encoder and tokenizer)."""
    to.mkdir(parents=True, exist_ok=True)
    _save_component(to / "vae", vae_config, vae_params)
    if dit_params is not None:
        _save_component(to / "transformer", DIT_CONFIG, dit_params)
    (to / "scheduler").mkdir(exist_ok=True)
    (to / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2) + "\n")
    index = {"_class_name": "ZImagePipeline", "_diffusers_version": "0.36.0",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["mlx_engine", "store:" + TEXT_MODEL], "tokenizer": ["mlx_engine", "store:" + TEXT_MODEL],
             "transformer": ["diffusers", "ZImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
    (to / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (to / "mlx_engine.json").write_text(json.dumps(defaults, indent=2) + "\n")


def latent_stats(vae, n: int = 512) -> tuple[float, float]:
    """``(shift_factor, scaling_factor)``: mean and 1/std of the posterior means over ``n`` training images."""
    saved = vae.shift_factor, vae.scaling_factor
    vae.shift_factor, vae.scaling_factor = 0.0, 1.0
    z = encode_latents(vae, shapes_data.seeds(n))
    vae.shift_factor, vae.scaling_factor = saved
    return float(z.mean()), float(1.0 / z.std())


# ---- command line ----------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.train_image", description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["vae", "text", "dit", "export"])
    ap.add_argument("--out", type=Path, required=True, help="run folder (checkpoints, logs, caches)")
    ap.add_argument("--to", type=Path, help="export: the diffusers folder to write")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long (resume later)")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop at this step (resume later with the same --steps: the schedule is unchanged)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fg-weight", type=float, default=0.0,
                    help="vae, dit: extra weight of the shape's (latent) pixels in the loss")
    ap.add_argument("--guidance", type=float, default=0.0,
                    help="export: the model's default guidance scale (CFG against the empty prompt; 0 is off)")
    ap.add_argument("--images", type=int, default=12000, help="dit: training images (latents encoded once)")
    ap.add_argument("--caption-every", type=int, default=3, help="text/dit: train on one long caption in this many")
    a = ap.parse_args(argv)
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(a.seed)

    if a.stage == "vae":
        params = init_params(vae_param_shapes(), a.seed)
        vae, binder = build_vae(params)
        loss = vae_loss_fn(vae, binder, kl_weight=1e-4)
        params, _ = train("vae", out, params, loss, vae_batches(a.seed, a.batch or 16, fg_weight=a.fg_weight),
                          steps=a.steps or 2000, lr=a.lr or 2e-3, minutes=a.minutes, ckpt_every=50, stop_at=a.stop_at)
        vae, _ = build_vae(params)
        shift, scale = latent_stats(vae)
        cfg = dict(VAE_CONFIG, shift_factor=shift, scaling_factor=scale)
        _save_component(out / "vae_export", cfg, params, dtype=mx.float32)
        print(f"[vae] exported, shift_factor {shift:.4f} scaling_factor {scale:.4f}")
    elif a.stage == "text":
        feats = encode_captions(all_captions(a.caption_every))
        np.savez(out / "captions.npz", **{f"c{i}": v for i, v in enumerate(feats.values())},
                 names=np.array(list(feats.keys())))
    elif a.stage == "dit":
        vae = load_vae_export(out / "vae_export")
        lat_file = out / f"latents_{a.images}.npz"
        train_seeds = [s for s in shapes_data.seeds(a.images * a.caption_every * 2)
                       if caption_in_subset(shapes_data.sample(s).caption, a.caption_every)][:a.images]
        if lat_file.is_file():
            lat = np.load(lat_file)["z"]
        else:
            t0 = time.time()
            lat = encode_latents(vae, train_seeds)
            np.savez(lat_file, z=lat)
            print(f"[dit] encoded {len(lat)} latents in {time.time() - t0:.0f} s, std {lat.std():.3f}")
        caps = [shapes_data.sample(s).caption for s in train_seeds]
        data = np.load(out / "captions.npz")
        names = [str(x) for x in data["names"]]
        feats = {n: data[f"c{i}"] for i, n in enumerate(names)}
        masks = latent_masks(train_seeds) if a.fg_weight > 0 else None
        params = init_params(dit_param_shapes(), a.seed)
        tr, binder = build_transformer(params)
        batches = dit_batches(a.seed, a.batch or 32, lat, caps, feats, masks=masks, fg_weight=a.fg_weight)
        train("dit", out, params, dit_loss_fn(tr, binder), batches, steps=a.steps or 6000, lr=a.lr or 1e-3,
              minutes=a.minutes, ckpt_every=100, log_every=20, stop_at=a.stop_at)
    else:
        to = a.to or out / "export"
        vae_dir = out / "vae_export"
        from safetensors.numpy import load_file

        vae_params = {k: mx.array(v) for k, v in load_file(str(vae_dir / "diffusion_pytorch_model.safetensors")).items()}
        vae_cfg = json.loads((vae_dir / "config.json").read_text())
        flat = mx.load(str(out / "dit.ckpt.safetensors"))
        dit_params = {k[2:]: v for k, v in flat.items() if k.startswith("p.")}
        defaults = {"width": SIDE, "height": SIDE, "steps": 16, "guidance": a.guidance}
        export_folder(to, vae_params, vae_cfg, dit_params, defaults)
        print(f"exported to {to}")


if __name__ == "__main__":
    main()
