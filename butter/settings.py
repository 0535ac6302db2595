"""Every tunable of `butter serve`, each declared exactly once: its default here, and with
it, as the field's metadata, its command-line flag (names, help, group). butter/cli.py
builds the `serve` parser from these fields and reads the parsed flags back into them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import attrs

from butter import cpu
from butter.chat.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
)

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
# A recurrent or hybrid model's checkpoints kept per cached prompt (--ctx-checkpoints):
# each costs the model's whole recurrent state (about 19 MiB for Qwen3.5-0.8B), counted
# in --cache-ram (butter/engine/checkpoints.py).
DEFAULT_CHECKPOINTS_PER_SEQUENCE = 8
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
# Anthropic's limit per request: room for an image of --max-image-bytes as base64 (a
# third larger) beside a long conversation.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
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


def default_cache_ram_mib() -> int:
    """A quarter of this machine's memory, at most DEFAULT_CACHE_RAM_MIB_CAP."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # (no sysconf names on this platform)
        return DEFAULT_CACHE_RAM_MIB_CAP
    return min(DEFAULT_CACHE_RAM_MIB_CAP, total // 4 // 2**20)


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


T = TypeVar("T")
Number = TypeVar("Number", int, float)

# Where a field keeps its Flag in its attrs metadata.
FLAG = "butter.flag"
# `--x` and `--no-x`.
ON_OFF = argparse.BooleanOptionalAction

# `butter serve --help` groups the flags under these titles, in the order the fields use them.
MODEL = "Model"
SERVER = "Server"
ACCESS = "Access"
SESSIONS = "Sessions and scheduling"
KV_CACHE = "KV cache"
SPECULATION = "Speculation"
THREADS = "Threads and kernels"


@attrs.frozen
class Flag:
    """How one ServeSettings field is set on `butter serve`'s command line."""

    help: str
    group: str
    # Empty until serve_flags() fills in the field's own: --max-queue for max_queue.
    names: tuple[str, ...]
    # The parser's default, read when the parser is built: some are this machine's or this
    # environment's. None: the flag is required.
    default: Callable[[], object] | None
    # docs/flags.md's words for a default read off the machine: this one's would mislead.
    doc_default: str | None
    # The parsed value to the field's, where they differ (units, clamps, repeated lists).
    from_flag: Callable[[Any], object] | None
    # add_argument's own keywords, passed on as they are: type, action, metavar, choices.
    options: Mapping[str, Any]

    @property
    def dest(self) -> str:
        """The parsed value's attribute: argparse names it after the first long name."""
        return self.names[0].removeprefix("--").replace("-", "_")

    def arguments(self) -> dict[str, Any]:
        """add_argument's keywords, the default read now."""
        default = {"required": True} if self.default is None else {"default": self.default()}
        return {**self.options, **default, "help": self.help}

    def setting(self, value: Any) -> Any:
        """The field's value for the parsed one."""
        return value if self.from_flag is None else self.from_flag(value)


def flag(default: T | attrs.NothingType = attrs.NOTHING, *, help: str, group: str,
         names: tuple[str, ...] = (), factory: Callable[[], T] | None = None,
         cli_default: Callable[[], object] | None = None, doc_default: str | None = None,
         from_flag: Callable[[Any], object] | None = None, **options: Any) -> T:
    """A ServeSettings field and its flag: with neither a default nor a factory, both are
    required. `cli_default` is the parser's default where it is not the field's."""
    spec = Flag(help=help, group=group, names=names,
                default=cli_default or _parser_default(default, factory),
                doc_default=doc_default, from_flag=from_flag, options=options)
    # What attrs.field returns stands for the field's value until the class is built.
    return cast(T, attrs.field(default=default, factory=factory, metadata={FLAG: spec}))


def _parser_default(default: object, factory: Callable[[], object] | None,
                    ) -> Callable[[], object] | None:
    if factory is not None:
        return factory
    return None if default is attrs.NOTHING else lambda: default


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def _joined(lists: list[list[str]]) -> tuple[str, ...]:
    return tuple(name for names in lists for name in names)


def _names_flag(*, help: str, group: str, metavar: str) -> tuple[str, ...]:
    """Comma-separated names, the flag given any number of times."""
    return flag((), help=help, group=group, metavar=metavar, action="append", type=_names,
                cli_default=list, from_flag=_joined)


def _at_least_zero(value: Number) -> Number:
    """A negative count or duration on the command line means 0: off, or never."""
    return max(value, type(value)(0))


def _seconds(milliseconds: float) -> float:
    return _at_least_zero(milliseconds / 1000)


def _key_or_none(key: str | None) -> str | None:
    return key or None  # an empty --api-key or $BUTTER_API_KEY: no key


@attrs.frozen
class ServeSettings:
    """Settings for one `butter serve` process, each field its own flag (`butter serve
    --help`, docs/flags.md)."""

    # --- Model
    model: str = flag(
        help="a .gguf path, or a bundled model (extra [demo]): smollm2-135m (an instruct "
             "model), gemma-3-270m (a base model)", group=MODEL)
    alias: str | None = flag(
        None, help="the id clients use for the model (default: --model)", group=MODEL)
    chat_template: str | None = flag(
        None, help="a jinja template file, or a built-in: gemma, chatml, llama3, mistral",
        group=MODEL)
    models_dir: str | None = flag(
        None, help="a folder of .gguf files that requests may name (e.g. qwen3-0.6b)",
        group=MODEL)
    mmproj: str | None = flag(
        None, metavar="PATH", group=MODEL,
        help="a vision projector GGUF (llama-server's --mmproj) for --model: its prompts may "
             "then hold images (LLaVA-style, Qwen-VL, Qwen3.5, Gemma 3 and SmolVLM vision "
             "towers). "
             "One that does not fit the model, or that butter cannot evaluate (audio-only), "
             "stops the server with the reason; loaded and released with --model, not with "
             "a model a request swaps in; llama.cpp only (default: none)")
    mmproj_auto: bool = flag(
        True, action=ON_OFF, group=MODEL,
        help="a GGUF model from the local HuggingFace cache loads the projector its snapshot "
             "holds (a *mmproj*.gguf beside it), as llama-server's -hf does; a model given "
             "by its path gets none without --mmproj, as with llama-server's -m (default: "
             "on)")
    allow_swap: bool = flag(
        True, action=ON_OFF, group=MODEL,
        help="let a request's `model` swap the resident model (default: allow)")
    # A request's `model` may name any file path, not only what GET /v1/models lists.
    allow_model_paths: bool = flag(
        False, action="store_true", group=MODEL,
        help="let a request's `model` name any file path; by default only what GET "
             "/v1/models lists: --models-dir, the HuggingFace cache, the demo alias and the "
             "boot model's folder")
    enable_thinking: bool | None = flag(  # the template's default when a client does not say
        None, action=ON_OFF, group=MODEL,
        help="default for chat_template_kwargs.enable_thinking when a client omits it "
             "(templates that support thinking)")
    reasoning_effort: str | None = flag(  # likewise, for `reasoning_effort`
        None, choices=("low", "medium", "high"), group=MODEL,
        help="default reasoning_effort passed to the template")

    # --- Server
    host: str = flag(
        DEFAULT_HOST, group=SERVER,
        help="the address to listen on; beyond loopback, set an API key")
    port: int = flag(
        DEFAULT_PORT, type=int, group=SERVER,
        help="the port to listen on; 0 picks a free one")
    ui: bool = flag(
        True, action=ON_OFF, group=SERVER,
        help="a chat page at / for browsers, with a live view of the engine; API clients' "
             "answers at / stay as they are (default: on)")
    # The flag counts milliseconds; the field, like every duration here, seconds.
    stream_flush: float = flag(
        DEFAULT_STREAM_FLUSH_SECONDS, names=("--stream-flush-ms",), type=float, group=SERVER,
        cli_default=lambda: DEFAULT_STREAM_FLUSH_SECONDS * 1000, from_flag=_seconds,
        help="after the first token, write stream chunks at most this often; 0 = every "
             "token (default %(default)s)")
    max_body_bytes: int = flag(
        DEFAULT_MAX_BODY_BYTES, type=_positive, group=SERVER,
        help="larger request bodies get 413 (default %(default)s)")
    body_timeout: float = flag(
        DEFAULT_BODY_TIMEOUT_SECONDS, type=float, group=SERVER,
        help="seconds a request body may take to arrive; then 408 (default %(default)s)")
    max_messages: int = flag(
        DEFAULT_MAX_MESSAGES, type=_positive, group=SERVER,
        help="messages allowed in one request (default %(default)s)")
    # Images sent to a model with a projector (--mmproj); each limit refuses with a 400.
    max_images: int = flag(
        DEFAULT_MAX_IMAGES, type=_positive, group=SERVER,
        help="images allowed in one request, counted in all its messages (default "
             "%(default)s)")
    max_image_bytes: int = flag(
        DEFAULT_MAX_IMAGE_BYTES, type=_positive, group=SERVER,
        help="bytes one image file may have, checked before it is decoded; the request body "
             "holds it as base64, a third larger, within --max-body-bytes (default "
             "%(default)s)")
    max_image_pixels: int = flag(
        DEFAULT_MAX_IMAGE_PIXELS, type=_positive, group=SERVER,
        help="pixels (width x height) one image may have, read from its header before its "
             "pixels are decoded (default %(default)s)")
    write_timeout: float = flag(
        DEFAULT_WRITE_TIMEOUT_SECONDS, type=float, from_flag=_at_least_zero, group=SERVER,
        help="seconds a response may wait for a client that reads nothing; then its "
             "connection is closed and its request cancelled; slow readers are not cut "
             "(0 = never; default %(default)s)")
    max_connections: int = flag(
        factory=default_max_connections, type=_positive, group=SERVER,
        doc_default=f"open-file limit − {FD_RESERVE}, at most {MAX_CONNECTIONS_CAP}",
        help="open connections allowed; past it new ones get 503 at once (default: the "
             f"open-file limit less {FD_RESERVE}, at most {MAX_CONNECTIONS_CAP}: %(default)s)")
    shutdown_grace: float = flag(
        DEFAULT_SHUTDOWN_GRACE_SECONDS, type=float, group=SERVER,
        help="seconds active requests get to finish on SIGINT/SIGTERM")

    # --- Access: who may use the server (butter/server/access.py, docs/security.md)
    # The field's default is no key; the parser's, the environment's.
    api_key: str | None = flag(
        None, cli_default=lambda: os.environ.get(API_KEY_ENV), from_flag=_key_or_none,
        doc_default=f"${API_KEY_ENV}", group=ACCESS,
        help="require this key on every route but /health (Authorization: Bearer KEY or "
             f"x-api-key: KEY); default: ${API_KEY_ENV}")
    api_key_file: str | None = flag(
        None, metavar="PATH", group=ACCESS,
        help="more keys, one per line (blank lines and # comments skipped), read again on "
             "SIGHUP; with --api-key both are accepted")
    # Host names a loopback listener answers to, and web origins allowed to call it,
    # beyond the loopback ones.
    allowed_hosts: tuple[str, ...] = _names_flag(
        metavar="NAME[,NAME]", group=ACCESS,
        help="host names this server answers to besides loopback ones, while it listens on "
             "a loopback address (DNS rebinding guard); `.example.com` for a domain and its "
             "subdomains, `*` for any")
    cors_origins: tuple[str, ...] = _names_flag(
        metavar="ORIGIN[,ORIGIN]", group=ACCESS,
        help="web origins (https://app.example:8443) whose pages may call the server, "
             "besides loopback origins; `*` for any (unsafe without an API key)")

    # --- Sessions and scheduling
    parallel: int = flag(
        DEFAULT_PARALLEL, type=_positive, group=SESSIONS,
        help="concurrent generation sessions (default %(default)s)")
    max_queue: int = flag(
        DEFAULT_MAX_QUEUE, type=int, group=SESSIONS,
        help="requests allowed to wait for a session; beyond it 503 (default %(default)s)")
    max_context: int | None = flag(
        None, type=_positive, group=SESSIONS,
        help="positions per request, prompt + completion (default: the model's trained "
             f"context, at most {DEFAULT_MAX_CONTEXT_CAP})")
    # A max_tokens beyond what the context still holds: clamped to it (False), or refused
    # with a 400 (True). Clamped by default, as llama-server does: agents such as Claude
    # Code ask for 32000 tokens whatever the model's context.
    strict_max_tokens: bool = flag(
        False, action="store_true", group=SESSIONS,
        help="refuse (400) a max_tokens larger than the context still holds, instead of "
             "clamping it to what fits (the default)")
    prefill_chunk: int = flag(
        DEFAULT_PREFILL_CHUNK, type=_positive, group=SESSIONS,
        help="prompt tokens evaluated per engine step (default %(default)s)")
    decode_stall: float = flag(
        DEFAULT_DECODE_STALL_SECONDS, type=float, from_flag=_at_least_zero, group=SESSIONS,
        help="seconds: while other requests stream, prompt chunks shrink (to 64 tokens at "
             "least) so that a step carrying one takes about this long; 0 = always "
             "--prefill-chunk (default %(default)s)")

    # --- KV cache
    kv_pool: int | None = flag(
        None, type=_positive, group=KV_CACHE,
        help="KV cells shared by all sessions (default: max-context + "
             f"{DEFAULT_CELLS_PER_EXTRA_SESSION} per extra session)")
    cache_ram_mib: int = flag(
        factory=default_cache_ram_mib, names=("--cache-ram",), type=int, metavar="MIB",
        from_flag=_at_least_zero, group=KV_CACHE,
        doc_default=f"a quarter of RAM, at most {DEFAULT_CACHE_RAM_MIB_CAP}",
        help="host RAM (MiB) for cached prompts evicted from the KV pool, restored when they "
             "return; 0 = off; llama.cpp only (default: a quarter of this machine's memory, "
             f"at most {DEFAULT_CACHE_RAM_MIB_CAP}: %(default)s)")
    ctx_checkpoints: int = flag(
        DEFAULT_CHECKPOINTS_PER_SEQUENCE, names=("--ctx-checkpoints",), type=int, metavar="N",
        from_flag=_at_least_zero, group=KV_CACHE,
        help="recurrent and hybrid models (Qwen3.5, LFM2, Granite 4, Nemotron-H): checkpoints "
             "of the recurrent state kept per cached prompt, so that a prompt diverging "
             "inside one is cut back to a checkpoint instead of prefilled again; they count "
             "against --cache-ram; 0 = off; llama.cpp only (default %(default)s)")
    kv_cache: str = flag(
        "raw", group=KV_CACHE,
        help="KV cache: raw (f16), affine8 (q8_0), affine4 (q4_0), aura / auraNvM (not on "
             "llama.cpp: raw is used)")
    aura_decode_path: str | None = flag(
        None, group=KV_CACHE,
        help="compressed or dequant-mirror; only with an AURA --kv-cache on a backend that "
             "has it (none yet), else ignored with a log line")
    kv_window_size: int | None = flag(
        None, type=_positive, group=KV_CACHE,
        help="slide each session's KV over this many positions (StreamingLLM), so "
             "generation can run past it")
    kv_window_keep: int | None = flag(
        None, type=int, group=KV_CACHE,
        help="attention-sink positions kept at the start of a sliding window (requires "
             "--kv-window-size)")

    # --- Speculation
    draft_max: int = flag(
        DEFAULT_DRAFT_MAX, type=int, metavar="N", from_flag=_at_least_zero, group=SPECULATION,
        help="speculative decoding: a decoding request drafts up to N tokens from its own "
             "prompt and output (prompt lookup) and a step verifies them with everyone's "
             "next token; outputs do not change, and steps take only the drafts their "
             "measured cost pays for; 0 = off; llama.cpp only (default %(default)s)")
    draft_model: str | None = flag(
        None, metavar="PATH", group=SPECULATION,
        help="speculative decoding: a smaller GGUF with the same vocabulary guesses the "
             "tokens prompt lookup finds none for (loaded beside every resident model whose "
             "vocabulary it shares); llama.cpp only (default: none)")

    # --- Threads and kernels
    threads: int = flag(
        factory=usable_cores, type=_positive, group=THREADS, doc_default="usable cores",
        help="llama.cpp threads at most (default: the cores of the CPU affinity mask within "
             "the cgroup's CPU quota, %(default)s)")
    # Fewer threads while other programs take cores (backends/team.py); else always `threads`.
    fit_threads: bool = flag(
        True, action=ON_OFF, group=THREADS,
        help="llama.cpp: steps run on fewer threads while other programs take some of the "
             "cores, and on all of them again when the cores are free (docs/concurrency.md; "
             "default: on)")
    step_shaping: bool = flag(  # backends/step_layouts.py
        True, action=ON_OFF, group=THREADS,
        help="llama.cpp: time alternative layouts of decode steps (pad output rows to 8, or "
             "one decode per row) and keep the fastest (default: on)")
    fast_lm_head: bool = flag(  # backends/lmhead.py
        True, action=ON_OFF, group=THREADS,
        help="llama.cpp: butter computes the logits (the output projection) with its "
             "AVX512-VNNI or AVX2 kernel where the CPU and the build allow (Q8_0 outputs, and "
             "Q6_K ones under AVX512-VNNI, in the file's bytes; other types requantized to "
             "Q8_0 at load), checked against llama.cpp's at load; /v1/server says which one "
             "runs (default: on)")
    # backends/llama_cpp/layer_matmul.py; the kernels need llama.cpp's extra buffer types,
    # which --deterministic turns off.
    fast_layers: bool = flag(
        True, action=ON_OFF, group=THREADS,
        help="llama.cpp: butter multiplies the layers' Q8_0, Q6_K, Q5_K, Q4_K, Q4_1 and Q5_0 "
             "matrices with its AVX512-VNNI or AVX2 kernels inside llama.cpp's CPU backend "
             "where the CPU and the build allow (each row computed alone, a few rows for "
             "little more than one); needs weight repacking on (not --deterministic); "
             "/v1/server says which one runs (default: on)")
    # docs/design/numerics.md, "Numerics and determinism". Off by default: repacked Q4_K
    # decodes faster (benchmarks/RESULTS.md).
    deterministic: bool = flag(
        False, action=ON_OFF, group=THREADS,
        help="llama.cpp: turn weight repacking off, so a prompt's KV cache and logits are "
             "bit-identical whether prefilled cold or reused from the cache (same seed, same "
             "output). By default llama.cpp repacks the weights it has interleaved kernels for "
             "(on x86: Q4_0, Q4_K, IQ4_NL), whose results depend slightly on a row's place in "
             "the batch: faster decode, slower prefill (benchmarks/RESULTS.md). It also "
             "computes a lone decode row as a row of a bigger step, so speculative decoding "
             "changes no bit of an output at any context length (default: off)")

    def template_defaults(self) -> dict[str, object]:
        defaults: dict[str, object] = {}
        if self.enable_thinking is not None:
            defaults["enable_thinking"] = self.enable_thinking
        if self.reasoning_effort is not None:
            defaults["reasoning_effort"] = self.reasoning_effort
        return defaults


def serve_flags() -> list[tuple[str, Flag]]:
    """(field name, flag) for each ServeSettings field that has one, in the fields' order."""
    return [(field.name, _named(field.metadata[FLAG], field.name))
            for field in attrs.fields(ServeSettings) if FLAG in field.metadata]


def _named(spec: Flag, field: str) -> Flag:
    return attrs.evolve(spec, names=spec.names or ("--" + field.replace("_", "-"),))
