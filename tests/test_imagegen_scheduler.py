"""The flow-matching Euler scheduler against diffusers' ``FlowMatchEulerDiscreteScheduler`` (PyTorch CPU): sigmas,
timesteps, Euler steps, image-to-image noising and start index, for static and dynamic shift configurations, several
step counts and image sizes; errors for missing or bad configs."""

from __future__ import annotations

import json
import math
import platform
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402
from diffusers.pipelines.z_image import pipeline_z_image, pipeline_z_image_img2img  # noqa: E402

from mlx_engine.imagegen.scheduler import (  # noqa: E402
    FlowMatchEulerScheduler,
    _beta_ppf,
    calculate_shift,
    retrieve_img2img_start,
    z_image_default_sigmas,
)
from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError  # noqa: E402
from mlx_engine.mlx import MLXContext  # noqa: E402

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json (the keys that differ from diffusers' defaults).
Z_IMAGE_TURBO = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.36.0.dev0",
                 "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
# black-forest-labs/FLUX.1-dev scheduler config (dynamic shifting).
FLUX_DEV = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
            "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
            "use_dynamic_shifting": True}

CONFIGS = {
    "z-image-turbo": Z_IMAGE_TURBO,
    "defaults": {},
    "static-shift-1.15": {"shift": 1.15, "num_train_timesteps": 500},
    "flux-dynamic": FLUX_DEV,
    "dynamic-linear": {**FLUX_DEV, "time_shift_type": "linear"},
    "dynamic-terminal": {**FLUX_DEV, "shift_terminal": 0.1, "max_shift": 2.05, "base_shift": 0.95},
    "static-terminal": {"shift": 3.0, "shift_terminal": 0.02},
    "invert": {"shift": 2.0, "invert_sigmas": True},
    "karras": {"shift": 3.0, "use_karras_sigmas": True},
    "exponential": {**FLUX_DEV, "use_exponential_sigmas": True},
}
STEPS = (1, 4, 8, 9, 30, 50)
SIZES = ((256, 256), (512, 512), (1024, 1024), (768, 1344), (2048, 2048))  # pixels (h, w)


def seq_len(h: int, w: int) -> int:
    """Image tokens of the Z-Image / FLUX pipelines: latents h/8 x w/8 in 2x2 patches."""
    return (h // 16) * (w // 16)


def mu_for(config: dict, h: int, w: int) -> float:
    c = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15, **config}
    return calculate_shift(seq_len(h, w), c["base_image_seq_len"], c["max_image_seq_len"], c["base_shift"],
                           c["max_shift"])


def reference(config: dict) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler.from_config({k: v for k, v in config.items()})


def assert_schedule(ours: FlowMatchEulerScheduler, ref: FlowMatchEulerDiscreteScheduler, exact: bool = True):
    assert ours.sigmas.dtype == np.float32 and ours.timesteps.dtype == np.float32
    rs, rt = ref.sigmas.numpy(), ref.timesteps.numpy()
    assert ours.sigmas.shape == rs.shape and ours.timesteps.shape == rt.shape
    np.testing.assert_allclose(ours.sigmas, rs, rtol=0, atol=1e-6)
    # timesteps are sigmas * 1000: 1e-6 relative to their scale
    np.testing.assert_allclose(ours.timesteps, rt, rtol=0, atol=1e-6 * max(1.0, float(np.abs(rt).max())))
    if exact:
        np.testing.assert_array_equal(ours.sigmas, rs)
        np.testing.assert_array_equal(ours.timesteps, rt)


