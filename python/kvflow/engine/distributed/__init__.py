"""Tensor parallelism across processes: rank 0 runs the engine and sends each step's plan; every
rank runs the step on its shard of the model (see docs/tensor_parallel.md)."""
