"""Experiments over the pipeline's stages: the recipe study, the head ablation, the fp8-store study, and
the result cache that lets a rerun reuse every trained head and report made from the same inputs. Their
entry points are scripts/study.py, scripts/ablation.py and scripts/fp8_study.py."""
