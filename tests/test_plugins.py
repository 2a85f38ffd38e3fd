"""Plug-ins (tlt_jax.plugins, tlt_jax.registry): a drafter, algorithm or task registered by a
decorator from a module of the user's own that the config's `plugins` names, imported before
the config is read and validated; docs/extending.md's worked module and command, run from a
directory outside the package."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tlt_jax import plugins
from tlt_jax.cli import config_from_file
from tlt_jax.components import algorithm_from_config, validate_config
from tlt_jax.config import ConfigError
from tlt_jax.drafters import DRAFTERS, register_drafter
from tlt_jax.registry import register
from tlt_jax.rl.algorithms import ALGORITHMS, register_algorithm
from tlt_jax.rl.tasks import TASKS, register_task

PAGE = pathlib.Path(REPO, "docs", "extending.md").read_text()
# docs/extending.md's plug-in module and the command that trains with it.
MODULE = re.search(r"```python my_plugins.py\n(.*?)```", PAGE, re.DOTALL).group(1)
COMMAND = re.search(r"```text\n(python -m tlt_jax.train [^\n]*--config.plugins=[^\n]*)\n```",
                    PAGE).group(1)


@pytest.fixture
def registries(monkeypatch):
  """The registries and the plug-in files imported, as they were before the test."""
  for registry in (DRAFTERS, ALGORITHMS, TASKS, plugins._FILES):
    for name, value in list(registry.items()):
      monkeypatch.setitem(registry, name, value)
  before = {id(r): set(r) for r in (DRAFTERS, ALGORITHMS, TASKS, plugins._FILES)}
  modules = set(sys.modules)
  yield
  for registry in (DRAFTERS, ALGORITHMS, TASKS, plugins._FILES):
    for name in set(registry) - before[id(registry)]:
      del registry[name]
  for name in set(sys.modules) - modules:
    if name.startswith(("tlt_jax_file_", "plugin_by_name")):
      del sys.modules[name]


@pytest.fixture
def plugin_file(tmp_path, registries):
  path = tmp_path / "my_plugins.py"
  path.write_text(MODULE)
  return path


def test_a_taken_name_is_refused_in_one_line():
  registry = {}

  class First:
    pass

  class Second:
    pass
  assert register(registry, "echo", "drafter")(First) is First and registry == {"echo": First}
  with pytest.raises(ValueError, match=r"^drafter 'echo' is registered already \(by "
                                       r"tests.test_plugins.*First\); give "
                                       r"tests.test_plugins.*Second another name$"):
    register(registry, "echo", "drafter")(Second)
  with pytest.raises(ValueError, match="must be an identifier: it names the config section"):
    register(registry, "my-drafter", "drafter")


@pytest.mark.parametrize("decorator, name", [(register_drafter, "eagle"),
                                             (register_algorithm, "grpo"),
                                             (register_task, "arithmetic")])
def test_the_built_in_names_are_taken(decorator, name, registries):
  with pytest.raises(ValueError, match=f"'{name}' is registered already"):
    decorator(name)(type("Other", (), {}))


def test_a_plugin_file_is_imported_once_and_its_algorithm_gets_a_section(plugin_file):
  """plugins=<file>: imported before the config file is read (the override of its section's
  knob applies), once however often it is named; the algorithm is the one the config builds."""
  spec = os.path.join(REPO, "configs", "default.py")
  config = config_from_file(spec, [f"plugins={plugin_file}", "rl.algorithm=clipped_grpo",
                                   "rl.clipped_grpo.max_abs=0.5"])
  validate_config(config)
  algorithm = algorithm_from_config(config)
  assert type(algorithm).__name__ == "ClippedGrpo" and algorithm.settings.max_abs == 0.5
  again = config_from_file(spec, [f"plugins={plugin_file},{plugin_file}"])
  assert again.rl.clipped_grpo.max_abs == 1.0  # imported once: no second registration
  with pytest.raises(ConfigError, match=r"rl.clipped_grpo.max_abs=-1.0 must be > 0"):
    validate_config(config_from_file(spec, [f"plugins={plugin_file}",
                                            "rl.algorithm=clipped_grpo",
                                            "rl.clipped_grpo.max_abs=-1"]))


def test_a_config_file_that_names_its_plugins_gets_their_sections(plugin_file, tmp_path):
  """c.plugins set in the config file itself: the sections are added after it ran."""
  config_file = tmp_path / "my_config.py"
  config_file.write_text(
      "from tlt_jax.config import base_config\n\n\n"
      "def get_config(arg=None):\n"
      "  c = base_config()\n"
      f"  c.plugins = {str(plugin_file)!r}\n"
      "  c.rl.algorithm = 'clipped_grpo'\n"
      "  return c\n")
  config = config_from_file(str(config_file))
  assert config.rl.clipped_grpo.max_abs == 1.0
  assert type(algorithm_from_config(config)).__name__ == "ClippedGrpo"


def test_a_module_name_on_the_path_and_the_errors_name_the_knob(tmp_path, monkeypatch,
                                                                registries):
  (tmp_path / "plugin_by_name.py").write_text(
      "import dataclasses\n"
      "from tlt_jax.rl.tasks import ArithmeticTask, register_task\n\n\n"
      "@register_task('arithmetic_copy')\n"
      "@dataclasses.dataclass(frozen=True)\n"
      "class ArithmeticCopy(ArithmeticTask):\n"
      "  pass\n")
  (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  (module,) = plugins.import_plugins(" plugin_by_name ")
  assert TASKS["arithmetic_copy"] is module.ArithmeticCopy
  with pytest.raises(ConfigError, match=r"^plugins='no_such_module': No module named "
                                        r"'no_such_module' \(a module name must be importable"):
    plugins.import_plugins("plugin_by_name,no_such_module")
  with pytest.raises(ConfigError, match=r"^plugins='nope.py': no such file"):
    plugins.import_plugins(["nope.py"])
  with pytest.raises(ConfigError, match=r"^plugins='.*broken.py' failed to import: "
                                        r"RuntimeError: boom$"):
    plugins.import_plugins(str(tmp_path / "broken.py"))
  assert not any(m.startswith("tlt_jax_file_broken") for m in sys.modules)


def _job(cwd, *extra) -> subprocess.CompletedProcess:
  """The page's command, run in `cwd` (outside the package) with the repository's config."""
  words = shlex.split(COMMAND)
  words = [os.path.join(REPO, w) if w == "configs/default.py" else w for w in words]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  return subprocess.run([sys.executable, *words[1:], *extra], cwd=cwd, env=env, text=True,
                        capture_output=True, timeout=900, check=False)


def test_the_job_validates_the_plugin_s_section_from_the_command_line(plugin_file):
  r = _job(plugin_file.parent, "--config.rl.clipped_grpo.max_abs=0")
  assert r.returncode == 1, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == ("config error: rl.clipped_grpo.max_abs=0.0 "
                                               "must be > 0")


@pytest.mark.slow
def test_the_documented_plugin_trains_from_outside_the_package(plugin_file):
  """docs/extending.md's module and command, one RL step: the run used the plug-in."""
  r = _job(plugin_file.parent, "--config.rl.steps=1", "--config.rl.eval_every=0")
  assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
  metrics = plugin_file.parent / "runs" / "clipped" / "metrics.jsonl"
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [row["advantage_max_abs"] for row in rows] == [0.5]
