"""The only package that imports vLLM internals: backend classes, metadata builder, impl."""
