"""How far a lossless chain method can go on a pair of models: where the draft's greedy choice differs from the target's.

With greedy verification a chain is accepted up to the first token where the draft and the target disagree, and the
target's own token there ends the verify. Along the target's greedy output, every position a chain drafts (after the
first new token, which the prefill emits, and before the last, which the final verify emits as its own token) where
the draft's greedy choice differs therefore ends a verify: a call needs that many verifies and a final one, however
long or well-timed its drafts. Where the draft's second choice is the target's token, a token
tree that branches in two there could still carry on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel


@dataclass
class Disagreements:
    """One prompt's greedy disagreements between a draft and its target."""

    new_tokens: int  # tokens the target's plain greedy decoding emitted
    disagreements: int  # positions between the first and the last new token where the draft's greedy choice differs
    second_right: int  # of those, positions where the draft's second choice is the target's token

    @property
    def fewest_verifies(self) -> int:
        """Verify forwards any greedy chain method needs: one per disagreement and the final one (none when the
        prefill's token is the only one)."""
        return self.disagreements + int(self.new_tokens > 1)


@torch.no_grad()
def greedy_disagreements(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    progress: bool = True,
) -> list[Disagreements]:
    """For each prompt, decode `max_new_tokens` greedily with `target` alone (stopping at its EOS), then run `draft`
    once over the whole sequence and count where its greedy choice differs from the target's tokens (at the positions a
    chain drafts: not the first new token, nor the last).

    Args:
        prompts: token ids of each prompt (one row at a time: no padding).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be an integer >= 1 (tokens to decode per prompt), got {max_new_tokens!r}.")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("Every prompt needs at least one token: the draft's guess of the first new token comes after it.")
    counts = []
    for prompt in tqdm(prompts, desc="disagreements", disable=not progress):
        ids = torch.tensor([list(prompt)], device=target.device)  # [1, prompt]
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, ids.shape[1] :].to(draft.device)  # [new]
        logits = draft(out.to(draft.device)).logits[0, ids.shape[1] - 1 : -1]  # [new, vocab] draft's guess of each
        top = logits.topk(min(2, logits.shape[-1]), dim=-1).indices  # [new, 2]
        wrong = top[:, 0] != new  # [new]
        wrong[0] = False  # the prefill emits the first new token
        wrong[-1] = False  # and the final verify the last, drafted or not
        second = (top[:, -1] == new) & wrong
        counts.append(Disagreements(int(new.shape[0]), int(wrong.sum()), int(second.sum())))
    return counts
