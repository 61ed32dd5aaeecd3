"""The flow-matching Euler scheduler, as diffusers' ``FlowMatchEulerDiscreteScheduler``.

Source: diffusers 0.42 ``schedulers/scheduling_flow_match_euler_discrete.py`` (``__init__``, ``set_timesteps``,
``step``, ``scale_noise``, ``time_shift``, ``stretch_shift_to_terminal``, ``_convert_to_karras / _exponential /
_beta``), with ``calculate_shift`` from ``pipelines/flux/pipeline_flux.py`` (copied into
``pipelines/z_image/pipeline_z_image.py``) and the image-to-image start step from ``get_timesteps`` of
``pipelines/z_image/pipeline_z_image_img2img.py``.

The schedule is computed on the host with NumPy, in the same dtypes as diffusers (the training-time table in float32,
the inference schedule in float64, then rounded to float32), so sigmas and timesteps match diffusers to the last bit
or so. ``scheduler_config.json`` is read literally: every key diffusers' scheduler understands is honoured, or refused
with :class:`~mlx_engine.errors.UnsupportedError` naming the key.

Flow matching (Lipman et al. 2023; rectified flow, Liu et al. 2023): ``x_sigma = sigma * noise + (1 - sigma) * x_0``;
the model predicts the velocity ``noise - x_0`` and one Euler step is ``x <- x + (sigma_next - sigma) * v``.

This module uses NumPy and the ml interfaces only (never ``mlx``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.ml import DType, Tensor

__all__ = ["FlowMatchEulerScheduler", "calculate_shift", "retrieve_img2img_start", "z_image_default_sigmas",
           "CONFIG_NAME"]

CONFIG_NAME = "scheduler_config.json"

#: diffusers' defaults for every key of ``FlowMatchEulerDiscreteScheduler.__init__``.
DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "invert_sigmas": False,
    "shift_terminal": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "time_shift_type": "exponential",
    "stochastic_sampling": False,
}
_CLASS_NAMES = ("FlowMatchEulerDiscreteScheduler",)


def calculate_shift(image_seq_len: float, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """The resolution-dependent shift ``mu``: a line through ``(base_seq_len, base_shift)`` and
    ``(max_seq_len, max_shift)`` evaluated at ``image_seq_len`` (diffusers ``pipelines/flux/pipeline_flux.py``
    ``calculate_shift``, used as is by the Z-Image pipelines).

    Args:
        image_seq_len: the number of image tokens, ``(latent_h // 2) * (latent_w // 2)`` for 2x2 patches.

    Returns:
        ``mu`` (a Python float), for :meth:`FlowMatchEulerScheduler.set_timesteps`.
    """
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    mu = image_seq_len * m + b
    return mu


def retrieve_img2img_start(num_inference_steps: int, strength: float) -> int:
    """Index of the first denoising step for image-to-image with ``strength`` (diffusers
    ``pipelines/z_image/pipeline_z_image_img2img.py`` ``get_timesteps``)::

        init_timestep = min(num_inference_steps * strength, num_inference_steps)
        t_start = int(max(num_inference_steps - init_timestep, 0))

    The init image is noised to ``sigmas[t_start]`` (:meth:`FlowMatchEulerScheduler.scale_noise`) and the loop runs
    steps ``t_start .. num_inference_steps - 1``; ``num_inference_steps - t_start`` steps in all (diffusers refuses
    fewer than one).

    Raises:
        InvalidRequestError: ``strength`` outside ``[0, 1]`` or ``num_inference_steps < 1``.
    """
    if not 0.0 <= float(strength) <= 1.0:
        raise InvalidRequestError(f"strength must be in [0, 1], got {strength}")
    check_steps(num_inference_steps)
    init_timestep = min(num_inference_steps * strength, num_inference_steps)
    return int(max(num_inference_steps - init_timestep, 0))


#: The most denoising steps a generation may ask for (schedulers are trained on 1000 timesteps; a bigger count in a
#: request or in a PNG's metadata is refused before any schedule is made).
MAX_STEPS = 1000


def check_steps(steps: Any) -> int:
    """``steps`` as a step count.

    Raises:
        InvalidRequestError: not an integer from 1 to :data:`MAX_STEPS`.
    """
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= MAX_STEPS:
        raise InvalidRequestError(f"steps (num_inference_steps) must be an integer from 1 to {MAX_STEPS}, "
                                  f"got {steps!r}")
    return int(steps)


def z_image_default_sigmas(num_inference_steps: int) -> list[float]:
    """The sigmas the Z-Image pipelines pass to ``set_timesteps`` when the caller gives none (diffusers
    ``pipelines/z_image/pipeline_z_image.py`` ``get_default_z_image_sigmas``:
    ``torch.linspace(1.0, 1 / n, n).tolist()``, float32 values as Python floats).

    The values reproduce ``torch.linspace`` in float32 (see :func:`_torch_linspace_f32`), so the pipeline can build
    the same schedule without torch.
    """
    n = check_steps(num_inference_steps)
    return [float(v) for v in _torch_linspace_f32(1.0, 1.0 / n, n)]


def _torch_linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps)`` in float32 on CPU (aten ``RangeFactoriesKernel.cpp``): the first half
    ``start + i * step``, the second ``end - (steps - 1 - i) * step``, ``step = (end - start) / (steps - 1)`` in
    float32, each value rounded once (the kernel's fused multiply-add, emulated in float64, where ``step * i`` and the
    sum are exact). Equal to torch's x86-64 CPU build for every length tried (1..999)."""
    f = np.float32
    s, e = f(start), f(end)
    if steps == 1:
        return np.array([s], dtype=np.float32)
    step = np.float64((e - s) / f(steps - 1))
    halfway = steps // 2
    i = np.arange(steps, dtype=np.float64)
    first = np.float64(s) + step * i[:halfway]
    second = np.float64(e) - step * (steps - 1 - i[halfway:])
    return np.concatenate([first, second]).astype(np.float32)


def _beta_ppf(q: float, a: float, b: float) -> float:
    """Quantile of the Beta(a, b) distribution (``scipy.stats.beta.ppf``), by bisection on the regularized incomplete
    beta function :func:`_betainc` (accurate to about 1e-15)."""
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _betainc(a, b, mid) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` by its continued fraction (modified Lentz), with the
    symmetry ``I_x(a, b) = 1 - I_{1-x}(b, a)`` where the fraction converges slowly (Numerical Recipes 6.4)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return h


class FlowMatchEulerScheduler:
    """Flow-matching Euler sampler schedule (diffusers ``FlowMatchEulerDiscreteScheduler``).

    Attributes:
        config: the scheduler configuration: diffusers' defaults overlaid with the keys of ``scheduler_config.json``
            (keys starting with ``_`` kept as they are).
        sigmas: float32 ``[steps + 1]`` after :meth:`set_timesteps`, from about 1 (pure noise) down to the appended
            terminal 0 (1 when ``invert_sigmas``). Before it: the training table ``[num_train_timesteps]``.
        timesteps: float32 ``[steps]``, ``sigmas[:-1] * num_train_timesteps`` (the transformer's ``t`` input; the
            Z-Image transformer takes ``(1000 - t) / 1000``, which is the pipeline's business).
        num_inference_steps: the step count of the last :meth:`set_timesteps`, or None.
    """

    def __init__(self, config: dict | None = None):
        cfg = dict(DEFAULTS)
        for key, value in (config or {}).items():
            cfg[key] = value
        self.config: dict[str, Any] = cfg
        self._validate()
        n = int(cfg["num_train_timesteps"])
        shift = cfg["shift"]
        # __init__ of the diffusers class: a float32 table (torch float32 ops are NumPy float32 ops with a weak scalar).
        timesteps = np.linspace(1, n, n, dtype=np.float32)[::-1].copy()
        sigmas = timesteps / np.float32(n)
        if not cfg["use_dynamic_shifting"]:
            sigmas = (np.float32(shift) * sigmas / (np.float32(1) + np.float32(shift - 1) * sigmas)).astype(np.float32)
        self.timesteps: np.ndarray = (sigmas * np.float32(n)).astype(np.float32)
        self.sigmas: np.ndarray = sigmas.astype(np.float32)
        self.sigma_min = float(self.sigmas[-1])
        self.sigma_max = float(self.sigmas[0])
        self.shift = shift
        self.num_inference_steps: int | None = None

    def _validate(self) -> None:
        cfg = self.config
        name = cfg.get("_class_name")
        if name is not None and name not in _CLASS_NAMES:
            raise UnsupportedError(f"scheduler _class_name {name!r} is not supported; this engine implements "
                                   f"{', '.join(_CLASS_NAMES)}")
        if cfg["time_shift_type"] not in ("exponential", "linear"):
            raise UnsupportedError(f"scheduler time_shift_type {cfg['time_shift_type']!r} is not supported; "
                                   "use 'exponential' or 'linear' (as diffusers)")
        chosen = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas") if cfg[k]]
        if len(chosen) > 1:
            raise UnsupportedError(f"scheduler config sets {' and '.join(chosen)}; at most one of them may be true")
        if cfg["stochastic_sampling"]:
            raise UnsupportedError("scheduler stochastic_sampling=true is not supported (its step draws fresh noise "
                                   "that this engine's Euler step does not take)")
        try:
            n = int(cfg["num_train_timesteps"])
            float(cfg["shift"])
        except (TypeError, ValueError):
            raise UnsupportedError("scheduler num_train_timesteps and shift must be numbers, got "
                                   f"{cfg['num_train_timesteps']!r} and {cfg['shift']!r}") from None
        if n < 1 or n != cfg["num_train_timesteps"]:
            raise UnsupportedError(f"scheduler num_train_timesteps must be a positive integer, got "
                                   f"{cfg['num_train_timesteps']!r}")
        if cfg["shift_terminal"] and not 0.0 <= float(cfg["shift_terminal"]) < 1.0:
            raise UnsupportedError(f"scheduler shift_terminal must be in [0, 1), got {cfg['shift_terminal']!r}")

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict) -> "FlowMatchEulerScheduler":
        """A scheduler from the keys of a ``scheduler_config.json`` (missing keys take diffusers' defaults; unknown
        keys are kept in :attr:`config` and ignored, as diffusers ignores them).

        Raises:
            UnsupportedError: another ``_class_name``, an unknown ``time_shift_type``, several of
                ``use_karras_sigmas`` / ``use_exponential_sigmas`` / ``use_beta_sigmas``, ``stochastic_sampling``,
                or a malformed number; the message names the key.
        """
        if not isinstance(config, dict):
            raise UnsupportedError(f"scheduler config must be a JSON object, got {type(config).__name__}")
        return cls(config)

    @classmethod
    def from_folder(cls, path: "str | os.PathLike[str]") -> "FlowMatchEulerScheduler":
        """A scheduler from a diffusers ``scheduler/`` folder (its ``scheduler_config.json``), or from the JSON
        file itself.

        Raises:
            WeightsError: the folder or ``scheduler_config.json`` is missing, unreadable, or not a JSON object (the
                message names the path).
            UnsupportedError: as :meth:`from_config`.
        """
        p = Path(os.fspath(path))
        file = p / CONFIG_NAME if p.is_dir() else p
        if not p.exists():
            raise WeightsError(f"{p}: no such scheduler folder (expected a folder holding {CONFIG_NAME})")
        if not file.is_file():
            raise WeightsError(f"{p}: no {CONFIG_NAME} in the scheduler folder")
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{file}: cannot read the scheduler config: {e}") from None
        if not isinstance(config, dict):
            raise WeightsError(f"{file}: the scheduler config is not a JSON object")
        return cls.from_config(config)

    # ---- the schedule -------------------------------------------------------------------------------------------
    def set_timesteps(self, num_inference_steps: int | None, mu: float | None = None,
                      sigmas: "list[float] | None" = None) -> None:
        """Compute :attr:`sigmas` (float32 ``[n + 1]``, last 0) and :attr:`timesteps` (float32 ``[n]``) as diffusers'
        ``set_timesteps`` does.

        Default sigmas are ``linspace(sigma_max, sigma_min, n)`` of the training table (float64); given ``sigmas``
        (e.g. :func:`z_image_default_sigmas`) are taken as float32. Then the shift: static,
        ``shift * s / (1 + (shift - 1) * s)``, or dynamic with ``mu``, ``e^mu / (e^mu + (1/s - 1))`` (exponential) or
        ``mu / (mu + (1/s - 1))`` (linear); then the optional stretch to ``shift_terminal``, the optional Karras /
        exponential / beta conversion, float32, ``timesteps = sigmas * num_train_timesteps``, and the terminal sigma.

        Args:
            num_inference_steps: the number of denoising steps ``n`` (>= 1); may be None when ``sigmas`` is given.
            mu: the dynamic shift (:func:`calculate_shift`); required when ``use_dynamic_shifting``, else ignored.
            sigmas: explicit sigmas, one per step (its length must equal ``num_inference_steps`` when both are
                given).

        Raises:
            InvalidRequestError: a missing ``mu`` with dynamic shifting, fewer than one step, a length mismatch, or a
                ``shift_terminal`` stretch of a schedule ending at sigma 1 (diffusers divides by zero there).
        """
        cfg = self.config
        n_train = cfg["num_train_timesteps"]
        if cfg["use_dynamic_shifting"] and mu is None:
            raise InvalidRequestError("mu must be given when the scheduler config has use_dynamic_shifting=true "
                                      "(see calculate_shift)")
        if num_inference_steps is not None:
            if sigmas is not None and len(sigmas) != num_inference_steps:
                raise InvalidRequestError(f"{len(sigmas)} sigmas given for {num_inference_steps} inference steps; "
                                          "they must be as many")
        elif sigmas is None:
            raise InvalidRequestError("give num_inference_steps or sigmas")
        else:
            num_inference_steps = len(sigmas)
        num_inference_steps = check_steps(num_inference_steps)

        if sigmas is None:
            t = np.linspace(self.sigma_max * n_train, self.sigma_min * n_train, num_inference_steps)
            s = t / n_train
        else:
            s = np.array(sigmas).astype(np.float32)
            num_inference_steps = len(s)

        if cfg["use_dynamic_shifting"]:
            s = self._time_shift(mu, 1.0, s)
        else:
            s = self.shift * s / (1 + (self.shift - 1) * s)
        if cfg["shift_terminal"]:
            one_minus_z = 1 - s
            if one_minus_z[-1] == 0:
                raise InvalidRequestError(
                    f"shift_terminal={cfg['shift_terminal']} cannot stretch a schedule whose last sigma is 1 "
                    f"({num_inference_steps} step(s)); diffusers would return NaN sigmas. Use more steps")
            scale_factor = one_minus_z[-1] / (1 - cfg["shift_terminal"])
            s = 1 - (one_minus_z / scale_factor)
        if cfg["use_karras_sigmas"]:
            s = self._karras(s, num_inference_steps)
        elif cfg["use_exponential_sigmas"]:
            s = self._exponential(s, num_inference_steps)
        elif cfg["use_beta_sigmas"]:
            s = self._beta(s, num_inference_steps)

        s32 = np.asarray(s).astype(np.float32)
        if cfg["invert_sigmas"]:
            s32 = (np.float32(1.0) - s32).astype(np.float32)
            terminal = np.ones(1, dtype=np.float32)
        else:
            terminal = np.zeros(1, dtype=np.float32)
        self.timesteps = (s32 * np.float32(n_train)).astype(np.float32)
        self.sigmas = np.concatenate([s32, terminal]).astype(np.float32)
        self.num_inference_steps = num_inference_steps

    def _time_shift(self, mu: float, sigma: float, t: np.ndarray) -> np.ndarray:
        if self.config["time_shift_type"] == "exponential":
            return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)
        return mu / (mu + (1 / t - 1) ** sigma)

    @staticmethod
    def _karras(in_sigmas: np.ndarray, n: int) -> np.ndarray:
        """Karras et al. 2022 (EDM) rho = 7 spacing between the schedule's ends (diffusers ``_convert_to_karras``)."""
        sigma_min, sigma_max = in_sigmas[-1].item(), in_sigmas[0].item()
        rho = 7.0
        ramp = np.linspace(0, 1, n)
        min_inv_rho = sigma_min ** (1 / rho)
        max_inv_rho = sigma_max ** (1 / rho)
        return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho

    @staticmethod
    def _exponential(in_sigmas: np.ndarray, n: int) -> np.ndarray:
        """Log-linear spacing between the schedule's ends (diffusers ``_convert_to_exponential``)."""
        sigma_min, sigma_max = in_sigmas[-1].item(), in_sigmas[0].item()
        return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))

    @staticmethod
    def _beta(in_sigmas: np.ndarray, n: int, alpha: float = 0.6, beta: float = 0.6) -> np.ndarray:
        """Beta(0.6, 0.6) quantile spacing (Lee et al. 2024, "Beta Sampling is All You Need"; diffusers
        ``_convert_to_beta``, which calls ``scipy.stats.beta.ppf``; computed here without SciPy)."""
        sigma_min, sigma_max = in_sigmas[-1].item(), in_sigmas[0].item()
        return np.array([sigma_min + (_beta_ppf(float(q), alpha, beta) * (sigma_max - sigma_min))
                         for q in 1 - np.linspace(0, 1, n)])

    # ---- sampling -----------------------------------------------------------------------------------------------
    def _check_index(self, step_index: int, last: int) -> int:
        i = int(step_index)
        if not 0 <= i <= last:
            raise InvalidRequestError(f"step index {step_index} is out of range 0..{last} for "
                                      f"{self.num_inference_steps} inference steps")
        return i

    def step(self, model_output: Tensor, step_index: int, sample: Tensor) -> Tensor:
        """One Euler step of the flow ODE: ``sample + (sigmas[i + 1] - sigmas[i]) * model_output``.

        As diffusers' ``step``: the sample is upcast to float32, ``dt`` is the float32 difference of the two sigmas,
        and the result is cast to ``model_output``'s dtype (the model output is upcast too, so a bfloat16 velocity
        is applied in float32).

        Args:
            model_output: the predicted velocity, same shape as ``sample`` (any layout, e.g. latents ``[B, h, w, C]``).
            step_index: ``i`` in ``0 .. num_inference_steps - 1``, the position in :attr:`timesteps`.
            sample: the current latents ``x_{sigma_i}``.

        Returns:
            ``x_{sigma_{i+1}}``, same shape, in ``model_output.dtype``.
        """
        i = self._check_index(step_index, len(self.sigmas) - 2)
        dt = self.sigmas[i + 1] - self.sigmas[i]  # float32 scalar, as torch's 0-d float32 difference
        out = sample.astype(DType.FLOAT32) + model_output.astype(DType.FLOAT32) * float(dt)
        return out if model_output.dtype == DType.FLOAT32 else out.astype(model_output.dtype)

    def scale_noise(self, sample: Tensor, step_index: int, noise: Tensor) -> Tensor:
        """The forward (noising) process for image-to-image: ``sigma * noise + (1 - sigma) * sample`` with
        ``sigma = sigmas[step_index]`` (diffusers ``scale_noise`` with ``begin_index = step_index``; use
        :func:`retrieve_img2img_start` for the index).

        Args:
            sample: the clean latents ``x_0`` (e.g. VAE latents, scaled and shifted as the transformer sees them).
            step_index: the index into :attr:`sigmas`.
            noise: standard normal noise of the same shape.

        Returns:
            the noised latents, in ``sample.dtype`` (bit-exact with diffusers for float32; for half-precision
            samples diffusers rounds sigma to that dtype before ``1 - sigma``, here ``1 - sigma`` is rounded once).
        """
        i = self._check_index(step_index, len(self.sigmas) - 1)
        sigma = self.sigmas[i]
        one_minus = np.float32(1.0) - sigma  # float32, as torch's (1.0 - sigma) on a float32 sigma
        return noise * float(sigma) + sample * float(one_minus)

    def __len__(self) -> int:
        return int(self.config["num_train_timesteps"])

    def __repr__(self) -> str:
        return (f"FlowMatchEulerScheduler(shift={self.shift}, dynamic={self.config['use_dynamic_shifting']}, "
                f"steps={self.num_inference_steps})")
