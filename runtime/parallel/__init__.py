"""Tensor parallelism: sharded Llama layers, the per-rank head/vocab split, and the multiprocess executor
that runs one worker process per rank (torch.distributed: gloo on CPU, NCCL on CUDA)."""
