"""Who guesses the next tokens."""

from specdec.proposers.base import DraftProposal, ProposeContext, Proposer
from specdec.proposers.draft_model import DraftModelProposer

__all__ = ["DraftModelProposer", "DraftProposal", "ProposeContext", "Proposer"]
