"""The README and docs/ stay true: every relative link resolves (anchors included), every
command in a bash block parses (its module's argument parser, or for a job its config file and
overrides), the knob reference is the schema's, and docs/extending.md's examples run."""

import glob
import importlib
import os
import re
import shlex

import pytest

from tests.experiment_modules import parse_error
from tlt_jax.cli import config_from_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted({os.path.join(REPO, "README.md"), os.path.join(REPO, "CHANGELOG.md"),
                *glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)})
# The jobs' flags besides --config.<key>=<value> (absl; tlt_jax.cli).
JOB_FLAGS = {"--config", "--workdir", "--start_over"}
JOBS = {"tlt_jax.train", "tlt_jax.sft", "tlt_jax.warmup_drafter", "tlt_jax.generate"}


def _rel(path):
  return os.path.relpath(path, REPO)


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading."""
  s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return s.replace(" ", "-")


def _anchors(path: str) -> set[str]:
  text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
  return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def _links(path: str):
  text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)  # code is not a link
  text = re.sub(r"`[^`\n]*`", "", text)
  return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves(page):
  broken = []
  for target in _links(page):
    if re.match(r"[a-z]+:", target):  # https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(full):
      broken.append(f"{target} (no such file)")
    elif anchor and full.endswith(".md") and anchor not in _anchors(full):
      broken.append(f"{target} (no heading #{anchor})")
  assert not broken, f"{_rel(page)}: {broken}"


def test_the_readme_stays_short_and_leads_to_the_pages():
  lines = open(os.path.join(REPO, "README.md")).read().splitlines()
  assert len(lines) <= 250, len(lines)
  text = "\n".join(lines)
  for page in ("docs/getting_started.md", "docs/configs.md", "docs/design.md",
               "docs/extending.md", "docs/reproducing.md", "docs/gpu_lease.md",
               "docs/testing.md", "docs/results/README.md", "CHANGELOG.md"):
    assert f"]({page}" in text, page
  # The GPU end-to-end figure with its device and run, and projections marked as such.
  assert "1x H200" in text and "gpu_h200_2026-12-04" in text
  assert "projected, not measured" in text


# ---------------------------------------------------------------- commands


def _bash_commands(page: str) -> list[str]:
  """The commands of a page's bash blocks: continuation lines joined, comments dropped,
  VAR="..." assignments of the block substituted, split at && ; and |."""
  out = []
  for block in re.findall(r"```bash\n(.*?)```", open(page).read(), flags=re.S):
    block = re.sub(r"\\\n\s*", " ", block)
    env = {"OUT": "/tmp/out"}
    for line in block.splitlines():
      line = re.sub(r"(^|\s)#.*$", "", line).strip()
      m = re.fullmatch(r'([A-Z_]+)="(.*)"', line)
      if m:
        env[m.group(1)] = m.group(2)
        continue
      for name, value in env.items():
        line = line.replace(f"${name}", value)
      line = re.sub(r"\$[a-z_]+", "0", line)  # a shell loop's variable
      for part in re.split(r"&&|;|\|", line):
        part = re.sub(r"^(do|then|else)\s+|\s*&$", "", part.strip())
        part = re.sub(r"\s*\d?>&?\s*\S+", "", part)  # redirections: 2>&1, > file
        if part:
          out.append(part)
  return out


def _check_job(argv: list[str]) -> None:
  """A job's flags: known names, --flag=value form, a config file that loads with its
  overrides (placeholders such as CFG are not checked)."""
  spec, overrides = None, []
  for arg in argv:
    name, sep, value = arg.partition("=")
    if name == "--config" and not sep:
      raise AssertionError(f"--config takes its value after '=' or as the next word: {arg}")
    if name.startswith("--config."):
      assert sep, f"{arg}: a job takes --flag=value"
      overrides.append(f"{name[len('--config.'):]}={value}")
    elif name in JOB_FLAGS:
      if name == "--config":
        spec = value
    elif not arg.startswith("--"):
      continue  # the value of `--config X` / `--workdir X`
    else:
      raise AssertionError(f"unknown flag {name}")
  if spec and not re.fullmatch(r"[A-Z_]+", spec):
    config_from_file(os.path.join(REPO, spec) if not os.path.isabs(spec) else spec, overrides)


def _normalise_job_argv(argv: list[str]) -> list[str]:
  """`--config X` (absl takes the next word too) as `--config=X`."""
  out, i = [], 0
  while i < len(argv):
    if argv[i] in ("--config", "--workdir") and i + 1 < len(argv):
      out.append(f"{argv[i]}={argv[i + 1]}")
      i += 2
    else:
      out.append(argv[i])
      i += 1
  return out


def _inline_commands(page: str) -> list[str]:
  """`python -m ...` in the prose and in unlabelled code blocks, less synopses (with [...],
  {a,b}, a|b or ...)."""
  text = open(page).read()
  found = re.findall(r"`(python3? -m [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
  for block in re.findall(r"```\n(.*?)```", text, flags=re.S):
    found += [line for line in re.sub(r"\\\n\s*", " ", block).splitlines()
              if re.match(r"python3? -m ", line)]
  return [re.sub(r"\s+#.*$", "", c) for c in found if not re.search(r"[\[{|<]|\.\.\.", c)]


def _commands():
  found = []
  for page in PAGES:
    for command in _bash_commands(page) + _inline_commands(page):
      words = shlex.split(command)
      while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before a command
        words.pop(0)
      if len(words) >= 3 and re.fullmatch(r"python3?", words[0]) and words[1] == "-m":
        found.append((_rel(page), words[2], words[3:]))
  return found


COMMANDS = _commands()


def test_the_docs_show_commands():
  modules = {m for _, m, _ in COMMANDS}
  assert {"tlt_jax.train", "tlt_jax.warmup_drafter", "experiments.reproduce",
          "experiments.gpu_headline"} <= modules, modules


def test_every_command_parses(monkeypatch):
  """Each `python -m MODULE ...` of a bash block: an experiment's or tool's argument parser
  accepts its arguments (the script stops before it runs), a job's config file loads with its
  overrides. pip and pytest lines are the CI's own (tests/test_repo.py)."""
  monkeypatch.chdir(REPO)
  failures = []
  for page, module, argv in COMMANDS:
    shown = f"{page}: python -m {module} {shlex.join(argv)}"
    if module in JOBS:
      try:
        _check_job(_normalise_job_argv(argv))
      except Exception as e:  # noqa: BLE001 - reported with the command
        failures.append(f"{shown}: {str(e).splitlines()[0]}")
      continue
    if not module.startswith(("experiments.", "tools.", "tlt_jax.")) or module == "pytest":
      continue
    importlib.import_module(module)
    if not argv:  # a mention of the module in the prose, not a command
      continue
    if error := parse_error(module, argv, monkeypatch):
      failures.append(f"{shown}: {error}")
  assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- generated and worked pages


