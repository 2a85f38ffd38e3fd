"""Speculative decoding: draft trees, exact verification, strategies and the tuner."""
