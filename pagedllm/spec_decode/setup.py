"""Building the worker's speculative side: the verifier, and the draft model with its cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.backends.base import CacheEngine, CacheSpec
from pagedllm.executors.model_runner import ModelRunner
from pagedllm.spec_decode.draft import DraftProposer, check_draft_config
from pagedllm.spec_decode.verify import SpecDecodeRunner

if TYPE_CHECKING:
    from pagedllm.executors.worker import Worker


def build_spec_runner(worker: Worker) -> SpecDecodeRunner:
    """The verifier over the worker's target runner; for "draft_model" the draft is loaded
    here, in the target's dtype and attention backend (a ValueError if its vocabulary differs)."""
    from pagedllm.models.model_loader import load_hf_config, load_model

    spec = worker.config.speculative
    assert spec is not None and worker.runner is not None
    draft = None
    if spec.uses_draft_model:
        assert spec.model is not None
        try:
            draft_config = load_hf_config(spec.model)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"speculative_config.model: cannot load {spec.model!r} ({exc})"
            ) from exc
        check_draft_config(draft_config, worker.hf_config)
        model = load_model(
            spec.model,
            draft_config,
            attn_backend=worker.attention,
            device=worker.device,
            dtype=worker.dtype,
        )
        worker.backend.prepare_model(
            model,
            int8_activations=worker.config.model.int8_activations,
            enforce_eager=worker.config.model.enforce_eager,
        )
        draft = DraftProposer(
            ModelRunner(
                model,
                worker.attention,
                device=worker.device,
                block_size=worker.config.cache.block_size,
                seed=worker.config.model.seed,
                sample_kernel=worker.backend.kernel("sample").value,
            )
        )
    return SpecDecodeRunner(worker.runner, draft)


def draft_cache_spec(worker: Worker, runner: SpecDecodeRunner) -> CacheSpec | None:
    """What one token stores in the draft's cache (None without a draft model)."""
    if runner.draft is None:
        return None
    from pagedllm.executors.worker import kv_geometry

    num_layers, num_kv_heads, head_size = kv_geometry(runner.draft.runner.model)
    return CacheSpec(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=worker.config.cache.block_size,
        dtype=worker.kv_cache_dtype,
    )


def draft_bytes_per_block(worker: Worker, runner: SpecDecodeRunner) -> int:
    spec = draft_cache_spec(worker, runner)
    return 0 if spec is None else CacheEngine.bytes_per_block(spec)


def init_draft_cache(
    worker: Worker, runner: SpecDecodeRunner, num_device: int, num_host: int
) -> None:
    """The draft's cache: as many blocks as the target's, so one block table indexes both."""
    spec = draft_cache_spec(worker, runner)
    if spec is None or runner.draft is None:
        return
    runner.draft.cache = worker.backend.make_cache_engine(
        spec, num_device, num_host, attention=worker.attention, rank=worker.rank
    )
