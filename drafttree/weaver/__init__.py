"""Weaver: a small path-conditioned adapter over the DFlash drafter's top-K candidates, the trees it grows
(best-first over path probabilities, w nodes per call) and the weaver-ddtree / weaver-caddtree methods."""
from .model import Weaver, WeaverConfig
from .proposer import WeaverProposer

__all__ = ["Weaver", "WeaverConfig", "WeaverProposer"]
