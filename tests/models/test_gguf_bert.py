"""llama.cpp ``bert`` GGUF files (embedding models) through the GGUF loader: a tiny random-weight
BertModel written as F32, F16 and Q8_0 files against sentence-transformers on the source folder,
the pooling the file names, the WordPiece tokenizer against BertTokenizerFast on the same
vocabulary, one-line refusals of damaged files, and the real all-MiniLM-L6-v2 converted to GGUF
against its safetensors folder. Rank files (cross-encoders): a random-weight
BertForSequenceClassification written as llama.cpp writes one, against transformers' logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm.models.gguf.reader import GGUFFileError
from pagedllm.models.pooling import PoolingConfig, PoolingType, finish_embedding
from tests.engine.pooling_models import widen
from tests.models.encoder_models import encoder_meta, load_packed
from tests.models.gguf_bert_files import write_bert_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

_WORDS = " ".join(
    (
        "the cat sat on mat hello world paged attention embed cache block query answer",
        "document retrieval model token caf naive resume tokyo",
    )
).split()
_PIECES = ["##s", "##ing", "##ed", "##er", "##ly", "##ding"]
_LETTERS = list("abcdefghijklmnopqrstuvwxyz0123456789")
_PUNCT = list(".,!?'-:;()\u6771\u4eac")
TEXTS = [
    "Hello world!",
    "The cats sat on the mat, naively embedding caches.",
    "Café résumé (naïve) — Tokyo 東京: 42 queries?",
    "xyzzy unknownword tokenizing",
    "a",
    "paged attention " * 6,
]


def tiny_vocab(cased: bool) -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]"]
    words = [w.capitalize() for w in _WORDS[:4]] + _WORDS if cased else _WORDS
    letters = [*_LETTERS, *(f"##{c}" for c in _LETTERS)]
    return list(dict.fromkeys([*specials, *words, *_PIECES, *letters, *_PUNCT]))


def _tokenizer(folder: Path, cased: bool) -> object:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(tiny_vocab(cased)) + "\n")
    fast = transformers.BertTokenizerFast(str(folder / "vocab.txt"), do_lower_case=not cased)
    fast.save_pretrained(str(folder))
    return fast


def _st_modules(folder: Path, mode: str) -> None:
    names = ["Transformer", "Pooling", "Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{n}"}
        for i, (n, p) in enumerate(zip(names, ["", "1_Pooling", "2_Normalize"], strict=True))
    ]
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, f"pooling_mode_{mode}": True})
    )
    (folder / "modules.json").write_text(json.dumps(modules))


def _config(tokenizer: object, **extra: int) -> object:
    return transformers.BertConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        type_vocab_size=2,
        **extra,
    )


def build_bert(folder: Path, *, cased: bool = False, mode: str = "mean_tokens") -> Path:
    """A tiny random-weight BertModel with a WordPiece tokenizer and sentence-transformers'
    pooling modules (``mode``, normalised)."""
    config = _config(_tokenizer(folder, cased))
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    widen(model)
    model.save_pretrained(str(folder))
    _st_modules(folder, mode)
    return folder


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert(tmp_path_factory.mktemp("bert"))


def embed(model: torch.nn.Module, tokenizer: object, texts: list[str]) -> torch.Tensor:
    ids = [tokenizer(t)["input_ids"] for t in texts]  # type: ignore[operator]
    lens = [len(i) for i in ids]
    flat = torch.tensor([t for seq in ids for t in seq])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(flat, positions, [], encoder_meta(lens))
        return finish_embedding(model.pool(hidden, lens), model.pooling_config.normalize)


def st_reference(folder: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return torch.as_tensor(st.encode(texts, normalize_embeddings=True)).float()


@pytest.mark.parametrize(("kind", "bound"), [("F32", 0.9999), ("F16", 0.9999), ("Q8_0", 0.999)])
def test_embeddings_match_sentence_transformers(
    bert: Path, tmp_path: Path, kind: str, bound: float
) -> None:
    from pagedllm.models.gguf.loading import gguf_tokenizer

    path = write_bert_gguf(bert, tmp_path / f"bert-{kind}.gguf", kind=kind)
    model = load_packed(path, torch.float32)
    assert model.pooling_config == PoolingConfig(PoolingType.MEAN, normalize=True)
    ours = embed(model, gguf_tokenizer(path), TEXTS)
    want = st_reference(bert, TEXTS)
    cosine = torch.nn.functional.cosine_similarity(ours, want, dim=-1)
    assert cosine.min().item() >= bound, f"{kind}: cosines {cosine.tolist()}"
    if kind == "F32":
        torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)


def test_pooling_type_comes_from_the_file(tmp_path: Path) -> None:
    """A file that says cls (llama.cpp's 2) pools the first token, as sentence-transformers
    does for the folder it was converted from."""
    folder = build_bert(tmp_path / "cls", mode="cls_token")
    path = write_bert_gguf(folder, tmp_path / "cls.gguf", pooling="cls")
    model = load_packed(path, torch.float32)
    assert model.pooling_config == PoolingConfig(PoolingType.CLS, normalize=True)
    from pagedllm.models.gguf.loading import gguf_tokenizer

    ours = embed(model, gguf_tokenizer(path), TEXTS)
    torch.testing.assert_close(ours, st_reference(folder, TEXTS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("cased", [False, True])
def test_tokenizer_matches_bert_tokenizer_fast(tmp_path: Path, cased: bool) -> None:
    """Ids, segment ids (pairs) and lower-casing (inferred from the vocabulary) as
    BertTokenizerFast on the vocabulary the file was converted from; decoding too."""
    from pagedllm.models.gguf.loading import gguf_tokenizer

    folder = build_bert(tmp_path / "b", cased=cased)
    path = write_bert_gguf(folder, tmp_path / "b.gguf")
    from pagedllm.models.gguf.reader import GGUFFile
    from pagedllm.models.gguf.wordpiece import wordpiece_tokenizer

    # Converted here, not read from the user's cache (a file of the same metadata converted
    # by an earlier run would hide a change to the converter).
    ours = wordpiece_tokenizer(GGUFFile(path))
    want = transformers.BertTokenizerFast.from_pretrained(str(folder))
    for text in [*TEXTS, "[CLS] Hello [MASK] world [SEP]", "HELLO The Cat"]:
        assert ours(text)["input_ids"] == want(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"]) == want.decode(want(text)["input_ids"])
    pair = ours(TEXTS[0], TEXTS[1]), want(TEXTS[0], TEXTS[1])
    assert pair[0]["input_ids"] == pair[1]["input_ids"]
    assert pair[0]["token_type_ids"] == pair[1]["token_type_ids"]
    assert (ours.cls_token_id, ours.sep_token_id, ours.pad_token_id) == (2, 3, 0)
    again = gguf_tokenizer(path)  # as the engine loads it (converted once, then cached)
    for text in (TEXTS[2], TEXTS[1]):
        assert dict(again(text, TEXTS[0])) == dict(want(text, TEXTS[0]))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"drop": ("blk.1.ffn_down.bias",)}, r"blk\.1\.ffn_down\.bias is missing \(bert needs"),
        ({"drop": ("token_types.weight",)}, r"token_types\.weight is missing"),
        (
            {"reshape": {"blk.0.attn_k.weight": (32, 64)}},
            r"blk\.0\.attn_k\.weight has shape \[32, 64\] where bert\.embedding_length 64 make",
        ),
        (
            {"reshape": {"blk.0.ffn_up.weight": (64, 64)}},
            r"ffn_up\.weight has shape \[64, 64\] where bert\.feed_forward_length 96",
        ),
        ({"metadata": {"bert.block_count": 1}}, r"bert\.block_count is 1, but .* blk\.1"),
        ({"metadata": {"bert.context_length": 99}}, r"context_length is 99, but position_embd"),
        ({"metadata": {"bert.attention.causal": True}}, r"bert\.attention\.causal is true"),
        (
            {"metadata": {"bert.pooling_type": 4}},  # rank, but no classifier
            r"cls\.output\.weight is missing \(a rank file's classifier needs it\)",
        ),
        ({"metadata": {"bert.pooling_type": 9}}, r"bert\.pooling_type is 9"),
        ({"metadata": {"bert.attention.layer_norm_epsilon": -1.0}}, r"layer_norm_epsilon is"),
    ],
)
def test_damaged_files_are_refused_in_one_line(
    bert: Path, tmp_path: Path, damage: dict, message: str
) -> None:
    from pagedllm.models.model_loader import load_hf_config

    path = write_bert_gguf(bert, tmp_path / "bad.gguf", **damage)
    with pytest.raises(GGUFFileError, match=message) as info:
        load_hf_config(str(path))
    assert "\n" not in str(info.value)


def test_real_minilm_as_gguf_matches_its_folder(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 converted to GGUF (F32) embeds as its safetensors folder does, with the
    same token ids from the file's own tokenizer."""
    from pagedllm.entrypoints.embedding_model import fetch_embedding_model
    from pagedllm.models.gguf.loading import gguf_tokenizer

    fetched = fetch_embedding_model()
    if fetched.path is None:
        pytest.skip(f"all-MiniLM-L6-v2 cannot be fetched: {fetched.reason}")
    folder = fetched.path
    path = write_bert_gguf(folder, tmp_path / "minilm.gguf")
    ours_tok = gguf_tokenizer(path)
    want_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours_tok(text)["input_ids"] == want_tok(text)["input_ids"], text
    gguf_model, folder_model = load_packed(path, torch.float32), load_packed(folder, torch.float32)
    assert gguf_model.pooling_config == folder_model.pooling_config
    got = embed(gguf_model, ours_tok, TEXTS)
    torch.testing.assert_close(got, embed(folder_model, want_tok, TEXTS), rtol=0, atol=1e-6)


def test_q8_0_file_through_the_engine(bert: Path, tmp_path: Path) -> None:
    """The worker's path: the task from the file (embed), the file's tokenizer, its Q8_0
    matrices kept as 8-bit groups by the CPU backend's linear kernel."""
    import numpy as np

    from pagedllm import Engine

    path = write_bert_gguf(bert, tmp_path / "bert-q8.gguf", kind="Q8_0")
    engine = Engine(str(path), device="cpu", dtype="float32")
    assert engine.pooling.task == "embed" and not engine.pooling.uses_kv_cache
    got = torch.as_tensor(np.asarray([o.embedding for o in engine.embed(TEXTS)])).float()
    cosine = torch.nn.functional.cosine_similarity(got, st_reference(bert, TEXTS), dim=-1)
    assert cosine.min().item() >= 0.999, cosine.tolist()


def test_q8_0_file_second_start_from_the_packed_cache(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An embedding GGUF's second start takes its packed panels from the cache (leaving those
    layers' tensors undecoded) and gives the first start's embeddings exactly."""
    import numpy as np

    from pagedllm import Engine

    monkeypatch.setenv("PAGEDLLM_PACKED_CACHE", "1")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_bert_gguf(bert, tmp_path / "bert-q8.gguf", kind="Q8_0")
    runs = []
    for _ in range(2):
        engine = Engine(str(path), device="cpu", dtype="float32")
        runs.append(np.asarray([o.embedding for o in engine.embed(TEXTS)]))
        del engine
    assert list((tmp_path / "cache" / "packed").iterdir()), "no packed cache written"
    np.testing.assert_array_equal(runs[0], runs[1])


# --- rank files: cross-encoders ----------------------------------------------------------------


def build_classifier(folder: Path, num_labels: int) -> Path:
    """A tiny random-weight BertForSequenceClassification with a WordPiece tokenizer."""
    config = _config(_tokenizer(folder, cased=False), num_labels=num_labels)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    widen(model)
    model.save_pretrained(str(folder))
    return folder


def hf_logits(folder: Path, pairs: list[tuple[str, str]], *, pooler: bool = True) -> torch.Tensor:
    """transformers' logits per pair; ``pooler`` False: its classifier on [CLS] as it is (what
    llama.cpp computes for a rank file without ``cls``)."""
    tok = transformers.BertTokenizerFast.from_pretrained(str(folder))
    model = transformers.BertForSequenceClassification.from_pretrained(str(folder)).eval()
    rows = []
    with torch.inference_mode():
        for query, doc in pairs:
            enc = tok(query, doc, return_tensors="pt")
            if pooler:
                rows.append(model(**enc).logits[0])
            else:
                rows.append(model.classifier(model.bert(**enc).last_hidden_state[:, 0])[0])
    return torch.stack(rows)


PAIRS = [(TEXTS[1], doc) for doc in TEXTS]


@pytest.mark.parametrize(("kind", "atol"), [("F32", 1e-5), ("F16", 2e-3)])
def test_rank_file_scores_as_transformers(tmp_path: Path, kind: str, atol: float) -> None:
    """A one-label cross-encoder as a rank file: the engine serves it as a classifier, and
    ``Engine.score`` answers transformers' sigmoid logits, documents in the same order."""
    import numpy as np

    from pagedllm import Engine

    folder = build_classifier(tmp_path / "ce", num_labels=1)
    path = write_bert_gguf(folder, tmp_path / f"ce-{kind}.gguf", kind=kind, pooling="rank")
    engine = Engine(str(path), device="cpu", dtype="float32")
    assert engine.pooling.task == "score" and not engine.pooling.uses_kv_cache
    query, docs = PAIRS[0][0], [doc for _, doc in PAIRS]
    got = np.asarray([o.score for o in engine.score(query, docs)])
    want = torch.sigmoid(hf_logits(folder, PAIRS)[:, 0]).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    if kind == "F32":
        assert list(np.argsort(-got)) == list(np.argsort(-want))


@pytest.mark.parametrize("pooler", [True, False])
def test_rank_file_logits_with_and_without_cls(tmp_path: Path, pooler: bool) -> None:
    """Three labels; with llama.cpp's ``cls`` (BERT's pooler: dense + tanh) and without it (the
    classifier on [CLS] as it is), each as transformers computes it."""
    from pagedllm.models.gguf.loading import gguf_tokenizer

    folder = build_classifier(tmp_path / "ce3", num_labels=3)
    drop = () if pooler else ("cls.weight", "cls.bias")
    path = write_bert_gguf(folder, tmp_path / "ce3.gguf", pooling="rank", drop=drop)
    model = load_packed(path, torch.float32)
    assert (model.pooler is not None) is pooler
    tok = gguf_tokenizer(path)
    encs = [tok(query, doc) for query, doc in PAIRS]
    lens = [len(e["input_ids"]) for e in encs]
    ids = torch.tensor([t for e in encs for t in e["input_ids"]])
    types = torch.tensor([t for e in encs for t in e["token_type_ids"]])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(ids, positions, [], encoder_meta(lens), token_type_ids=types)
        got = model.pool(hidden, lens)
    want = hf_logits(folder, PAIRS, pooler=pooler)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"drop": ("cls.output.weight",)}, r"cls\.output\.weight is missing \(a rank file's"),
        ({"drop": ("cls.output.bias",)}, r"cls\.output\.bias is missing"),
        ({"drop": ("cls.bias",)}, r"cls\.bias is missing"),
        (
            {"reshape": {"cls.output.weight": (3, 32)}},
            r"cls\.output\.weight has shape \[3, 32\] where bert\.embedding_length 64 make",
        ),
        ({"reshape": {"cls.weight": (64, 32)}}, r"cls\.weight has shape \[64, 32\]"),
        (
            {"metadata": {"bert.classifier.output_labels": ["a", "b"]}},
            r"output_labels names 2 labels, but cls\.output\.weight has 3 rows",
        ),
        (
            {"metadata": {"bert.pooling_type": 1}},
            r"cls\.bias is a classifier's, but bert\.pooling_type is not 4",
        ),
    ],
)
def test_damaged_rank_files_are_refused_in_one_line(
    tmp_path: Path, damage: dict, message: str
) -> None:
    from pagedllm.models.model_loader import load_hf_config

    folder = build_classifier(tmp_path / "ce", num_labels=3)
    path = write_bert_gguf(folder, tmp_path / "bad.gguf", pooling="rank", **damage)
    with pytest.raises(GGUFFileError, match=message) as info:
        load_hf_config(str(path))
    assert "\n" not in str(info.value)
