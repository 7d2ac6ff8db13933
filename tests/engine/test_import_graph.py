"""The package's import graph, read from the source: ``engine/`` and ``core/`` hold no cycle,
and ``core/`` reaches neither torch nor a backend.

Which imports count:

- For cycles, every import statement: at module level, inside ``if TYPE_CHECKING``, and inside
  functions. A function-level import only defers a dependency, it does not remove it: the
  nine-module circle this test was written against was closed by one such import
  (``LLMEngine.__new__`` importing the replicated engine to return it).
- For what ``core/`` loads, the imports that run when a core module is imported: module level
  (not ``TYPE_CHECKING``), followed transitively through ``pagedllm`` modules and their parent
  packages. A function-level import in a module ``core/`` reads (``config.py`` asks the backend
  registry for device names when it validates a device) is that module's business when called,
  and it cannot be followed without making every module reachable from everything. ``core/``'s
  own imports count at every level: nothing inside ``core/`` may name torch or a backend.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pagedllm

PACKAGE = Path(pagedllm.__file__).parent
FORBIDDEN_IN_CORE = ("torch", "pagedllm.backends")


def _forbidden_in_core(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_CORE)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, *, runtime_only: bool) -> Iterator[str]:
    """Names imported by ``path``; ``runtime_only``: only those run when it is imported."""

    def walk(node: ast.AST, deferred: bool) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            here = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                here = True
            if runtime_only and here:
                continue
            if isinstance(child, ast.Import):
                yield from (alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:  # ``from pkg import module`` names the module
                    full = f"{child.module}.{alias.name}"
                    yield full if full in MODULES else child.module
            yield from walk(child, here)

    yield from walk(ast.parse(path.read_text()), False)


def _internal(name: str) -> str | None:
    """The pagedllm module that importing ``name`` loads (its longest known prefix)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def _graph(prefixes: tuple[str, ...]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name.startswith(prefixes):
            targets = {_internal(i) for i in _imports(path, runtime_only=False)}
            graph[name] = {t for t in targets if t and t.startswith(prefixes) and t != name}
    return graph


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_engine_and_core_have_no_import_cycle() -> None:
    graph = _graph(("pagedllm.engine", "pagedllm.core"))
    assert len(graph) > 20, sorted(graph)  # the walk found the modules
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _loaded_by(name: str) -> set[str]:
    """Every pagedllm module importing ``name`` runs, and what each of them imports."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:n]) for n in range(1, len(parts))]  # its packages run first
        for imported in _imports(MODULES[module], runtime_only=True):
            internal = _internal(imported)
            todo += [internal] if internal else []
    return seen


def test_core_imports_neither_torch_nor_a_backend() -> None:
    core = [name for name in MODULES if name.startswith("pagedllm.core")]
    assert len(core) > 10, core
    bad = []
    for name in core:
        direct = set(_imports(MODULES[name], runtime_only=False))
        bad += [f"{name} imports {i}" for i in direct if _forbidden_in_core(i)]
        for module in _loaded_by(name):
            names = set(_imports(MODULES[module], runtime_only=True)) | {module}
            bad += [
                f"{name} loads {module}, which imports {i}" for i in names if _forbidden_in_core(i)
            ]
    assert not bad, "\n".join(sorted(set(bad)))


# What the offline engine never needs: the server's stack, the replicated engines' transport,
# and transformers beyond the tokenizer class (its auto mappings and model code cost ~1 s).
NOT_FOR_THE_OFFLINE_ENGINE = (
    "fastapi",
    "uvicorn",
    "starlette",
    "prometheus_client",
    "zmq",
    "msgspec",
    "ray",
    "sentence_transformers",
    "transformers.models.auto",
    "transformers.modeling_utils",
)

_BUILD_ENGINE = """
import json, sys
from pagedllm import Engine
engine = Engine(sys.argv[1], device="cpu", num_kv_blocks=16)
out = engine.generate("hello", use_tqdm=False)
print(json.dumps(sorted(sys.modules)))
"""


def _run_on_gguf(script: str, gguf: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """``python -c script gguf`` in a fresh interpreter (what it imports is its own), the user
    cache at ``cache``; fails the test with its stderr if it fails."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(gguf)],
        capture_output=True,
        text=True,
        env={**os.environ, "PAGEDLLM_CACHE_DIR": str(cache)},
        cwd=PACKAGE.parent,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_offline_engine_on_a_gguf_imports_nothing_it_does_not_serve_with(
    tmp_path: Path,
) -> None:
    """In a fresh interpreter, ``Engine(<gguf>)`` and a request load none of
    :data:`NOT_FOR_THE_OFFLINE_ENGINE`, nor ggml's ``gguf`` package, once the file's tokenizer
    was converted (the first start converts it with transformers and caches it)."""
    import json

    from tests.conftest import build_model
    from tests.models.gguf_files import write_gguf

    path = write_gguf(build_model(tmp_path / "llama", "llama"), tmp_path / "m.gguf", default="Q8_0")
    for start in ("first", "second"):
        done = _run_on_gguf(_BUILD_ENGINE, path, tmp_path / "cache")
        loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
        heavy = [
            m for m in loaded for h in NOT_FOR_THE_OFFLINE_ENGINE if m == h or m.startswith(h + ".")
        ]
        if start == "second":
            assert not heavy, f"the offline engine loaded {sorted(heavy)}"
            # The cached tokenizer is pagedllm's own over the tokenizers library: transformers
            # (~1.3 s of a start) is not imported at all.
            assert "transformers" not in loaded, sorted(m for m in loaded if "transformers" in m)
            assert "pagedllm.tokenization.tokenizer" in loaded
            # The header is parsed by our own reader: ggml's gguf package (0.2-0.3 s of a
            # start, its quants tables) is imported only to dequantise a type kept as floats.
            assert "gguf" not in loaded, sorted(m for m in loaded if m.startswith("gguf"))
    assert (tmp_path / "cache" / "gguf-tokenizers").is_dir()


# What `pagedllm serve` imports in its front process (the HTTP side; the engine runs in a core
# process): these, then the tokenizer the core names, loaded while the core starts.
_FRONT = """
import sys
sys.modules["torch"] = None  # any import of torch now fails, naming the importer
import pagedllm.entrypoints.cli
from pagedllm.entrypoints import demo
from pagedllm.entrypoints.openai.api_server import ServerSettings, model_info, run_server
from pagedllm.entrypoints.openai.offload import RequestLimits
from pagedllm.entrypoints.openai.chat_messages import load_chat_template
from pagedllm.entrypoints.openai.template_render import ChatTemplateError, TemplateLimits
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.core_process import freeze_startup_objects
from pagedllm.engine.prompts import load_tokenizer
from pagedllm.entrypoints.cli import serve_settings
from pagedllm.entrypoints.cli_args import build_parser
for device in ("auto", "cpu"):  # every flag's check, before the core is asked for anything
    serve_settings(build_parser().parse_args(["serve", sys.argv[1], "--device", device]))
print(type(load_tokenizer(sys.argv[1])).__name__)
print("transformers" in sys.modules)
"""


def test_the_server_front_imports_no_torch(tmp_path: Path) -> None:
    """``pagedllm serve``'s front process (routes, the core's client, the flags' checks with
    ``--device`` auto or cpu, the GGUF's cached tokenizer) never imports torch: ~1.5 s of its
    start, and ~300 MB, it does not use; nor transformers, once the tokenizer is converted and
    cached."""
    from tests.conftest import build_model
    from tests.models.gguf_files import write_gguf

    path = write_gguf(build_model(tmp_path / "llama", "llama"), tmp_path / "m.gguf", default="Q8_0")
    convert = "import sys; from pagedllm.engine.prompts import load_tokenizer as l; l(sys.argv[1])"
    for script in (convert, _FRONT):  # the first converts and caches the tokenizer
        done = _run_on_gguf(script, path, tmp_path / "cache")
    # pagedllm's tokenizer class, and no transformers either (~1.3 s of the front's start)
    assert done.stdout.split()[-2:] == ["Tokenizer", "False"], done.stdout


# What a chat-template worker runs (template_worker.main): the tokenizer unpickled, a render.
_WORKER = """
import pickle, sys
from pagedllm.entrypoints.openai.template_worker import render
tokenizer = pickle.loads(open(sys.argv[1], "rb").read())
print(render(tokenizer, {"messages": [{"role": "user", "content": "hi"}]}, 1000)["text"])
print("transformers" in sys.modules, "tokenizers" in sys.modules)
"""


def test_a_template_worker_on_a_cached_gguf_tokenizer_imports_no_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's chat-template workers unpickle what the renderer sends them: for
    pagedllm's tokenizer class its templates and special tokens alone, so a worker's start (the
    server's start-up check waits for one) imports neither transformers nor a vocabulary."""
    import pickle

    from pagedllm.engine.prompts import load_tokenizer
    from pagedllm.entrypoints.openai.template_render import _worker_copy
    from tests.conftest import build_model
    from tests.models.gguf_files import write_gguf

    path = write_gguf(build_model(tmp_path / "llama", "llama"), tmp_path / "m.gguf", default="Q8_0")
    convert = "import sys; from pagedllm.engine.prompts import load_tokenizer as l; l(sys.argv[1])"
    _run_on_gguf(convert, path, tmp_path / "cache")  # converted and cached
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = load_tokenizer(str(path))
    setup = tmp_path / "tokenizer.pickle"
    setup.write_bytes(pickle.dumps(_worker_copy(tokenizer)))
    done = _run_on_gguf(_WORKER, setup, tmp_path / "cache")
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "False False", done.stdout
    assert lines[0] == "<s>user", lines  # the file's template: "<s>user\nhi</s>..."
