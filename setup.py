"""Builds mlx-engine's CPU kernels (``mlx_engine.mlx._kernels``, an MLX extension; sources in
``mlx_engine/mlx/kernels``) with CMake at install. Everything else is declared in pyproject.toml.

The kernels are optional: where they cannot be built (no C++ compiler, no CMake, an MLX without its CMake files) the
install goes on with a warning, and the engine runs quantized weights through MLX's own operations
(``mlx-engine run --verbose`` says which). ``MLX_ENGINE_NO_KERNELS=1`` skips the build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: Path):
        # optional: an install without the kernels (MLX_ENGINE_NO_KERNELS, a failed build) copies nothing in place
        super().__init__(name, sources=[], optional=True)
        self.sourcedir = str(sourcedir)


class OptionalCMakeBuild(build_ext):
    """Configure and build each extension's CMake project into the place setuptools expects the module."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        if os.environ.get("MLX_ENGINE_NO_KERNELS", "").lower() in ("1", "true", "yes", "on"):
            print("mlx-engine: MLX_ENGINE_NO_KERNELS is set; not building the CPU kernels", file=sys.stderr)
            return
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        # The module finds libmlx.so in the installed mlx package beside it (site-packages/mlx/lib).
        rpath = "$ORIGIN/" + "../" * ext.name.count(".") + "mlx/lib" if sys.platform.startswith("linux") else \
            "@loader_path/" + "../" * ext.name.count(".") + "mlx/lib"
        configure = [
            "cmake", "-S", ext.sourcedir, "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={target.parent}",
            "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", f"-DCMAKE_INSTALL_RPATH={rpath}",
            f"-DPYTHON_MODULE_EXTENSION={sysconfig.get_config_var('EXT_SUFFIX')}",
        ]
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        try:
            subprocess.run(configure, check=True)
            subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"mlx-engine: WARNING: the CPU kernels were not built ({e}); quantized weights will run through "
                  "MLX's own operations, slower on the CPU", file=sys.stderr)


setup(
    ext_modules=[CMakeExtension("mlx_engine.mlx._kernels", HERE / "mlx_engine" / "mlx" / "kernels")],
    cmdclass={"build_ext": OptionalCMakeBuild},
)
