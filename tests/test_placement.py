"""Models placed the way users load them: accelerate offload (CPU and disk), bfloat16 and bitsandbytes drafts,
a bitsandbytes target, and clear errors for placements that cannot run.

Every model is built from a config, saved with `save_pretrained` and reloaded with `from_pretrained`, as a user would.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from accelerate import cpu_offload, init_empty_weights
from conftest import left_padded_prompts, perturbed, tiny_model, word_tokenizer
from test_sampling import NEW, assert_converges, exact_joint, sample_loop
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.commands import bench as bench_command
from hf_dynspec.commands import calibrate as calibrate_command
from hf_dynspec.devices import input_device, model_devices, unloaded_parameters
from hf_dynspec.evaluation import models
from hf_dynspec.evaluation.bench import run_benchmark
from hf_dynspec.evaluation.settings import BenchSettings
from hf_dynspec.placement import Placement

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MAX_NEW = 16
# hidden size 64: bitsandbytes' 4-bit CPU kernels quantize in blocks of 64 input features
SIZES = dict(hidden_size=64, intermediate_size=128)
# embeddings, the second layer and the head on disk: the input embeddings' weight stays on `meta`
DISK_MAP = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
            "model.rotary_emb": "cpu", "lm_head": "disk"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Paths of a saved tiny Llama target, a draft that agrees with it part of the time, and a Qwen2 target."""
    root = tmp_path_factory.mktemp("checkpoints")
    target = tiny_model("llama", seed=0, dtype=torch.float32, **SIZES)
    target.save_pretrained(root / "target")
    perturbed(target, scale=0.05).save_pretrained(root / "draft")
    tiny_model("qwen2", seed=1, dtype=torch.float32, **SIZES).save_pretrained(root / "qwen2")
    return root


def load(path, **kwargs):
    kwargs.setdefault("dtype", torch.float64)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def bnb_config(bits: int):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    if bits == 8:
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)


def prompts():
    return left_padded_prompts([5, 9, 3], seed=2)


def plain(target) -> torch.Tensor:
    ids, mask = prompts()
    return target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)


def speculative(target, draft, k: int = 3, **kwargs) -> torch.Tensor:
    ids, mask = prompts()
    return target.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=k),
        **kwargs,
    )


# ---- offload ------------------------------------------------------------------------------------------------------
def test_cpu_offloaded_target_matches_plain_generate(saved):
    reference = plain(load(saved / "target"))
    target = load(saved / "target")
    cpu_offload(target, execution_device=torch.device("cpu"))  # weights kept aside, loaded by hooks per forward
    assert target.get_input_embeddings().weight.device.type == "meta"
    assert input_device(target) == torch.device("cpu")
    assert torch.equal(speculative(target, load(saved / "draft")), reference)


@pytest.mark.parametrize("model_name", ["target", "qwen2"])
def test_disk_offloaded_target_matches_plain_generate(saved, tmp_path, model_name):
    reference = plain(load(saved / model_name))
    target = load(saved / model_name, device_map=DISK_MAP, offload_folder=tmp_path / "offload")
    assert "disk" in target.hf_device_map.values()
    assert target.get_input_embeddings().weight.device.type == "meta"
    assert unloaded_parameters(target) == []
    draft = load(saved / "draft") if model_name == "target" else perturbed(load(saved / model_name), scale=0.05)
    assert torch.equal(speculative(target, draft), reference)


