"""How long the work of a step took, on the clocks of the devices that ran it.

On a CPU every forward is synchronous and the host's clock says how long it took. On CUDA the host only queues work:
an `Instant` records an event on each device's stream, and `Seconds` between two instants is read (waiting for the
second's events) only when used as a number, after the step's read of the device has passed them anyway. It imports
nothing of hf_dynspec.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Instant:
    """A moment of the loop: the host's clock, and a CUDA event recorded on the current stream of each CUDA device
    the models compute on (none on a CPU)."""

    wall: float
    events: tuple = ()
    devices: tuple[torch.device, ...] = ()  # the CUDA devices of `events`

    @classmethod
    def now(cls, cuda_devices: tuple[torch.device, ...] = ()) -> Instant:
        events = []
        for device in cuda_devices:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return cls(time.perf_counter(), tuple(events), tuple(cuda_devices))


def elapsed(start: Instant, end: Instant | None = None) -> float | Seconds:
    """Seconds from `start` to `end` (default: now, on `start`'s devices) as the devices ran the work between them
    (`Seconds`, read when used); where no CUDA device is involved, every forward is synchronous, and this is the
    host's clock, as a float."""
    end = Instant.now(start.devices) if end is None else end
    return Seconds(start, end) if end.events else end.wall - start.wall


class Seconds:
    """The seconds between two `Instant`s on the devices' clocks, read when first used as a number: the most any
    device's stream took from the first instant's event to the second's. Reading waits for the second instant's
    events, which costs nothing once the step's read of the device (`readback`) has passed them; so the loop takes
    its timings before that read and uses them after it."""

    __slots__ = ("_start", "_end", "_value")

    def __init__(self, start: Instant, end: Instant) -> None:
        self._start, self._end, self._value = start, end, None

    def __float__(self) -> float:
        if self._value is None:
            elapsed = []
            for first, last in zip(self._start.events, self._end.events):
                last.synchronize()
                elapsed.append(first.elapsed_time(last) / 1000.0)
            self._value = max(elapsed, default=self._end.wall - self._start.wall)
        return self._value

    def __repr__(self) -> str:
        return f"Seconds({float(self)!r})"

    def __add__(self, other: object) -> float:
        return float(self) + float(other)

    def __radd__(self, other: object) -> float:
        return float(other) + float(self)

    def __sub__(self, other: object) -> float:
        return float(self) - float(other)

    def __rsub__(self, other: object) -> float:
        return float(other) - float(self)

    def __lt__(self, other: object) -> bool:
        return float(self) < float(other)

    def __gt__(self, other: object) -> bool:
        return float(self) > float(other)


def time_call(
    fn: Callable[[], Any], warmup: int, repeats: int, devices: tuple[torch.device, ...] = ()
) -> list[float]:
    """Seconds of `repeats` calls of `fn` after `warmup` untimed ones, on the clock the loop times its steps with
    (`elapsed`): on the CUDA `devices` `fn` runs on, the time their streams took, waited for."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = Instant.now(devices)
        fn()
        samples.append(float(elapsed(start)))
    return samples
