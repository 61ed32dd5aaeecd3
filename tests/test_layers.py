"""The installed layout: one import package (``mlx_engine``), the layer rules of the design note (import-linter
contracts in ``pyproject.toml``), no import cycles, and a user's own ``models`` / ``cli`` / ``kvcache`` /
``imagegen`` never shadowing ours.

The contracts are checked on the files of a wheel built from the checkout: the repository keeps ``kvcache/``,
``models/``, ``imagegen/`` and ``cli/`` at its top level and setuptools maps them into ``mlx_engine``, so only the
installed tree has the layout whose imports the contracts speak of.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps .`` of the checkout (no build isolation: the test extras bring setuptools), without the
    CPU kernels (``MLX_ENGINE_NO_KERNELS``: the contracts are about the Python files; tests/test_cpu_kernels.py
    covers the kernels the install built)."""
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("wheel-build")
    src = build / "src"  # a copy, so the build's own folders never land in the checkout
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                            "__pycache__", ".pytest_cache", "runs", "*.so"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, MLX_ENGINE_NO_KERNELS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("mlx_engine-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel's files unpacked: what ``pip install`` puts in site-packages."""
    root = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root)
    return root


def test_the_wheel_installs_only_mlx_engine(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"mlx_engine", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    for f in ("mlx_engine/kvcache/causal.py", "mlx_engine/models/arch/llama.py", "mlx_engine/imagegen/zimage.py",
              "mlx_engine/cli/main.py", "mlx_engine/store/catalog.py", "mlx_engine/bench/mlx_lm_peer.py",
              "mlx_engine/server/app.py", "mlx_engine/assets/shapes-64/model_index.json"):
        assert f in names, f
    assert not any(n.startswith(("mlx_engine/training", "mlx_engine/tests", "mlx_engine/benchmarks")) for n in names)
    with zipfile.ZipFile(wheel) as z:
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        assert "mlx-engine = mlx_engine.cli.main:main" in z.read(entry).decode()


def _lint(site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(PYPROJECT)!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=site, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_layer_contracts_hold(installed):
    r = _lint(installed)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and "Contracts: 7 kept" in r.stdout, r.stdout


@pytest.mark.parametrize("file, line, contract", [
    ("weights/gguf.py", "from mlx_engine import store", "Layers"),         # an upward import
    ("models/layers/base.py", "import mlx.core", "Only the MLX backend"),          # mlx outside the backend
    ("api/__init__.py", "import mlx_lm", "mlx_lm only in the bench"),
    ("bench/run.py", "import llama_cpp", "llama_cpp only in the bench's llama.cpp peer"),
    ("cli/image.py", "from mlx_engine.imagegen import zimage", "The CLI goes through the API"),
    ("server/app.py", "from mlx_engine import bench", "Layers"),         # server and bench are independent rooms
    ("server/worker.py", "import mlx.core", "Only the MLX backend"),
    ("server/openai_api.py", "import llguidance", "llguidance only in the structured-output module"),
    ("models/layers/base.py", "from mlx_engine.models.generation import runner", "Models by concern"),
    ("models/text/tokenizer.py", "from mlx_engine.models.arch import llama", "Models by concern"),
])
def test_the_contracts_catch_a_bad_import(installed, tmp_path, file, line, contract):
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    target = site / "mlx_engine" / file
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    r = _lint(site)
    assert r.returncode != 0, r.stdout
    assert "6 kept, 1 broken" in r.stdout, r.stdout
    assert contract in r.stdout.split("Broken contracts", 1)[1], r.stdout


def test_no_import_cycles(installed):
    """No module imports, directly or through others, a module that imports it (imports for type checking included)."""
    code = r"""
import grimp, sys
g = grimp.build_graph("mlx_engine", exclude_type_checking_imports=False, cache_dir=None)
cycles = []
for m in sorted(g.modules):
    for n in sorted(g.find_modules_directly_imported_by(m)):
        chain = g.find_shortest_chain(importer=n, imported=m)
        if chain:
            cycles.append(" -> ".join((m,) + tuple(chain)))
print("\n".join(cycles))
print(len(g.modules), "modules")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=installed, env=dict(os.environ, PYTHONPATH=str(installed)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert int(lines[-1].split()[0]) > 50  # the whole package was read
    assert lines[:-1] == [], "\n".join(lines[:-1])


def test_a_users_own_packages_do_not_shadow_ours(tmp_path, smollm2_gguf, model_store):
    """A working folder with its own ``models/`` package, ``cli.py``, ``kvcache.py`` and ``imagegen.py`` (each
    raising on import): the Python API and ``mlx-engine run`` still answer."""
    work = tmp_path / "project"
    (work / "models").mkdir(parents=True)
    boom = "raise ImportError('the user\\'s own {} was imported')\n"
    (work / "models" / "__init__.py").write_text(boom.format("models"))
    for name in ("cli", "kvcache", "imagegen", "training"):
        (work / f"{name}.py").write_text(boom.format(name))
    env = dict(os.environ, MLX_ENGINE_HOME=str(model_store.root), PYTHONPATH=str(work))
    api = ("import mlx_engine; m = mlx_engine.load('smollm2:135m'); "
           "print(m.generate('What is the capital of France?', max_tokens=12))")
    r = subprocess.run([sys.executable, "-c", api], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    script = Path(sys.executable).with_name("mlx-engine")
    r = subprocess.run([str(script), "run", "smollm2:135m", "What is the capital of France?", "--max-tokens", "12"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
