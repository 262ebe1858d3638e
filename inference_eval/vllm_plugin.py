"""spechead's vLLM plugin: registers the default `mtp` head (docs/design.md §3) as a draft architecture
that vLLM serves through its existing `eagle3` speculative method. Imports nothing of vLLM at module top:
it runs inside vLLM's own environment (`make vllm-env` installs spechead there with
`pip install --no-deps -e .`, which registers the entry point below), and spechead's own code reads
`MTP_ARCH` from it without vLLM.

Entry point (pyproject.toml): `[project.entry-points."vllm.general_plugins"] spechead_mtp =
"inference_eval.vllm_plugin:register"`. vLLM calls `register()` in every process it starts
(vllm/plugins/__init__.py, group `vllm.general_plugins`); it adds the architecture `MTP_ARCH` to
vLLM's ModelRegistry, by name: the class, `inference_eval/vllm_mtp.py` `SpecheadMTPForCausalLM`, is
imported by the registry when a draft of that architecture is built. An `mtp-vllm` export
(artifacts/export.py) names that architecture; served with `{"method": "eagle3", "model": <export>,
"num_speculative_tokens": k}` vLLM keeps the name (it starts with `Eagle3`:
vllm/transformers_utils/configs/eagle.py). How the class reproduces the head: vllm_mtp.py's docstring.
"""

from __future__ import annotations

MTP_ARCH = "Eagle3SpecheadMTPForCausalLM"
MODEL_CLASS = "inference_eval.vllm_mtp:SpecheadMTPForCausalLM"


def register() -> None:
    """vLLM's general-plugin hook: add the MTP draft architecture to the model registry (idempotent;
    the class is imported lazily, by name, so registering does not import the model code)."""
    from vllm import ModelRegistry  # deferred on purpose: spechead's environment has no vLLM

    if MTP_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MTP_ARCH, MODEL_CLASS)
