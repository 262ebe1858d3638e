"""Primitives every stage uses — atomic writes, hashing, the target fingerprint, safetensors reading,
progress lines, the cache directory, the CPU decode kernel. This package imports nothing of spechead."""
