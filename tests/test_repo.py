"""The README's quick start and CI stay in step."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quick_start_commands():
  text = open(os.path.join(REPO, "README.md")).read()
  section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```bash\n(.+?)\n```", section)


def test_quick_start_has_two_commands_and_ci_runs_the_test_one():
  commands = _quick_start_commands()
  assert len(commands) == 2, commands
  assert "pytest" in commands[1]
  ci = open(os.path.join(REPO, ".ci", "run")).read().splitlines()
  assert commands[1] in ci, "'.ci/run' must run the README's test command verbatim"
