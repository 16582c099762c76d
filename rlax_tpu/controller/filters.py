"""DAPO's dynamic sampling (Yu et al. 2025, §3.2): drop prompt groups with no signal.

DAPO over-samples and keeps a group only if 0 < #correct < G, i.e. its rewards are not
all equal (otherwise every group-relative advantage is 0). The controller calls this on
the host when it assembles a batch; it is plain NumPy.
"""

from __future__ import annotations

import numpy as np


def dynamic_sampling_keep(rewards, group_ids) -> np.ndarray:
    """bool[n]: keep sample k iff the rewards of its group (group_ids[k]) are not all equal.

    rewards: float[n]; group_ids: int[n] (any ids, groups of any size, in any order).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(
            f"rewards {rewards.shape} and group_ids {group_ids.shape} must be equal 1-d shapes"
        )
    _, index = np.unique(group_ids, return_inverse=True)
    hi = np.full(index.max(initial=-1) + 1, -np.inf)
    lo = np.full_like(hi, np.inf)
    np.maximum.at(hi, index, rewards)
    np.minimum.at(lo, index, rewards)
    return (hi != lo)[index]
