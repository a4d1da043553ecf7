"""Benchmarks against transformers' own assisted generation: models, prompts, the harness and plots."""
