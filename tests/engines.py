"""The engine settings tests build: `EngineConfig` with the tests' own defaults."""

import functools

from tlt_jax.rollout.engine import EngineConfig

# Unless a test says otherwise: 32 rows a slice, SD from 8 running rows, and programs compiled
# on first use (no background compiles for a test to wait for or race with). A run's defaults
# are the config schema's (EngineConfig's own).
engine_config = functools.partial(EngineConfig, max_batch=32, sd_threshold=8,
                                  compile_ahead=False)
