"""The engine-core process: EngineCore in a busy loop behind ZMQ sockets (vLLM V1's EngineCoreProc, simplified).

Sockets (ipc://, the API-server side binds, this side connects): one PULL for every API server's requests
(fair-queued), one PUSH per API server for its outputs. The loop blocks on the input socket while there is
no work (an idle core costs nothing) and otherwise drains it without blocking before every step, so a
request or an abort waits at most one step.

Lifecycle: READY (or STARTUP_FAILED with the exception) on every output socket once the model is loaded;
on a fatal error (a dead tensor-parallel worker, too many failed steps, a bug in this loop) DEAD with the
reason, then exit 1; on SHUTDOWN (or when the parent process is gone) stop the workers and exit 0. SIGINT and
SIGTERM are ignored: a terminal's Ctrl-C or a process-group SIGTERM reaches this process too, and the API
server drives the shutdown (a SIGTERM drain still needs the core to finish the in-flight requests).
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import signal
import threading
import time

from kvserve.runtime.engine.core_messages import (
    CoreReady,
    EngineCoreOutputs,
    MessageCodec,
    MessageType,
    RequestFailure,
    failure_message,
)

logger = logging.getLogger("kvserve.engine.core")

PARENT_POLL_S = 0.5
IDLE_POLL_MS = 500  # while idle: how often to look at the parent (a message wakes the loop at once)
LINGER_MS = 4000  # how long a DEAD or STARTUP_FAILED message may take to leave at exit


# What a prestarted core (core_client.PrestartedCore) imports while the API server still builds its config: the
# modules the core's start-up needs anyway (torch, transformers' config classes, the model code), so these
# seconds overlap the API server's own imports instead of following them.
PRELOAD_MODULES = (
    "torch",
    "zmq",
    "transformers.models.auto.configuration_auto",
    "transformers.utils.type_validators",  # what every model's config class imports (seconds: torch.distributed)
    "kvserve.runtime.engine.engine_core",
    "kvserve.runtime.executor.model_runner",
)


def run_prestarted_core(conn, parent_pid: int, log_level: int) -> None:
    """Process entry point of a core started before its config exists (core_client.PrestartedCore): import
    PRELOAD_MODULES, then wait for run_engine_core's arguments on `conn` and run it. The pipe closed unsent
    (the API server failed before its config was built, or died): leave quietly."""
    entered_monotonic = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    for name in PRELOAD_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- a piece that fails here fails again where it is used, with its context
            logger.debug("preloading %s failed", name, exc_info=True)
    preload_s = time.monotonic() - entered_monotonic
    try:
        args, kwargs = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    conn.close()
    run_engine_core(*args, **kwargs, preload_s=preload_s)


def _watch_parent(api_server_pid: int) -> None:
    """Leave when the API server is gone (killed with SIGKILL, it could not send SHUTDOWN). The direct parent
    may be a forkserver (core_client._core_mp_context), which itself exits with the API server: so watch both.
    Tensor-parallel workers below watch this process the same way, so nothing is orphaned."""
    parent_pid = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            try:
                os.kill(api_server_pid, 0)
            except ProcessLookupError:
                os._exit(3)
            except PermissionError:
                pass
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="kvserve-core-parent-watch", daemon=True).start()


def run_engine_core(
    config,
    input_addresses: list[str],
    output_addresses: list[str],
    parent_pid: int,
    log_level: int,
    tokenizer_vocab_size: int,
    status_address: str | None = None,
    spawned_monotonic: float | None = None,
    preload_s: float | None = None,
) -> None:
    """Process entry point (spawned by core_client.CoreClient or the multi-API-server launcher).
    status_address: the launcher's socket, which gets READY / STARTUP_FAILED / DEAD too (never per-step
    outputs): an API server still starting may miss them, and the launcher writes the termination message.
    spawned_monotonic: time.monotonic() in the parent just before it started this process (one clock for
    every process of a host), for the engine_process_start phase; for a prestarted core (run_prestarted_core),
    when the parent handed it these arguments, so the phase is what the start-up still waited for.
    preload_s: a prestarted core's imports before that (the engine_preload phase, overlapped)."""
    entered_monotonic = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))  # a group launcher blocks them
    _watch_parent(parent_pid)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    logging.getLogger("kvserve").setLevel(log_level)
    try:  # a process title helps `ps` users; optional
        import setproctitle  # type: ignore

        setproctitle.setproctitle("kvserve::EngineCore")
    except ImportError:
        pass
    import zmq

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)  # the default HWM of 1000 would block senders under load
    for address in input_addresses:  # one per API server; PULL fair-queues between them
        inp.connect(address)
    outs = []
    for address in output_addresses:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.connect(address)
        outs.append(sock)
    lifecycle = list(outs)  # who hears READY / STARTUP_FAILED / DEAD
    if status_address is not None:
        status = ctx.socket(zmq.PUSH)
        status.setsockopt(zmq.LINGER, LINGER_MS)
        status.connect(status_address)
        lifecycle.append(status)
    codec = MessageCodec()

    def send_all(frame: bytes) -> None:
        for sock in lifecycle:
            sock.send(frame, copy=False)

    exit_code = 0
    core = None
    _leave_a_cpu_to_the_api_server(config)
    try:
        from kvserve.runtime.engine.engine_core import EngineCore

        try:
            core = EngineCore(config, tokenizer_vocab_size=tokenizer_vocab_size)
        except BaseException as exc:
            logger.exception("engine core failed to start")
            send_all(codec.encode(MessageType.STARTUP_FAILED, failure_message(exc)))
            exit_code = 1
            return
        m, c = core.config.model, core.config.cache
        logger.info(
            "engine core ready (pid %d): %s, max_model_len=%d, %d KV blocks (+1 reserved null block) x %d tokens "
            "(%.1f MiB), device=%s",
            os.getpid(),
            m.architecture,
            m.max_model_len,
            c.num_blocks - 1,
            c.block_size,
            core.executor.kv_cache_bytes / 2**20,
            core.config.device,
        )
        phases = dict(core.executor.startup_phases)
        if spawned_monotonic is not None:
            phases["engine_process_start"] = max(0.0, entered_monotonic - spawned_monotonic)
        if preload_s is not None:
            phases["engine_preload"] = preload_s
        ready = CoreReady(pickle.dumps(core.config), pickle.dumps(core.limits), os.getpid(), core.get_stats(), phases)
        send_all(codec.encode(MessageType.READY, ready))
        exit_code = _busy_loop(core, inp, outs, codec)
    except BaseException as exc:  # a dead worker, too many failed steps, or a bug here: tell every client
        logger.exception("engine core died")
        try:
            send_all(codec.encode(MessageType.DEAD, failure_message(exc)))
        except Exception:  # noqa: BLE001
            pass
        exit_code = 1
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001
                logger.exception("stopping the tensor-parallel workers failed")
        for sock in [inp, *lifecycle]:
            sock.close()  # lingers: a DEAD message still goes out
        ctx.term()
        os._exit(exit_code)  # no atexit joins of daemon helpers; the exit status is what the client reads


