"""Capacity planner: the real scheduler + KV manager (runtime/core, unchanged) on a simulated clock, with
step times from a fitted step-time model. Torch-free (pyproject contract "planner-torch-free")."""
