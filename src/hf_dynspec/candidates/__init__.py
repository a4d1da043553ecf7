"""Proposers: draft tokens for every row of a batch (also usable as transformers `CandidateGenerator`s)."""

from .base import BatchedProposer, Proposal
from .draft_model import DraftModelProposer
from .draft_tree import DraftTreeProposer
from .free import ModelFreeProposer, ModelFreeSource, Offer
from .prompt_lookup import LookupSource, LookupTreeProposer, PromptLookupProposer
from .tree import TokenTree
from .trie import prompt_lookup_tree

__all__ = [
    "BatchedProposer",
    "DraftModelProposer",
    "DraftTreeProposer",
    "LookupSource",
    "LookupTreeProposer",
    "ModelFreeProposer",
    "ModelFreeSource",
    "Offer",
    "PromptLookupProposer",
    "Proposal",
    "TokenTree",
    "prompt_lookup_tree",
]
