"""transformers' batch processor with the decoding requests' drafts verified in the step's forward.

The step's forward keeps the logits of every query position of a drafting request; verification
(`hf_dynspec.verification`: greedy matching, rejection sampling of a deterministic proposal, or, under coupled sampling,
equality with the perturbed argmax) accepts `a_i` draft tokens and adds one more, all appended to the request at once;
the request's position then moves back over its rejected positions, which the next step overwrites in the paged
cache. Token trees get their shape in the packed forward here (each node at its depth's position, seeing its
ancestors alone) and their accepted nodes' keys and values are copied to their path's positions. Requests without a
draft go through transformers' own update, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..candidates.tree import TokenTree
from ..clocks import Instant, elapsed
from ..coupling import coupled_choice, perturb
from ..verification import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling
from .engine import ContinuousBatchProcessor, FutureRequestState, GenerationOutput, PagedAttentionCache, kept_logits
from .speculator import Speculator, ancestry


@dataclass
class _Verified:
    """Tokens a drafting request emits this step, with their log-probabilities."""

    tokens: list[int]
    logprobs: list[float] | None
    accepted: int
    path: list[int]  # the accepted draft nodes, by depth (a chain's: 1 to `accepted`)


class SpeculativeBatchProcessor(ContinuousBatchProcessor):
    """transformers' batch processor with the decoding requests' drafts verified in the step's forward."""

    speculator: Speculator

    @classmethod
    def adopt(cls, processor: ContinuousBatchProcessor, speculator: Speculator) -> SpeculativeBatchProcessor:
        """`processor`, built by transformers' manager, made speculative (its state is kept as built)."""
        processor.__class__ = cls
        processor.speculator = speculator
        processor._scores = None
        processor.coupled = speculator.streams is not None and bool(processor.do_sample)
        return processor

    def prepare_next_batch(self) -> bool:
        self.speculator.propose(self.scheduler.active_requests)
        ready = super().prepare_next_batch()
        self.speculator.settle(self.inputs_and_outputs.requests_in_batch if ready else [])
        return ready

    @torch.no_grad()
    def _generation_step(self, model: torch.nn.Module) -> None:
        start = Instant.now(self.speculator.devices)
        if self.speculator.drafting or self.coupled:  # coupled sampling samples every request itself
            self._verify_forward(model)
        else:
            super()._generation_step(model)
        self._forward_seconds = elapsed(start)  # on the devices' clocks, read in `update_batch` (`Speculator.observe`)

    def _verify_forward(self, model: torch.nn.Module) -> None:
        """The step's forward, keeping the scores of every query position of a drafting request."""
        ios = self.inputs_and_outputs
        batch = ios.get_model_kwargs(use_padding=False)
        self._shape_trees(batch)
        indices, columns = self._score_positions(batch["cu_seq_lens_q"].tolist())
        keep = self.model_runner.supports_logits_to_keep(model)
        scores = kept_logits(model, batch, indices, keep).float()  # [scored positions, vocab]
        if self.logit_processor.do_processing:
            arguments = batch["logits_processor_args"][:, columns]  # [arguments, scored positions]
            scores = self.logit_processor(batch["input_ids"][0, indices], scores, arguments)
        self._scores = scores

    def _shape_trees(self, batch: dict) -> None:
        """Give the token trees of the step their shape in the packed forward (built causal, as chains): each node
        sits at its depth's position and attends to the request's cache and its own ancestors among the new keys."""
        masks = batch["attention_mask"]
        masks = masks if isinstance(masks, dict) else dict.fromkeys(batch["cu_seq_lens_k"], masks)
        cumulative_q = batch["cu_seq_lens_q"].tolist()
        cumulative_k = {layer_type: batch["cu_seq_lens_k"][layer_type].tolist() for layer_type in masks}
        for i, future in enumerate(self.inputs_and_outputs.requests_in_batch):
            row = self.speculator.rows.get(future.state.request_id)
            if row is None or row.parents is None or not row.draft:
                continue
            start, nodes = cumulative_q[i], 1 + len(row.draft)
            past = future.state.position_offset - future.query_length
            visible, depths = ancestry([-1] + row.parents)  # [nodes, nodes], [nodes]
            batch["position_ids"][0, start : start + nodes] = past + depths
            for layer_type, mask in masks.items():
                end = cumulative_k[layer_type][i + 1]  # the request's new keys are the last of its key span
                block = mask[..., start : start + nodes, end - nodes : end]  # [..., nodes, nodes]
                block.fill_(torch.finfo(mask.dtype).min).masked_fill_(visible.to(block.device), 0.0)

    def _score_positions(self, cumulative: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Query positions whose scores the step needs (a request's last one; every one of a drafting request), and
        for each the index of its request among those that get a new token (the logits processors' argument column).
        """
        indices, columns = [], []
        ends = zip(self.inputs_and_outputs.requests_in_batch, cumulative[1:])
        for column, (future, end) in enumerate((f, end) for f, end in ends if f.has_new_token):
            width = 1 + len(self._draft(future))
            indices.extend(range(end - width, end))
            columns.extend([column] * width)
        return torch.tensor(indices, dtype=torch.int32), torch.tensor(columns, dtype=torch.long)

    def _draft(self, future: FutureRequestState) -> list[int]:
        row = self.speculator.rows.get(future.state.request_id)
        return row.draft if row is not None else []

    def update_batch(self) -> None:
        ios = self.inputs_and_outputs
        futures = list(ios.requests_in_batch)
        query_tokens = sum(future.query_length for future in futures)
        accepted: dict[str, int] = {}
        if self._scores is not None:
            accepted = self._update_verified(futures)
            self._scores = None
        else:
            super().update_batch()
        self.speculator.observe(query_tokens, len(futures), self._forward_seconds, accepted)

    def _update_verified(self, futures: list[FutureRequestState]) -> dict[str, int]:
        """Emit the verified tokens of drafting requests; the other requests' tokens go through transformers' update."""
        scores = self._scores
        drafting, others, plain_rows = [], [], []
        offset = 0
        for future in futures:
            draft = self._draft(future)
            if draft:
                drafting.append((future, draft, scores[offset : offset + 1 + len(draft)]))  # [1 + k, vocab]
            else:
                others.append(future)
                if future.has_new_token:
                    plain_rows.append(offset)
            offset += 1 + len(draft) if future.has_new_token else 0
        verified = self._verify(drafting)
        self._move_accepted([(future, result.path) for (future, _, _), result in zip(drafting, verified)])
        outputs = [self._emit(future, result) for (future, _, _), result in zip(drafting, verified)]
        if plain_rows and self.coupled:
            self._sample_coupled(scores[plain_rows], [future for future in others if future.has_new_token])
        elif plain_rows:  # transformers' sampler writes their tokens (and log-probabilities) where its update reads them
            self.model_runner._sample(scores[plain_rows].unsqueeze(0), self.inputs_and_outputs.output_ids)
        self._hand_over(others)
        delivered = [output for output in outputs if output is not None]
        if delivered:
            self.output_router.deliver_batch(delivered)
        return {future.state.request_id: result.accepted for (future, _, _), result in zip(drafting, verified)}

    def _sample_coupled(self, scores: torch.Tensor, futures: list[FutureRequestState]) -> None:
        """Coupled sampling of the requests without a draft (`scores`: `[requests, vocab]` processed, in the order
        of `futures`): their perturbed argmax, written where transformers' update reads sampled tokens (and their
        log-probabilities, as its sampler writes them)."""
        keys = torch.tensor([self._keys_of(future, [[]])[0] for future in futures])  # [requests]
        tokens = coupled_choice(scores, self._streams_of(futures), keys)  # [requests]
        output_ids = self.inputs_and_outputs.output_ids
        output_ids[0, : tokens.shape[0]].copy_(tokens)
        if self.return_logprobs:
            logprobs = scores.float().log_softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
            output_ids[1, : tokens.shape[0]].copy_(logprobs.view(dtype=torch.int32))

    def _streams_of(self, futures: list[FutureRequestState]) -> torch.LongTensor:
        """`[requests]` each request's stream of coupled sampling."""
        book = self.speculator.streams
        return torch.tensor([book.assign(f.state.request_id, f.state.initial_tokens) for f in futures])

    def _keys_of(self, future: FutureRequestState, paths: list[list[int]]) -> list[int]:
        """The noise key of the token `future`'s request samples after its tokens so far and each of `paths`."""
        state = future.state
        return self.speculator.streams.keys(state.request_id, state.initial_tokens, state.generated_tokens, paths)

    def _perturbed(
        self, scores: torch.Tensor, futures: list[FutureRequestState], paths: list[list[list[int]]]
    ) -> torch.Tensor:
        """`scores` (`[requests, nodes, vocab]`) plus the noise of the token each node samples: after the request's
        tokens and the node's path of draft tokens (`paths[i][j]`; nodes past a request's own sample anything)."""
        keys = torch.zeros(scores.shape[:2], dtype=torch.long)  # [requests, nodes]
        for i, (future, request_paths) in enumerate(zip(futures, paths)):
            keys[i, : len(request_paths)] = torch.tensor(self._keys_of(future, request_paths))
        return perturb(scores, self._streams_of(futures).unsqueeze(1).expand_as(keys), keys)

    def _verify(self, drafting: list[tuple[FutureRequestState, list[int], torch.Tensor]]) -> list[_Verified]:
        """Greedy matching or rejection sampling of every drafting request's draft, in one batch (coupled sampling:
        greedy matching of the perturbed scores)."""
        if not drafting:
            return []
        if any(self.speculator.rows[future.state.request_id].parents is not None for future, _, _ in drafting):
            return self._verify_trees(drafting)
        width = max(len(draft) for _, draft, _ in drafting)
        vocab = drafting[0][2].shape[-1]
        scores = torch.full((len(drafting), width + 1, vocab), float("-inf"))  # [requests, k + 1, vocab]
        drafts = torch.zeros(len(drafting), width, dtype=torch.long)  # [requests, k]
        for i, (_, draft, rows) in enumerate(drafting):
            scores[i, : rows.shape[0]] = rows
            drafts[i, : len(draft)] = torch.tensor(draft)
        lengths = torch.tensor([len(draft) for _, draft, _ in drafting], dtype=torch.long)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [requests, k + 1, vocab]
        if self.coupled:
            paths = [[draft[:depth] for depth in range(len(draft) + 1)] for _, draft, _ in drafting]
            perturbed = self._perturbed(scores, [future for future, _, _ in drafting], paths)
            accepted, next_tokens = verify_greedy(perturbed, drafts, lengths)
        elif self.do_sample:
            accepted, next_tokens = verify_sampling(probs, drafts, lengths, None)
        else:
            accepted, next_tokens = verify_greedy(scores, drafts, lengths)
        results = []
        for i, (_, draft, _) in enumerate(drafting):
            a = int(accepted[i])
            tokens = draft[:a] + [int(next_tokens[i])]
            logprobs = None
            if self.return_logprobs:
                logprobs = [float(probs[i, j, token].log()) for j, token in enumerate(tokens)]
            results.append(_Verified(tokens, logprobs, a, list(range(1, a + 1))))
        return results

    def _verify_trees(self, drafting: list[tuple[FutureRequestState, list[int], torch.Tensor]]) -> list[_Verified]:
        """Greedy walks or multi-draft rejection sampling (each node a fixed proposal) of every drafting request's
        token tree (chains as trees), in one batch."""
        rows = [self.speculator.rows[future.state.request_id] for future, _, _ in drafting]
        roots = [future.state.generated_tokens[-1] for future, _, _ in drafting]
        tree = TokenTree.from_parent_lists(
            [[root] + row.draft for root, row in zip(roots, rows)],
            [[-1] + (row.parents if row.parents is not None else list(range(len(row.draft)))) for row in rows],
        )
        vocab = drafting[0][2].shape[-1]
        scores = torch.full((len(drafting), tree.num_nodes, vocab), float("-inf"))  # [requests, nodes, vocab]
        for i, (_, _, request_scores) in enumerate(drafting):
            scores[i, : request_scores.shape[0]] = request_scores
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [requests, nodes, vocab]
        if self.coupled:
            nodes = tree.paths()[:, :, 1:]  # [requests, nodes, depth] each node's path after the root
            tokens = tree.tokens.gather(1, nodes.clamp(min=0).flatten(1)).view(nodes.shape).tolist()
            depths = tree.depths.tolist()
            paths = [[row_tokens[node][: row_depths[node]] for node in range(len(row_depths))]
                     for row_tokens, row_depths in zip(tokens, depths)]
            perturbed = self._perturbed(scores, [future for future, _, _ in drafting], paths)
            outcome = verify_tree_greedy(perturbed, tree)
        else:
            outcome = verify_tree_sampling(probs, tree, None) if self.do_sample else verify_tree_greedy(scores, tree)
        results = []
        for i in range(len(drafting)):
            a = int(outcome.accepted[i])
            path = outcome.path[i, :a].tolist()  # accepted nodes, depth 1 to a
            tokens = outcome.emitted[i, : a + 1].tolist()
            logprobs = None
            if self.return_logprobs:
                logprobs = [float(probs[i, node, token].log()) for node, token in zip([0] + path, tokens)]
            results.append(_Verified(tokens, logprobs, a, path))
        return results

    def _move_accepted(self, verified: list[tuple[FutureRequestState, list[int]]]) -> None:
        """Copy the keys and values of accepted tree nodes to their path's positions (node at depth `d` to the
        position after the request's newest token plus `d - 1`), in every layer; chains are already in place."""
        moves = []  # (request id, from position, to position)
        for future, path in verified:
            past = future.state.position_offset - future.query_length  # the position of the request's newest token
            moves.extend((future.state.request_id, past + node, past + depth) for depth, node in enumerate(path, 1))
        moves = [move for move in moves if move[1] != move[2]]
        if moves:
            _copy_positions(self.cache, moves)

    def _emit(self, future: FutureRequestState, result: _Verified) -> GenerationOutput | None:
        """Append a drafting request's verified tokens, move its position back over the rejected ones and register
        the blocks its accepted tokens completed; its output when it streams or finished."""
        state = future.state
        past = state.position_offset - future.query_length  # the request's cached positions before this step
        finished = False
        for j, token in enumerate(result.tokens):
            finished = state.update_and_check_completion(token, result.logprobs[j] if result.logprobs else None)
            if finished:
                break
        written = 1 + result.accepted  # the newest token and the accepted drafts are now in the cache
        state.position_offset = past
        complete = self.cache.count_new_complete_blocks(state, written)
        state.position_offset = past + written
        if finished:
            self.scheduler.finish_request(state.request_id)
            self.scheduler.block_new_requests = False
        else:
            self.cache.mark_complete_blocks(state, complete)
        return state.to_generation_output() if state.streaming or finished else None

    def _hand_over(self, futures: list[FutureRequestState]) -> None:
        """Run transformers' own update on the requests without a draft (prefill chunks, plain decoding, forks)."""
        ios = self.inputs_and_outputs
        ios.requests_in_batch = futures
        ios.num_request_in_batch = len(futures)
        if futures:
            super().update_batch()


def _copy_positions(cache: PagedAttentionCache, moves: list[tuple[str, int, int]]) -> None:
    """For each `(request id, source, destination)`, copy the keys and values the request's paged cache holds at
    position `source` to position `destination`, in every layer (all sources are read before any is written)."""
    for allocator in cache.cache_allocators.values():
        source, destination = (
            torch.tensor([allocator.get_write_indices(r, position, 1)[0] for r, position in ends], dtype=torch.long)
            for ends in ([(r, s) for r, s, _ in moves], [(r, d) for r, _, d in moves])
        )
        for keys, values in allocator._kv_token_views.values():  # each [cache positions, kv heads, head dim]
            keys.index_copy_(0, destination.to(keys.device), keys.index_select(0, source.to(keys.device)))
            values.index_copy_(0, destination.to(values.device), values.index_select(0, source.to(values.device)))
