"""Every tunable of `butter serve`, each default named exactly once."""

from __future__ import annotations

import os

import attrs

from butter import cpu

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_PARALLEL = 1
DEFAULT_MAX_QUEUE = 64
# The KV cells a single request may use (prompt + completion) when the model's trained
# context is larger: 8192 positions fit comfortably in memory for small local models.
DEFAULT_MAX_CONTEXT_CAP = 8192
# Each extra parallel session adds this many cells to the shared pool by default, so a
# pool fits `parallel` typical chat requests without one long request starving the rest.
DEFAULT_CELLS_PER_EXTRA_SESSION = 2048
# Sequence ids beyond the --parallel generating ones: idle ones hold cached prompts (the
# prefix cache), so a chat's side requests or a second conversation do not evict the first.
DEFAULT_CACHED_PROMPTS = 32
# The host-RAM tier (--cache-ram) holds prefixes evicted from the KV pool: llama-server's
# default budget (8 GiB), at most a quarter of the machine's memory.
DEFAULT_CACHE_RAM_MIB_CAP = 8192
# Tokens evaluated per engine step across all prefilling sessions. Smaller chunks keep
# decode latency of siblings low; larger ones prefill faster. Measured on 2 cores.
DEFAULT_PREFILL_CHUNK = 256
# With a value, while sessions decode, prompt chunks shrink (to 64 tokens at least) so that a
# step carrying one takes about this long: each such step is a stall in every stream. Off by
# default: on the Qwen3-0.6B shape (2 cores, an 8k prompt beside 4 streams) 0.5 s cut the
# longest stall 8.5 -> 2.5 s and tripled the streams' rate, but cost the long prompt 9-19%
# more time to its first token (docs/design/prompt-chunks.md).
DEFAULT_DECODE_STALL_SECONDS = 0.0
# Speculative decoding: the most draft tokens one session verifies in a step. The backend's
# exact batch width limits it first: 15 where butter's kernels multiply every matrix, else
# 6, or 2 with llama.cpp's repacked weights. The engine takes fewer wherever the measured
# step costs say so, so a cap at that width costs nothing where drafts are not kept and lets
# a long copy take whole lines a step (benchmarks/RESULTS.md, "How many drafts a step").
DEFAULT_DRAFT_MAX = 15
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# After a stream's first content, SSE frames are written at most this often (seconds):
# fewer writes leave more CPU to llama.cpp under load. 0 writes every token at once.
DEFAULT_STREAM_FLUSH_SECONDS = 0.1
DEFAULT_MAX_MESSAGES = 2048
# A request body that has not fully arrived after this long gets 408 (slow senders).
DEFAULT_BODY_TIMEOUT_SECONDS = 60.0
# Request headers beyond this many bytes are refused by hypercorn (h11) with a 4xx.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# An idle keep-alive connection is closed after this long.
DEFAULT_KEEP_ALIVE_SECONDS = 5.0
API_KEY_ENV = "BUTTER_API_KEY"


