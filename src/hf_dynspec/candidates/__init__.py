"""Proposers: draft tokens for every row of a batch (also usable as transformers `CandidateGenerator`s)."""

from .base import BatchedProposer, Proposal
from .draft_model import DraftModelProposer
from .draft_tree import DraftTreeProposer
from .prompt_lookup import PromptLookupProposer
from .tree import TokenTree
from .trie import LookupTreeProposer, prompt_lookup_tree

__all__ = [
    "BatchedProposer",
    "DraftModelProposer",
    "DraftTreeProposer",
    "LookupTreeProposer",
    "PromptLookupProposer",
    "Proposal",
    "TokenTree",
    "prompt_lookup_tree",
]
