"""Does a suffix proposal's own confidence say whether the target accepts it, beyond its match length?

arctic-inference gives each proposed token a probability: the product, along the chain, of the shares of earlier
occurrences of the matched text that continued that way. This generates the target's greedy outputs for a dataset's
prompts, then replays them through a suffix cache as a service would see them (each request's prompt, its output so
far, and every earlier request's output), and counts, per match-length class and per share of the token's own step
(`probs[j] / probs[j - 1]`), how many proposed tokens the target's output confirmed (a chain stops at its first miss).
The goodput policy scales its acceptance estimates by this confidence (`estimators.ConfidenceScale`).

    python evaluation/probes/suffix_confidence.py --dataset agent --num-prompts 16 --max-new-tokens 64 \
        --out suffix_confidence.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from hf_dynspec.candidates.suffix import SuffixCache
from hf_dynspec.evaluation.bench import prompt_ids
from hf_dynspec.evaluation.models import load_model, load_tokenizer, resolve_model
from hf_dynspec.evaluation.settings import BenchSettings

COPY_MATCH = 4  # the goodput policy's `copy_anchor`: a match this long or longer is a copy


def share_class(share: float) -> str:
    """The bin of a token's share of its context's continuations."""
    return "1" if share >= 0.999 else ("0.5-1" if share >= 0.5 else "<0.5")


def replay(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], max_tokens: int = 8) -> dict:
    """`{"<match class> <share class>": [tried, accepted]}` over every position of every output, each request's
    suffix proposal checked against what the target wrote next."""
    cache = SuffixCache()
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for prompt, output in zip(prompts, outputs):
        request = cache.start(list(prompt))
        for t in range(len(output)):
            draft = cache.speculate(request, list(prompt) + list(output[:t]), max_tokens, False)
            previous, tokens = 1.0, zip(draft.token_ids, draft.probs) if draft is not None else ()
            for j, (token, probability) in enumerate(tokens):
                share, previous = probability / previous, probability
                key = f"{'copy' if draft.match_len >= COPY_MATCH else 'short'} {share_class(share)}"
                accepted = t + j < len(output) and output[t + j] == token
                counts[key][0] += 1
                counts[key][1] += int(accepted)
                if not accepted:
                    break
            cache.extend(request, [output[t]])
        cache.stop(request)
    return dict(sorted(counts.items()))


def greedy_outputs(settings: BenchSettings, max_new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """The bench target's prompts and greedy outputs for `settings`' dataset."""
    name, options = settings.load_options("target")
    location = resolve_model(name)
    prompts = prompt_ids(settings, load_tokenizer(location), settings.num_prompts)
    model = load_model(location, options)
    outputs = []
    with torch.no_grad():
        for prompt in tqdm(prompts, desc="greedy outputs"):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return prompts, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="agent")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--out", default=None, help="JSON with the counts (and the outputs, to replay again).")
    args = parser.parse_args()
    settings = BenchSettings(dataset=args.dataset, num_prompts=args.num_prompts, batch_sizes=[1],
                             max_prompt_tokens=args.max_prompt_tokens)
    prompts, outputs = greedy_outputs(settings, args.max_new_tokens)
    counts = replay(prompts, outputs)
    for key, (tried, accepted) in counts.items():
        print(f"{key:12s} tried {tried:5d} accepted {accepted:5d} ({accepted / tried:.0%})")
    if args.out:
        with open(args.out, "w") as stream:
            json.dump({"settings": vars(args), "counts": counts, "prompts": prompts, "outputs": outputs}, stream)


if __name__ == "__main__":
    main()
