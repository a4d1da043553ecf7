"""Drafts from a model with another tokenizer: each row's text is re-encoded for the draft, and the draft's
continuation re-encoded for the target (transformers' universal assisted decoding, one row at a time)."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.candidate_generator import AssistedCandidateGeneratorDifferentTokenizers

from ..clocks import Instant, elapsed
from ..devices import cuda_devices
from ..sequences import TokenBatch
from .base import BatchedProposer, EarlyStop, Proposal
from .draft_model import MAX_INLINE_TAIL
from .free import proposal_of


class TranslatedDraftProposer(BatchedProposer):
    """Proposes chains of target tokens with a draft model whose tokenizer differs from the target's.

    Each row has its own transformers `AssistedCandidateGeneratorDifferentTokenizers`: it decodes the row's tokens to
    text, encodes the text with the draft's tokenizer (re-using the draft's KV cache for the part that did not change),
    lets the draft continue greedily and re-encodes the continuation with the target's tokenizer. A row's proposal is
    the target tokens after its own, up to the length the policy chose.

    The draft's distribution lives in another vocabulary, so a proposal carries none (`Proposal.probs` is `None`):
    the verifier takes each draft token `x` as proposed with certainty (a one-hot `q`), accepts it with the target's
    probability `p(x)` and otherwise draws from `p` without `x`, which follows `p` exactly whatever `x` is. The draft
    therefore drafts greedily even when the target samples: its likeliest token is the one most often accepted.

    Rows draft one after another (`rows_apart`), so a step's draft time grows with the rows that draft. A draft forward
    wider than `MAX_INLINE_TAIL` tokens (a row's prompt, the first time it drafts, or the tokens of its steps without
    speculation) is a catch-up, timed apart from drafting (`catchup_seconds`) as the draft model proposer does, and
    `backlog` tells the policy about it before it is paid.
    """

    rows_apart = True

    def __init__(
        self,
        draft_model: PreTrainedModel,
        target_tokenizer: PreTrainedTokenizerBase,
        assistant_tokenizer: PreTrainedTokenizerBase,
        generation_config: GenerationConfig,
        vocab_size: int,
    ) -> None:
        self.model = draft_model
        self.target_tokenizer = target_tokenizer
        self.assistant_tokenizer = assistant_tokenizer
        self.vocab_size = vocab_size
        config = copy.deepcopy(generation_config)
        config.do_sample = False  # greedy drafts: see the class docstring
        config.temperature, config.top_p, config.top_k, config.min_p = None, None, None, None
        config.max_length = 1 << 30  # the loop caps each row's draft by its remaining budget
        config.min_length = 0
        self.generation_config = config
        self.rows: list[AssistedCandidateGeneratorDifferentTokenizers] = []
        self.num_seen = torch.zeros(0, dtype=torch.long)  # [batch] each row's tokens its draft has processed
        self._catchup_started: Instant | None = None
        self._devices = cuda_devices(draft_model)  # the catch-up clock waits for these

    def start(self, batch: TokenBatch) -> None:
        super().start(batch)
        self.rows = [self._generator(batch.real_tokens(row)) for row in range(batch.batch_size)]
        self.num_seen = torch.zeros_like(batch.host_num_real)  # [batch] on the host

    def backlog(self, batch: TokenBatch) -> torch.LongTensor:
        """`[batch]` each row's tokens not yet in its draft's cache (the prompt, before the row first drafts), on the
        host."""
        return batch.host_num_real - self.num_seen

    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        self.catchup_seconds, self.catchup_tokens = 0.0, 0
        hooks = [  # the generators run the draft: count its forwards and time its catch-ups
            self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            self.model.register_forward_hook(self._after_forward),
        ]
        try:
            found = [self._continuation(batch, row, int(lengths[row])) for row in range(batch.batch_size)]
        finally:
            for hook in hooks:
                hook.remove()
        return proposal_of(batch, found)

    def commit(self, batch: TokenBatch, proposal: Proposal, kept: torch.BoolTensor) -> None:
        """A row that drafted has its tokens before the step (`batch` is not yet updated) and its accepted draft tokens
        in its draft's cache: only the target's token of this step is new to it."""
        drafted = proposal.lengths_on_host() > 0
        accepted = kept[:, 1:].to("cpu", copy=True).sum(dim=1)  # [batch] kept nodes after the root
        self.num_seen = torch.where(drafted, batch.host_num_real + accepted, self.num_seen)

    def select_rows(self, keep: torch.LongTensor) -> None:
        self.rows = [self.rows[int(row)] for row in keep.tolist()]
        self.num_seen = self.num_seen[keep.to("cpu", copy=True)]

    def release(self) -> None:
        self.rows = []

    def _generator(self, tokens: torch.LongTensor) -> AssistedCandidateGeneratorDifferentTokenizers:
        """A row's candidate generator; `tokens`: `[num_real]` the row's tokens."""
        return AssistedCandidateGeneratorDifferentTokenizers(
            input_ids=tokens.unsqueeze(0),
            assistant_model=self.model,
            target_tokenizer=self.target_tokenizer,
            assistant_tokenizer=self.assistant_tokenizer,
            generation_config=self.generation_config,
            model_kwargs={},
            logits_processor=LogitsProcessorList(),  # the target's processors speak the target's vocabulary
        )

    def _continuation(self, batch: TokenBatch, row: int, length: int) -> torch.LongTensor:
        """`[found]` up to `length` target tokens that continue the row, as the draft sees it."""
        tokens = batch.real_tokens(row)  # [num_real]
        if length <= 0:
            return torch.zeros(0, dtype=torch.long)
        generator = self.rows[row]
        generator.num_assistant_tokens = length
        candidates, _ = generator.get_candidates(tokens.unsqueeze(0))  # [1, num_real + new]
        found = candidates[0, tokens.shape[0] : tokens.shape[0] + length].to("cpu", copy=True)  # on the host
        inside = found < self.vocab_size  # a token the target's tokenizer has but its model does not score
        return found[: int(inside.long().cumprod(0).sum())]

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Count the forward; one over more than `MAX_INLINE_TAIL` new tokens is a catch-up, timed until
        `_after_forward` (as the draft model proposer counts and times its catch-up forwards)."""
        self.forwards += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        width = int(ids.shape[-1]) if ids is not None else 1
        if width > MAX_INLINE_TAIL:
            self.catchup_tokens += width
            self._catchup_started = Instant.now(self._devices)

    def _after_forward(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if self._catchup_started is not None:
            self.catchup_seconds += float(elapsed(self._catchup_started))  # waits for the draft's devices
            self._catchup_started = None
