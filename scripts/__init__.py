"""Thin hydra entry points, one per stage (`python -m scripts.<stage>`): precompute, regenerate, train,
evaluate, export, pipeline (the demo), and the experiments study, ablation and fp8_study. Each is
`@stage_main` (scripts/runtime.py): the thread policy, the stage's checks before work (scripts/checks.py)
and its status file around the stage function. `scripts.cli` is the `spechead` command. The stage functions
themselves (the hydra config → the stage's typed config → the library) are in experiments/stages.py, which the
studies call too."""