def _leave_a_cpu_to_the_api_server(config) -> None:
    """On CPU, run the core's intra-op pool on all cores but one, unless the user chose (OMP_NUM_THREADS).

    With every core in the pool, each wake-up on the other side (the API server's HTTP and detokenising, both
    processes' ZMQ I/O threads) preempts an OpenMP worker and the whole pool waits at its barrier: measured on
    this 2-core machine, one greedy stream of the demo model took 24 ms per token through the core process
    with 2 threads, 4.9 ms with 1, and 5.4 ms in-process with 2. GPUs do not compute on this pool.
    """
    threads = core_cpu_threads(config)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def core_cpu_threads(config) -> int | None:
    """The intra-op thread count the core process sets (None: it leaves torch's default): all cores but one on
    CPU unless OMP_NUM_THREADS is set. bench_served_vs_offline also runs the offline loop with it."""
    if str(getattr(config, "device", "cpu")).startswith("cuda") or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) - 1)


def _busy_loop(core, inp, outs: list, codec: MessageCodec) -> int:
    import zmq

    from kvserve.runtime.engine.core_utilities import CoreUtilities

    owners: dict[str, int] = {}  # request id -> API-server index
    last_sent: dict = {}  # the stats and failure count the API servers last got (_send_step)
    num_clients = len(outs)
    utilities = CoreUtilities(core)  # UTILITY calls (LoRA load/unload) run beside this loop, not in it
    while True:
        utilities.send_finished(outs, codec)
        busy = core.has_unfinished_requests()
        if not busy and not inp.poll(utilities.poll_ms(IDLE_POLL_MS)):
            core.check_health()  # a tensor-parallel worker that died while idle: DEAD now, not at the next request
            continue
        handled = False
        failures: list[list[RequestFailure]] = [[] for _ in range(num_clients)]
        while True:
            try:
                frame = inp.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            handled = True
            kind, body = codec.decode(frame.buffer)
            if kind is MessageType.ADD:
                try:
                    core.add_request(
                        body.request_id,
                        body.prompt_token_ids,
                        body.sampling_params,
                        body.arrival_time,
                        count_prompt_tokens=body.count_prompt_tokens,
                    )
                    owners[body.request_id] = body.client_index
                except Exception as exc:  # noqa: BLE001 -- the API server validated it; still, fail it alone
                    logger.warning("request %s refused by the core: %s", body.request_id, exc)
                    failures[body.client_index].append(RequestFailure(body.request_id, str(exc), False))
            elif kind is MessageType.ABORT:
                if body.stopped_ids:
                    core.finish_stopped(body.stopped_ids)
                for request_id in body.request_ids:
                    core.abort_request(request_id)
                    owners.pop(request_id, None)
            elif kind is MessageType.UTILITY:
                utilities.submit(body)
            elif kind is MessageType.SHUTDOWN:
                logger.info("engine core: shutdown requested")
                utilities.shutdown()
                return 0
        if core.has_unfinished_requests():
            step = core.step()
        elif handled:  # e.g. aborts while idle: the clients' gauges must see them
            step = EngineCoreOutputs()
        else:
            continue
        _send_step(core, step, failures, owners, outs, codec, last_sent)


