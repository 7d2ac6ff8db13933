"""Sampling semantics against transformers, seeded reproducibility, forks and logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.layers.sampler import SamplingRow, apply_penalties
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Engine:
    return Engine(str(llama_path), device="cpu", block_size=8, num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf(llama_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(llama_path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(llama_path))


def all_free(engine: Engine) -> bool:
    bm = engine.block_manager
    return bm.get_num_free_device_blocks() == bm.num_device_blocks


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"), [(1.0, False), (0.5, True), (2.0, "never")]
)
def test_beam_search_matches_transformers(
    engine: Engine, hf, length_penalty: float, early_stopping: object
) -> None:
    model, tok = hf
    params = SamplingParams(
        n=2,
        best_of=3,
        use_beam_search=True,
        temperature=0.0,
        max_tokens=10,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outs = engine.generate(PROMPTS[:4], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:4], outs, strict=True):
        ids = tok.encode(prompt)
        ref = model.generate(
            torch.tensor([ids]),
            num_beams=3,
            num_return_sequences=2,
            max_new_tokens=10,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            pad_token_id=2,
        )
        expected = [[t for t in r[len(ids) :].tolist() if t != 2] for r in ref]
        assert [c.token_ids for c in out.outputs] == expected, prompt
    assert all_free(engine)


def test_repetition_penalty_matches_transformers_processor() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    histories = [([1, 2, 3], [4, 4]), ([10], []), ([7, 8], [9, 49])]
    rows = [
        SamplingRow(i, SamplingParams(repetition_penalty=1.7), len(h[1]), h)
        for i, h in enumerate(histories)
    ]
    ours = logits.clone()
    apply_penalties(ours, rows)
    proc = RepetitionPenaltyLogitsProcessor(1.7)
    for i, (prompt, out) in enumerate(histories):
        ref = proc(torch.tensor([prompt + out]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], ref, atol=0, rtol=0)


def test_repetition_penalty_greedy_matches_transformers(engine: Engine, hf) -> None:
    model, tok = hf
    params = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.5)
    outs = engine.generate(PROMPTS[:4], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:4], outs, strict=True):
        ids = tok.encode(prompt)
        ref = model.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.5,
            pad_token_id=2,
        )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref, prompt


def test_seeded_sampling_independent_of_batch(engine: Engine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=12)
    alone = engine.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batch = engine.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others, params, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    again = engine.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_n4_prompt_blocks_allocated_once_then_freed(engine: Engine) -> None:
    bm = engine.block_manager
    prompt = {"prompt_token_ids": list(range(3, 3 + 21))}  # 21 tokens: 3 blocks of 8
    engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=5))
    engine.step()  # the prefill step samples 4 tokens and forks 3 children
    group = engine.scheduler.running[0]
    assert len(group.seqs) == 4
    assert bm.num_device_blocks - bm.get_num_free_device_blocks() == 3
    tables = [bm.get_block_table(s) for s in group.seqs]
    assert all(t == tables[0] for t in tables)
    assert all(bm.device.ref_counts[b] == 4 for b in tables[0])
    engine.step()  # first decode: the shared last block is copied on write for 3 of them
    tables = [bm.get_block_table(s) for s in group.seqs]
    assert len({t[-1] for t in tables}) == 4 and len({tuple(t[:2]) for t in tables}) == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs[-1].outputs) == 4
    assert all_free(engine)


def test_logprobs_match_transformers_every_step(engine: Engine, hf) -> None:
    model, tok = hf
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = engine.generate([PROMPTS[5]], params, use_tqdm=False)[0]
    ids = tok.encode(PROMPTS[5])
    full = ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)
    for step, entry in enumerate(out.outputs[0].logprobs):
        pos = len(ids) - 1 + step
        for token, lp in entry.items():
            assert abs(lp - float(ref[pos, token])) < 1e-4, (step, token)
        assert len(entry) >= 3
    assert out.prompt_logprobs[0] is None
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert ids[pos] in entry
        for token, lp in entry.items():
            assert abs(lp - float(ref[pos - 1, token])) < 1e-4
    comp = out.outputs[0]
    chosen = [e[t] for e, t in zip(comp.logprobs, comp.token_ids, strict=True)]
    assert abs(comp.cumulative_logprob - sum(chosen)) < 1e-4


def test_stop_string_across_token_boundary(engine: Engine) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = engine.generate([PROMPTS[0]], base, use_tqdm=False)[0].outputs[0]
    tok = engine.tokenizer
    pieces = [tok.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # A stop string made of the last char of token 3's text and the first of token 4's.
    boundary = len(pieces[3])
    stop = free.text[boundary - 1 : boundary + 1]
    assert len(stop) == 2
    first = free.text.find(stop)
    streamed: list[str] = []
    engine.add_request("stop", PROMPTS[0], base.clone(stop=[stop]))
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed.append(o.outputs[0].text)
            final = o
    assert final is not None and final.finished
    assert final.outputs[0].text == free.text[:first]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert all(stop not in t for t in streamed)
    assert all(final.outputs[0].text.startswith(t) for t in streamed)
    inc = engine.generate(
        [PROMPTS[0]], base.clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert inc.text == free.text[: first + len(stop)]


def test_incremental_detokenization_of_chinese_and_emoji(engine: Engine) -> None:
    from pagedllm.core.sequence import Sequence
    from pagedllm.engine.detokenizer import Detokenizer

    tok = engine.tokenizer
    text = "你好，世界！北京欢迎您。日本語と한국어 🎉🧪🚀 done"  # mostly unseen: byte tokens
    ids = tok.encode(text)
    seq = Sequence(0, tok.encode("Say:"), 8)
    detok = Detokenizer(tok)
    params = SamplingParams()
    emitted = []
    for t in ids:
        seq.output_token_ids.append(t)
        emitted.append(detok.decode_new(seq, params))
    assert "".join(emitted) == tok.decode(ids) == text
    assert all("\ufffd" not in piece for piece in emitted)
    assert any(piece == "" for piece in emitted)  # some bytes had to wait for the rest


def test_min_tokens_stop_token_ids_and_logit_bias(engine: Engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    free = engine.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = free[2]
    out = engine.generate([PROMPTS[2]], greedy.clone(stop_token_ids=[stop_tok]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == free[: free.index(stop_tok) + 1] and out.stop_reason == stop_tok
    out = engine.generate(
        [PROMPTS[2]], greedy.clone(stop_token_ids=[stop_tok], min_tokens=6), use_tqdm=False
    )[0].outputs[0]
    assert stop_tok not in out.token_ids[:6] and len(out.token_ids) >= 6
    out = engine.generate([PROMPTS[2]], greedy.clone(logit_bias={7: 100.0}), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == [7] * 8
    assert all_free(engine)