def test_calculate_shift_equals_diffusers():
    for h, w in SIZES:
        n = seq_len(h, w)
        assert calculate_shift(n) == pipeline_z_image.calculate_shift(n)
        assert calculate_shift(n, 256, 8192, 0.3, 1.7) == pipeline_z_image.calculate_shift(n, 256, 8192, 0.3, 1.7)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_training_table_equals_diffusers(name):
    ours, ref = FlowMatchEulerScheduler.from_config(CONFIGS[name]), reference(CONFIGS[name])
    np.testing.assert_array_equal(ours.sigmas, ref.sigmas.numpy())
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy())
    assert ours.sigma_min == ref.sigma_min and ours.sigma_max == ref.sigma_max


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_default_schedule_equals_diffusers(name):
    config = CONFIGS[name]
    ours, ref = FlowMatchEulerScheduler.from_config(config), reference(config)
    dynamic = config.get("use_dynamic_shifting", False)
    for steps in STEPS:
        for h, w in (SIZES if dynamic else SIZES[:1]):
            mu = mu_for(config, h, w) if dynamic else None
            if config.get("shift_terminal") and steps == 1:
                # one sigma of 1: diffusers' stretch divides 0 by 0 and returns NaN; we refuse
                with pytest.raises(InvalidRequestError, match="shift_terminal"):
                    ours.set_timesteps(steps, mu=mu)
                continue
            ours.set_timesteps(steps, mu=mu)
            ref.set_timesteps(steps, mu=mu)
            assert_schedule(ours, ref)
            assert ours.sigmas[-1] == (1.0 if config.get("invert_sigmas") else 0.0)
            assert ours.num_inference_steps == steps


@pytest.mark.parametrize("name", ["z-image-turbo", "flux-dynamic", "static-shift-1.15", "dynamic-terminal"])
def test_z_image_pipeline_sigmas_equal_diffusers(name):
    """The Z-Image pipelines pass explicit sigmas (linspace(1, 1/n, n)) and always a mu."""
    config = CONFIGS[name]
    ours, ref = FlowMatchEulerScheduler.from_config(config), reference(config)
    for steps in STEPS:
        sig = pipeline_z_image.get_default_z_image_sigmas(steps)
        for h, w in SIZES:
            mu = mu_for(config, h, w)
            if config.get("shift_terminal") and steps == 1:
                with pytest.raises(InvalidRequestError, match="shift_terminal"):
                    ours.set_timesteps(steps, mu=mu, sigmas=sig)
                continue
            ours.set_timesteps(steps, mu=mu, sigmas=sig)
            ref.set_timesteps(sigmas=sig, mu=mu)
            assert_schedule(ours, ref)
            ours.set_timesteps(None, mu=mu, sigmas=sig)
            assert_schedule(ours, ref)


def test_torch_linspace_reproduced_for_many_lengths():
    """Bit-equal to this torch build (x86-64 uses a fused multiply-add); never more than one float32 ulp apart."""
    for n in range(1, 300):
        ours = np.array(z_image_default_sigmas(n), np.float32)
        ref = pipeline_z_image.get_default_z_image_sigmas(n)
        np.testing.assert_array_max_ulp(ours, np.array(ref, np.float32), maxulp=1)
        if platform.machine() in ("x86_64", "AMD64"):
            assert ours.tolist() == ref, n


def test_z_image_turbo_known_values():
    """shift 3 applied twice (the table, then set_timesteps) as diffusers does: the first sigma is 1, the second of
    a 9-step Turbo schedule is 3s/(1+2s) of the pipeline's linspace value."""
    s = FlowMatchEulerScheduler.from_config(Z_IMAGE_TURBO)
    s.set_timesteps(9, mu=mu_for(Z_IMAGE_TURBO, 1024, 1024), sigmas=z_image_default_sigmas(9))
    assert s.sigmas[0] == 1.0 and s.timesteps[0] == 1000.0 and s.sigmas[-1] == 0.0
    x = np.float32(1 - (1 - 1 / 9) / 8)
    assert abs(s.sigmas[1] - 3 * x / (1 + 2 * x)) < 1e-6


