"""Capacity planner: the real scheduler + KV manager (runtime/core, unchanged) on a simulated clock, with
step times from a fitted step-time model. Torch-free (pyproject contract "planner-torch-free").

The per-replica plan the operator and `kvserve plan` share lives here too: catalog.py (GPU and model
datasheets), kv_plan.py (weights, activations and KV blocks per GPU for one engine shape) and layout.py (one
pod, or pipeline stages over several: the parallel layout of a replica)."""
