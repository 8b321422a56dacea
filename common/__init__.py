"""Shared building blocks of both services: config helpers, logging, sampling parameters, model loading,
the paged model runner and its KV cache. Imports no service."""
