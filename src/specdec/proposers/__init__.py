"""Who guesses the next tokens."""

from specdec.proposers.base import DraftProposal, ProposeContext, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.heads import EagleProposer, MedusaProposer
from specdec.proposers.hybrid import NgramThenDraftProposer
from specdec.proposers.ngram import NgramIndex, NgramMatch, NgramProposer, find_match

__all__ = [
    "DraftModelProposer", "DraftProposal", "EagleProposer", "MedusaProposer", "NgramIndex", "NgramMatch", "NgramProposer",
    "NgramThenDraftProposer", "ProposeContext", "Proposer", "find_match",
]
