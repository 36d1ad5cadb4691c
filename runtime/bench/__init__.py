"""The one home of benchmark code: offline throughput, single-step timing, serving, served-vs-offline, router,
GPU kernels and serving. Each `kvserve bench ...` subcommand only parses arguments and calls into here; every
benchmark prints its result against a peer run in the same run (never a timed unit test)."""