def default_cache_ram_mib() -> int:
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # (no sysconf names on this platform)
        return DEFAULT_CACHE_RAM_MIB_CAP
    return min(DEFAULT_CACHE_RAM_MIB_CAP, total // 4 // 2**20)
RETRY_AFTER_SECONDS = 1
# /ready answers 503 once a single engine step has run this long: the engine is stuck (a
# native hang), not slow; a prefill chunk of a large model on a few cores takes seconds.
ENGINE_STALL_SECONDS = 60.0
# On SIGINT/SIGTERM, active requests get this long to finish before they are cancelled.
DEFAULT_SHUTDOWN_GRACE_SECONDS = 10.0
# A response whose client has read nothing for this long is abandoned: the connection is
# closed and the request cancelled. Progress-based: slow readers and long streams go on.
DEFAULT_WRITE_TIMEOUT_SECONDS = 30.0
# File descriptors kept free when --max-connections is sized from the open-file limit
# (each connection holds one): the model files, logs, pipes, listening sockets, and
# refused connections while their 503 is delivered.
FD_RESERVE = 128
# ... and at most this many by default: each idle connection still costs a task and buffers.
MAX_CONNECTIONS_CAP = 4096


def default_max_connections() -> int:
    """The open-file limit less FD_RESERVE, at most MAX_CONNECTIONS_CAP."""
    try:
        import resource
    except ImportError:  # no resource module (Windows): the cap's guess
        return MAX_CONNECTIONS_CAP
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CAP
    return max(1, min(MAX_CONNECTIONS_CAP, soft - FD_RESERVE))


def usable_cores() -> int:
    """Cores this process may keep busy: its affinity mask, within its cgroup's CPU quota
    (unlike os.cpu_count)."""
    return cpu.usable_cores()


@attrs.frozen
class ServeSettings:
    """Settings for one `butter serve` process (see `butter serve --help`)."""

    model: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    alias: str | None = None
    chat_template: str | None = None
    parallel: int = DEFAULT_PARALLEL
    max_queue: int = DEFAULT_MAX_QUEUE
    max_context: int | None = None
    kv_pool: int | None = None
    cache_ram_mib: int = attrs.field(factory=default_cache_ram_mib)  # 0: no host-RAM tier
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    decode_stall: float = DEFAULT_DECODE_STALL_SECONDS  # 0: chunks never shrink
    draft_max: int = DEFAULT_DRAFT_MAX  # speculative decoding's drafts per step; 0: off
    draft_model: str | None = None  # a GGUF with the same vocabulary that guesses drafts
    threads: int = attrs.field(factory=usable_cores)
    # Fewer threads while other programs take cores (backends/team.py); else always `threads`.
    fit_threads: bool = True
    step_shaping: bool = True  # lay out decode steps by measured cost (backends/shaping.py)
    fast_lm_head: bool = True  # butter's output projection where it applies (backends/lmhead.py)
    # butter's Q8_0, Q6_K, Q5_K, Q4_K, Q4_1 and Q5_0 layer matmuls inside llama.cpp where they apply
    # (backends/llama_cpp/layer_matmul.py); they need llama.cpp's extra buffer types, which
    # --deterministic turns off.
    fast_layers: bool = True
    # llama.cpp: no weight repacking, so a prompt's KV and logits are bit-identical cold and
    # on a cache hit (docs/design/numerics.md, "Numerics and determinism"). Off by default:
    # repacked Q4_K decodes faster (benchmarks/RESULTS.md).
    deterministic: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS
    api_key: str | None = None
    api_key_file: str | None = None  # more keys, one per line, read again on SIGHUP
    # Host names a loopback listener answers to, and web origins allowed to call it,
    # beyond the loopback ones (butter/server/access.py, docs/security.md).
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    ui: bool = True  # the chat page at / (--no-ui: API clients' answers only)
    stream_flush: float = DEFAULT_STREAM_FLUSH_SECONDS
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_SECONDS
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECONDS  # 0: never abandon a response
    max_connections: int = attrs.field(factory=default_max_connections)
    kv_cache: str = "raw"
    aura_decode_path: str | None = None
    kv_window_size: int | None = None
    kv_window_keep: int | None = None
    models_dir: str | None = None
    allow_swap: bool = True
    # A request's `model` may name any file path, not only what GET /v1/models lists.
    allow_model_paths: bool = False
    # A max_tokens beyond what the context still holds: clamped to it (False), or refused
    # with a 400 (True). Clamped by default, as llama-server does: agents such as Claude
    # Code ask for 32000 tokens whatever the model's context.
    strict_max_tokens: bool = False
    enable_thinking: bool | None = None  # template default when a client does not say
    reasoning_effort: str | None = None  # likewise, for `reasoning_effort`

    def template_defaults(self) -> dict[str, object]:
        defaults: dict[str, object] = {}
        if self.enable_thinking is not None:
            defaults["enable_thinking"] = self.enable_thinking
        if self.reasoning_effort is not None:
            defaults["reasoning_effort"] = self.reasoning_effort
        return defaults
