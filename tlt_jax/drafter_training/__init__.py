"""Drafter training: EAGLE-aligned loss, jitted update step, windows of policy features."""