def _send_step(
    core,
    step: EngineCoreOutputs,
    failures: list[list[RequestFailure]],
    owners: dict[str, int],
    outs: list,
    codec: MessageCodec,
    last_sent: dict,
) -> None:
    """Route one step's deltas to the API server that owns each request; every server gets the stats.

    A step with nothing for anyone and the stats unchanged since the last message is not sent: a P/D prefill
    engine holding leases steps only to poll NIXL (every few ms, for up to the lease timeout), and the API
    servers would otherwise wake for each of those steps to read the same numbers."""
    stats = core.get_stats()
    if (
        not (step.deltas or step.failures or step.first_scheduled or any(failures))
        and last_sent.get("stats") == stats
        and last_sent.get("num_step_failures") == step.num_step_failures
    ):
        return
    last_sent.update(stats=stats, num_step_failures=step.num_step_failures)
    if len(outs) == 1:
        per_client = [
            EngineCoreOutputs(
                step.deltas, step.failures + failures[0], step.first_scheduled, stats, step.num_step_failures
            )
        ]
    else:
        per_client = [EngineCoreOutputs([], failures[i], [], stats, step.num_step_failures) for i in range(len(outs))]
        for delta in step.deltas:
            per_client[owners.get(delta.request_id, 0)].deltas.append(delta)
        for failure in step.failures:
            per_client[owners.get(failure.request_id, 0)].failures.append(failure)
        for item in step.first_scheduled:
            per_client[owners.get(item[0], 0)].first_scheduled.append(item)
    for request_id in [d.request_id for d in step.deltas] + [f.request_id for f in step.failures]:
        if not core.is_unfinished(request_id):  # finished in the core this step
            owners.pop(request_id, None)
    for sock, outputs in zip(outs, per_client):
        sock.send(codec.encode(MessageType.OUTPUTS, outputs), copy=False)
