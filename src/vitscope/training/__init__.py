"""Training: the loop (single process and DDP), optimizers, recipes with their expected results, curves."""
