"""Process groups and collectives (``parallel_state``) and pipeline micro-batches (``micro_batch``);
the executors that start ranks live in ``pagedllm/executor/``."""
