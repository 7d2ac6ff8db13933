"""The name lists that settings are checked against, each written once.

A name a user types (a flag's choices, an ``EngineArgs`` field, a ``ValueError`` listing what is
allowed) is checked in several layers: the CLI before loading, ``config.py`` at the edge, and the
module that acts on it (the KV cache, the quantization methods, the router). A list written in
each of them drifts; here it is written once, and every layer derives its choices and messages
from it. The module imports nothing, so the CLI lists choices without importing torch and
``config.py`` stays light; a module that maps a name to something heavier (a ``torch.dtype``, a
method class) keys its own table by these names.

Lists whose owner is already light keep their table with the owner: scheduling policies
(``core/policy.py`` ``POLICIES``), tool-call parsers (``entrypoints/openai/tool_parsers.py``
``TOOL_PARSERS``) and ``--cpu-bind`` modes (``engine/cpu_binding.py`` ``BIND_MODES``).
"""

from __future__ import annotations

#: ``dtype``: weights and activations ("auto": the model's own).
DTYPES = ("auto", "float32", "float16", "bfloat16")

#: ``kv_cache_dtype`` -> the ``torch`` dtype attribute the cache stores (``backends/kv_layout.py``
#: resolves it); "auto" is the compute dtype, "fp8" is "fp8_e4m3" as in vLLM.
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

#: ``quantization`` methods applied at load (``layers/quantization``; None: as the checkpoint is).
QUANTIZATION_METHODS = ("int8", "w8a8", "int4")

#: ``preemption_mode`` (None: swap multi-sequence groups, recompute the rest).
PREEMPTION_MODES = ("recompute", "swap")

#: ``distributed_executor_backend`` (None: in-process for one rank, else one process per rank).
EXECUTOR_BACKENDS = ("uni", "mp", "ray")

#: ``router``: how requests are spread over data-parallel replicas (``engine/router.py``).
ROUTERS = ("prefix", "least_loaded", "round_robin")
