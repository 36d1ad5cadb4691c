"""The typed messages between API-server processes and the engine-core process (vLLM V1's EngineCoreRequest /
EngineCoreOutputs idea), and their msgpack wire format.

Only token ids cross the boundary: the API server tokenises, detokenises and checks stop strings; the core
schedules and runs the model and reports, per step, the *new* token ids of each request it advanced. A core
request is one sequence: the API server sends an n > 1 request as n child requests (engine/parent_request.py).

Wire format: one ZMQ frame per message, `type byte + msgpack(struct)`. Structs are `array_like` (field names
stay off the wire) so new fields may only be appended with defaults. SamplingParams travels as its pickle:
msgspec would encode the dataclass field by field and cannot describe the compiled grammar it carries
(that pickles as xgrammar's own serialisation, through `CompiledConstraint.__reduce__`). Pickle is safe here because
both ends are
processes of one server talking over ipc:// sockets in a private (0700) directory.
"""

from __future__ import annotations

import enum
import pickle
from typing import Any

import msgspec

from kvserve.runtime.core.outputs import TokenLogprobs
from kvserve.runtime.outputs import EngineStats
from kvserve.runtime.sampling_params import SamplingParams


class MessageType(bytes, enum.Enum):
    # API server -> core
    ADD = b"\x00"
    ABORT = b"\x01"
    SHUTDOWN = b"\x02"
    UTILITY = b"\x03"  # a call answered by UTILITY_RESULT (e.g. load a LoRA adapter: runtime/server/lora_remote.py)
    # core -> API server
    READY = b"\x10"
    OUTPUTS = b"\x11"
    DEAD = b"\x12"  # the core is dead (soft failure); carries the reason
    STARTUP_FAILED = b"\x13"
    UTILITY_RESULT = b"\x14"  # to the API server that made the call
    LORA_ADAPTERS = b"\x15"  # to every API server, whenever the served adapters change
    SLEEP_STATE = b"\x16"  # to every API server, whenever sleep mode's state changes (sleep, wake_up)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params_pickle: bytes  # see the module docstring; build with `make`, read with `sampling_params`
    arrival_time: float  # time.monotonic(): CLOCK_MONOTONIC is one clock for all processes of a host
    client_index: int = 0  # which API-server process gets the outputs
    count_prompt_tokens: bool = True  # False for children 1.. of an n > 1 request: a prompt is counted once

    @classmethod
    def make(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        client_index: int = 0,
        count_prompt_tokens: bool = True,
    ) -> "EngineCoreRequest":
        return cls(
            request_id,
            prompt_token_ids,
            pickle.dumps(params, protocol=pickle.HIGHEST_PROTOCOL),
            arrival_time,
            client_index,
            count_prompt_tokens,
        )

    @property
    def sampling_params(self) -> SamplingParams:
        return pickle.loads(self.sampling_params_pickle)


