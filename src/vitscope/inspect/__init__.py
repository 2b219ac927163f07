"""Look inside a model: attention capture, rollout, head statistics, importance, pictures, explorer.

    from vitscope.inspect import capture_attention, rollout, head_stats
    cap = capture_attention(model, images)          # cap[i]: (B, H, N, N) of block i
    maps = rollout_map(rollout(cap.layers(), num_prefix_tokens=1), cap.layout)  # (B, h, w)
    explore(model, images)                          # the interactive explorer, inline in a notebook
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
from vitscope.inspect.importance import (
    HeadImportance,
    PruningCurve,
    ablation_importance,
    evaluate,
    gradient_importance,
    pruning_curve,
    rank_heads,
)
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
    "REGIONS", "AttentionCapture", "CaptureTooLarge", "HeadImportance", "HeadStats", "PruningCurve",
    "TokenLayout", "ablation_importance", "attention_modules", "capture_attention", "capturing", "cls_maps",
    "entropy", "estimate_bytes", "evaluate", "fuse_heads", "grad_rollout", "gradient_importance",
    "head_stats", "mean_distance", "patch_distances", "pruning_curve", "query_map", "rank_heads",
    "region_mass", "rollout", "rollout_map", "token_layout", "explore", "write_explorer", "write_report",
]


def __getattr__(name):
    # Pictures and the explorer pull in matplotlib; load them only when asked for.
    if name == "write_report":
        from vitscope.inspect.plots import write_report

        return write_report
    if name in ("explore", "write_explorer"):
        from vitscope.inspect import explorer

        return getattr(explorer, name)
    raise AttributeError(f"module 'vitscope.inspect' has no attribute {name!r}")
