"""kvtierd: a KV-cache daemon for LLM inference."""
