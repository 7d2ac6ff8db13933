"""A ``bert`` or ``nomic-bert`` file's tensors held against its hyper-parameters
(``checks.check_model`` runs these for encoder families in place of the decoder blocks' checks).

Every tensor the encoder reads is required by name and shaped from ``bert.*`` (PyTorch order
``[rows, columns]``), so a damaged or mislabelled file fails in one line naming the tensor and
the keys that size it, not as a reshape error while loading.
"""

from __future__ import annotations

from pagedllm.models.gguf.encoder import HEAD_TENSORS, is_rank
from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError

_BLOCK_MATRICES = {
    "bert": ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down"),
    "nomic-bert": ("attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
}
_NORMS = ("attn_output_norm", "layer_output_norm")


def _fail(gguf: GGUFFile, what: str) -> GGUFFileError:
    return GGUFFileError(f"{gguf.path}: {what}")


def _need(gguf: GGUFFile, name: str, shape: tuple[int, ...], why: str, arch: str) -> None:
    tensor = gguf.tensors.get(name)
    if tensor is None:
        raise _fail(gguf, f"{name} is missing ({arch} needs it)")
    if tuple(tensor.shape) != shape:
        raise _fail(gguf, f"{name} has shape {list(tensor.shape)} where {why} make {list(shape)}")


def _rows(gguf: GGUFFile, name: str, arch: str) -> int:
    tensor = gguf.tensors.get(name)
    if tensor is None:
        raise _fail(gguf, f"{name} is missing ({arch} needs it)")
    if len(tensor.shape) != 2:
        raise _fail(gguf, f"{name} has shape {list(tensor.shape)} (a table is [rows, width])")
    return int(tensor.shape[0])


def check_encoder(gguf: GGUFFile, arch: str, sizes: dict[str, int]) -> None:
    """Tables, embedding norm and every block's tensors (weights and biases) as the sizes in
    ``sizes`` (``checks._sizes``: widths, heads, blocks) make them; the position table as
    long as ``<arch>.context_length``; no grouped heads (BERT has none). nomic-bert has no
    position table and may leave out biases: a kind has them in every block or in none."""
    hidden, heads = sizes["embedding_length"], sizes["attention.head_count"]
    ffn, blocks = sizes["feed_forward_length"], sizes["block_count"]
    h = f"{arch}.embedding_length {hidden}"
    if sizes["attention.head_count_kv"] != heads:
        raise _fail(gguf, f"{arch}.attention.head_count_kv must equal attention.head_count")
    if sizes["head"] * heads != hidden:
        raise _fail(gguf, f"{arch}.attention.key_length x head_count must be {h}")
    rotary = arch == "nomic-bert"
    tables = ("token_embd", "token_types", *(() if rotary else ("position_embd",)))
    for table in tables:
        rows = _rows(gguf, f"{table}.weight", arch)
        _need(gguf, f"{table}.weight", (rows, hidden), h, arch)
    context = gguf.metadata(f"{arch}.context_length", None)
    positions = None if rotary else gguf.tensors["position_embd.weight"].shape[0]
    if context is not None and positions is not None and context > positions:
        raise _fail(
            gguf,
            f"{arch}.context_length is {context}, but position_embd.weight has {positions} rows",
        )
    for suffix in ("weight", "bias"):
        _need(gguf, f"token_embd_norm.{suffix}", (hidden,), h, arch)
    f_why = f"{arch}.feed_forward_length {ffn} and {h}"
    shapes = {
        "attn_qkv": (3 * hidden, hidden),
        "attn_q": (hidden, hidden),
        "attn_k": (hidden, hidden),
        "attn_v": (hidden, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    kinds = _BLOCK_MATRICES[arch]
    biased = {k for k in kinds if not rotary or f"blk.0.{k}.bias" in gguf.tensors}
    for i in range(blocks):
        b = f"blk.{i}"
        for kind in kinds:
            rows, cols = shapes[kind]
            why = f_why if kind.startswith("ffn") else h
            _need(gguf, f"{b}.{kind}.weight", (rows, cols), why, arch)
            if kind in biased:
                _need(gguf, f"{b}.{kind}.bias", (rows,), why, arch)
            elif f"{b}.{kind}.bias" in gguf.tensors:
                raise _fail(gguf, f"{b}.{kind}.bias is present, but blk.0.{kind}.bias is not")
        for norm in _NORMS:
            for suffix in ("weight", "bias"):
                _need(gguf, f"{b}.{norm}.{suffix}", (hidden,), h, arch)
    extra = sorted(
        {int(n.split(".")[1]) for n in gguf.tensors if n.startswith("blk.")} - set(range(blocks))
    )
    if extra:
        raise _fail(
            gguf, f"{arch}.block_count is {blocks}, but the file has tensors of blk.{extra[0]}"
        )
    _check_head(gguf, arch, hidden)


def _check_head(gguf: GGUFFile, arch: str, hidden: int) -> None:
    """A rank file's classifier: ``cls.output`` [labels, hidden] with its bias, as many labels
    as ``<arch>.classifier.output_labels`` names where it names them, and ``cls`` [hidden,
    hidden] with its bias or neither; any other file has no classifier tensors."""
    head = sorted(n for n in gguf.tensors if n.rpartition(".")[0] in HEAD_TENSORS)
    if not is_rank(gguf):
        if head:
            raise _fail(gguf, f"{head[0]} is a classifier's, but {arch}.pooling_type is not 4")
        return
    h, why = f"{arch}.embedding_length {hidden}", "a rank file's classifier"
    labels = _rows(gguf, "cls.output.weight", why)
    named = gguf.metadata(f"{arch}.classifier.output_labels", None)
    if isinstance(named, list) and len(named) != labels:
        raise _fail(
            gguf,
            f"{arch}.classifier.output_labels names {len(named)} labels, but cls.output.weight "
            f"has {labels} rows",
        )
    if labels < 1:
        raise _fail(gguf, "cls.output.weight has no rows (a classifier needs a label)")
    _need(gguf, "cls.output.weight", (labels, hidden), h, why)
    _need(gguf, "cls.output.bias", (labels,), "its weight's rows", why)
    if "cls.weight" in gguf.tensors or "cls.bias" in gguf.tensors:
        _need(gguf, "cls.weight", (hidden, hidden), h, why)
        _need(gguf, "cls.bias", (hidden,), h, why)
