"""The README's quick start, CI and the declared dependencies stay in step."""

import ast
import configparser
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported by the package or the experiments but not needed by `pip install -e .`: test and
# comparison tools, and optional extras that the code imports only when asked.
OPTIONAL = {"torch", "gguf", "reasoning_gym", "pytest", "nbclient", "nbformat", "tensorboardX",
            "wandb"}
# Distribution name -> module name where they differ.
MODULE_OF = {"ml-collections": "ml_collections", "absl-py": "absl",
             "orbax-checkpoint": "orbax"}


def _quick_start_commands():
  text = open(os.path.join(REPO, "README.md")).read()
  section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```bash\n(.+?)\n```", section)


def test_quick_start_has_two_commands_and_ci_runs_both():
  commands = _quick_start_commands()
  assert len(commands) == 2, commands
  install, job = commands[0].split(" && ")
  assert install == "pip install -e ." and "python -m tlt_jax.train" in job
  assert "pytest" in commands[1]
  ci = open(os.path.join(REPO, ".ci", "run")).read()
  assert commands[1] in ci.splitlines(), "'.ci/run' must run the README's test command verbatim"
  # The first command as a smoke run: the package alone (without byte-compiling it, which
  # changes nothing it installs), then the main job on runlocal.
  assert "pip install -q --no-compile -e .\n" in ci
  assert "-m tlt_jax.train --config configs/default.py:runlocal" in ci


def _declared() -> set[str]:
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(REPO, "setup.cfg"))
  names = set()
  for line in cfg["options"]["install_requires"].splitlines():
    name = re.split(r"[<>=\[ ]", line.strip(), maxsplit=1)[0]
    if name:
      names.add(MODULE_OF.get(name, name).replace("-", "_"))
  return names


def _imported(folder: str) -> set[str]:
  names = set()
  for root, _, files in os.walk(os.path.join(REPO, folder)):
    for fn in files:
      if fn.endswith(".py"):
        tree = ast.parse(open(os.path.join(root, fn)).read())
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
          elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
  return names


def test_runtime_imports_are_declared_dependencies():
  """Every third-party package the library, configs and experiments import is in
  install_requires (and requirements.txt mirrors it), so `pip install -e .` is enough."""
  imported = set().union(*(_imported(d) for d in ("tlt_jax", "configs", "experiments")))
  scripts = {f[:-3] for f in os.listdir(os.path.join(REPO, "experiments")) if f.endswith(".py")}
  third_party = imported - set(sys.stdlib_module_names) - {"tlt_jax", "configs"} - scripts
  declared = _declared()
  missing = third_party - declared - OPTIONAL
  assert not missing, f"imported but not in setup.cfg install_requires: {sorted(missing)}"
  # transformers renders the chat template (tlt_jax.rl.tokenizer) with jinja2, which it
  # does not install itself.
  assert "jinja2" in declared
  requirements = {MODULE_OF.get(n, n).replace("-", "_") for n in (
      re.split(r"[<>=\[ ]", line.strip(), maxsplit=1)[0]
      for line in open(os.path.join(REPO, "requirements.txt"))
      if line.strip() and not line.startswith("#"))}
  assert requirements == declared
