"""Look inside a model: attention capture, rollout, head statistics, importance, pictures, explorer.

    from vitscope.inspect import capture_attention, rollout, head_stats
    cap = capture_attention(model, images)          # cap[i]: (B, H, N, N) of block i
    maps = rollout_map(rollout(cap.layers(), num_prefix_tokens=1), cap.layout)  # (B, h, w)
    explore(model, images)                          # the interactive explorer, inline in a notebook
    probes = read_probes("runs/translate_rnn")      # attention over training, kept by every run
    probes_figure(probes)                           # side by side at a few steps
    explore(model, images, probes=probes)           # the explorer with a slider over all of them
    probes_page(probes)                             # that slider alone
"""

from vitscope.inspect.capture import (
    AttentionCapture,
    CaptureTooLarge,
    TokenLayout,
    attention_modules,
    capture_attention,
    capturing,
    estimate_bytes,
    token_layout,
)
from vitscope.inspect.explorer import explore, write_explorer
from vitscope.inspect.importance import (
    HeadImportance,
    PruningCurve,
    ablation_importance,
    evaluate,
    gradient_importance,
    pruning_curve,
    rank_heads,
)
from vitscope.inspect.plots import write_report
from vitscope.inspect.probes import Probes, probes_figure, read_probes, run_probes
from vitscope.inspect.probes_page import probes_page, write_probes_page
from vitscope.inspect.rollout import fuse_heads, grad_rollout, rollout, rollout_map
from vitscope.inspect.stats import (
    REGIONS,
    HeadStats,
    cls_maps,
    entropy,
    head_stats,
    mean_distance,
    patch_distances,
    query_map,
    region_mass,
)

__all__ = [
    "REGIONS", "AttentionCapture", "CaptureTooLarge", "HeadImportance", "HeadStats", "Probes", "PruningCurve",
    "TokenLayout", "ablation_importance", "attention_modules", "capture_attention", "capturing", "cls_maps",
    "entropy", "estimate_bytes", "evaluate", "fuse_heads", "grad_rollout", "gradient_importance",
    "head_stats", "mean_distance", "patch_distances", "probes_figure", "probes_page", "pruning_curve", "query_map",
    "rank_heads", "read_probes", "run_probes", "write_probes_page",
    "region_mass", "rollout", "rollout_map", "token_layout", "explore", "write_explorer", "write_report",
]

