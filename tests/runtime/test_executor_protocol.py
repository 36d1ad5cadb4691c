"""The engine core's one seam to whatever runs the model: both executors implement executor/base.py's
Executor with its exact signatures, and the core, engine and server never probe an executor, runner,
proposer or engine with getattr/hasattr."""

from __future__ import annotations

import ast
import inspect
import pathlib
import pickle

import pytest

from kvserve.runtime.core.outputs import KVConnectorStep, KVTransfer, ModelRunnerOutput, SchedulerOutput
from kvserve.runtime.executor.base import Executor
from kvserve.runtime.executor.multiproc import MultiprocExecutor
from kvserve.runtime.executor.uniproc import UniprocExecutor

RUNTIME = pathlib.Path(__file__).resolve().parents[2] / "runtime"
METHODS = sorted(n for n, v in vars(Executor).items() if callable(v) and not n.startswith("_"))
ATTRIBUTES = sorted(Executor.__annotations__)


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("executor_class", [UniprocExecutor, MultiprocExecutor])
def test_executor_implements_the_protocol(executor_class):
    assert {"execute", "submit", "collect", "is_done", "check_health", "shutdown", "describe_ranks"} <= set(METHODS)
    for name in METHODS:
        assert _params(getattr(executor_class, name)) == _params(getattr(Executor, name)), name


def test_uniproc_executor_has_every_attribute_and_runs_a_step(model_factory):
    from kvserve.runtime import LLM, SamplingParams

    model_dir, _ = model_factory("llama_gqa")
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=16, block_size=8)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, UniprocExecutor)
        for name in ATTRIBUTES:
            assert hasattr(executor, name), name
        assert executor.num_blocks == llm.engine.config.cache.num_blocks == 16
        (rank,) = executor.describe_ranks()
        assert rank.rank == 0 and rank.num_blocks == 16 and rank.param_bytes > 0
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        handle = executor.submit(SchedulerOutput([], [], []))
        assert executor.is_done(handle) and executor.collect(handle).sampled_token_ids == {}
        with pytest.raises(ValueError, match="collected already"):
            executor.collect(handle)
    finally:
        llm.shutdown()


def test_kv_connector_sections_are_empty_by_default_and_travel():
    sched = SchedulerOutput([], [], [])
    assert sched.kv_connector.is_empty
    out = ModelRunnerOutput({})
    assert out.finished_sending == set() and out.finished_receiving == set()
    step = KVConnectorStep(load={"r": KVTransfer([3, 4], 20)}, save={"s": KVTransfer([7], 5)})
    sched = SchedulerOutput([], [], [], kv_connector=step)
    back = pickle.loads(pickle.dumps(sched))  # what the multiprocess executor sends every rank
    assert not back.kv_connector.is_empty
    assert back.kv_connector.load["r"].block_ids == [3, 4] and back.kv_connector.save["s"].num_tokens == 5


PROBED = ("runner", "executor", "engine", "proposer", "core", "client")


def _probes(path: pathlib.Path, root: pathlib.Path = RUNTIME) -> list[str]:
    """getattr/hasattr calls whose object is named like one of the seams' objects."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0]) if node.args else ""
            if any(word in target.split(".")[-1] for word in PROBED):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_getattr_probing_in_core_engine_or_server():
    files = [p for folder in ("core", "engine", "server") for p in sorted((RUNTIME / folder).glob("*.py"))]
    assert len(files) > 20
    assert [probe for path in files for probe in _probes(path)] == []


def test_a_probe_is_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(core):\n    return getattr(core.runner, 'lora', None)\n")
    assert len(_probes(probe, tmp_path)) == 1
