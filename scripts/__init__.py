"""Thin hydra entry points: precompute, train, evaluate, export, pipeline (the demo)."""
