"""Reasoning RL: tasks (`tasks`) and data files as `Example`s, answer checking, rewards, the
RL algorithms (`algorithms`), one step's phases and the policy update."""

from tlt_jax.rl.tasks.example import Example

__all__ = ["Example"]
