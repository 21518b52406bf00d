"""Configuration of the ``sparse_kv`` attention backend, and the server settings it refuses.

Where it comes from: the environment variable ``SPARSE_RL_KV_CONFIG`` holds either a JSON object or the
path of a ``.json`` / ``.yaml`` file with the fields of :class:`SparseKVConfig` (nested ``compression``
holds :class:`~sparse_rl_megatron.compression.CompressionConfig`'s fields). SGLang starts its schedulers
with ``spawn``, so they inherit it; ``python -m sglang_ext.launch_server --sparse-kv-config ...`` and
``SGLangRolloutEngine`` set it for you. Select the backend with ``attention_backend="sparse_kv"``
(``--attention-backend sparse_kv``).

A request may override compression fields for itself with
``sampling_params["custom_params"]["sparse_kv"] = {"method": "snapkv", "budget": 256, ...}``; its
``window`` and ``budget + buffer`` may not exceed the server's (they size the query ring and the kept-position
buffer). Admission reserves each request's own ``budget + buffer + 1`` future tokens (``admission.py``).

Everything is validated when the server starts (``refusals.py``, hooked on ``ServerArgs.resolve_once`` and
``ServerArgs.check_server_args``), before any model loads, with one line naming the bad field.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from sparse_rl_megatron.compression import SCORERS, CompressionConfig
from sparse_rl_megatron.compression.scorers import ACCUMULATED_ATTENTION, QUERY_CENTERS, QUERY_WINDOW
from sparse_rl_megatron.utils.config_io import ConfigError, from_dict, to_dict

BACKEND_NAME = "sparse_kv"
CONFIG_ENV = "SPARSE_RL_KV_CONFIG"
REQUEST_KEY = "sparse_kv"
"""Key of a request's overrides in ``custom_params`` and of the provenance in the response ``meta_info``."""
FAULT_ENV = "SPARSE_RL_KV_FAULT"
"""Test-only fault injection, one of ``PLUGIN_FAULTS``: ``skip_free`` (evicted slots are dropped from the request but
never freed), so a test can show the strict idle memory checker catches a broken free; ``stale_tables`` (the tables
ignore SGLang's rewrites of a bound row, the defect of issue 25), so a test can show the soak's oracle catches
stale slots; ``abort_insert`` (an aborted compressed request goes into the radix tree whole); ``no_refusal`` (a
retracted or preempted compressed request resumes as if it were dense). Never set it otherwise. Read once per
process, when the plugin's backend is built (``PluginFaults.from_env``), not on the paths it breaks."""
PluginFault = Literal["skip_free", "stale_tables", "abort_insert", "no_refusal"]
PLUGIN_FAULTS: tuple[str, ...] = get_args(PluginFault)


@dataclass(frozen=True)
class PluginFaults:
    """The test-only faults of ``FAULT_ENV`` this process runs with, one flag each (all off but in fault tests)."""

    skip_free: bool = False
    stale_tables: bool = False
    abort_insert: bool = False
    no_refusal: bool = False

    @classmethod
    def from_env(cls) -> "PluginFaults":
        """From ``FAULT_ENV`` (unset, or a value that names no fault: none)."""
        fault = os.environ.get(FAULT_ENV, "")
        return cls(**{fault: True}) if fault in PLUGIN_FAULTS else cls()

PLUGIN_PROVIDES = frozenset({QUERY_WINDOW, QUERY_CENTERS})
"""The scorer inputs (``scorers.INPUT_FIELDS``) the plugin keeps: the ring of the last alpha queries per row, and
(servers started with a scorer that needs them) the running sums of each row's pre-RoPE queries (``query_centers``)."""
PLUGIN_LACKS = {
    ACCUMULATED_ATTENTION: "per-step attention mass, which the kernels do not return",
}
"""Why the plugin does not provide each other input a scorer may need."""


def _plugin_lacks(method: str) -> str | None:
    missing = sorted(SCORERS.get(method).needs - PLUGIN_PROVIDES)
    return PLUGIN_LACKS.get(missing[0], missing[0]) if missing else None


def supported_methods() -> list[str]:
    """The registered scorers the plugin serves: those needing only what it provides (read at each call, so a
    scorer a run's plugin registers later counts)."""
    return [m for m in SCORERS.names() if SCORERS.get(m).runs_with(PLUGIN_PROVIDES)]
InnerBackend = Literal["", "torch_native", "triton", "flashinfer", "fa3"]
"""An SGLang attention backend under the plugin, or '' for the device's default."""
INNER_BACKENDS: tuple[str, ...] = tuple(b for b in get_args(InnerBackend) if b)