def test_the_knob_reference_is_the_schemas():
  from tools import config_reference
  current = open(config_reference.PAGE).read()
  assert current == config_reference.page_text(current), (
      "docs/configs.md is out of date: run python -m tools.config_reference")


@pytest.mark.slow
def test_the_extending_examples_run(monkeypatch):
  """docs/extending.md's python blocks, in order, in one namespace; the registries they add
  to are restored afterwards."""
  from tlt_jax.drafters import DRAFTERS
  from tlt_jax.rl.algorithms import ALGORITHMS
  from tlt_jax.rl.tasks import TASKS
  monkeypatch.chdir(REPO)
  for registry in (DRAFTERS, ALGORITHMS, TASKS):
    for name, value in list(registry.items()):
      monkeypatch.setitem(registry, name, value)  # restored, and the new names removed
  added = {id(r): set(r) for r in (DRAFTERS, ALGORITHMS, TASKS)}
  blocks = re.findall(r"```python\n(.*?)```", open(os.path.join(REPO, "docs",
                                                                 "extending.md")).read(), re.S)
  assert len(blocks) >= 6
  namespace = {"__name__": "extending_examples"}
  try:
    for i, block in enumerate(blocks):
      exec(compile(block, f"docs/extending.md, python block {i + 1}", "exec"), namespace)
    assert {"repeat", "rloo", "counting"} <= set(DRAFTERS) | set(ALGORITHMS) | set(TASKS)
  finally:
    for registry in (DRAFTERS, ALGORITHMS, TASKS):
      for name in set(registry) - added[id(registry)]:
        del registry[name]