def test_max_memory_offload_of_target_and_draft_matches_plain_generate(saved, tmp_path):
    reference = plain(load(saved / "target"))
    # float64 weights: 96 x 64 x 8 bytes = 48 KiB per embedding, so 64 KiB keeps only the first modules in memory
    target = load(saved / "target", device_map="auto", max_memory={"cpu": "64KiB"}, offload_folder=tmp_path / "t")
    draft = load(saved / "draft", device_map="auto", max_memory={"cpu": "64KiB"}, offload_folder=tmp_path / "d")
    assert "disk" in target.hf_device_map.values() and "disk" in draft.hf_device_map.values()
    out = speculative(target, draft, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert out.dynspec_stats.accepted_tokens > 0



@pytest.mark.parametrize("head_on", ["disk", "cpu"])
def test_a_dispatched_draft_narrows_its_head_only_when_the_head_is_in_memory(saved, tmp_path, head_on):
    from hf_dynspec.candidates.draft_head import unsupported_reason

    reference = plain(load(saved / "target"))
    draft = load(saved / "draft", device_map={**DISK_MAP, "lm_head": head_on}, offload_folder=tmp_path / "d")
    reason = unsupported_reason(draft)
    assert (reason is None) if head_on == "cpu" else ("offloaded" in reason)
    ids, mask = prompts()
    out = load(saved / "target").generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=3, draft_vocab_size=24),
    )
    assert torch.equal(out.sequences, reference)
    assert out.dynspec_stats.accepted_tokens > 0

def test_placement_of_an_offloaded_model_names_its_execution_device(saved, tmp_path):
    target = load(saved / "target", device_map={"": "disk"}, offload_folder=tmp_path / "offload")
    assert {p.device.type for p in target.parameters()} == {"meta"}
    assert model_devices(target) == {torch.device("cpu")}
    placement = Placement.of(torch.device("cpu"), target, load(saved / "draft"))
    assert (placement.target_device, placement.draft_device, placement.cuda_devices) == (
        torch.device("cpu"), torch.device("cpu"), ())


# ---- dtypes and quantized drafts ----------------------------------------------------------------------------------
def test_bfloat16_draft_beside_float32_target_matches_plain_generate(saved):
    target = load(saved / "target", dtype=torch.float32)
    draft = load(saved / "draft", dtype=torch.bfloat16)
    assert draft.dtype == torch.bfloat16
    assert torch.equal(speculative(target, draft), plain(target))


@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_draft_matches_plain_generate(saved, bits):
    target = load(saved / "target")
    draft = load(saved / "draft", dtype=torch.float32, quantization_config=bnb_config(bits), device_map="cpu")
    assert getattr(draft, f"is_loaded_in_{bits}bit")
    out = speculative(target, draft, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain(target))
    assert out.dynspec_stats.accepted_tokens > 0  # the quantized draft's tokens are used


def test_bitsandbytes_target_matches_its_own_plain_generate(saved):
    target = load(saved / "target", dtype=torch.float32, quantization_config=bnb_config(8), device_map="cpu")
    assert target.is_loaded_in_8bit
    assert torch.equal(speculative(target, load(saved / "draft", dtype=torch.float32)), plain(target))


@pytest.mark.slow
def test_sampling_with_a_quantized_draft_follows_the_target(tmp_path):
    vocab = 6
    target = tiny_model("llama", seed=4, vocab=vocab, eos_token_id=None, dtype=torch.float32)
    target.generation_config.eos_token_id = None
    perturbed(target, scale=0.3, seed=8).save_pretrained(tmp_path / "draft")
    draft = load(tmp_path / "draft", dtype=torch.float32, quantization_config=bnb_config(8), device_map="cpu")
    draft.generation_config.eos_token_id = None
    prompt = torch.tensor([3, 4, 5, 3, 2])
    temperature, top_k = 0.9, 5
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    with torch.no_grad():
        joint = exact_joint(target, prompt, processors)
    assert joint.shape == (vocab**NEW,)
    torch.manual_seed(0)
    assert_converges(lambda n: sample_loop(target, draft, prompt, 3, n, temperature, top_k), joint,
                     sizes=(100, 1_000, 10_000))


# ---- impossible placements ----------------------------------------------------------------------------------------
def empty_model():
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
    with init_empty_weights():
        return LlamaForCausalLM(config).eval()


def test_draft_on_meta_without_hook_is_a_clear_error(saved):
    with pytest.raises(ValueError, match="draft model has .* meta device with no accelerate hook"):
        speculative(load(saved / "target"), empty_model())


