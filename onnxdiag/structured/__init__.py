"""Structured pruning: physical channel removal over dependency groups (METHODS §B6).

- :func:`prune_channels` — remove a plan's channels from a copy of the model.
- :func:`plan_pruning` — scores + budget (uniform / reference / global) → :class:`Plan`.
- :func:`magnitude_scores`, :func:`bn_scale_scores`, :func:`random_scores` — scores
  from the model alone; :func:`score_groups` — layer scores → group scores.
- :func:`save_plan` / :func:`load_plan` / :func:`replay_plan` — plans as JSON, replayed
  to the same bytes on the same model.

- :func:`prune_reconstructed` — remove channels and reconstruct their consumers from the
  dense model's input moments (:func:`collect_input_moments`; docs/METHODS.md §E2);
  :func:`recon_scores` / :func:`wanda_scores` — the repair-aware and Wanda choices (§E3).

Transformer groups (docs/METHODS.md §D): an attention block's heads are one group channel
each (head_dim features of Q, K, V and of the output projection's input);
:mod:`.counts` rewrites the Reshape / Split literals that count heads or features.

No function modifies its input model.
"""

from .plan import BUDGETS, PLAN_SCHEMA, Plan, load_plan, plan_pruning, replay_plan, save_plan
from .prune import GroupCut, PruneRecord, kept_output_channels, normalize_removed, prune_channels
from .recon_score import recon_scores, wanda_scores
from .reconstruct import collect_input_moments, consumer_sites, prune_reconstructed
from .scores import bn_scale_scores, magnitude_scores, random_scores, score_groups

__all__ = [
    "BUDGETS", "PLAN_SCHEMA", "GroupCut", "Plan", "PruneRecord", "bn_scale_scores",
    "collect_input_moments", "consumer_sites", "kept_output_channels", "load_plan",
    "magnitude_scores", "normalize_removed", "plan_pruning", "prune_channels",
    "prune_reconstructed", "random_scores", "recon_scores", "replay_plan", "save_plan",
    "score_groups", "wanda_scores",
]
