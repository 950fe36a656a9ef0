"""Benchmarks of a running server: `python -m kvflow bench serve` sends streamed requests to any
OpenAI-compatible endpoint (kvflow's server, vLLM, SGLang) and reports throughput, TTFT, TPOT,
ITL and end-to-end latency, and the goodput under service-level objectives."""
