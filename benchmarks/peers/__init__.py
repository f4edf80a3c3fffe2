"""Peers of the throughput benchmark: vLLM and llama.cpp, each set up in its own environment."""
