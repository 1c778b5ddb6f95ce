"""DFlash block-diffusion drafter: model, checkpoints, the draft vocabulary (training: drafttree.training)."""
from drafttree.drafter.checkpoint import CheckpointError, load_drafter, save_drafter
from drafttree.drafter.model import DFlashConfig, DFlashDrafter, block_attention_mask

__all__ = ["DFlashConfig", "DFlashDrafter", "block_attention_mask", "load_drafter", "save_drafter", "CheckpointError"]
