"""What crosses between the API server process and the engine core process, and how.

Two ZeroMQ PUSH/PULL sockets over ``ipc://`` (a Unix socket in a private temporary folder):
server -> core carries requests, aborts and calls; core -> server carries one message per step.

- Server -> core messages are pickled. They are few (one per request, not per token) and carry
  ``SamplingParams``: pickling lets any field another part of the project adds (a guided-decoding
  spec, a LoRA request) cross without this module knowing it. The socket lives in a folder only
  this user can open, so nobody else can hand the core a pickle.
- Core -> server messages are msgpack (msgspec): the hot path, one per step, with every request's
  *new* tokens, text and logprobs since the previous step, never the whole output again.
  ``OutputAccumulator`` on the server side rebuilds the cumulative ``RequestOutput`` the serving
  code has always read, so streaming deltas, logprobs and finish reasons are unchanged.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pagedllm.outputs import CompletionOutput, RequestMetricsView, RequestOutput

# Message kinds, core -> server.
READY, ACKS, STEP, REPLY, FAILED, DEAD = "ready", "acks", "step", "reply", "failed", "dead"
# Message kinds, server -> core.
ADD, ABORT, CALL, STOP, CUT = "add", "abort", "call", "stop", "cut"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode_out(kind: str, payload: Any) -> bytes:
    return _encoder.encode((kind, payload))


def decode_out(data: bytes) -> tuple[str, Any]:
    kind, payload = _decoder.decode(data)
    return kind, payload


def encode_in(message: tuple[Any, ...]) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode_in(data: bytes) -> tuple[Any, ...]:
    return pickle.loads(data)  # a private socket: see the module docstring


def _metrics_tuple(m: RequestMetricsView | None) -> list[Any] | None:
    if m is None:
        return None
    return [
        m.arrival_time,
        m.first_scheduled_time,
        m.first_token_time,
        m.finished_time,
        m.num_preemptions,
    ]


@dataclass
class _Sent:
    """How much of each sequence the server already has (per output index)."""

    tokens: list[int] = field(default_factory=list)  # counts of token ids, text chars, logprobs
    chars: list[int] = field(default_factory=list)
    first: bool = True


class DeltaEncoder:
    """Core side: each ``RequestOutput`` as what changed since the last one of that request.

    While a request runs its sequences only grow (text is held back before a possible stop
    string, so it never shrinks), so a delta is a tail. Beam search reorders its hypotheses and a
    finished ``best_of`` picks the best ``n``: those, and every final output, go out whole.
    """

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, out: RequestOutput, *, reorders: bool) -> list[Any]:
        sent = self._sent.setdefault(out.request_id, _Sent())
        whole = reorders or out.finished
        seqs = []
        for i, c in enumerate(out.outputs):
            t0 = 0 if whole or i >= len(sent.tokens) else sent.tokens[i]
            c0 = 0 if whole or i >= len(sent.chars) else sent.chars[i]
            seqs.append(
                [
                    c.index,
                    t0,
                    c.token_ids[t0:],
                    c0,
                    c.text[c0:],
                    None if c.logprobs is None else c.logprobs[t0:],
                    c.cumulative_logprob,
                    c.finish_reason,
                    c.stop_reason,
                ]
            )
        sent.tokens = [len(c.token_ids) for c in out.outputs]
        sent.chars = [len(c.text) for c in out.outputs]
        head = None
        if sent.first:
            head = [out.prompt, out.prompt_token_ids, out.prompt_logprobs]
            sent.first = False
        if out.finished:
            self._sent.pop(out.request_id, None)
        return [
            out.request_id,
            out.finished,
            head,
            _metrics_tuple(out.metrics),
            out.error,
            out.failed,
            out.num_cached_tokens,
            seqs,
            out.pooled,
        ]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


@dataclass
class _Seq:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None


class OutputAccumulator:
    """Server side: the deltas of one request folded back into cumulative ``RequestOutput``s."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: Any = None
        self.seqs: dict[int, _Seq] = {}

    def apply(self, entry: list[Any]) -> RequestOutput:
        _, finished, head, metrics, error, failed, num_cached, seqs, pooled = entry
        if head is not None:
            self.prompt, self.prompt_token_ids, self.prompt_logprobs = head
            if self.prompt_logprobs is not None:
                self.prompt_logprobs = [_int_keys(d) for d in self.prompt_logprobs]
        outputs = []
        for index, t0, tokens, c0, text, lps, cum, finish, stop in seqs:
            seq = self.seqs.get(index)
            if seq is None or t0 == 0:
                seq = self.seqs[index] = _Seq([], "", None if lps is None else [])
            del seq.token_ids[t0:]
            seq.token_ids.extend(tokens)
            seq.text = seq.text[:c0] + text
            if lps is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                del seq.logprobs[t0:]
                seq.logprobs.extend(_int_keys(d) for d in lps)
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=seq.text,
                    token_ids=list(seq.token_ids),
                    cumulative_logprob=cum,
                    logprobs=None if seq.logprobs is None else list(seq.logprobs),
                    finish_reason=finish,
                    stop_reason=stop,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=self.prompt_logprobs,
            metrics=None if metrics is None else RequestMetricsView(*metrics),
            error=error,
            failed=failed,
            num_cached_tokens=num_cached,
            pooled=pooled,
        )


def _int_keys(d: dict[Any, float] | None) -> dict[int, float] | None:
    """msgpack keeps integer keys, but be strict: logprob dicts are keyed by token id."""
    if d is None:
        return None
    return {int(k): v for k, v in d.items()}
