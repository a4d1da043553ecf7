"""Which proposer `generate`'s loop drafts with: one decision from the call's arguments and its `DynSpecConfig`.

A draft model alone (`proposer="draft"`, trees, or a draft with another tokenizer), a model-free source alone
(prompt lookup, suffix trees, the rollout cache: `sources`), or a source beside the draft model
(`hybrid.HybridProposer`: the default with a draft model).
Continuous batching makes the same decision for requests in `hf_dynspec.continuous.entry_points`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from ..config import DynSpecConfig
from ..eagle3 import StateHead
from ..placement import Placement
from .base import BatchedProposer
from .draft_model import DraftModelProposer
from .draft_tree import DraftTreeProposer
from .eagle_head import HeadProposer, HeadTreeProposer
from .free import ModelFreeProposer, ModelFreeSource
from .hybrid import HybridProposer
from .prompt_lookup import LookupTreeProposer, PromptLookupProposer
from .sources import SourceContext, build_source, source_name
from .translated_draft import TranslatedDraftProposer


@dataclass
class LoopChoice:
    """What the loop's proposer is chosen and built from."""

    model: PreTrainedModel  # the target
    draft: PreTrainedModel | None
    config: DynSpecConfig
    generation_config: GenerationConfig
    logits_processor: LogitsProcessorList
    placement: Placement
    translation: tuple | None  # (target tokenizer, draft tokenizer) for a draft with another tokenizer
    streams: torch.LongTensor | None  # [rows] coupled sampling's stream of each row of the call
    across_ranks: bool  # rows of other data-parallel ranks share the rollout cache


def loop_proposer(self: LoopChoice) -> BatchedProposer:
    """The proposer `generate`'s loop drafts with, as the call's arguments and config ask; a clear error for what
    they cannot combine.

    With a draft model, the default (`proposer="auto"`) is `HybridProposer`: per row and step a copy from the context
    (suffix trees with the `suffix` extra, else prompt lookup) or the draft model, as the policy decides.
    `proposer="draft"` keeps the draft model alone; token trees and a draft with another tokenizer are the draft
    model alone too."""
    draft, proposer = self.draft, self.config.proposer
    if self.config.reuse_rollouts:
        return _rollout_proposer(self)
    named_mix = proposer == "hybrid" or (proposer == "suffix" and draft is not None)
    if named_mix and self.config.tree_node_budget:
        raise ValueError(
            f"DynSpecConfig(proposer={proposer!r}) with an assistant model proposes chains; set "
            "`tree_node_budget=0`, or keep the tree and use proposer='auto' (a draft-model tree with "
            "`assistant_model`, a prompt-lookup trie without) or proposer='suffix' without an assistant model."
        )
    if proposer == "suffix" and draft is None:
        return ModelFreeProposer(_source(self), self.config.prompt_lookup_max_tokens)
    if draft is None:
        if proposer in ("hybrid", "draft"):
            raise ValueError(
                f"DynSpecConfig(proposer={proposer!r}) drafts with a draft model: pass `assistant_model=<draft "
                "model>` (and no `prompt_lookup_num_tokens`), or drop the proposer to use prompt lookup."
            )
        lookup = self.generation_config.prompt_lookup_num_tokens  # None: coupled sampling with no proposer named
        return _lookup_proposer(self, int(lookup) if lookup is not None else self.config.prompt_lookup_max_tokens)
    if isinstance(draft, StateHead):
        return _head_proposer(self)
    if self.translation is not None:
        vocab = self.model.config.get_text_config().vocab_size
        return TranslatedDraftProposer(draft, *self.translation, self.generation_config, vocab)
    if self.config.tree_node_budget:
        return DraftTreeProposer(
            draft, self.logits_processor, self.generation_config, self.placement, self.config,
            branching=self.config.tree_branching,
        )
    model = DraftModelProposer(draft, self.logits_processor, self.generation_config, self.placement, self.config)
    if proposer != "draft" and self.config.num_speculative_tokens > 0:
        return HybridProposer(model, ModelFreeProposer(_source(self), self.config.prompt_lookup_max_tokens))
    return model


def _head_proposer(self: LoopChoice) -> BatchedProposer:
    """An EAGLE-3 head's chains, beside copies from the context unless `proposer="draft"`."""
    if self.translation is not None:
        raise ValueError(
            "A draft head (EAGLE-3, MTP) as `assistant_model` drafts with the target's tokenizer: pass no "
            "`assistant_tokenizer`."
        )
    if self.config.tree_node_budget:
        return HeadTreeProposer(
            self.draft, self.model, self.logits_processor, self.generation_config, self.placement, self.config,
            branching=self.config.tree_branching,
        )
    head = HeadProposer(self.draft, self.model, self.logits_processor, self.generation_config, self.placement, self.config)
    if self.config.proposer != "draft" and self.config.num_speculative_tokens > 0:
        return HybridProposer(head, ModelFreeProposer(_source(self), self.config.prompt_lookup_max_tokens))
    return head


def _rollout_proposer(self: LoopChoice) -> BatchedProposer:
    """The rollout cache's proposals, beside the draft model when there is one (`DynSpecConfig.reuse_rollouts`)."""
    draft = self.draft
    if self.config.tree_node_budget or self.config.proposer != "auto" or self.translation is not None:
        raise ValueError(
            "DynSpecConfig(reuse_rollouts=True) proposes chains from the rollout cache, beside the assistant model "
            "when one is given: set `tree_node_budget=0` and proposer='auto', and use a draft with the target's "
            "tokenizer (no `assistant_tokenizer`)."
        )
    rollout = ModelFreeProposer(_source(self), self.config.prompt_lookup_max_tokens)
    if draft is None:
        return rollout
    model = DraftModelProposer(draft, self.logits_processor, self.generation_config, self.placement, self.config)
    return HybridProposer(model, rollout)


def _source(self: LoopChoice) -> ModelFreeSource:
    """The model-free source the config asks for (`candidates.sources`); a row's stream is its index's."""
    streams = self.streams.tolist() if self.streams is not None else []
    context = SourceContext(
        self.model, self.config, lambda row, prompt: streams[row], across_ranks=self.across_ranks
    )
    return build_source(source_name(self.config), context)


def _lookup_proposer(self: LoopChoice, num_tokens: int) -> PromptLookupProposer:
    kind = LookupTreeProposer if self.config.tree_node_budget else PromptLookupProposer
    return kind(
        max_ngram=self.config.prompt_lookup_max_ngram,
        min_ngram=self.config.prompt_lookup_min_ngram,
        num_output_tokens=num_tokens,
    )
