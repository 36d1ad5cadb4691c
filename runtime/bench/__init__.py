"""Benchmarks: the one home of benchmark code (`kvserve bench ...`).

peer.py: `kvserve bench peer`, kvserve against vLLM's CPU build (a separate venv, never a dependency) on the
same model and workload; offline_driver.py: the offline run both engines execute, in their own processes.
"""
