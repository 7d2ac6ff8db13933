"""``Engine(model, data_parallel_size=N)``: an offline batch spread over N engine replicas.

The replicas and the router are the server's (``dp_client.py``); ``generate`` hands every prompt
to the router, waits for all of them and returns the outputs in input order, as the one-engine
``generate`` does. Stepping by hand (``add_request`` / ``step``) drives one scheduler, and N
replicas have N: those are refused with a ValueError rather than half-supported.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from pagedllm.core.pooling_params import PoolingParams, RequestParams
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.dp_client import DataParallelClient
from pagedllm.engine.pooling import PoolingInfo
from pagedllm.engine.pooling_api import PoolingFront
from pagedllm.engine.prompts import batch_inputs
from pagedllm.engine.router import Router
from pagedllm.engine.sampling_defaults import default_sampling_params
from pagedllm.outputs import RequestOutput


class DataParallelEngine(PoolingFront):
    """What ``Engine(..., data_parallel_size=N)`` returns for N > 1 (see the module docstring)."""

    def __init__(self, model: str, device: str = "auto", **engine_args: Any) -> None:
        self.client = DataParallelClient(model, device, log_stats_interval=None, **engine_args)
        self.tokenizer = self.client.tokenizer
        self._ids = itertools.count()

    @property
    def router(self) -> Router:
        return self.client.router

    @property
    def replicas(self) -> list[Any]:
        return self.client.replicas

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Every prompt to completion over the replicas; outputs in input order."""
        del use_tqdm  # no progress bar across replicas
        return asyncio.run(self.generate_async(prompts, sampling_params, lora_request=lora_request))

    async def generate_async(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """``generate`` for a caller already inside an event loop (a notebook, a service).

        Every prompt is handed over before any hand-over is awaited: a replica acknowledges
        between steps, so awaiting each in turn would bring it about one prompt a step and no
        batch would form. A prompt that is refused fails the call, and the prompts already taken
        are aborted (their blocks return).
        """
        prompts, params_list, loras = batch_inputs(prompts, sampling_params, lora_request)
        default = self.get_default_sampling_params()
        params_list = [default if sp is None else sp for sp in params_list]
        return await self._run(prompts, params_list, loras)

    async def _run(
        self, prompts: list[Any], params_list: list[RequestParams], loras: list[Any]
    ) -> list[RequestOutput]:
        rids = [f"generate-{next(self._ids)}" for _ in prompts]
        handed = await asyncio.gather(
            *(
                self.client.add_request(rid, prompt, sp, lora_request=lora)
                for rid, prompt, sp, lora in zip(rids, prompts, params_list, loras, strict=True)
            ),
            return_exceptions=True,
        )
        streams = [s for s in handed if not isinstance(s, BaseException)]
        try:
            for outcome in handed:
                if isinstance(outcome, BaseException):
                    raise outcome
            return list(await asyncio.gather(*(_last(s) for s in streams)))
        finally:
            for stream in streams:
                stream.abort()

    # -- pooling: embeddings and scores, spread over the replicas like generate -------------
    def encode(
        self, prompts: list[Any], params: PoolingParams | list[PoolingParams]
    ) -> list[RequestOutput]:
        """Pooling requests to completion over the replicas (``LLMEngine.encode``)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        return asyncio.run(self._run(list(prompts), list(params_list), [None] * len(prompts)))

    @property
    def pooling(self) -> PoolingInfo:
        """The replicas' task, as ``PoolingFront.score`` reads it from ``LLMEngine``."""
        info = self.client.describe()
        return PoolingInfo(task=info["task"], model_task=info["model_task"])

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no ``SamplingParams``: the model's defaults."""
        return default_sampling_params(self.client.describe().get("sampling_defaults", {}))

    def get_stats(self) -> dict[str, float]:
        return self.client.get_stats()

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "data_parallel_size: add_request/step drive one engine; with replicas use "
            "generate() or the server (pagedllm serve --data-parallel-size N)"
        )

    step = add_request

    def shutdown(self) -> None:
        self.client.stop()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


async def _last(stream: Any) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last
