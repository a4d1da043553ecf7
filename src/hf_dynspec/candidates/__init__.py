"""Proposers: draft tokens for every row of a batch (also usable as transformers `CandidateGenerator`s)."""

from .base import BatchedProposer, Proposal
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer
from .tree import TokenTree
from .trie import prompt_lookup_tree

__all__ = [
    "BatchedProposer",
    "DraftModelProposer",
    "PromptLookupProposer",
    "Proposal",
    "TokenTree",
    "prompt_lookup_tree",
]