def test_input_device_of_unloaded_embeddings_is_a_clear_error():
    model = empty_model()
    with pytest.raises(ValueError, match="meta device without an accelerate hook"):
        input_device(model)
    assert "model.embed_tokens.weight" in unloaded_parameters(model)


def test_meta_parameters_outside_hooks_are_named(saved, tmp_path):
    target = load(saved / "target", device_map=DISK_MAP, offload_folder=tmp_path / "offload")
    assert unloaded_parameters(target) == []
    del target.lm_head._hf_hook  # a module whose weights nobody will load
    assert unloaded_parameters(target) == ["lm_head.weight"]
    with pytest.raises(ValueError, match="target model has 1 parameters .*lm_head.weight"):
        speculative(target, load(saved / "draft"))


def test_draft_with_another_vocabulary_is_a_clear_error(saved):
    draft = tiny_model("llama", vocab=128)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative(load(saved / "target"), draft)


# ---- GPU-only paths -------------------------------------------------------------------------------------------------
@needs_cuda
def test_draft_on_gpu_beside_cpu_target_matches_plain_generate(saved):
    target = load(saved / "target")
    draft = load(saved / "draft", dtype=torch.float32).to("cuda")
    placement = Placement.of(torch.device("cpu"), target, draft)
    assert placement.cuda_devices == (torch.device("cuda", torch.cuda.current_device()),)
    assert torch.equal(speculative(target, draft), plain(target))


@needs_cuda
def test_target_offloaded_from_gpu_to_cpu_matches_plain_generate(saved):
    reference = plain(load(saved / "target"))
    target = load(saved / "target", device_map="auto", max_memory={0: "64KiB", "cpu": "1GiB"})
    assert "cpu" in target.hf_device_map.values()
    ids, mask = prompts()
    out = target.generate(input_ids=ids.to(0), attention_mask=mask.to(0), max_new_tokens=MAX_NEW, do_sample=False,
                          assistant_model=load(saved / "draft").to(0), custom_generate=hf_dynspec.speculative_loop)
    assert torch.equal(out.cpu(), reference)


# ---- loading options: dtypes, variants, memory limits ---------------------------------------------------------------
def test_variants_of_registry_names():
    assert models.split_variant("qwen2.5-coder-0.5b@bf16") == ("qwen2.5-coder-0.5b", {"dtype": "bfloat16"})
    assert models.split_variant("qwen2.5-coder-0.5b@8bit") == ("qwen2.5-coder-0.5b", {"quantization": "8bit"})
    assert models.split_variant("qwen2.5-coder-0.5b") == ("qwen2.5-coder-0.5b", {})
    assert models.split_variant("/data/runs@2024/model") == ("/data/runs@2024/model", {})
    with pytest.raises(ValueError, match="Unknown variant 'int3' of 'qwen2.5-coder-0.5b'.*@8bit"):
        models.split_variant("qwen2.5-coder-0.5b@int3")


def test_gguf_dtype_follows_the_hardware(monkeypatch):
    gguf = models.ModelLocation("/nowhere", "m.gguf")
    for supported, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(models, "cpu_bfloat16_support", lambda supported=supported: {"supported": supported})
        assert models.default_gguf_dtype("cpu") == expected
        assert models.resolve_dtype("auto", gguf) == expected
    assert models.resolve_dtype("float16", gguf) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        models.resolve_dtype("fp8", gguf)


def test_cpu_bfloat16_support_reads_cpu_flags():
    support = models.cpu_bfloat16_support()
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.is_file() else set()
    assert set(support["flags"]) == flags & {"amx_bf16", "avx512_bf16", "bf16"}
    assert support["supported"] == (bool(support["flags"]) or any(support["torch"].values()))


