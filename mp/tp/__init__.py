"""Tensor parallelism beyond the lesson (tensor_parallel.py): collectives, operators, replicas, sequence parallel, hybrid."""
