"""Serving with speculation: transformers' OpenAI-compatible server (`transformers serve`) over an enabled model.

`transformers serve MODEL --continuous-batching` answers `/v1/chat/completions`, `/v1/completions` and
`/v1/responses` from a continuous-batching manager it starts with `model.init_continuous_batching`. `serve` runs
that same server, its handlers and schema unchanged, with the model enabled (`hf_dynspec.enable`) as it is loaded:
its manager is then hf_dynspec's (`hf_dynspec.continuous`), and every decoding request drafts from a draft model,
prompt lookup or suffix trees as the policy chooses, step by step. Without `--continuous-batching` the server's
`generate` calls speculate through the same binding. From transformers 5.25 the server loads each model in a process
of its own, from a `ModelLoader` it pickles there: `SpeculatingLoader` is that loader, enabling what it loads; with
5.20-5.24 the model loads in the server's process (`speculating_loads`).

What the server adds to `transformers serve`: every request is checked before its handler runs
(`hf_dynspec.request_checks`: a 4xx naming the field, where transformers' handlers answer some malformed requests with a
500 or take them silently), and from transformers 5.25 the model goes by the name it is served as (the registry name,
or `served_model_name`), in `/v1/models`, in requests and in answers (`ServedModelManager`), and its stats lines say
which requests hold blocks of the paged caches.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel
from transformers.utils import logging

from .config import DynSpecConfig
from .continuous import SpeculationStats
from .integration import enable
from .request_checks import REQUESTED_TOKENS, Limits, RequestChecks

try:  # transformers >= 5.25 loads the served model in a process of its own, through a `ModelLoader`
    from transformers.cli.serve import Serve as _Serve
    from transformers.cli.serving.model_manager import EngineClient as _EngineClient
    from transformers.cli.serving.model_manager import ModelLoader as _ModelLoader
    from transformers.cli.serving.model_manager import ModelManager as _ModelManager
    from transformers.cli.serving.utils import canonical_model_id, parse_model_id, prompt_length
except ImportError:  # older releases (in-process loading), or no serving extras
    _ModelLoader = None


def serve(
    model: str,
    *,
    assistant_model: str | None = None,
    prompt_lookup_num_tokens: int | None = None,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    stats_interval: float = 10.0,
    served_model_name: str | None = None,
    **serve_options: Any,
):
    """Run `transformers serve model` with speculation, until the server stops (Ctrl+C or SIGTERM), as
    `transformers serve` runs; returns transformers' `Serve`. (transformers 5.20-5.24 only: `non_blocking=True`
    returns once the server listens, and `kill_server()` stops it.)

    Args:
        model: the model to load and serve: a name of `hf_dynspec.evaluation.models.REGISTRY` (the default target's
            GGUF file, assembled from its pip packages), or what `transformers serve MODEL` takes (a Hub id, a local
            folder, `<folder or repo>:<file>.gguf`).
        assistant_model: a draft model sharing the target's vocabulary (a registry name, a local folder or a Hub id),
            loaded in the served model's dtype and device.
        prompt_lookup_num_tokens: draft up to this many tokens a step by prompt lookup.
        dynspec_config: the speculation settings; `DynSpecConfig(proposer="suffix")` drafts from suffix trees.
        stats_interval: seconds between the lines saying what speculation did (requests, draft tokens, acceptance)
            and which requests hold blocks of the paged caches, logged at info beside transformers' own stats lines
            (`log_level="info"`) when they change.
        served_model_name: the name clients know the model by (in `/v1/models`, in requests' `model` and in
            answers); by default `model` as given (transformers 5.25 and newer; before, the name it loads by).
        serve_options: `transformers serve`'s options by their Python names (`continuous_batching=True`, `port`,
            `device`, `dtype`, `cb_num_blocks`, `cb_max_batch_tokens`, `log_level`, ...).
    """
    config = DynSpecConfig.coerce(dynspec_config)
    _check_serve_arguments(config, assistant_model, prompt_lookup_num_tokens, stats_interval, served_model_name)
    location, eos_token_ids = served_model(model)
    speculation = Speculation(prompt_lookup_num_tokens, config, eos_token_ids, assistant_model, stats_interval)
    if _ModelLoader is not None:
        name = served_model_name or model
        return SpeculativeServe(speculation, {name: location}, force_model=name, **serve_options)
    if served_model_name is not None:
        raise ValueError("`served_model_name` needs transformers 5.25 or newer: upgrade transformers, or leave it out "
                         f"(the model is then served as {location!r}).")
    from transformers.cli.serve import Serve

    with speculating_loads(speculation), checked_requests():
        return Serve(force_model=location, **serve_options)


def _check_serve_arguments(
    config: DynSpecConfig,
    assistant_model: str | None,
    prompt_lookup_num_tokens: int | None,
    stats_interval: float,
    served_model_name: str | None,
) -> None:
    """A clear error for `serve` arguments it cannot serve with."""
    if assistant_model is None and prompt_lookup_num_tokens is None and config.proposer != "suffix":
        raise ValueError(
            "Say where draft tokens come from: `assistant_model` (a draft model), `prompt_lookup_num_tokens=N`, or a "
            "`dynspec_config` with proposer='suffix'."
        )
    if prompt_lookup_num_tokens is not None and (
        not isinstance(prompt_lookup_num_tokens, int) or prompt_lookup_num_tokens < 1
    ):
        raise ValueError(f"`prompt_lookup_num_tokens` must be a positive integer, got {prompt_lookup_num_tokens!r}.")
    if not stats_interval > 0:
        raise ValueError(f"`stats_interval` must be a positive number of seconds, got {stats_interval!r}.")
    if served_model_name is not None and (not isinstance(served_model_name, str) or not served_model_name.strip()):
        raise ValueError(f"`served_model_name` must be a non-empty name, got {served_model_name!r}.")


@dataclass(frozen=True)
class Speculation:
    """How the served model speculates; it travels to the process the server loads the model in (pickled)."""

    prompt_lookup_num_tokens: int | None
    config: DynSpecConfig
    eos_token_ids: tuple[int, ...] = ()
    assistant_model: str | None = None
    stats_interval: float = 10.0

    def apply(self, model: PreTrainedModel) -> None:
        """Enable `model` (just loaded by the server) with these settings, and log what its managers speculate."""
        if self.eos_token_ids:
            model.generation_config.eos_token_id = list(self.eos_token_ids)
        if self.prompt_lookup_num_tokens is not None:
            model.generation_config.prompt_lookup_num_tokens = self.prompt_lookup_num_tokens
        draft = load_draft(self.assistant_model, model) if self.assistant_model is not None else None
        enable(model, draft, dynspec_config=self.config)
        _log_speculation(model, self.stats_interval)


def _log_speculation(model: PreTrainedModel, interval: float) -> None:
    """Every `interval` seconds, if they changed, two lines at info about the latest speculating manager
    `model.init_continuous_batching` made: what it speculated so far (`speculation_line`), and which requests hold
    blocks of its paged caches (`cache_line`). They go through transformers' serving logger, whose level the server's
    `log_level` sets."""
    managers: list[Any] = []
    init = model.init_continuous_batching

    def recording(*args: Any, **kwargs: Any) -> Any:
        manager = init(*args, **kwargs)
        managers.append(manager)
        return manager

    model.init_continuous_batching = recording
    logger = logging.get_logger("transformers.cli.serving.speculation")

    def report() -> None:
        last = None
        while True:
            time.sleep(interval)
            speculating = [manager for manager in managers if hasattr(manager, "held_blocks")]
            if not speculating:
                continue
            lines = (speculation_line(speculating[-1].speculation), cache_line(speculating[-1].held_blocks()))
            if lines != last:
                for line in lines:
                    logger.info(line)
                last = lines

    threading.Thread(target=report, name="speculation-stats", daemon=True).start()


def speculation_line(stats: SpeculationStats) -> str:
    """What a speculating manager did, in one line: requests, draft tokens, acceptance, tokens per decoding step, the
    seconds its steps spent in forwards and in drafting, and the requests that left unfinished."""
    per_step = stats.emitted_tokens / stats.decode_steps if stats.decode_steps else 0.0
    return (
        f"Speculation: {stats.requests} requests, {stats.draft_tokens} draft tokens "
        f"({stats.free_tokens} model-free), {stats.accepted_tokens} accepted ({100 * stats.acceptance_rate:.0f}%), "
        f"{per_step:.2f} tokens per decoding step, {stats.forward_seconds:.2f} s in forwards, "
        f"{stats.draft_seconds:.2f} s drafting, {stats.unfinished} requests cancelled or failed"
    )


def cache_line(held: dict[str, dict[str, int]]) -> str:
    """Which requests hold blocks of each paged cache (`SpeculativeManager.held_blocks`), in one line."""
    parts = [f"{cache} {sum(blocks.values())} blocks held by {len(blocks)} requests" for cache, blocks in held.items()]
    return "Paged caches: " + ", ".join(parts)


def served_model(model: str) -> tuple[str, tuple[int, ...]]:
    """The name `transformers serve` loads for `model` (registry names become `<folder>:<file>.gguf`), and the EOS
    ids the registry gives it (empty for other models)."""
    from .evaluation.models import REGISTRY, resolve_model

    if model not in REGISTRY:
        return model, ()
    location = resolve_model(model)
    name = f"{location.path}:{location.gguf_file}" if location.gguf_file else location.path
    return name, location.eos_token_ids


@contextmanager
def speculating_loads(speculation: Speculation) -> Iterator[None]:
    """transformers 5.20-5.24, which load the served model in the server's own process: while open, every model
    its serving loads is enabled by `speculation` (the server preloads its model, so the models it serves are)."""
    from transformers.cli.serving.model_manager import ModelManager

    original = ModelManager.load_model_and_processor
    enabled: weakref.WeakSet = weakref.WeakSet()  # requests load the model again, and get the one loaded before

    def load(self, *args, **kwargs):
        model, processor = original(self, *args, **kwargs)
        if model not in enabled:
            speculation.apply(model)
            enabled.add(model)
        return model, processor

    ModelManager.load_model_and_processor = load
    try:
        yield
    finally:
        ModelManager.load_model_and_processor = original


def load_draft(name: str, model: PreTrainedModel) -> PreTrainedModel:
    """The draft `name` (a registry name, a local folder or a Hub id) in `model`'s dtype, on its device. A registry
    name may end in a variant (`qwen2.5-coder-0.5b@4bit`: bitsandbytes 4-bit, computing in `model`'s dtype)."""
    from transformers import AutoModelForCausalLM

    from .evaluation.models import REGISTRY, LoadOptions, load_model, resolve_model, split_variant

    base, variant = split_variant(name)
    if base in REGISTRY:  # placed on the model's device as it loads (bitsandbytes models cannot move afterwards)
        options = LoadOptions(dtype=str(model.dtype).removeprefix("torch."), device=str(model.device))
        return load_model(resolve_model(base), options.with_variant(variant))
    draft = AutoModelForCausalLM.from_pretrained(name, dtype=model.dtype)
    return draft.to(model.device).eval()


@contextmanager
def checked_requests() -> Iterator[None]:
    """While open, every app transformers' serving builds (`build_server`) checks its requests first
    (`request_checks.RequestChecks`), against the model its manager serves. transformers' `Serve` builds its app
    itself, from the module's `build_server`, with no hook for middleware of its own."""
    from transformers.cli.serving import server

    original = server.build_server

    def build_checked(model_manager: Any, *args: Any, **kwargs: Any) -> Any:
        app = original(model_manager, *args, **kwargs)
        app.add_middleware(RequestChecks, limits=request_limits(model_manager))
        return app

    server.build_server = build_checked
    try:
        yield
    finally:
        server.build_server = original


def request_limits(model_manager: Any) -> Limits:
    """The model names a server's requests may give (the one it serves) and its context length, where its manager
    knows it (transformers 5.25 and newer: the served model's config and `--max-model-len`)."""
    name = model_manager.force_model
    get_engine, state = getattr(model_manager, "get_engine", None), getattr(model_manager, "generation_state", None)
    if get_engine is None or state is None:
        return Limits((name,))
    return Limits((name,), state.context_length(get_engine(None).model_config))


if _ModelLoader is not None:  # transformers >= 5.25: the served model loads in a process of its own

    class SpeculatingLoader(_ModelLoader):
        """transformers' `ModelLoader`, enabling each model it loads by `speculation`, and loading a model named as
        served from where it is (`locations`: served name -> what `transformers serve` loads). The server pickles its
        loader into the model's process, so that this class, not a patched method, reaches it."""

        speculation: Speculation
        locations: dict[str, str]

        @classmethod
        def adopt(cls, loader: Any, speculation: Speculation, locations: dict[str, str]) -> SpeculatingLoader:
            adopted = cls.__new__(cls)
            adopted.__dict__.update(vars(loader))
            adopted.speculation = speculation
            adopted.locations = {key: location for name, location in locations.items()
                                 for key in (name, canonical_model_id(name))}
            return adopted

        def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> tuple[PreTrainedModel, Any]:
            location = self.locations.get(model_id, model_id)
            self.gguf = parse_model_id(location)[2] is not None
            model, processor = super().load_model_and_processor(location, on_progress)
            self.speculation.apply(model)
            return model, processor

        def get_quantization_config(self) -> Any:
            """transformers' (bitsandbytes, with `quantization`); for a GGUF file without it, its weights
            dequantized as they load, as the benchmarks load them (kept in GGUF blocks, they may be unpacked in every
            forward, which costs a CPU more than the forward itself)."""
            config = super().get_quantization_config()
            if config is None and getattr(self, "gguf", False):
                from transformers import GgufConfig

                return GgufConfig(dequantize=True)
            return config

        def load_config(self, model_id: str) -> Any:
            return super().load_config(self.locations.get(model_id, model_id))

        def load_processor(self, model_id: str) -> Any:
            return super().load_processor(self.locations.get(model_id, model_id))

    class ServedEngine(_EngineClient):
        """transformers' `EngineClient` under the name the model is served as (`model_id`, which answers carry), which
        fits each request to the model's context before it generates: an explicit answer length (`max_tokens`) that
        does not fit is refused (400), a default one is shortened to what fits, and a prompt of no tokens is refused
        (continuous batching cannot run one)."""

        async def generate_non_streaming(self, inputs: dict, generation_kwargs: dict) -> tuple[str, int, list[int]]:
            self.fit(inputs, generation_kwargs)
            return await super().generate_non_streaming(inputs, generation_kwargs)

        def generate_streaming(self, inputs: dict, generation_kwargs: dict, response_parser: Any = None) -> Any:
            self.fit(inputs, generation_kwargs)
            return super().generate_streaming(inputs, generation_kwargs, response_parser)

        def fit(self, inputs: dict, generation_kwargs: dict) -> None:
            """Check the request against the context; shorten a default answer length to what fits."""
            length = prompt_length(inputs)
            if length == 0:
                raise ValueError("The prompt is empty once tokenized: send at least one token of text.")
            limit = self.generation_state.context_length(self.model_config)
            wanted = generation_kwargs.get("max_new_tokens")
            if limit is None or wanted is None or length + wanted <= limit:
                return
            requested = REQUESTED_TOKENS.get()
            if requested is None:
                generation_kwargs["max_new_tokens"] = limit - length
                return
            name, value = requested
            raise ValueError(
                f"`{name}` is {value}, but the prompt has {length} tokens and the model takes at most {limit}, prompt "
                f"and answer: ask for at most {limit - length} tokens, or shorten the prompt."
            )

    class ServedModelManager(_ModelManager):
        """transformers' `ModelManager`, its model (`force_model`) named as served: `/v1/models` lists that name,
        requests give it (another is refused), and answers carry it (`ServedEngine`)."""

        def preload_engine(self, force_model: str, engine_connection: tuple | None) -> None:
            engine = ServedEngine(force_model, self.loader, self.generation_state, connection=engine_connection)
            self.engines[canonical_model_id(force_model)] = engine
            if engine_connection is None:
                engine.start()

    @contextmanager
    def served_names() -> Iterator[None]:
        """While open, transformers' serving builds its model manager as a `ServedModelManager` (`Serve.run` builds
        it itself, from the module's `ModelManager`)."""
        from transformers.cli.serving import model_manager

        original = model_manager.ModelManager
        model_manager.ModelManager = ServedModelManager
        try:
            yield
        finally:
            model_manager.ModelManager = original

    class SpeculativeServe(_Serve):
        """`transformers serve` whose models load enabled and go by the names they are served as: its loader becomes
        a `SpeculatingLoader` before it serves, with one API server or several, and its requests are checked."""

        def __init__(self, speculation: Speculation, locations: dict[str, str], **options: Any) -> None:
            self.speculation = speculation
            self.locations = locations
            super().__init__(**options)

        def run(self, *args: Any, **kwargs: Any) -> None:
            self._speculate()
            with served_names(), checked_requests():
                super().run(*args, **kwargs)

        def run_api_servers(self, count: int) -> None:
            self._speculate()
            super().run_api_servers(count)

        def _speculate(self) -> None:
            if not isinstance(self.loader, SpeculatingLoader):
                self.loader = SpeculatingLoader.adopt(self.loader, self.speculation, self.locations)
