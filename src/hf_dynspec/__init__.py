"""hf_dynspec: batched, lossless, load-aware speculative decoding for Hugging Face Transformers.

```python
import hf_dynspec
out = model.generate(**inputs, assistant_model=draft, custom_generate=hf_dynspec.speculative_loop)
```
"""

from .config import DynSpecConfig
from .integration import clear_rollouts, disable, enable, generate
from .loop import DynSpecOutput, speculative_loop
from .policies import DraftLengthPolicy, PolicyInput, StepFeedback
from .stats import DynSpecStats, StepRecord

__version__ = "0.1.0"

_CONTINUOUS = ("generate_batch", "init_continuous_batching")
"""Entry points over transformers' continuous batching (`hf_dynspec.continuous`), imported on first use."""


def __getattr__(name: str):
    if name in _CONTINUOUS:
        from . import continuous

        return getattr(continuous, name)
    raise AttributeError(f"module 'hf_dynspec' has no attribute {name!r}")


__all__ = [
    "DynSpecConfig",
    "DynSpecOutput",
    "DynSpecStats",
    "DraftLengthPolicy",
    "PolicyInput",
    "StepFeedback",
    "StepRecord",
    "clear_rollouts",
    "disable",
    "enable",
    "generate",
    "generate_batch",
    "init_continuous_batching",
    "speculative_loop",
]
