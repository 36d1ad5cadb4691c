"""One home per setting: every engine, router and server setting's default is written in exactly one place.

The homes: EngineArgs (every engine setting), RouterConfig and its Weights (the router's), ServerConfig (the API
server's), and SchedulerConfig.max_model_len (the standalone context length: EngineArgs has none, it is the
model's). Everything else -- the frozen engine configs, the planner's EngineShape, the router's replica set,
`kvserve serve` / `kvserve router` flags, the benchmarks -- takes the default from its home.

Checked two ways: the parsers' defaults equal their home's (what a user gets), and a scan of the source finds no
literal that restates a home's default under the setting's name (what a maintainer would have to keep equal).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib

import pytest

from kvserve.cli import router as cli_router
from kvserve.cli.main import build_parser
from kvserve.runtime import engine_args
from kvserve.runtime.core.scheduler import SchedulerConfig
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.router.config import RouterConfig
from kvserve.runtime.router.scoring import Weights
from kvserve.runtime.server.state import ServerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("runtime", "cli", "operator")  # the kernels hold no settings

# (class, fields that are the home of their setting; None: all of them)
HOMES: tuple[tuple[type, frozenset[str] | None], ...] = (
    (EngineArgs, None),
    (RouterConfig, frozenset(f.name for f in dataclasses.fields(RouterConfig)) - {"default_block_size"}),
    (Weights, None),
    (ServerConfig, None),
    (SchedulerConfig, frozenset({"max_model_len"})),
)
# Other spellings of a setting: flag dests and parameters named after what they set.
ALIASES = {
    "default_block_size": "block_size",  # the router's assumption for a replica that does not report one
    "drain_timeout": "drain_timeout_s",
    "drain_accept_seconds": "drain_accept_s",
    "poll_interval": "poll_interval_s",
    "read_timeout": "read_timeout_s",
    "hold_timeout": "hold_timeout_s",
    "hold_retry_after": "hold_retry_after_s",
    "prefill_timeout": "prefill_timeout_s",
    **{f"weight_{f.name}": f.name for f in dataclasses.fields(Weights)},
}
# `kvserve serve` flags that set a ServerConfig field, by argparse dest.
SERVE_FLAGS = {
    "api_key": "api_key",
    "tool_call_parser": "tool_call_parser",
    "max_queue_len": "max_queue_len",
    "drain_timeout": "drain_timeout_s",
    "drain_accept_seconds": "drain_accept_s",
    "otlp_traces_endpoint": "otlp_traces_endpoint",
    "allow_runtime_lora_updating": "allow_runtime_lora_updating",
    "lora_download_dir": "lora_download_dir",
    "max_request_body_bytes": "max_request_body_bytes",
}
# Names that mean another setting outside the homes: `seed` is a workload's or a random model's seed in the
# benchmarks and model builders, not the engine's sampling seed.
OTHER_MEANING = {"seed"}
# Restatements left on purpose, each with its reason. Keys: (path, enclosing class or function, name).
KNOWN = {
    # A layout's or a plan's own arithmetic default (one rank, one stage), not the engine's setting.
    ("runtime/capacity/kv.py", "KVLayout", "tensor_parallel_size"): "geometry of one rank",
    ("runtime/config.py", "kv_layout", "tensor_parallel_size"): "geometry of one rank",
}


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def settings() -> dict[str, list[tuple[str, object]]]:
    """setting name -> [(home, default)]: every engine, router and server setting's default, where it lives."""
    out: dict[str, list[tuple[str, object]]] = {}
    for cls, names in HOMES:
        for f in dataclasses.fields(cls):
            if names is None or f.name in names:
                out.setdefault(f.name, []).append((f"{cls.__name__}.{f.name}", _field_default(f)))
    return out


def _home_site(path: str, owner: str, name: str) -> bool:
    return any(owner == cls.__name__ and (names is None or name in names) for cls, names in HOMES)


