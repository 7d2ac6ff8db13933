"""``embed`` and ``score`` over any engine's ``encode`` (pooling requests run to completion).

Written once against a callable so the offline engine and the server compute scores the same
way: a cross-encoder reads each (query, document) pair as one input and its logit is the score
(through a sigmoid where the head has one label, as sentence-transformers' ``CrossEncoder`` and
vLLM's ``/score`` do); an embedding model scores by the cosine of the two embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.core.pooling_params import PoolingParams
from pagedllm.engine.pooling import PoolingInfo
from pagedllm.engine.prompts import PromptType
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput

# Inputs one call may carry (OpenAI's cap on an embeddings request's list).
MAX_INPUTS = 2048

Encode = Callable[[list[Any], list[PoolingParams]], list[RequestOutput]]


def check_inputs(inputs: Sequence[Any], field: str = "input") -> None:
    """An empty batch, an empty text, or more than ``MAX_INPUTS``: a ValueError naming ``field``."""
    if not inputs:
        raise ValueError(f"{field}: must not be empty")
    if len(inputs) > MAX_INPUTS:
        raise ValueError(f"{field}: at most {MAX_INPUTS} inputs per request, got {len(inputs)}")
    for item in inputs:
        if isinstance(item, str) and not item:
            raise ValueError(f"{field}: texts must not be empty")
        if isinstance(item, list) and not item:
            raise ValueError(f"{field}: token id lists must not be empty")


def _vectors(outputs: list[RequestOutput]) -> list[list[float]]:
    vectors = []
    for out in outputs:
        if out.pooled is None:
            raise RuntimeError(out.error or f"request {out.request_id} ended without a vector")
        vectors.append(out.pooled)
    return vectors


def embed(
    encode: Encode,
    inputs: str | list[int] | Sequence[Any],
    params: PoolingParams,
) -> list[EmbeddingRequestOutput]:
    """One embedding per input (a text, or a list of token ids), in input order."""
    if isinstance(inputs, str) or (
        isinstance(inputs, list) and inputs and isinstance(inputs[0], int)
    ):
        inputs = [inputs]
    items = list(inputs)
    check_inputs(items)
    # Shortest first, as sentence-transformers' encode sorts: a step's prompts are then of
    # similar lengths, and an encoder's attention pads each step's batch to its longest.
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    ran = encode([items[i] for i in order], [params] * len(items))
    outputs: list[RequestOutput] = [ran[0]] * len(items)
    for k, i in enumerate(order):
        outputs[i] = ran[k]
    return [
        EmbeddingRequestOutput(out.request_id, vec, list(out.prompt_token_ids))
        for out, vec in zip(outputs, _vectors(outputs), strict=True)
    ]


def pair_prompt(tokenizer: Any, query: str, doc: str, truncate: int | None) -> dict[str, Any]:
    """A cross-encoder's input: the pair as its tokenizer joins them, with token types."""
    if tokenizer is None:
        raise ValueError("query: scoring text pairs needs the model's tokenizer")
    enc = tokenizer(
        query, doc, truncation="only_second" if truncate else False, max_length=truncate
    )
    prompt: dict[str, Any] = {"prompt_token_ids": list(enc["input_ids"])}
    if "token_type_ids" in enc:
        prompt["token_type_ids"] = list(enc["token_type_ids"])
    return prompt


def logit_score(logits: list[float]) -> float:
    """A classifier's relevance: sigmoid of a one-label head, else the last label's softmax."""
    if len(logits) == 1:
        return 1.0 / (1.0 + math.exp(-logits[0]))
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    return exps[-1] / sum(exps)


def score(
    encode: Encode,
    tokenizer: Any,
    info: PoolingInfo,
    query: str,
    docs: Sequence[str],
    *,
    truncate_prompt_tokens: int | None = None,
) -> list[ScoringRequestOutput]:
    """The relevance of each document to the query, in document order."""
    if not isinstance(query, str) or not query:
        raise ValueError("query: must be a non-empty string")
    docs = [docs] if isinstance(docs, str) else list(docs)
    check_inputs(docs, "documents")
    if not all(isinstance(d, str) for d in docs):
        raise ValueError("documents: must be strings")
    if info.model_task == "classify":
        prompts = [pair_prompt(tokenizer, query, d, truncate_prompt_tokens) for d in docs]
        params = PoolingParams(task="classify")
        outputs = encode(prompts, [params] * len(prompts))
        return [
            ScoringRequestOutput(out.request_id, logit_score(vec), len(out.prompt_token_ids))
            for out, vec in zip(outputs, _vectors(outputs), strict=True)
        ]
    params = PoolingParams(normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
    outputs = encode([query, *docs], [params] * (len(docs) + 1))
    q, *rest = _vectors(outputs)
    return [
        ScoringRequestOutput(
            out.request_id,
            sum(a * b for a, b in zip(q, vec, strict=True)),
            len(outputs[0].prompt_token_ids) + len(out.prompt_token_ids),
        )
        for out, vec in zip(outputs[1:], rest, strict=True)
    ]


class PoolingFront:
    """``embed`` and ``score`` over an ``encode``: one place where the engines' Python calls
    become pooling requests (``LLMEngine`` and the replicas' ``DataParallelEngine`` each supply
    ``encode``, ``tokenizer`` and ``pooling``)."""

    tokenizer: Any
    pooling: PoolingInfo
    encode: Encode

    def embed(
        self,
        inputs: PromptType | list[PromptType],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per text (or list of token ids), in order; see ``PoolingParams``."""
        params = PoolingParams(
            dimensions=dimensions,
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        return embed(self.encode, inputs, params)  # type: ignore[arg-type]

    def score(
        self, query: str, docs: str | list[str], *, truncate_prompt_tokens: int | None = None
    ) -> list[ScoringRequestOutput]:
        """Each document's relevance to ``query``: a cross-encoder's (sigmoid) logit, or the
        cosine of an embedding model's two embeddings."""
        return score(
            self.encode,  # type: ignore[arg-type]
            self.tokenizer,
            self.pooling,
            query,
            docs,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )


class PoolingMixin(PoolingFront):
    """``LLMEngine``'s ``encode`` over its ``add_request``, and the front above it."""

    _seq_ids: Any
    loop: Any
    add_request: Callable[..., None]
    abort_request: Callable[..., None]
    _run_to_completion: Callable[..., list[RequestOutput]]

    def encode(
        self, prompts: list[PromptType], params: PoolingParams | list[PoolingParams]
    ) -> list[RequestOutput]:
        """Pooling requests run to completion (vLLM's ``LLM.encode``): each output's
        ``pooled`` is its vector. Nothing is queued if any request is invalid."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"encode-{next(self._seq_ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
                self.add_request(rid, prompt, p)
        except ValueError:
            self.abort_request([r for r in ids if r in self.loop.requests])
            self.loop.pending.clear()
            raise
        from tqdm.auto import tqdm

        return self._run_to_completion(ids, tqdm(total=len(ids), disable=True))
