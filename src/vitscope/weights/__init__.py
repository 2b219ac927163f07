"""Weights: safetensors checkpoints and resume state, timm and Hugging Face weights, pretrained downloads,
and what `eval`, `predict` and `explain` accept as a model.

    from vitscope.weights import load_timm_state_dict, load_hf, export_hf
"""

from vitscope.weights.hf import export_hf, hf_to_vitscope, load_hf
from vitscope.weights.model_io import (
    create_from_timm,
    load_model,
    load_timm_state_dict,
    load_weights,
    save_model,
)

__all__ = ["create_from_timm", "export_hf", "hf_to_vitscope", "load_hf", "load_model", "load_timm_state_dict",
           "load_weights", "save_model"]