@dataclass
class SparseKVConfig:
    """Settings of the ``sparse_kv`` attention backend (one per server)."""

    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Default compression of every request (method, budget B, window alpha, buffer W, scope, scorer knobs)."""
    inner_backend: InnerBackend = ""
    """The SGLang backend that runs the attention kernels: '' = torch_native on CPU, triton on CUDA."""
    kept_digest: bool = False
    """Hash the kept logical positions of every event into the response (one device->host copy per event)."""
    free_evicted: bool = True
    """Give evicted slots back to the allocator. False mimics the published fork (attention reads the
    compressed set, memory stays dense); for benchmarks only."""
    stats_path: str = ""
    """If set, forwards append JSON lines of pool usage read from the allocator (tests, benchmarks)."""
    stats_every: int = 1
    """With ``stats_path``: log every k-th forward (compression time is accumulated over all of them)."""
    count_host_syncs: bool = False
    """With ``stats_path``: count what would make the host wait for a GPU in the plugin's hooks
    (``host_syncs``) and log it per forward (tests; it slows the hooks down)."""
    check_tables: bool = False
    """Tests only: before every forward compare the plugin's physical table with SGLang's ``req_to_token`` rows
    where it mirrors them, and raise on a difference (catches a rewrite the plugin missed; a host sync)."""

    def __post_init__(self) -> None:
        c = self.compression
        if c.method not in supported_methods():
            raise ValueError(
                f"compression.method '{c.method}' is not supported by the SGLang plugin (it needs "
                f"{_plugin_lacks(c.method)}); valid: {', '.join(supported_methods())}")
        if c.uses_center_file:
            raise ValueError("compression.triattention_centers=file is not supported by the SGLang plugin (it keeps "
                             "online centers only); set it to online")
        if c.compress_prefill:
            raise ValueError("compression.compress_prefill is not supported by the SGLang plugin (Sparse-RL "
                             "compresses during decode only); set it to false")
        if c.trigger_on_newline:
            raise ValueError("compression.trigger_on_newline is not supported by the SGLang plugin; set it to false")
        if self.stats_every < 1:
            raise ValueError(f"stats_every must be >= 1; got {self.stats_every}")
        if self.inner_backend and self.inner_backend not in INNER_BACKENDS:
            raise ValueError(f"inner_backend must be one of {', '.join(INNER_BACKENDS)} (or '' for the "
                             f"device default); got '{self.inner_backend}'")

    def resolved_inner_backend(self, device: str) -> str:
        return self.inner_backend or ("torch_native" if device == "cpu" else "triton")

    def to_json(self) -> str:
        return json.dumps(to_dict(self))


def parse_config(text: str, source: str = CONFIG_ENV) -> SparseKVConfig:
    """A :class:`SparseKVConfig` from JSON text or a path to a .json/.yaml file; errors name the field."""
    text = text.strip()
    data: Any
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source}: not valid JSON ({err})") from None
    else:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"{source}: '{text}' is neither a JSON object nor an existing .json/.yaml file")
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text())
        else:
            data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping")
    try:
        return from_dict(SparseKVConfig, data, path="sparse_kv")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


@contextlib.contextmanager
def scheduler_env(**variables: str):
    """Set environment variables for the SGLang processes started inside the block (spawned processes copy
    the environment when they start: the plugin config, SGLang's switches), then restore the caller's."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def config_from_env() -> SparseKVConfig:
    """The server's config (defaults to dense compression when ``SPARSE_RL_KV_CONFIG`` is unset)."""
    text = os.environ.get(CONFIG_ENV, "")
    return parse_config(text) if text.strip() else SparseKVConfig()


def request_params(compression: CompressionConfig) -> dict[str, Any]:
    """A request's ``custom_params`` carrying its own compression (the one conversion of a client's
    ``CompressionConfig`` into what the plugin reads back with ``request_compression``)."""
    return {REQUEST_KEY: to_dict(compression)}


def request_compression(base: CompressionConfig, overrides: Any) -> CompressionConfig:
    """A request's compression: the server's, with the fields of ``custom_params['sparse_kv']`` replaced."""
    if overrides is None:
        return base
    if not isinstance(overrides, dict):
        raise ConfigError(f"custom_params.{REQUEST_KEY} must be a mapping of compression fields; got {overrides!r}")
    merged = {**to_dict(base), **overrides}
    config = from_dict(CompressionConfig, merged, path=f"custom_params.{REQUEST_KEY}")
    try:
        SparseKVConfig(compression=config)  # the plugin's own restrictions (methods, prefill compression)
    except ValueError as err:
        raise ConfigError(f"custom_params.{REQUEST_KEY}: {err}") from None
    if config.is_dense:  # nothing is compressed: no query ring, no position buffer
        return config
    if QUERY_CENTERS in config.scorer.needs and QUERY_CENTERS not in base.scorer.needs:
        raise ConfigError(f"custom_params.{REQUEST_KEY}.method '{config.method}' needs query centers, which a server "
                          f"keeps only when started with such a method (it was started with '{base.method}')")
    if config.window > base.window:
        raise ConfigError(f"custom_params.{REQUEST_KEY}.window ({config.window}) exceeds the server's window "
                          f"({base.window}), which sizes the query ring")
    if config.max_candidates > base.max_candidates:
        raise ConfigError(f"custom_params.{REQUEST_KEY}: budget + buffer ({config.max_candidates}) exceeds the "
                          f"server's ({base.max_candidates}), which sizes the position buffer")
    return config