class EngineCoreAbort(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Finish requests in the core and free their blocks: `request_ids` aborted, `stopped_ids` finished as
    "stopped" (the API server found a stop string in their text)."""

    request_ids: list[str]
    stopped_ids: list[str] = []


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step did for one request (one sequence) in the core: its new token ids only."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" (stop strings are decided by the API server)
    stop_reason: int | str | None = None
    kv_transfer_params: dict | None = None  # P/D: a prefill's params for the decode engine (core/pd_connector.py)


class RequestFailure(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The core failed this request (engine/errors.py RequestError): it is finished and its blocks freed."""

    request_id: str
    message: str
    retryable: bool


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One per step per API-server process."""

    deltas: list[SampleDelta] = []
    failures: list[RequestFailure] = []
    first_scheduled: list[tuple[str, float]] = []  # (request id, monotonic time) for requests first scheduled
    stats: EngineStats | None = None
    num_step_failures: int = 0  # cumulative


class CoreReady(msgspec.Struct, array_like=True, gc=False):
    """Sent once per API server when the core has loaded the model."""

    engine_config: bytes  # pickled EngineConfig (with the KV block count the core found)
    limits: bytes  # pickled RequestLimits: what a request is validated against
    pid: int
    stats: EngineStats  # the gauges before the first step
    # Seconds per start-up phase in the core process (runtime/startup_phases.py): process start, the model
    # runner's phases (tensor/pipeline parallel: rank 0's).
    startup_phases: dict[str, float] = {}


class CoreFailure(msgspec.Struct, array_like=True, gc=False):
    """Why the core died (DEAD) or could not start (STARTUP_FAILED): the pickled exception (its types --
    EngineDeadError, WorkerDiedError, PlanRejected, InvalidParameter -- all pickle) and a text fallback."""

    exception: bytes
    text: str


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    """API server -> core: run `method` (a name the core's utility table knows) with JSON-like args."""

    call_id: int
    client_index: int
    method: str
    args: list[Any]


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """status 0: done, `value` the result; else the HTTP status to answer with, the field at fault and a code."""

    call_id: int
    status: int = 0
    message: str = ""
    param: str | None = None
    code: str | None = None
    value: Any = None


class LoraAdapters(msgspec.Struct, array_like=True, gc=False):
    """The adapters the core serves now (name, directory), sent to every API server after a change."""

    adapters: list[tuple[str, str]]


class SleepState(msgspec.Struct, array_like=True, gc=False):
    """Whether the core is asleep now, sent to every API server after a sleep or wake_up call (issue 43: with
    --api-server-count > 1 the others must refuse and answer not ready as well, or serve again)."""

    is_sleeping: bool


_BODY_TYPES = {
    MessageType.ADD: EngineCoreRequest,
    MessageType.ABORT: EngineCoreAbort,
    MessageType.OUTPUTS: EngineCoreOutputs,
    MessageType.READY: CoreReady,
    MessageType.DEAD: CoreFailure,
    MessageType.STARTUP_FAILED: CoreFailure,
    MessageType.UTILITY: UtilityCall,
    MessageType.UTILITY_RESULT: UtilityResult,
    MessageType.LORA_ADAPTERS: LoraAdapters,
    MessageType.SLEEP_STATE: SleepState,
}


class MessageCodec:
    """Encoder + typed decoders. Not thread-safe (msgspec encoders keep a buffer): one per thread."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders = {kind: msgspec.msgpack.Decoder(body) for kind, body in _BODY_TYPES.items()}

    def encode(self, kind: MessageType, body: Any = None) -> bytes:
        return kind.value + (b"" if body is None else self._encoder.encode(body))

    def decode(self, frame: bytes | memoryview) -> tuple[MessageType, Any]:
        view = memoryview(frame)
        kind = MessageType(bytes(view[:1]))
        decoder = self._decoders.get(kind)
        return kind, (None if decoder is None else decoder.decode(view[1:]))


class _ReduceAs:
    """Pickles as `cls(*args)`: for exceptions whose constructor is not `cls(message)` (InvalidParameter and
    its PlanRejected take (param, message); plain pickling would call cls(message) and fail to unpickle)."""

    def __init__(self, cls: type, *args: Any):
        self.cls, self.args = cls, args

    def __reduce__(self):
        return self.cls, self.args


def failure_message(exc: BaseException) -> CoreFailure:
    from kvserve.runtime.errors import InvalidParameter

    try:
        # A PlanRejected at startup must stay one: the termination message (and the operator) key on its type.
        data = pickle.dumps(_ReduceAs(type(exc), exc.param, str(exc)) if isinstance(exc, InvalidParameter) else exc)
        pickle.loads(data)  # some exceptions pickle but do not unpickle (custom __init__ signatures)
    except Exception:  # noqa: BLE001 -- then only the text crosses
        data = b""
    return CoreFailure(data, " ".join(str(exc).split()) or type(exc).__name__)


def failure_exception(failure: CoreFailure, fallback: type[BaseException]) -> BaseException:
    if failure.exception:
        try:
            exc = pickle.loads(failure.exception)
            if isinstance(exc, BaseException):
                return exc
        except Exception:  # noqa: BLE001
            pass
    return fallback(failure.text)
