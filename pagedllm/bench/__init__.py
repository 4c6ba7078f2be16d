"""``pagedllm bench``: offline throughput, batch latency and an OpenAI-compatible serving client.

Names and definitions follow vLLM's benchmark suite (``vllm bench throughput |
latency | serve``): request throughput, output and total token throughput,
TTFT, TPOT, ITL and end-to-end latency with mean, median and p99.
"""
