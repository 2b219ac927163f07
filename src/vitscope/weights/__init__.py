"""Weights: safetensors checkpoints and resume state, timm and Hugging Face weights, pretrained downloads,
and what `eval`, `predict` and `explain` accept as a model."""
