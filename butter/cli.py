"""`butter serve`: argv → ServeSettings → load the model → serve until a signal."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import trio

from butter.bench import command as bench_command
from butter.errors import ModelLoadError
from butter.kv import kv_window, parse_aura_decode_path, parse_kv_cache
from butter.model import Model
from butter.models import ModelCatalog, resolve_model
from butter.pipeline.resident import ResidentModel
from butter.server.access import ANY, ApiKeys, is_loopback_name
from butter.server.holders import SwappableHolder
from butter.server.serve import ServeServer
from butter.settings import ServeSettings, serve_flags

log = logging.getLogger("butter")

HARD_EXIT_MARGIN_SECONDS = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="butter",
        description="An OpenAI- and Anthropic-compatible HTTP server for local LLMs.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI + Anthropic APIs)")
    _add_settings_flags(serve)
    # Not a setting: it picks the log level before any settings exist.
    logging_flags = serve.add_argument_group("Logging")
    logging_flags.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    bench_command.add_parser(commands)
    return parser


def _add_settings_flags(serve: argparse.ArgumentParser) -> None:
    """A flag for each ServeSettings field, declared with the field (butter/settings.py);
    an argument group for each of their groups, in the order the fields first name them."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for _, spec in serve_flags():
        if spec.group not in groups:
            groups[spec.group] = serve.add_argument_group(spec.group)
        groups[spec.group].add_argument(*spec.names, **spec.arguments())


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """Also validates the flag combinations, before any model is loaded."""
    settings = ServeSettings(**{field: spec.setting(getattr(args, spec.dest))
                                for field, spec in serve_flags()})
    parse_kv_cache(settings.kv_cache)
    parse_aura_decode_path(settings.aura_decode_path)
    kv_window(settings.kv_window_size, settings.kv_window_keep)
    return settings


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
    model = await Model.from_settings(settings)  # boot failures end here, in one line
    catalog = model_catalog(settings)
    boot_ids = {settings.model, settings.alias or settings.model}

    async def load(model_id: str) -> Model:
        if model_id in boot_ids:
            return await Model.from_settings(settings)
        return await Model.from_settings(settings, model_id, catalog.resolve(model_id))

    holder = SwappableHolder(
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
        max_images=settings.max_images,
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
            resident = holder.resident
            assert resident is not None  # (the holder was given the loaded model)
            model_lines = _model_lines(resident)
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
