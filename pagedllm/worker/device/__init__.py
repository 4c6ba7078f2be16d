"""The device path of the runner (the Triton backend: CUDA, or the CPU under Triton's interpreter):
step inputs built by kernels (``device_inputs``), the draw on the device (``device_sampler``),
decode steps replayed as CUDA graphs (``cuda_graphs``) and the sampled ids' pinned copy to the
host (``host_tokens``)."""
