"""The loop's timings are the devices': on a CUDA device the host runs ahead of the kernels, so what the policy and
the statistics read must come from events on the device's stream, not from the host's clock. A fake CUDA device whose
clock advances by a fixed amount per forward (and whose events the loop records) proves the policy sees device time."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.clocks import Instant, Seconds, elapsed
from hf_dynspec.placement import Placement
from hf_dynspec.policies import StaticPolicy

TARGET_SECONDS, DRAFT_SECONDS = 0.5, 0.125
"""Device seconds of one forward of each model on the fake device (the host takes microseconds)."""


class FakeDevice:
    """A device clock that only forwards advance; its events read it when recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits = 0  # events waited for

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.time = None

            def record(self, stream=None) -> None:
                self.time = device.now

            def synchronize(self) -> None:
                device.waits += 1

            def elapsed_time(self, end) -> float:
                return (end.time - self.time) * 1000.0

        return Event


@pytest.fixture
def fake_cuda(monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    of = Placement.of.__func__

    def on_fake_cuda(cls, *args, **kwargs):
        placement = of(cls, *args, **kwargs)
        placement.cuda_devices = (torch.device("cuda", 0),)
        return placement

    monkeypatch.setattr(Placement, "of", classmethod(on_fake_cuda))
    return device


class Recorder(StaticPolicy):
    """The static policy, keeping what each step told it."""

    def __init__(self, config: DynSpecConfig) -> None:
        super().__init__(config.num_speculative_tokens)
        self.steps = []

    def observe(self, feedback) -> None:
        self.steps.append(feedback)


def test_the_policy_sees_device_time_not_host_time(fake_cuda):
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, scale=0.1)
    for model, seconds in ((target, TARGET_SECONDS), (draft, DRAFT_SECONDS)):
        model.register_forward_hook(lambda *_, s=seconds: setattr(fake_cuda, "now", fake_cuda.now + s))
    ids, mask = left_padded_prompts([5, 9], seed=3)
    config = DynSpecConfig(policy="static", num_speculative_tokens=3, draft_lookahead=0, collect_step_stats=True)
    policy = Recorder(config)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, assistant_model=draft,
                          custom_generate=hf_dynspec.speculative_loop, dynspec_config=config, dynspec_policy=policy,
                          return_dict_in_generate=True)
    stats = out.dynspec_stats
    assert policy.steps and len(policy.steps) == len(stats.steps)
    for feedback, record in zip(policy.steps, stats.steps):
        assert feedback.verify_seconds == pytest.approx(TARGET_SECONDS)  # one target forward per step
        forwards = (feedback.draft_seconds + feedback.catchup_seconds) / DRAFT_SECONDS
        assert forwards == pytest.approx(round(forwards)) and 0 <= round(forwards) <= 1 + 3  # whole draft forwards
        assert record.verify_seconds == feedback.verify_seconds and record.draft_seconds == feedback.draft_seconds
    assert policy.steps[0].catchup_seconds == pytest.approx(DRAFT_SECONDS)  # the draft's prompt, apart
    assert sum(feedback.draft_seconds for feedback in policy.steps) >= 3 * DRAFT_SECONDS
    assert stats.total_seconds == pytest.approx(fake_cuda.now)  # the whole call on the device's clock
    assert fake_cuda.waits > 0


def test_a_duration_is_read_when_used():
    """`Seconds` waits for its end event only when read, as a number."""
    device = FakeDevice()
    Event = device.event_class()
    start, end = Instant(0.0, (Event(),)), Instant(1.0, (Event(),))
    start.events[0].record(), setattr(device, "now", 2.5), end.events[0].record()
    seconds = Seconds(start, end)
    assert device.waits == 0
    assert float(seconds) == 2.5 and seconds - 0.5 == 2.0 and 1.0 + seconds == 3.5 and device.waits == 1
    assert elapsed(Instant(1.0), Instant(3.0)) == 2.0  # no CUDA device: the host's clock
