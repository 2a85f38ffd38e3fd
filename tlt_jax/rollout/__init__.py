"""Rollout: generation from the policy on the mesh (plain batched decoding and adaptive SD)."""
