"""Pipeline parallelism on torch.distributed.pipelining: flat stages (issue 26)."""
