"""Continuous batching: scheduler, model runner, sampler, streaming."""
