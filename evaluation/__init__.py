"""The evaluation stage (`python -m scripts.evaluate`): heads and draft models decoded by the engine
(inference_eval/) on a prompt set (data/prompts.py), τ, α_d, simulated τ and speedup, k=auto, the report.
A room of its own above data/ and artifacts/: the engine below them never imports it."""