def test_beta_sigmas_against_mpmath():
    """diffusers' beta sigmas need SciPy (not a dependency here); our Beta(0.6, 0.6) quantile is checked against
    mpmath's incomplete beta at 30 digits and the schedule against diffusers' formula with that quantile."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 30
    def ppf(q):
        if q <= 0 or q >= 1:
            return float(q >= 1)
        return float(mpmath.findroot(lambda x: mpmath.betainc(0.6, 0.6, 0, x, regularized=True) - q,
                                     (mpmath.mpf(0), mpmath.mpf(1)), solver="anderson", tol=1e-40))

    for q in (1e-9, 1e-4, 0.01, 0.1, 0.25, 0.5, 0.6, 0.77, 0.9, 0.999, 1 - 1e-9):
        assert abs(_beta_ppf(q, 0.6, 0.6) - ppf(q)) < 1e-14, q
    assert _beta_ppf(0.5, 0.6, 0.6) == pytest.approx(0.5, abs=1e-15)
    assert _beta_ppf(0.0, 0.6, 0.6) == 0.0 and _beta_ppf(1.0, 0.6, 0.6) == 1.0

    config = {"shift": 3.0, "use_beta_sigmas": True}
    s = FlowMatchEulerScheduler.from_config(config)
    for steps in (1, 4, 9, 30):
        s.set_timesteps(steps)
        plain = FlowMatchEulerScheduler.from_config({"shift": 3.0})
        plain.set_timesteps(steps)
        # the ends of the shifted schedule, in float64 as diffusers has them before its conversion
        t = np.linspace(plain.sigma_max * 1000, plain.sigma_min * 1000, steps) / 1000
        shifted = 3.0 * t / (1 + 2.0 * t)
        lo, hi = shifted[-1], shifted[0]
        want = np.array([lo + ppf(q) * (hi - lo) for q in 1 - np.linspace(0, 1, steps)]).astype(np.float32)
        np.testing.assert_allclose(s.sigmas[:-1], want, rtol=0, atol=1e-7)
        assert s.sigmas[-1] == 0.0


def test_step_equals_diffusers():
    ctx = MLXContext()
    rng = np.random.default_rng(1)
    for name in ("z-image-turbo", "flux-dynamic", "invert"):
        config = CONFIGS[name]
        ours, ref = FlowMatchEulerScheduler.from_config(config), reference(config)
        mu = mu_for(config, 512, 512)
        ours.set_timesteps(8, mu=mu)
        ref.set_timesteps(8, mu=mu)
        ref.set_begin_index(0)
        x = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)  # NCHW for diffusers
        ours_x = ctx.from_numpy(x.transpose(0, 2, 3, 1))  # channels last for us
        ref_x = torch.from_numpy(x)
        for i, t in enumerate(ref.timesteps):
            v = rng.standard_normal(x.shape).astype(np.float32) * 3
            ref_x = ref.step(torch.from_numpy(v), t, ref_x, return_dict=False)[0]
            ours_x = ours.step(ctx.from_numpy(v.transpose(0, 2, 3, 1)), i, ours_x)
            got = ours_x.numpy().transpose(0, 3, 1, 2)
            np.testing.assert_allclose(got, ref_x.numpy(), rtol=0, atol=1e-6)
        assert ours_x.numpy().dtype == np.float32


def test_step_upcasts_and_returns_the_model_output_dtype():
    from mlx_engine.ml import DType

    ctx = MLXContext()
    s = FlowMatchEulerScheduler.from_config(Z_IMAGE_TURBO)
    s.set_timesteps(4)
    x = ctx.from_numpy(np.ones((1, 2, 2, 4), np.float32))
    v = ctx.from_numpy(np.full((1, 2, 2, 4), 2.0, np.float32), DType.BFLOAT16)
    y = s.step(v, 0, x)
    assert y.dtype == DType.BFLOAT16
    dt = float(s.sigmas[1] - s.sigmas[0])
    np.testing.assert_allclose(y.numpy(), np.float32(1 + 2 * dt), rtol=1e-2)
    with pytest.raises(InvalidRequestError):
        s.step(v, 4, x)  # 4 steps: indices 0..3


@pytest.mark.parametrize("steps", [1, 4, 9, 30, 50])
def test_img2img_start_and_noise_equal_diffusers(steps):
    ctx = MLXContext()
    rng = np.random.default_rng(steps)
    for strength in (0.0, 0.05, 0.1, 0.3, 0.5, 0.6, 0.75, 0.9, 0.99, 1.0):
        ref = reference(Z_IMAGE_TURBO)
        ref.set_timesteps(sigmas=pipeline_z_image.get_default_z_image_sigmas(steps), mu=0.5)
        holder = SimpleNamespace(scheduler=ref)
        _, remaining = pipeline_z_image_img2img.ZImageImg2ImgPipeline.get_timesteps(holder, steps, strength, "cpu")
        t_start = retrieve_img2img_start(steps, strength)
        assert t_start == steps - remaining, (steps, strength)
        if remaining < 1:
            continue  # diffusers refuses to run with no step left
        x0 = rng.standard_normal((1, 16, 4, 6)).astype(np.float32)
        noise = rng.standard_normal(x0.shape).astype(np.float32)
        latent_timestep = ref.timesteps[t_start:t_start + 1]
        want = ref.scale_noise(torch.from_numpy(x0), latent_timestep, torch.from_numpy(noise)).numpy()
        ours = FlowMatchEulerScheduler.from_config(Z_IMAGE_TURBO)
        ours.set_timesteps(steps, mu=0.5, sigmas=z_image_default_sigmas(steps))
        got = ours.scale_noise(ctx.from_numpy(x0.transpose(0, 2, 3, 1)), t_start,
                               ctx.from_numpy(noise.transpose(0, 2, 3, 1)))
        np.testing.assert_allclose(got.numpy().transpose(0, 3, 1, 2), want, rtol=0, atol=1e-6)


def test_img2img_start_validates():
    with pytest.raises(InvalidRequestError):
        retrieve_img2img_start(8, 1.5)
    with pytest.raises(InvalidRequestError):
        retrieve_img2img_start(8, -0.1)
    with pytest.raises(InvalidRequestError):
        retrieve_img2img_start(0, 0.5)


def test_from_folder_reads_diffusers_saved_config(tmp_path):
    for name, config in CONFIGS.items():
        folder = tmp_path / name
        reference(config).save_config(folder)
        ours = FlowMatchEulerScheduler.from_folder(folder)
        saved = json.loads((folder / "scheduler_config.json").read_text())
        assert all(ours.config[k] == v for k, v in saved.items())
        assert FlowMatchEulerScheduler.from_folder(folder / "scheduler_config.json").config == ours.config
    # the real Z-Image-Turbo file, written as is
    folder = tmp_path / "turbo"
    folder.mkdir()
    (folder / "scheduler_config.json").write_text(json.dumps(Z_IMAGE_TURBO))
    s = FlowMatchEulerScheduler.from_folder(folder)
    assert s.shift == 3.0 and s.config["use_dynamic_shifting"] is False


def test_folder_errors(tmp_path):
    with pytest.raises(WeightsError, match="nowhere"):
        FlowMatchEulerScheduler.from_folder(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match="empty.*scheduler_config.json"):
        FlowMatchEulerScheduler.from_folder(empty)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "scheduler_config.json").write_text("{ not json")
    with pytest.raises(WeightsError, match="scheduler_config.json"):
        FlowMatchEulerScheduler.from_folder(bad)
    (bad / "scheduler_config.json").write_text("[1, 2]")
    with pytest.raises(WeightsError, match="not a JSON object"):
        FlowMatchEulerScheduler.from_folder(bad)
    (bad / "scheduler_config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(WeightsError, match="scheduler_config.json"):
        FlowMatchEulerScheduler.from_folder(bad)


def test_unsupported_configs_name_the_key():
    cases = {
        "_class_name": {"_class_name": "DDIMScheduler"},
        "time_shift_type": {"time_shift_type": "cosine"},
        "use_beta_sigmas": {"use_beta_sigmas": True, "use_karras_sigmas": True},
        "stochastic_sampling": {"stochastic_sampling": True},
        "num_train_timesteps": {"num_train_timesteps": "many"},
        "shift_terminal": {"shift_terminal": 1.5},
    }
    for key, config in cases.items():
        with pytest.raises(UnsupportedError, match=key):
            FlowMatchEulerScheduler.from_config(config)


def test_set_timesteps_errors():
    s = FlowMatchEulerScheduler.from_config(FLUX_DEV)
    with pytest.raises(InvalidRequestError, match="mu"):
        s.set_timesteps(8)
    with pytest.raises(InvalidRequestError, match="as many"):
        s.set_timesteps(8, mu=1.0, sigmas=[1.0, 0.5])
    with pytest.raises(InvalidRequestError):
        s.set_timesteps(0, mu=1.0)
    # mu is ignored by a static config, as in diffusers
    t = FlowMatchEulerScheduler.from_config(Z_IMAGE_TURBO)
    t.set_timesteps(4, mu=7.0)
    u = FlowMatchEulerScheduler.from_config(Z_IMAGE_TURBO)
    u.set_timesteps(4)
    np.testing.assert_array_equal(t.sigmas, u.sigmas)
    assert len(t) == 1000 and math.isclose(t.sigmas[0], 1.0)
