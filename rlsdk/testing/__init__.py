"""Helpers for testing distributed RL code (rlsdk's own tests and users' tests)."""
