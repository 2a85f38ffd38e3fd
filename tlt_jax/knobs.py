"""A component's knobs defined once: its frozen dataclass owns each knob's default and
check, and the config schema's section is made from it (`defaults_of`), the component from the
section (`build_from`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


class ConfigError(ValueError):
  """A configuration value or key is wrong; the message names the key and the fix. The one
  error type of config validation, wherever a knob is checked."""


@dataclasses.dataclass(frozen=True)
class NoSettings:
  """The knobs of a component that has none of its own (an algorithm's or a task's
  `Settings`): no config section."""


def defaults_of(cls: type, exclude: tuple[str, ...] = ()) -> dict:
  """{field: default} of dataclass `cls` (built with no arguments), less `exclude`."""
  defaults = cls()
  return {f.name: getattr(defaults, f.name) for f in dataclasses.fields(cls)
          if f.name not in exclude}


def build_from(cls: type, knobs: Mapping, **given):
  """cls(**the values in `knobs` (a config section) of its fields (a field the section lacks
  keeps its default), **given); the dataclass checks them (ValueError naming the knob)."""
  values = {f.name: knobs[f.name] for f in dataclasses.fields(cls)
            if f.name in knobs and f.name not in given}
  return cls(**values, **given)
