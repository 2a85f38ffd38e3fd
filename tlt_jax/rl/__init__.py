"""Reasoning-RL data: tasks and datasets (as `Example`s), answer checking, rewards."""

from tlt_jax.rl.tasks.example import Example

__all__ = ["Example"]
