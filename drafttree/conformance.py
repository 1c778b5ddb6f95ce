"""The implementations conform to drafttree.protocols, each with its own state and draft types.

Checked by mypy only (tests/test_types.py); nothing imports this module, so protocols.py itself depends
on nothing above it (no import circle between the protocols and the code that implements them)."""
from __future__ import annotations

from .lookup.index import Continuations
from .lookup.proposers import LookupDFlashProposer, LookupDFlashState, LookupDraft, LookupProposer, LookupState
from .marginals import Scores
from .methods import Decoder
from .model.hybrid import HybridModel
from .model.transformer import Transformer
from .proposers import BestFirstPolicy, CalibrationState, ChainPolicy, CostAwarePolicy, DFlashProposer, DFlashState
from .protocols import Proposer, TargetModel, TreePolicy
from .serve import scheduler
from .weaver.proposer import WeaverDraft, WeaverProposer


def _targets(dense: Transformer, hybrid: HybridModel) -> list[TargetModel]:
    return [dense, hybrid]


def _policies(chain: ChainPolicy, ddtree: BestFirstPolicy, caddtree: CostAwarePolicy
              ) -> tuple[TreePolicy[None], TreePolicy[None], TreePolicy[CalibrationState | None]]:
    return chain, ddtree, caddtree


def _proposers(dflash: DFlashProposer, lookup: LookupProposer, lookup_dflash: LookupDFlashProposer,
               weaver: WeaverProposer) -> tuple[Proposer[DFlashState, Scores | None],
                                                Proposer[LookupState, Continuations | None],
                                                Proposer[LookupDFlashState, LookupDraft],
                                                Proposer[DFlashState, WeaverDraft]]:
    return dflash, lookup, lookup_dflash, weaver


def _decoder(decoder: Decoder) -> scheduler.Decoder:
    return decoder
