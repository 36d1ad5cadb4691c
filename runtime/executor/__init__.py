"""The executor: turns a SchedulerOutput into sampled tokens on the device. The model runner (inputs, KV tensors,
sampling, CUDA graphs) runs in this process, or one tensor-parallel worker process per rank (multiproc.py,
tp_worker.py; torch.distributed: gloo on CPU, NCCL on CUDA)."""