def _sites(tree: ast.AST):
    """(owner, name, default expression) of every dataclass-style field, parameter default and argparse default."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    yield node.name, item.target.id, item.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            for arg, default in zip(args[len(args) - len(node.args.defaults) :], node.args.defaults):
                yield node.name, arg.arg, default
            for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults):
                if default is not None:
                    yield node.name, arg.arg, default
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            for kw in node.keywords:
                if kw.arg == "default" and flags:
                    yield "argparse", flags[0][2:].replace("-", "_"), kw.value


def _literal(node: ast.AST):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def restatements() -> list[tuple[str, int, str, str, object]]:
    homes = settings()
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for owner, name, node in _sites(ast.parse(path.read_text(), rel)):
                setting = ALIASES.get(name, name)
                is_literal, value = _literal(node)
                if not is_literal or value is None or value is False or setting not in homes or name in OTHER_MEANING:
                    continue  # derived from a home, or "no value" (None/False restate nothing)
                if _home_site(rel, owner, name) or (rel, owner, name) in KNOWN:
                    continue
                if any(type(value) is type(d) and value == d for _, d in homes[setting]):
                    found.append((rel, node.lineno, owner, name, value))
    return found


def test_every_setting_default_is_listed_once():
    listed = settings()
    assert len(listed) > 60  # the engine's, the router's and the server's
    for name, homes in listed.items():
        assert all(d is not dataclasses.MISSING for _, d in homes) or name in {"served_model_names"}, name
    # A name in two homes is two components' own settings (both the router and a replica cap request bodies).
    shared = {name: [h for h, _ in homes] for name, homes in listed.items() if len(homes) > 1}
    assert shared == {
        # EngineArgs: none (the model's context limit); the scheduler's standalone default (tests, the simulator)
        "max_model_len": ["EngineArgs.max_model_len", "SchedulerConfig.max_model_len"],
        "max_request_body_bytes": ["RouterConfig.max_request_body_bytes", "ServerConfig.max_request_body_bytes"],
        "seed": ["EngineArgs.seed", "RouterConfig.seed"],
        "api_server_count": ["EngineArgs.api_server_count", "ServerConfig.api_server_count"],
    }


def test_no_default_is_restated_outside_its_home():
    assert restatements() == []


def test_the_scan_finds_a_restated_default(tmp_path, monkeypatch):
    """The scan is not vacuous: a config field or a flag written with the home's literal is found."""
    code = (
        "from dataclasses import dataclass\n@dataclass\nclass CacheConfig:\n    block_size: int = 16\n"
        "def add(parser):\n    parser.add_argument('--hold-timeout', type=float, default=60.0)\n"
    )
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "x.py").write_text(code)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert [(r[3], r[4]) for r in restatements()] == [("block_size", 16), ("hold_timeout", 60.0)]


def _subparser(*words: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def test_router_flags_take_their_defaults_from_router_config_and_weights():
    actions = {a.dest: a for a in _subparser("router")._actions}
    config_fields = {f.name: f for f in dataclasses.fields(RouterConfig)}
    weight_fields = {f.name: f for f in dataclasses.fields(Weights)}
    for flag in cli_router.WEIGHT_FLAGS:
        assert actions[flag.dest].default == _field_default(weight_fields[flag.field]), flag.flag
    for flag in cli_router.CONFIG_FLAGS + cli_router.HOLD_FLAGS + cli_router.PD_FLAGS:
        assert actions[flag.dest].default == _field_default(config_fields[flag.field]), flag.flag
    assert {flag.field for flag in cli_router.WEIGHT_FLAGS} == set(weight_fields)  # every weight is a flag
    assert actions["block_size"].default == engine_args.default("block_size") == RouterConfig().default_block_size


def test_serve_flags_take_their_defaults_from_server_config_and_engine_args():
    actions = {a.dest: a for a in _subparser("serve")._actions}
    server_fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    for dest, name in SERVE_FLAGS.items():
        assert actions[dest].default == _field_default(server_fields[name]), dest
    for f in dataclasses.fields(EngineArgs):
        if f.name in actions:
            assert actions[f.name].default == f.default, f.name


def test_the_engines_derived_defaults_equal_engine_args():
    from kvserve.runtime.config import CacheConfig, ParallelConfig
    from kvserve.runtime.planner.simulator import EngineShape

    args = EngineArgs()
    assert CacheConfig().block_size == EngineShape(num_blocks=2).block_size == args.block_size
    assert SchedulerConfig().max_num_seqs == EngineShape(num_blocks=2).max_num_seqs == args.max_num_seqs
    assert EngineShape(num_blocks=2).max_model_len == SchedulerConfig().max_model_len
    assert EngineShape(num_blocks=2).max_num_batched_tokens == engine_args.CHUNKED_PREFILL_BATCHED_TOKENS
    assert SchedulerConfig().preemption_mode == args.preemption_mode
    assert ParallelConfig().master_port == args.master_port


def test_each_rule_is_written_once():
    """The chunked-prefill budget rule and the preemption-mode check: every caller raises the one message."""
    rule = engine_args.chunked_prefill_budget_error(False, 512, 1024)
    assert rule and "without chunked prefill" in rule
    with pytest.raises(ValueError) as exc:
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024)
    assert str(exc.value) == rule
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 1024}
    args = EngineArgs(model="m", enable_chunked_prefill=False, max_num_batched_tokens=512)
    with pytest.raises(InvalidParameter) as exc:
        engine_args.resolve_for_config(args, config)
    assert exc.value.param == "max_num_batched_tokens" and str(exc.value) == rule
    mode = engine_args.preemption_mode_error("evict")
    with pytest.raises(ValueError, match="preemption_mode must be 'recompute' or 'swap', got 'evict'"):
        SchedulerConfig(preemption_mode="evict")
    assert mode == "preemption_mode must be 'recompute' or 'swap', got 'evict'"
    # Nobody spells the modes out again.
    for top in SCANNED:
        for path in (ROOT / top).rglob("*.py"):
            if path.name != "engine_args.py":
                assert '("recompute", "swap")' not in path.read_text(), path
