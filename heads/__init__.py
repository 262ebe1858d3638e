"""Draft-head architectures and the Llama building blocks they share with the engine's target.

Nothing here imports train/, data/ or inference_eval/ (docs/design.md §1).
"""
