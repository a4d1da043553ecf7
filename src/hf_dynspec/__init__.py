"""hf_dynspec: batched, lossless, load-aware speculative decoding for Hugging Face Transformers.

```python
import hf_dynspec
out = model.generate(**inputs, assistant_model=draft, custom_generate=hf_dynspec.speculative_loop)
```
"""

from .config import DynSpecConfig
from .integration import disable, enable, generate
from .loop import DynSpecOutput, speculative_loop
from .policies import DraftLengthPolicy, PolicyInput, StepFeedback
from .stats import DynSpecStats, StepRecord

__version__ = "0.1.0"

__all__ = [
    "DynSpecConfig",
    "DynSpecOutput",
    "DynSpecStats",
    "DraftLengthPolicy",
    "PolicyInput",
    "StepFeedback",
    "StepRecord",
    "disable",
    "enable",
    "generate",
    "speculative_loop",
]