def test_auto_dtype_of_a_checkpoint_is_its_config_dtype(tmp_path):
    tiny_model("qwen2", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    location = models.ModelLocation(str(tmp_path / "bf16"))
    assert models.resolve_dtype("auto", location) == torch.bfloat16
    model = models.load_model(location, models.LoadOptions())
    assert model.dtype == torch.bfloat16
    assert model.hf_dynspec_load["dtype_requested"] == "auto" and model.hf_dynspec_load["dtype"] == "bfloat16"
    assert models.load_model(location, models.LoadOptions(dtype="float32")).dtype == torch.float32


def test_max_memory_parsing_and_option_checks():
    assert models.parse_max_memory("cpu=1GiB, 0=10GiB") == {"cpu": "1GiB", 0: "10GiB"}
    assert models.parse_max_memory("") is None
    with pytest.raises(ValueError, match="DEVICE=SIZE pairs"):
        models.parse_max_memory("1GiB")
    with pytest.raises(ValueError, match="`quantization` must be one of none, 8bit, 4bit"):
        models.LoadOptions(quantization="3bit")
    with pytest.raises(ValueError, match="`max_memory` must be a dict"):
        models.LoadOptions(max_memory="cpu=1GiB")
    assert models.parse_max_memory("cpu=35%") == {"cpu": "35%"}
    for bad in ("cpu=0%", "cpu=150%", "cpu=many%"):
        with pytest.raises(ValueError, match="share of the weights"):
            models.parse_max_memory(bad)
    with pytest.raises(ValueError, match="weight_share_limits"):
        models.LoadOptions(max_memory={"cpu": "35%"}).from_pretrained_kwargs(torch.float32)


def test_a_share_of_the_weights_is_the_same_part_of_the_model_in_every_dtype(saved, tmp_path):
    location = models.ModelLocation(str(saved / "target"))
    parameters = sum(p.numel() for p in load(saved / "target").parameters())
    for dtype in (torch.float32, torch.bfloat16):
        limits = models.weight_share_limits({"cpu": "50%", 0: "1GiB"}, location, dtype)
        assert limits == {"cpu": int(parameters * dtype.itemsize * 0.5), 0: "1GiB"}
    assert models.weight_share_limits({"cpu": "1GiB"}, location, torch.float32) == {"cpu": "1GiB"}
    offloaded = models.load_model(
        location, models.LoadOptions(dtype="float32", max_memory={"cpu": "30%"}, offload_folder=str(tmp_path / "o"))
    )
    assert "disk" in offloaded.hf_device_map.values()
    assert offloaded.hf_dynspec_load["max_memory"] == {"cpu": "30%"}
    assert offloaded.hf_dynspec_load["max_memory_bytes"] == {"cpu": int(parameters * 4 * 0.3)}


def test_load_model_offloads_and_quantizes_as_asked(saved, tmp_path):
    location = models.ModelLocation(str(saved / "target"))
    offloaded = models.load_model(
        location, models.LoadOptions(dtype="float32", max_memory={"cpu": "64KiB"}, offload_folder=str(tmp_path / "o"))
    )
    assert "disk" in offloaded.hf_device_map.values()
    assert offloaded.hf_dynspec_load["max_memory"] == {"cpu": "64KiB"}
    quantized = models.load_model(location, models.LoadOptions(dtype="float32", quantization="8bit"))
    assert quantized.is_loaded_in_8bit and quantized.hf_dynspec_load["quantization"] == "8bit"


def test_gguf_models_are_dequantized_once_into_a_checkpoint(saved, tmp_path, monkeypatch):
    source = tmp_path / "source"
    load(saved / "target", dtype=torch.float32).save_pretrained(source)
    word_tokenizer(96).save_pretrained(source)
    # stand-in for a GGUF file: `from_pretrained` reads this directory instead of `gguf_file=...`
    monkeypatch.setattr(models.ModelLocation, "from_pretrained_kwargs", lambda self: {})
    gguf = models.ModelLocation(str(source), "tiny.gguf", (1,))
    copy = models.dequantized_checkpoint(gguf, torch.bfloat16, tmp_path / "cache")
    assert copy == models.ModelLocation(str(tmp_path / "cache" / "dequantized" / "tiny-bfloat16"), None, (1,))
    stamp = Path(copy.path) / ".complete"
    assert stamp.is_file() and not list((tmp_path / "cache" / "dequantized").glob("*.partial-*"))
    assert AutoModelForCausalLM.from_pretrained(copy.path).dtype == torch.bfloat16
    modified = stamp.stat().st_mtime_ns
    assert models.dequantized_checkpoint(gguf, torch.bfloat16, tmp_path / "cache") == copy
    assert stamp.stat().st_mtime_ns == modified  # reused, not written again
    plain_location = models.ModelLocation(str(source))
    assert models.dequantized_checkpoint(plain_location, torch.bfloat16, tmp_path / "cache") == plain_location


# ---- command line ---------------------------------------------------------------------------------------------------
def parse(command: str, argv: list[str]):
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    (bench_command if command == "bench" else calibrate_command).add_parser(subparsers)
    return parser.parse_args([command, *argv])


def test_bench_offload_scenario_and_per_model_options():
    settings = bench_command.settings_from_args(parse("bench", ["--scenario", "offload"]))
    assert settings.batch_sizes == [1] and settings.dtype == "auto"
    assert settings.methods == "plain,hf-assisted,hf-assisted+rowmajor,dynspec-goodput@marginal:16,dynspec-tree:32:40"
    assert settings.target_max_memory == {"cpu": "35%"} and settings.target_offload_folder
    argv = ["--scenario", "offload", "--target-max-memory", "cpu=2GiB,0=8GiB", "--draft", "qwen2.5-coder-0.5b@4bit",
            "--target-dtype", "float32", "--draft-quantization", "8bit", "--draft-offload-folder", "/tmp/d"]
    settings = bench_command.settings_from_args(parse("bench", argv))
    assert settings.target_max_memory == {"cpu": "2GiB", 0: "8GiB"}
    name, options = settings.load_options("draft")
    assert (name, options.quantization, options.offload_folder) == ("qwen2.5-coder-0.5b", "4bit", "/tmp/d")
    name, options = settings.load_options("target")
    assert (options.dtype, options.quantization) == ("float32", "none")
    with pytest.raises(ValueError, match="Unknown variant 'fp4'"):
        bench_command.settings_from_args(parse("bench", ["--draft", "qwen2.5-coder-0.5b@fp4"]))
    with pytest.raises(SystemExit):
        parse("bench", ["--target-max-memory", "lots"])


def test_tiny_bench_records_dtypes_and_bfloat16_support():
    settings = BenchSettings(tiny=True, num_prompts=1, batch_sizes=[1], max_new_tokens=4, methods="plain",
                             repetitions=1, warmup_tokens=0, draft_dtype="bfloat16")
    results = run_benchmark(settings, progress=False)
    assert results["config"]["loaded_models"] == {
        "target": {"dtype_requested": "auto", "dtype": "float32"},
        "draft": {"dtype_requested": "bfloat16", "dtype": "bfloat16"},
    }
    assert results["machine"]["bfloat16"]["cpu"] == models.cpu_bfloat16_support()


def test_calibrate_records_the_target_dtype(tmp_path):
    argv = ["--tiny", "--target-dtype", "bfloat16", "--batch-sizes", "1", "--tokens-per-row", "1",
            "--context-length", "4", "--warmup", "0", "--repeats", "1", "--no-progress", "--out", str(tmp_path / "p.json")]
    assert calibrate_command.run(parse("calibrate", argv)) == 0
    assert json.loads((tmp_path / "p.json").read_text())["dtype"] == "bfloat16"


def test_tiny_models_refuse_placement_options():
    with pytest.raises(ValueError, match="target_max_memory, target_offload_folder do not apply"):
        bench_command.settings_from_args(parse("bench", ["--scenario", "offload", "--tiny"]))
    with pytest.raises(ValueError, match="draft_quantization do not apply"):
        BenchSettings(tiny=True, draft_quantization="8bit")
    argv = ["--tiny", "--draft-quantization", "8bit", "--out", "unused.json"]
    assert calibrate_command.run(parse("calibrate", argv)) == 2
