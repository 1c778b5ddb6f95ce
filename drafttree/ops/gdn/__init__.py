"""Gated DeltaNet (gated delta rule) ops: references in `naive.py`, tree verification in `tree.py`."""
from drafttree.ops.gdn.naive import (
    chunk_gated_delta_rule,
    l2norm,
    prepare_qk,
    recurrent_gated_delta_rule,
    tree_oracle,
)
from drafttree.ops.gdn.tree import (
    GDNTreeStash,
    ancestor_mask,
    commit_gdn_path,
    replay_gdn_path,
    tree_gated_delta_verify,
)

__all__ = [
    "GDNTreeStash",
    "ancestor_mask",
    "chunk_gated_delta_rule",
    "commit_gdn_path",
    "l2norm",
    "prepare_qk",
    "recurrent_gated_delta_rule",
    "replay_gdn_path",
    "tree_gated_delta_verify",
    "tree_oracle",
]
