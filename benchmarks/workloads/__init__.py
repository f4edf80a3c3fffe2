"""Workloads of the benchmarks that come from files rather than a random generator."""
